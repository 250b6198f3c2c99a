"""Image bytes to uint8 tensors: torchvision's decoders (libjpeg-turbo, libpng, libwebp) first,
PIL for the formats they do not read (BMP, TIFF, PPM, ...). One function for every source: image
files, WebDataset shards and Hugging Face datasets."""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib

import torch
from torch import Tensor

from vitlab.data.download import DatasetError

# torchvision 0.29 warns on every first use that TorchCodec will take its decoders over; vitlab
# pins torchvision, and the warning says nothing a user can act on (only torchvision's is ignored)
warnings.filterwarnings(
    "ignore", "The image decoding", DeprecationWarning, module=r"torchvision\.io\.image"
)

# torchvision allocates what a header claims; refuse what PIL would refuse as a decompression bomb
MAX_PIXELS = 2 * 89_478_485
PNG = b"\x89PNG\r\n\x1a\n"
SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # fmt: skip
# the segments with a length that may come before the frame header: DHT, DAC, DQT, DRI, DNL,
# APPn, COM (any other marker there, FF 00 included, sends the reading to PIL)
SEGMENTS = {0xC4, 0xCC, 0xDB, 0xDD, 0xDC, 0xFE, *range(0xE0, 0xF0)}
MAX_HEADER = 1 << 20  # bytes scanned for the frame header before PIL is asked instead


def decode_image(data: bytes, in_chans: int, where: str) -> Tensor:
    """The image in `data` as uint8 (C, H, W), C = in_chans (1: greyscale, 3: RGB); a DatasetError
    naming `where` when it cannot be decoded."""
    from torchvision.io import ImageReadMode

    mode = ImageReadMode.GRAY if in_chans == 1 else ImageReadMode.RGB
    kind = image_format(data)  # torchvision's WebP decoder ignores GRAY (warns, gives RGB): PIL's
    if kind is not None and (kind != "webp" or in_chans == 3) and _size_ok(data, where):
        damage = png_damage(data) if kind == "png" else None  # after the size: no bomb inflated
        if damage:  # torchvision's decoder would crash the process on it
            raise DatasetError(f"cannot read image {where}: {damage}")
        x = _tv_decode(data, mode) if damage is None else None  # "": PIL is to decide
        if x is not None:  # a 16-bit PNG decodes to uint16: its high bytes
            return (x.to(torch.int32) >> 8).to(torch.uint8) if x.dtype == torch.uint16 else x
    return _pil_decode(data, "L" if in_chans == 1 else "RGB", where)


def _tv_decode(data: bytes, mode) -> Tensor | None:  # mode: torchvision's ImageReadMode
    """torchvision's decoding, None where it raises (damaged: PIL's view and message decide)."""
    from torchvision.io import decode_image

    try:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
    except Exception:
        return None


