"""Any dataset vitlab reads, written as WebDataset shards (`vitlab data shard SRC DST`).

DST/train-000000.tar, ... and DST/test-000000.tar, ... hold samples `KEY.jpg` / `.png` / `.webp`
(an image file's bytes as they are; in-memory arrays and other formats as PNG, losslessly; every
image decoded once on the way, one that does not decode skipped and named) and
`KEY.cls` (the class index), in a seeded random order (so each shard mixes the classes and a
shuffle buffer has something to shuffle); DST/index.json lists each split's shards with their
sample counts and sizes, the class names, channels and normalisation statistics. Each shard is
written under a temporary name and renamed when whole; index.json comes last."""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from vitlab.data.datasets import ArraySplit, Split, dataset_info, load_split
from vitlab.data.decode import available_cores, decode_image, image_format
from vitlab.data.download import DatasetError
from vitlab.data.folders import FolderSplit, folder_root, scanned_folders
from vitlab.data.hf import HFSplit
from vitlab.data.shards import INDEX, ShardSplit, is_pattern
from vitlab.data.workers import MAX_WORKERS, signals_to_main
from vitlab.runtime import without_bars

UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
FORMAT = "vitlab-shards/1"
SHUFFLE_BUFFER = 10_000  # samples re-sharded shards are mixed through (their encoded bytes)
log = logging.getLogger(__name__)


def parse_size(text: str) -> int:
    """'1GB', '500MB', '2.5e8' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?B?)\s*", text.upper())
    try:
        size = float(m.group(1)) * UNITS[m.group(2)] if m else float("nan")
    except (ValueError, KeyError):  # "." or "1e" is no number, "5XB" no unit
        size = float("nan")
    if not 1 <= size < float("inf"):
        raise ValueError(
            f"a shard size is a positive number of bytes with a unit (500MB, 1GB), got {text!r}"
        )
    return int(size)


def _checked(split: Split, i: int, in_chans: int) -> tuple[bytes, str]:
    """(encoded image, extension) of sample i of an indexed split, decoded once to check it (the
    same decoder training uses, size guard included); a DatasetError naming the sample when it
    cannot be read or decoded."""
    from torchvision.io import encode_png

    if isinstance(split, ArraySplit):
        return encode_png(split.images[i]).numpy().tobytes(), "png"
    where = split.where(i)
    try:
        data = split.read(i)
    except OSError as e:
        raise DatasetError(f"cannot read image {where}: {e}") from None
    return _stored(data, decode_image(data, in_chans, where))


def _stored(data: bytes, pixels: torch.Tensor) -> tuple[bytes, str]:
    """(bytes, extension) a checked image is stored as: its own bytes when they are JPEG, PNG or
    WebP, else (BMP, TIFF, ...) the PNG of what training decodes (`pixels`)."""
    from torchvision.io import encode_png

    ext = image_format(data)
    return (data, ext) if ext else (encode_png(pixels).numpy().tobytes(), "png")


class _Checked(Dataset):
    """Sample i's (encoded image, extension, label, why it was skipped or None), in a worker."""

    def __init__(self, split: Split, in_chans: int) -> None:
        self.split, self.in_chans = split, in_chans

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[bytes, str, int, str | None]:
        try:
            data, ext = _checked(self.split, i, self.in_chans)
        except DatasetError as e:
            return b"", "", -1, str(e)
        return data, ext, int(self.split.labels[i]), None


def _as_is(sample: object) -> object:
    return sample


def samples(
    split: Split, seed: int, in_chans: int, workers: int
) -> Iterator[tuple[bytes, str, int, str | None]]:
    """(encoded image, extension, label, None) of every sample, or (..., why) for one that does
    not decode; indexed splits in a seeded order, checked by `workers` processes."""
    if isinstance(split, ShardSplit):
        for s, key, data, label in _shuffled(split, seed):
            try:
                pixels = decode_image(data, in_chans, f"{key} of {split.urls[s]}")
            except DatasetError as e:
                yield b"", "", -1, str(e)
            else:
                yield *_stored(data, pixels), label, None
        return
    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed)).tolist()
    loader = DataLoader(
        _Checked(split, in_chans), batch_size=None, sampler=order, num_workers=workers,
        collate_fn=_as_is, prefetch_factor=64 if workers else None,
        worker_init_fn=signals_to_main,
    )  # fmt: skip
    yield from loader


def _shuffled(split: ShardSplit, seed: int) -> Iterator[tuple[int, str, bytes, int]]:
    """(shard, key, image bytes, label) of every sample of `split`: the shards in a seeded order,
    their samples through a seeded SHUFFLE_BUFFER-sample shuffle buffer (class-sorted shards come
    out mixed, one pass, bounded memory)."""
    rng = random.Random(seed)
    order = list(range(len(split.urls)))
    rng.shuffle(order)
    buffer: list[tuple[int, str, bytes, int]] = []
    for s in order:
        for key, data, label in split.read(s):
            buffer.append((s, key, data, label))
            if len(buffer) >= SHUFFLE_BUFFER:
                i = rng.randrange(len(buffer))
                buffer[i], buffer[-1] = buffer[-1], buffer[i]
                yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


def _commit(file, path: Path) -> None:
    """Flush, fsync and close `file` (open on a temporary name), then rename it to `path`."""
    file.flush()
    os.fsync(file.fileno())
    file.close()
    os.replace(file.name, path)


