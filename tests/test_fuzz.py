"""Hostile and broken inputs, fuzzed: every reader of outside files (IDX, CIFAR pickles, .npz and
safetensors checkpoints, image files, YAML configs) either reads the input or refuses it with one of
vitlab's own errors and a message; never another exception, a crash, a hang or code execution.

A few hundred generated inputs per reader here; benchmarks/fuzz.py runs the same cases by the
thousand and records the counts."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import struct
import tempfile
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import save_file

from vitlab.config import ConfigError, load_run_config
from vitlab.data import make_loader
from vitlab.data.datasets import DatasetError, load_split, read_idx
from vitlab.data.folders import scan_image_folder
from vitlab.eval.run import predict_files
from vitlab.formats.base import load_weights
from vitlab.models.checkpoint import CheckpointError, read_source, save_pretrained
from vitlab.models.registry import UnknownModelError
from vitlab.models.vit import VisionTransformer, ViTConfig
from vitlab.preprocessing import Preprocessing

OWN_ERRORS = (ConfigError, DatasetError, CheckpointError, UnknownModelError)

# --- mutation of valid inputs --------------------------------------------------------------------


@st.composite
def mutated(draw, base: st.SearchStrategy[bytes]) -> bytes:
    """A valid input with a few bytes flipped, cut, inserted or overwritten (often none)."""
    raw = bytearray(draw(base))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "delete"]))
        pos = draw(st.integers(0, len(raw)))
        if kind == "truncate":
            del raw[pos:]
        elif kind == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del raw[pos : pos + draw(st.integers(1, 16))]
        elif raw and kind == "flip":
            raw[min(pos, len(raw) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif raw:
            chunk = draw(st.binary(min_size=1, max_size=8))
            raw[pos : pos + len(chunk)] = chunk
    return bytes(raw)


def inputs(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Valid, damaged and random inputs."""
    return st.one_of(valid, mutated(valid), st.binary(max_size=512))


def refused_or_read(call: Callable[[], object]) -> object:
    """call()'s result, or None when it raised one of vitlab's errors with a message; any other
    exception propagates (and fails the case)."""
    try:
        return call()
    except OWN_ERRORS as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        return None


# --- IDX (Fashion-MNIST) -------------------------------------------------------------------------


@st.composite
def idx_files(draw) -> bytes:
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    header = bytes([0, 0, 8, len(shape)]) + struct.pack(f">{len(shape)}i", *shape)
    return header + draw(st.binary(min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))


@st.composite
def idx_headers(draw) -> bytes:
    """Arbitrary dimension counts and sizes (negative, huge) with a short payload."""
    ndim = draw(st.integers(0, 255))
    sizes = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=ndim, max_size=ndim))
    magic = draw(st.sampled_from([bytes([0, 0, 8]), draw(st.binary(min_size=3, max_size=3))]))
    return magic + bytes([ndim]) + struct.pack(f">{ndim}i", *sizes) + draw(st.binary(max_size=64))


@st.composite
def gz_idx(draw) -> tuple[bytes, bool]:
    raw = draw(st.one_of(idx_files(), idx_headers()))
    if not draw(st.booleans()):
        return draw(inputs(st.just(raw))), False
    return draw(inputs(st.just(gzip.compress(raw, mtime=0)))), True


def check_idx(case: tuple[bytes, bool], folder: Path) -> None:
    raw, compressed = case
    path = folder / ("f-idx3-ubyte.gz" if compressed else "f-idx3-ubyte")
    path.write_bytes(raw)
    arr = refused_or_read(lambda: read_idx(path))
    if arr is not None:  # exactly the header's shape, filled by the rest of the file
        payload = gzip.decompress(raw) if compressed else raw
        assert arr.dtype == np.uint8 and 4 + 4 * arr.ndim + arr.size == len(payload)
    arr = refused_or_read(lambda: read_idx(path, sha256="0" * 64))
    assert arr is None  # a wrong digest is always refused


