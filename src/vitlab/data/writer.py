"""Any dataset vitlab reads, written as WebDataset shards (`vitlab data shard SRC DST`).

DST/train-000000.tar, ... and DST/test-000000.tar, ... hold samples `KEY.jpg` / `.png` / `.webp`
(an image file's bytes as they are; in-memory arrays and other formats as PNG, losslessly) and
`KEY.cls` (the class index), in a seeded random order (so each shard mixes the classes and a
shuffle buffer has something to shuffle); DST/index.json lists each split's shards with their
sample counts and sizes, the class names, channels and normalisation statistics."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from vitlab.data.datasets import ArraySplit, FolderSplit, Split, dataset_info, load_split
from vitlab.data.download import DatasetError
from vitlab.data.hf import HFSplit
from vitlab.data.shards import INDEX, ShardSplit

UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
FORMAT = "vitlab-shards/1"


def parse_size(text: str) -> int:
    """'1GB', '500MB', '2.5e8' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?B?)\s*", text.upper())
    if not m or m.group(2) not in UNITS:
        raise ValueError(
            f"a shard size is a number of bytes with a unit (500MB, 1GB), got {text!r}"
        )
    return int(float(m.group(1)) * UNITS[m.group(2)])


def _extension(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _png(image) -> bytes:  # a PIL image
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def encoded(split: Split, i: int) -> tuple[bytes, str]:
    """(encoded image, extension) of sample i of an indexed split."""
    from PIL import Image

    if isinstance(split, ArraySplit):
        pixels = split.images[i].permute(1, 2, 0).numpy()  # (H, W, C)
        return _png(Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels)), "png"
    data = split.read(i)
    ext = _extension(data)
    if ext is None:  # BMP, TIFF, ...: re-encoded losslessly
        with Image.open(io.BytesIO(data)) as im:
            return _png(im.convert("L" if im.mode in ("1", "L") else "RGB")), "png"
    return data, ext


def samples(split: Split, seed: int) -> Iterator[tuple[bytes, str, int]]:
    """(encoded image, extension, label) of every sample, indexed splits in a seeded order."""
    if isinstance(split, ShardSplit):
        for s in range(len(split.urls)):
            for _key, data, label in split.read(s):
                yield data, _extension(data) or "png", label
        return
    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order:
        data, ext = encoded(split, i)
        yield data, ext, int(split.labels[i])


def write_split(split: Split, dst: Path, name: str, shard_size: int, seed: int, bar) -> dict:
    """Write one split's shards; returns its entry of the index."""
    import webdataset as wds

    shards, writer, size, count = [], None, 0, 0

    def close() -> None:
        if writer is not None:
            writer.close()
            shards.append({"name": f"{name}-{len(shards):06d}.tar", "count": count, "bytes": size})

    for n, (data, ext, label) in enumerate(samples(split, seed)):
        if writer is None or size >= shard_size:
            close()
            writer = wds.TarWriter(str(dst / f"{name}-{len(shards):06d}.tar"))
            size, count = 0, 0
        size += writer.write({"__key__": f"{name}-{n:09d}", ext: data, "cls": str(label).encode()})
        count += 1
        bar.update(1)
    close()
    return {"count": sum(s["count"] for s in shards), "shards": shards}


def write_shards(
    source: str,
    dst: Path,
    shard_size: int = 10**9,
    data_dir: str | None = None,
    keys: tuple[str | None, str | None] = (None, None),
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Write dataset `source`'s train and test splits as shards under dst; returns the index."""
    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    if (dst / INDEX).exists() or any(dst.glob("*.tar")):
        raise DatasetError(f"{dst} already holds shards: choose an empty folder")
    splits = {s: load_split(source, s, data_dir, seed, keys) for s in ("train", "test")}
    info = dataset_info(source, splits["train"])
    index = {
        "format": FORMAT,
        "source": source,
        "classes": info.classes,
        "in_chans": info.in_chans,
        "mean": list(info.mean),
        "std": list(info.std),
        "splits": {},
    }
    total = sum(len(s) for s in splits.values())
    with tqdm(total=total, unit="img", desc=f"sharding {source}", disable=not progress) as bar:
        for name, split in splits.items():
            index["splits"][name] = write_split(split, dst, name, shard_size, seed, bar)
    (dst / INDEX).write_text(json.dumps(index, indent=1))
    return index


__all__ = ["FolderSplit", "HFSplit", "parse_size", "write_shards"]