class _Shard:
    """One shard written to a hidden temporary file, fsynced, then renamed into place: a kill
    leaves whole shards and at most one .tmp file, never a truncated .tar."""

    def __init__(self, path: Path) -> None:
        import webdataset as wds

        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115  (closed by close())
        self.tar = wds.TarWriter(self.file, mtime=0)  # fixed times: the same data, the same bytes
        self.size = self.count = 0

    def write(self, sample: dict) -> None:
        self.tar.write(sample)
        self.size = self.tar.tarstream.offset  # headers and padding too (tarfile buffers records)
        self.count += 1

    def discard(self) -> None:
        try:
            self.tar.close()  # else its stream would write to the closed file when collected
        finally:
            self.file.close()
            self.tmp.unlink(missing_ok=True)

    def close(self) -> dict:
        self.tar.close()
        size = self.file.tell()  # the file's, with the archive's end blocks
        _commit(self.file, self.path)
        return {"name": self.path.name, "count": self.count, "bytes": size}


def write_split(
    split: Split, dst: Path, name: str, shard_size: int, seed: int, in_chans: int, workers: int,
    bar,
) -> dict:  # fmt: skip
    """Write one split's shards; returns its entry of the index (skipped: the samples that did
    not decode, each named in a warning)."""
    shards, shard, skipped, n = [], None, 0, 0
    try:
        for data, ext, label, why in samples(split, seed, in_chans, workers):
            bar.update(1)
            if why is not None:
                log.warning("skipping an image that does not decode: %s", why)
                skipped += 1
                continue
            if shard is None or shard.size >= shard_size:
                if shard is not None:
                    shards.append(shard.close())
                shard = _Shard(dst / f"{name}-{len(shards):06d}.tar")
            shard.write({"__key__": f"{name}-{n:09d}", ext: data, "cls": str(label).encode()})
            n += 1
        if shard is not None:
            shards.append(shard.close())
            shard = None
        if skipped and not n:  # an index of no shards: "write at least 1 (--shard-size)" later
            raise DatasetError(f"the {name} split: none of its {skipped} images decodes (each "
                               f"named in a warning, unless -q): nothing to shard")  # fmt: skip
    finally:
        if shard is not None:  # failed or interrupted: the shard being written is no use
            shard.discard()
    return {"count": n, "skipped": skipped, "shards": shards}


def write_shards(
    source: str,
    dst: Path,
    shard_size: int = 10**9,
    data_dir: str | None = None,
    keys: tuple[str | None, str | None] = (None, None),
    seed: int = 0,
    progress: bool = True,
    workers: int | None = None,
) -> dict:
    """Write dataset `source`'s train and test splits as shards under dst; returns the index.
    Every image is decoded once on the way (by `workers` processes, default one per available
    core up to MAX_WORKERS; shards being re-sharded are read and checked in this process): one
    that does not decode is skipped and named; the index counts the skipped. A failure or an
    interrupt removes the shards this call wrote."""
    from tqdm import tqdm

    if workers is not None and workers < 0:  # before the sources are read and dst is made
        raise ValueError(f"workers is a number of processes (0: this one), got {workers}")
    if (dst / INDEX).exists():
        raise DatasetError(f"{dst} already holds shards: choose an empty folder")
    if dst.is_dir() and (any(dst.glob("*.tar")) or any(dst.glob(".*.tar.tmp"))):
        raise DatasetError(f"{dst} holds .tar files but no {INDEX}: the remains of an "
                           f"interrupted `vitlab data shard`? Remove them, or choose an empty "
                           f"folder")  # fmt: skip
    if source.startswith("imagefolder:"):  # dst would be scanned as one more class
        root = folder_root(source).resolve()
        if any(dst.resolve().is_relative_to(folder) for folder in scanned_folders(root)):
            raise DatasetError(f"{dst} is inside the image folder {root}'s images: write the "
                               f"shards elsewhere")  # fmt: skip
    with without_bars(not progress):  # a library's too (datasets' as it loads an hf: table)
        splits = {"train": load_split(source, "train", data_dir, seed, keys)}
        if source.startswith("wds:") and is_pattern(source[4:]):  # one split's shards
            log.warning("%s names one split's shards: writing them as the train split only "
                        "(name the test split's source with data.test when training)",
                        source)  # fmt: skip
        else:
            splits["test"] = load_split(source, "test", data_dir, seed, keys)
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
    workers = min(available_cores(), MAX_WORKERS) if workers is None else workers
    made = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    total = sum(len(s) for s in splits.values())
    try:
        with tqdm(total=total, unit="img", desc=f"sharding {source}", disable=not progress) as bar:
            for name, split in splits.items():
                index["splits"][name] = write_split(
                    split, dst, name, shard_size, seed, info.in_chans, workers, bar
                )
    except BaseException:  # shards without their index train nothing: leave the folder empty
        for name in splits:  # a shard made as the signal came may leave its .tmp too
            for path in [*dst.glob(f"{name}-*.tar"), *dst.glob(f".{name}-*.tar.tmp")]:
                path.unlink(missing_ok=True)
        if made and not any(dst.iterdir()):  # nor a folder this call made, left empty
            dst.rmdir()
        raise
    with open(dst / f".{INDEX}.tmp", "w") as f:  # last, atomically: then every shard is whole
        f.write(json.dumps(index, indent=1))
        _commit(f, dst / INDEX)
    folder = os.open(dst, os.O_RDONLY)  # the renames themselves on disk
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return index


__all__ = ["FolderSplit", "HFSplit", "parse_size", "write_shards"]