# --- CIFAR batches (pickles) ---------------------------------------------------------------------

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.binary(max_size=8),
    st.text(max_size=8),
    st.builds(
        lambda shape, dtype: np.zeros(shape, dtype=dtype),
        st.lists(st.integers(0, 4), max_size=3),
        st.sampled_from(["u1", "i8", "f4", "c8", "U3", "S2", "?"]),
    ),
)
hashable = st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.text(max_size=8))
values = st.recursive(
    leaves,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(hashable, c, max_size=3),
    max_leaves=12,
)
keys = st.sampled_from([b"data", b"labels", b"label_names", b"batch_label", b"filenames", "data"])


@st.composite
def cifar_batches(draw) -> bytes:
    n = draw(st.integers(0, 3))
    batch: dict = {b"data": draw(st.sampled_from([
        np.zeros((n, 3072), np.uint8), np.zeros((n, 3071), np.uint8), np.zeros(n, np.int64),
    ]))}  # fmt: skip
    batch[b"labels"] = draw(st.lists(st.integers(-(2**66), 2**66), min_size=n, max_size=n + 1))
    batch.update(draw(st.dictionaries(keys, values, max_size=3)))
    obj = draw(st.one_of(st.just(batch), values))
    return pickle.dumps(obj, protocol=draw(st.integers(0, pickle.HIGHEST_PROTOCOL)))


@st.composite
def cifar_cases(draw) -> tuple[bytes, bytes]:
    meta = {b"label_names": [f"c{i}".encode() for i in range(10)]}
    metas = st.one_of(st.just(pickle.dumps(meta)), st.builds(pickle.dumps, values))
    return draw(inputs(cifar_batches())), draw(inputs(metas))


def check_cifar(case: tuple[bytes, bytes], folder: Path) -> None:
    batch, meta = case
    d = folder / "cifar-10-batches-py"
    d.mkdir(exist_ok=True)
    (d / "test_batch").write_bytes(batch)
    (d / "batches.meta").write_bytes(meta)
    split = refused_or_read(lambda: load_split("cifar10", "test", str(folder)))
    if split is not None:
        n = len(split.labels)
        assert split.images.shape == (n, 3, 32, 32) and split.images.dtype == torch.uint8
        assert split.labels.dtype == torch.int64 and all(isinstance(c, str) for c in split.classes)


# --- .npz and safetensors checkpoints ------------------------------------------------------------

npz_names = st.sampled_from([
    "embedding/kernel", "embedding/bias", "cls", "Transformer/posembed_input/pos_embedding",
    "Transformer/encoder_norm/scale", "Transformer/encoder_norm/bias", "head/kernel", "head/bias",
    "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel",
    "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel",
    "Transformer/encoderblock_0/LayerNorm_0/scale", "x",
])  # fmt: skip
small_arrays = st.builds(
    lambda shape, dtype: np.ones(shape, dtype=dtype),
    st.lists(st.integers(0, 4), max_size=4),
    st.sampled_from(["f4", "f2", "i4", "u1", "?", "c8", "U2"]),
)


@st.composite
def npz_files(draw) -> bytes:
    arrays = draw(st.dictionaries(npz_names, small_arrays, max_size=8))
    buf = io.BytesIO()
    (np.savez_compressed if draw(st.booleans()) else np.savez)(buf, **arrays)
    return buf.getvalue()


