"""Image bytes to uint8 tensors: torchvision's decoders (libjpeg-turbo, libpng, libwebp) first,
PIL for the formats they do not read (BMP, TIFF, PPM, ...). One function for every source: image
files, WebDataset shards and Hugging Face datasets."""

from __future__ import annotations

import io
import os
import warnings

import torch
from torch import Tensor

from vitlab.data.download import DatasetError

# torchvision 0.29 warns on every first use that TorchCodec will take its decoders over; vitlab
# pins torchvision, and the warning says nothing a user can act on
warnings.filterwarnings("ignore", "The image decoding and encoding", DeprecationWarning)

# torchvision allocates what a header claims; refuse what PIL would refuse as a decompression bomb
MAX_PIXELS = 2 * 89_478_485


def decode_image(data: bytes, in_chans: int, where: str) -> Tensor:
    """The image in `data` as uint8 (C, H, W), C = in_chans (1: greyscale, 3: RGB); a DatasetError
    naming `where` when it cannot be decoded."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as tv_decode

    mode = ImageReadMode.GRAY if in_chans == 1 else ImageReadMode.RGB
    if _torchvision_reads(data):
        try:
            return tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
        except Exception:  # damaged: PIL's view, and its error message, decide
            pass
    return _pil_decode(data, "L" if in_chans == 1 else "RGB", where)


def _torchvision_reads(data: bytes) -> bool:
    """JPEG, PNG or WebP: what torchvision decodes (its GIF decoder ignores PIL's size limit)."""
    png = data[:8] == b"\x89PNG\r\n\x1a\n"
    webp = data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return (data[:3] == b"\xff\xd8\xff" or png or webp) and _size_ok(data)


def _size_ok(data: bytes) -> bool:
    """A PNG's header dimensions within MAX_PIXELS (JPEG and WebP decoders check their own)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or len(data) < 24:
        return True
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return w * h <= MAX_PIXELS


def _pil_decode(data: bytes, mode: str, where: str) -> Tensor:
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    try:
        with Image.open(io.BytesIO(data)) as im:
            return TF.pil_to_tensor(im.convert(mode))
    except Exception as e:  # PIL raises many kinds for bad files
        if "BytesIO" in str(e):  # "cannot identify image file <_io.BytesIO object at 0x...>"
            e = type(e)("not an image file of a format PIL knows")
        raise DatasetError(f"cannot read image {where}: {type(e).__name__}: {e}") from None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