def image_format(data: bytes) -> str | None:
    """'jpg', 'png' or 'webp' from the leading bytes: what torchvision decodes (its GIF decoder
    ignores PIL's size limit); None for anything else."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == PNG:
        return "png"
    return "webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples a pixel
# Adam7, an interlaced PNG's seven passes: (first column, first row, column step, row step)
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2))  # fmt: skip


def png_passes(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, bytes a row with its filter byte, end) in a PNG's inflated pixel data of each
    pass that has pixels: one for a plain PNG, up to seven for an interlaced one."""
    width, height = struct.unpack(">II", data[16:24])
    bits, out, at = PNG_SAMPLES[data[25]] * data[24], [], 0
    for x, y, dx, dy in ADAM7 if data[28] else ((0, 0, 1, 1),):
        columns, rows = -(-(width - x) // dx), -(-(height - y) // dy)
        if columns > 0 and rows > 0:
            line = 1 + (columns * bits + 7) // 8
            out.append((at, line, at + rows * line))
            at += rows * line
    return out


def png_damage(data: bytes) -> str | None:
    """None when a PNG's pixel data reads without an error where libpng reads the rows: the
    chunks up to the end of the IDAT run whole, the IDAT chunks' CRCs right, the run one zlib
    stream (checksum right) of exactly the rows IHDR's size needs (each pass's, interlaced),
    each starting with a filter type 0-4 (chunks after the run are not read; other chunks'
    faults libpng raises, or warns of). Else what is wrong, or "" where PIL is to decide (data
    past the rows). torchvision's PNG decoder crashes the process (SIGSEGV) on an error in the
    rows (one flipped bit in the pixels did), and raises on one in the header; PIL fills
    missing rows with black without a word."""
    if len(data) < 33 or data[12:16] != b"IHDR" or data[25] not in PNG_SAMPLES or data[28] > 1:
        return ""
    passes = png_passes(data)
    need, got, stream = passes[-1][2] if passes else 0, 0, zlib.decompressobj()
    i, started = 8, False  # in the IDAT run
    while i + 12 <= len(data):
        n, kind = struct.unpack(">I", data[i : i + 4])[0], data[i + 4 : i + 8]
        end, name = i + 12 + n, kind.decode("ascii", "replace")
        if kind == b"IEND" or started and kind != b"IDAT":  # the run is over (or never came)
            break
        if end > len(data):
            return f"the file ends inside its {name} chunk (truncated)"
        if kind == b"IDAT":
            if zlib.crc32(data[i + 4 : end - 4]) != struct.unpack(">I", data[end - 4 : end])[0]:
                return "its IDAT chunk's CRC is wrong (damaged)"
            started = True
            try:  # at most one byte past what IHDR needs: more is for PIL to judge
                rows = stream.decompress(data[i + 8 : end - 4], need + 1 - got)
            except zlib.error as e:
                return f"its pixel data is damaged ({e})"
            bad = _bad_filter(rows, got, passes)
            if bad:
                return f"a row's filter type is {bad}, not 0-4 (damaged)"
            got += len(rows)
            if got > need:
                return ""
        i = end
    if got < need:
        return f"its pixel data ends early ({got:,} of {need:,} bytes)"
    return "" if not stream.eof or stream.unused_data else None  # the rows whole, the stream not


def _bad_filter(rows: bytes, at: int, passes: list[tuple[int, int, int]]) -> int:
    """The largest filter byte past 4 in `rows`, inflated pixel data from offset `at`; else 0.
    Each piece is checked as it comes: the whole image is not held twice."""
    stop, bad = at + len(rows), 0
    for start, line, end in passes:
        first = start + -(-(max(start, at) - start) // line) * line  # the first row start in it
        if first < min(end, stop):
            bad = max(bad, max(rows[first - at : min(end, stop) - at : line]))
    return bad if bad > 4 else 0


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR or a JPEG's SOF segment, read directly (about 100x
    faster than PIL opening the file); None for WebP and for a header this does not follow."""
    if data[:8] == PNG:
        if len(data) >= 24 and data[12:16] == b"IHDR":
            return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return None
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data) and i < MAX_HEADER:
        if data[i] != 0xFF:
            return None  # libjpeg would scan on for a marker: PIL's reading decides
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # RSTn, TEM: no length
            i += 2
        elif marker in SOF:
            if i + 9 > len(data):
                return None
            width, height = data[i + 7 : i + 9], data[i + 5 : i + 7]
            return int.from_bytes(width, "big"), int.from_bytes(height, "big")
        elif marker in SEGMENTS:
            length = int.from_bytes(data[i + 2 : i + 4], "big")
            if length < 2:
                return None
            i += 2 + length
        else:  # FF 00, EOI, SOI again, anything unexpected before the frame header
            return None
    return None


def _size_ok(data: bytes, where: str) -> bool:
    """False when the header cannot be read (the decoder then names the fault); a DatasetError
    when the header's dimensions pass MAX_PIXELS. Only the header is read (by PIL where
    _header_size does not know the format): torchvision's decoders allocate what it claims
    before they read the pixels."""
    from PIL import Image

    size = _header_size(data)
    if size is None:
        try:
            with Image.open(io.BytesIO(data)) as im:
                size = im.size
        except Exception:
            return False
    w, h = size
    if w * h > MAX_PIXELS:
        raise DatasetError(f"cannot read image {where}: its header claims {w} x {h} pixels, "
                           f"more than {MAX_PIXELS:,} (a decompression bomb?)")  # fmt: skip
    return True


def pil_convert(im, mode: str):  # (PIL.Image.Image, 'L' | 'RGB') -> PIL.Image.Image
    """`im` in `mode`, a 16-bit greyscale image (PIL's I;16 modes, and I, as it opens 16-bit
    PGM / PPM files) by its high bytes as the PNG path reads it (PIL's convert clips every value
    above 255 to white)."""
    if im.mode.startswith("I;16") or im.mode == "I":
        import numpy as np
        from PIL import Image

        high = np.clip(np.asarray(im).astype(np.int64) >> 8, 0, 255).astype(np.uint8)
        im = Image.fromarray(high, "L")
    return im.convert(mode)


def _pil_decode(data: bytes, mode: str, where: str) -> Tensor:
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    try:
        with Image.open(io.BytesIO(data)) as im:
            return TF.pil_to_tensor(pil_convert(im, mode))
    except Exception as e:  # PIL raises many kinds for bad files
        if not data:  # said as predict's open_image says it
            raise DatasetError(f"cannot read image {where}: an empty file") from None
        if "BytesIO" in str(e):  # "cannot identify image file <_io.BytesIO object at 0x...>"
            e = type(e)("not an image file of a format PIL knows")
        raise DatasetError(f"cannot read image {where}: {type(e).__name__}: {e}") from None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


GREY_STATS = ((0.449,), (0.226,))  # ImageNet's, averaged over the channels: for greyscale data
# PIL's modes of one grey channel (1-bit, 8-bit, with alpha, 16-bit of either order, float)
GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def channels_of(split: object, sample: int = 16, skip_unreadable: bool = False) -> int:
    """1 when every one of `sample` images spread over `split` (len, read(i) -> bytes and
    where(i); the first and last included) is greyscale, else 3: a colour dataset whose first
    image is grey is still read in colour. An image that does not open is a DatasetError, or,
    `skip_unreadable` (image folders: skipped and named when loaded), passed over."""
    from PIL import Image

    n = len(split)  # type: ignore[arg-type]
    seen = 0  # of no images (callers refuse an empty split): colour
    for i in sorted({round(k * (n - 1) / max(1, sample - 1)) for k in range(sample)} if n else ()):
        try:
            with Image.open(io.BytesIO(split.read(i))) as im:  # type: ignore[attr-defined]
                if im.mode not in GREY_MODES:
                    return 3
                seen += 1
        except Exception as e:
            if not skip_unreadable:
                where = split.where(i)  # type: ignore[attr-defined]
                raise DatasetError(f"cannot read image {where}: {type(e).__name__}: {e}") from None
    return 1 if seen else 3