@st.composite
def npz_headers(draw) -> bytes:
    """A zip holding one .npy with an arbitrary header (shape, dtype, order)."""
    shape = draw(st.lists(st.integers(-2, 2**40), max_size=3))
    descr = draw(st.sampled_from(["<f4", "|O", "<U5", "|V0", "x", "<f4,<i4", ">c16"]))
    order = draw(st.booleans())
    header = f"{{'descr': {descr!r}, 'fortran_order': {order}, 'shape': {tuple(shape)}, }}"
    header = draw(st.sampled_from([header, header[: len(header) // 2], "{'a': 1}"]))
    body = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("embedding/kernel.npy", body + draw(st.binary(max_size=64)))
    return buf.getvalue()


@st.composite
def torch_files(draw) -> bytes:
    """torch.save of a few small tensors under ViT names in the zip format, or of one in the legacy
    pickle format, whose storage key (the storage's address) is made the same in every process,
    so that a derandomized run draws the same bytes (with more storages, their order would vary)."""
    names = draw(st.lists(vit_keys, max_size=4, unique=True))
    dtypes = st.sampled_from(
        [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
    )
    shapes = st.lists(st.integers(0, 4), max_size=4)
    legacy = draw(st.booleans())
    buf = io.BytesIO()
    tensors = {k: torch.ones(draw(shapes), dtype=draw(dtypes)) for k in names[: 1 if legacy else 4]}
    torch.save(tensors, buf, _use_new_zipfile_serialization=not legacy)
    key = b"X" + struct.pack("<I", 16) + b"1" * 16
    return (
        re.sub(rb"X.{4}\d{8,}", key, buf.getvalue(), flags=re.DOTALL) if legacy else buf.getvalue()
    )


def check_torch(raw: bytes, folder: Path) -> None:
    path = folder / "ckpt.pt"
    path.write_bytes(raw)
    refused_or_read(lambda: read_source(path))


def check_npz(raw: bytes, folder: Path) -> None:
    path = folder / "ckpt.npz"
    path.write_bytes(raw)
    refused_or_read(lambda: read_source(path))


vit_keys = st.sampled_from([
    "patch_embed.proj.weight", "pos_embed.weight", "cls_token", "norm.weight", "head.weight",
    "blocks.0.norm1.weight", "pos_embed", "conv_proj.weight", "x",
])  # fmt: skip
dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)
config_fields = st.dictionaries(
    st.sampled_from(["img_size", "patch_size", "embed_dim", "depth", "num_heads", "x"]), json_values
)


@st.composite
def metadata(draw) -> dict:
    meta = {"format": draw(st.sampled_from(["vitlab", "pt", "x"]))}
    for key in draw(st.lists(st.sampled_from(["config", "preprocessing", "classes", "info"]))):
        meta[key] = draw(st.one_of(
            st.builds(json.dumps, st.one_of(config_fields, json_values)),
            st.just("[" * 100_000), st.text(max_size=8),
        ))  # fmt: skip
    return meta


@st.composite
def safetensors_headers(draw) -> bytes:
    """An 8-byte length, a JSON header of tensors (dtype, shape, offsets) and metadata, a body."""
    header: dict = {}
    for name in draw(st.lists(vit_keys, max_size=4, unique=True)):
        shape = draw(st.lists(st.integers(-1, 2**33), max_size=3))
        start = draw(st.integers(-1, 64))
        header[name] = {
            "dtype": draw(dtypes),
            "shape": shape,
            "data_offsets": [start, start + draw(st.integers(-1, 64))],
        }
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(metadata(), json_values))
    text = json.dumps(header).encode()
    length = draw(st.sampled_from([len(text), len(text) + 1, 2**63, 0]))
    return struct.pack("<Q", length) + text + draw(st.binary(max_size=64))


@st.composite
def safetensors_files(draw) -> bytes:
    """A real safetensors file (tensors from vit_keys, vitlab-like metadata), possibly damaged."""
    tensors = {
        k: torch.ones(draw(st.lists(st.integers(0, 3), max_size=4)))
        for k in draw(st.lists(vit_keys, max_size=4, unique=True))
    }
    with tempfile.TemporaryDirectory() as d:
        save_file(tensors, f"{d}/x.safetensors", metadata=draw(metadata()))
        return Path(f"{d}/x.safetensors").read_bytes()


def check_safetensors(raw: bytes, folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(raw)
    refused_or_read(lambda: load_weights(path))
    refused_or_read(lambda: read_source(path))


# --- image files ---------------------------------------------------------------------------------

IMAGE_FORMATS = {"PNG": ".png", "JPEG": ".jpg", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif",
                 "WEBP": ".webp", "PPM": ".ppm"}  # fmt: skip


@st.composite
def image_files(draw) -> tuple[bytes, str]:
    fmt = draw(st.sampled_from(sorted(IMAGE_FORMATS)))
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P", "1", "I;16", "CMYK"]))
    w, h = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    im = Image.new(
        "RGB", (w, h), tuple(draw(st.lists(st.integers(0, 255), min_size=3, max_size=3)))
    )
    buf = io.BytesIO()
    try:
        im.convert(mode).save(buf, format=fmt)
    except (OSError, ValueError, KeyError):  # a mode the format cannot store
        im.save(buf, format=fmt)
    return buf.getvalue(), IMAGE_FORMATS[fmt]


@st.composite
def image_cases(draw) -> tuple[bytes, str]:
    raw, suffix = draw(image_files())
    return draw(inputs(st.just(raw))), draw(st.sampled_from([suffix, ".png", ".jpg"]))


def check_image(case: tuple[bytes, str], folder: Path) -> None:
    """An image folder keeps a file only when PIL verifies it (otherwise skips it, warning): a kept
    file then loads as a batch, or is a DatasetError naming it when it does not decode (verify
    does not decode); a folder of unreadable files is a DatasetError."""
    raw, suffix = case
    root = folder / "images"
    (root / "cls").mkdir(parents=True, exist_ok=True)
    for p in (root / "cls").iterdir():
        p.unlink()
    (root / "cls" / f"a{suffix}").write_bytes(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = refused_or_read(lambda: scan_image_folder(root))
    if split is not None:
        pre = Preprocessing((8, 8), 3, (0.5,) * 3, (0.5,) * 3)
        batch = refused_or_read(lambda: next(iter(make_loader(split, 1, pre))))
        if batch is not None:
            images, _ = batch
            assert images.shape == (1, 3, 8, 8) and torch.isfinite(images).all()


def check_predict(case: tuple[bytes, str], folder: Path) -> None:
    """`vitlab predict` on an image file: its top classes, or an error naming the file."""
    raw, suffix = case
    path = str(folder / f"a{suffix}")
    Path(path).write_bytes(raw)
    result = predict_files(tiny_checkpoint(folder), [path], device="cpu")
    assert len(result) == 1 and result[0]["image"] == path
    assert "top" in result[0] or result[0]["error"].startswith(f"cannot read image {path}")


def tiny_checkpoint(folder: Path) -> str:
    path = folder / "tiny.safetensors"
    if not path.exists():
        cfg = ViTConfig(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=1, num_classes=2)
        save_pretrained(VisionTransformer(cfg), path)
    return str(path)


# --- YAML configs --------------------------------------------------------------------------------

SECTIONS = ["model", "data", "optim", "train", "finetune", "x"]
CONFIG_KEYS = ["name", "epochs", "lr", "batch_size", "img_size", "patch_size", "betas", "from",
               "crop_scale", "hflip", "ema", "precision", "dir", "embed_dim", "y"]  # fmt: skip
yaml_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
    st.sampled_from(["vit_nano_patch4_28", "digits", "fp32", "adamw", "cosine"]),
)  # fmt: skip
yaml_values = st.recursive(
    yaml_leaves,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(yaml_leaves, c, max_size=3),
    max_leaves=8,
)
yaml_trees = st.dictionaries(
    st.one_of(st.sampled_from(SECTIONS), yaml_leaves),
    st.one_of(
        st.dictionaries(
            st.one_of(st.sampled_from(CONFIG_KEYS), yaml_leaves), yaml_values, max_size=4
        ),
        yaml_values,
    ),  # fmt: skip
    max_size=4,
)
YAML_SNIPPETS = [
    "train:\n  epochs: " + "9" * 5000, "train: {epochs: 2001-13-45}", "data: {dir: !!binary AA}",
    "model: !!python/object/apply:os.system [touch pwned]", "a: &a [*a]", "[" * 10_000,
    "model: {name: vit_nano_patch4_28, img_size: 0}", "model: {patch_size: -1}",
    "optim: {betas: [1, 2, 3]}", "\udcff: 1", "train: {epochs: .inf}", "train: !!set {a}",
    "data: {name: digits, crop_scale: [0.1, .nan]}", "model: {1: 2}", "{? [a, b] : 1}",
]  # fmt: skip


@st.composite
def yaml_texts(draw) -> bytes:
    tree = yaml.safe_dump(draw(yaml_trees), allow_unicode=True).encode("utf-8", "surrogatepass")
    snippet = draw(st.sampled_from(YAML_SNIPPETS)).encode("utf-8", "surrogatepass")
    return draw(inputs(st.sampled_from([tree, snippet])))


def check_yaml(raw: bytes, folder: Path) -> None:
    path = folder / "config.yaml"
    path.write_bytes(raw)
    refused_or_read(lambda: load_run_config(str(path)))
    assert not Path("pwned").exists()


# --- the cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    inputs: st.SearchStrategy
    check: Callable[..., None]


CASES = {
    "idx": Case(gz_idx(), check_idx),
    "cifar": Case(cifar_cases(), check_cifar),
    "npz": Case(st.one_of(inputs(npz_files()), npz_headers()), check_npz),
    "torch": Case(inputs(torch_files()), check_torch),
    "safetensors": Case(
        inputs(st.one_of(safetensors_headers(), safetensors_files())), check_safetensors
    ),  # fmt: skip
    "image": Case(st.one_of(image_cases(), st.tuples(st.binary(), st.just(".png"))), check_image),
    "yaml": Case(yaml_texts(), check_yaml),
    "predict": Case(
        st.one_of(image_cases(), st.tuples(st.binary(), st.just(".png"))), check_predict
    ),  # fmt: skip
}


def fuzz(name: str, examples: int, derandomize: bool = True) -> int:
    """Run case `name` on `examples` generated inputs; the number of inputs tried."""
    case, tried = CASES[name], [0]
    with tempfile.TemporaryDirectory() as d:

        @settings(
            max_examples=examples,
            derandomize=derandomize,
            database=None,
            deadline=timedelta(seconds=10),  # a hang fails the case
            suppress_health_check=list(HealthCheck),
        )
        @given(case.inputs)
        def run(x) -> None:
            tried[0] += 1
            case.check(x, Path(d))

        run()
    return tried[0]


@pytest.mark.parametrize("name", [n for n in CASES if n != "predict"])
def test_readers_refuse_broken_inputs_with_vitlab_errors(name: str) -> None:
    assert fuzz(name, examples=200) >= 200


def test_predict_refuses_broken_images_with_a_dataset_error(tmp_path: Path) -> None:
    """Two files the fuzzing found: PPM headers with a NUL byte for a size or a pixel (PIL raises
    ValueError); benchmarks/fuzz.py fuzzes `vitlab predict` further."""
    for raw in (b"P6\n\x00\x00\n255\n", b"P3\n2 2\n255\n\x00\n"):
        check_predict((raw, ".ppm"), tmp_path)


def _png_chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """A PNG's chunks: kind -> (offset, data length) of its first one of that kind."""
    out, i = {}, 8
    while i + 12 <= len(data):
        n = struct.unpack(">I", data[i : i + 4])[0]
        out.setdefault(data[i + 4 : i + 8], (i, n))
        i += 12 + n
    return out


def _with_idat(data: bytes, pixels: bytes) -> bytes:
    """`data` with its one IDAT chunk holding `pixels` compressed, its CRC right."""
    i, n = _png_chunks(data)[b"IDAT"]
    body = b"IDAT" + zlib.compress(pixels)
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return data[:i] + chunk + data[i + 12 + n :]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(pixels: np.ndarray, interlaced: bool, piece: int, before: bytes = b"") -> bytes:
    """An 8-bit PNG of (H, W) grey or (H, W, 3) RGB pixels written by hand (PIL writes no
    interlaced PNG): Adam7's passes when `interlaced`, the zlib stream in IDAT chunks of `piece`
    bytes, the chunks `before` between IHDR and them."""
    from vitlab.data.decode import ADAM7

    raw = b""
    for x, y, dx, dy in ADAM7 if interlaced else ((0, 0, 1, 1),):
        part = pixels[y::dy, x::dx]
        if part.size:  # a pass with no pixels has no rows
            raw += b"".join(b"\0" + row.tobytes() for row in part.reshape(len(part), -1))
    stream = zlib.compress(raw)
    h, w = pixels.shape[:2]
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2 * (pixels.ndim == 3), 0, 0,
                                         interlaced))  # fmt: skip
    idat = b"".join(_chunk(b"IDAT", stream[k : k + piece]) for k in range(0, len(stream), piece))
    return b"\x89PNG\r\n\x1a\n" + header + before + idat + _chunk(b"IEND", b"")


def test_a_png_check_passes_interlaced_split_and_ancillary_chunks() -> None:
    """Whole PNGs of the kinds PIL does not write keep torchvision's decoder, with the pixels
    written: interlaced (Adam7's passes counted, so their filter bytes are checked), the stream
    over many IDAT chunks, a text chunk with a wrong CRC before them (libpng warns and drops it;
    the first version of the check refused the file). A damaged interlaced PNG is named."""
    from vitlab.data.decode import decode_image, png_damage

    rng = np.random.default_rng(0)
    broken_text = bytearray(_chunk(b"tEXt", b"key\0value"))
    broken_text[-1] ^= 1
    for shape in ((13, 7), (1, 1), (3, 9), (17, 33, 3)):
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        for interlaced, piece, before in (
            (0, 7, b""),
            (1, 1 << 20, b""),
            (1, 5, bytes(broken_text)),
        ):
            data = _png(pixels, interlaced, piece, before)
            assert png_damage(data) is None, (shape, interlaced, piece)
            got = decode_image(data, 3 if len(shape) == 3 else 1, "x").permute(1, 2, 0).numpy()
            assert np.array_equal(got, pixels.reshape(got.shape)), (shape, interlaced, piece)
    data = _png(rng.integers(0, 256, (9, 9), dtype=np.uint8), True, 1 << 20)
    i, n = _png_chunks(data)[b"IDAT"]
    raw = bytearray(zlib.decompress(data[i + 8 : i + 8 + n]))
    raw[-1 - 9] = 5  # the last pass's last row starts 10 bytes from the end (1 + 9 pixels)
    assert png_damage(_with_idat(data, bytes(raw))) == "a row's filter type is 5, not 0-4 (damaged)"


def test_a_png_damaged_in_its_pixels_is_an_error_not_a_crash() -> None:
    """torchvision's PNG decoder ends the process (SIGSEGV) on an error libpng meets reading the
    rows: one flipped bit in the pixels did (a QA run of benchmarks/fuzz.py crashed twice in four;
    so would a damaged PNG in an image folder). Such a PNG is now checked first and read by PIL,
    which names it; whole PNGs of every kind keep torchvision's decoder, with PIL's pixels."""
    from vitlab.data.decode import decode_image, png_damage

    x = np.linspace(0, 255, 40)
    grey = (np.add.outer(x, x[:30]) / 2).astype(np.uint8)  # 40 rows of 30
    kinds = {"L": grey, "RGB": np.stack([grey, grey[::-1], 255 - grey], -1), "P": grey,
             "I;16": grey.astype(np.uint16) * 257, "RGBA": np.stack([grey] * 4, -1)}  # fmt: skip
    for mode, pixels in kinds.items():
        im = Image.fromarray(pixels).convert("P") if mode == "P" else Image.fromarray(pixels)
        buffer = io.BytesIO()
        im.save(buffer, "PNG")
        good = buffer.getvalue()
        assert png_damage(good) is None, mode  # torchvision's fast path
        for chans, pil_mode in ((1, "L"), (3, "RGB")):
            want = np.asarray((Image.fromarray(grey) if mode == "I;16" else im).convert(pil_mode))
            got = decode_image(good, chans, mode).permute(1, 2, 0).numpy()
            assert np.abs(got.astype(int) - want.reshape(got.shape)).max() <= 1, (mode, chans)
    i, n = _png_chunks(good)[b"IDAT"]
    raw = zlib.decompress(good[i + 8 : i + 8 + n])
    line = len(raw) // 40
    flipped = bytearray(good)
    flipped[i + 8 + n // 2] ^= 1
    zlib_body = bytearray(good)
    zlib_body[i + 8 + n - 1] ^= 0xFF  # the stream's checksum, the chunk's CRC made right
    zlib_body[i + 8 + n : i + 12 + n] = struct.pack(">I", zlib.crc32(zlib_body[i + 4 : i + 8 + n]))
    damaged = {
        "IDAT: CRC error": bytes(flipped),
        "IDAT: incorrect data check": bytes(zlib_body),
        "bad adaptive filter value": _with_idat(good, bytes([9]) + raw[1:]),
        "Not enough image data": _with_idat(good, raw[: 20 * line]),
        "too much image data": _with_idat(good, raw + raw[:line]),
        "truncated": good[: i + 8 + n // 2],
    }
    said = {
        "IDAT: CRC error": "its IDAT chunk's CRC is wrong",
        "IDAT: incorrect data check": "its pixel data is damaged (Error -3 while decompressing "
        "data: incorrect data check)",
        "bad adaptive filter value": "a row's filter type is 9, not 0-4",
        "Not enough image data": f"its pixel data ends early ({20 * line:,} of {40 * line:,}",
        "truncated": "the file ends inside its IDAT chunk",
    }  # PIL's own reading said less: "broken data stream", or nothing (black rows)
    for libpng_said, data in damaged.items():
        if libpng_said in said:
            assert png_damage(data).startswith(said[libpng_said]), libpng_said
            with pytest.raises(
                DatasetError, match=f"image {libpng_said}: {re.escape(said[libpng_said])}"
            ):
                decode_image(data, 3, libpng_said)
    extra = damaged["too much image data"]  # rows whole, a row more after them: PIL reads them
    assert png_damage(extra) == "" and decode_image(extra, 1, "x").shape == (1, 40, 30)


class _Payload:
    """Pickles to a call of `func(*args)`: what a hostile CIFAR batch would carry."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_code_in_a_cifar_pickle_never_runs(tmp_path: Path) -> None:
    """Each payload creates a marker file when unpickled by pickle.loads (checked: the payloads are
    real); vitlab refuses them all, naming the callable, and no marker appears."""
    import builtins
    import os
    import subprocess
    import sys

    marker = tmp_path / "marker"
    payloads = [
        _Payload(os.system, f"touch {marker}"),
        _Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        _Payload(Path.touch, marker),
        _Payload(subprocess.call, ["touch", str(marker)]),
    ]
    for payload in payloads:
        raw = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [payload]})
        for target in ("test_batch", "batches.meta"):
            d = tmp_path / "cifar-10-batches-py"
            d.mkdir(exist_ok=True)
            (d / "test_batch").write_bytes(raw)
            meta = {b"label_names": [b"a"]}
            (d / "batches.meta").write_bytes(pickle.dumps(meta) if target == "test_batch" else raw)
            with pytest.raises(DatasetError, match=rf"{target} \(under .*\): refusing to unpickle"):
                load_split("cifar10", "test", str(tmp_path))
            assert not marker.exists()
        # the same bytes do run code through plain pickle
        code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
        subprocess.run([sys.executable, "-c", code], input=raw, check=True)
        assert marker.exists()
        marker.unlink()


def test_a_cifar_batch_of_zero_strides_is_refused(tmp_path: Path) -> None:
    """numpy.ndarray called by the pickle itself, on one byte with strides 0, made an array of
    any shape: a 135-byte test_batch read as 300,000 images (a QA pass). numpy's own pickles
    name ndarray only as _reconstruct's argument; called, it is refused, naming the file."""
    images = _Payload(np.ndarray, (300_000, 3072), np.dtype("u1"), b"\0", 0, (0, 0))
    labels = _Payload(np.ndarray, (300_000,), np.dtype("u1"), b"\0", 0, (0,))
    raw = pickle.dumps({b"data": images, b"labels": labels}, protocol=3)
    assert len(raw) < 400 and pickle.loads(raw)[b"data"].shape == (300_000, 3072)  # real
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    (d / "test_batch").write_bytes(raw)
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"]}))
    with pytest.raises(
        DatasetError, match=r"test_batch \(under .*\): refusing to unpickle a call of numpy.ndarray"
    ):
        load_split("cifar10", "test", str(tmp_path))


def test_a_cifar_batch_claiming_a_billion_labels_is_refused_at_once(tmp_path: Path) -> None:
    """An array pickled without its data (numpy's own pickles carry shape (0,) until the bytes
    are set) would make the reader allocate, and check one by one, what the file does not hold:
    the fuzzer found such a batch taking over a minute. Refused at once."""
    reconstruct = np.zeros(1).__reduce__()[0]
    labels = _Payload(reconstruct, np.ndarray, (10**9,), b"b")
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    raw = pickle.dumps({b"data": np.zeros((0, 3072), np.uint8), b"labels": labels})
    (d / "test_batch").write_bytes(raw)
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a"]}))
    t0 = time.perf_counter()
    with pytest.raises(DatasetError, match=r"shape \(1000000000,\) without its data"):
        load_split("cifar10", "test", str(tmp_path))
    assert time.perf_counter() - t0 < 5
