"""Datasets by name. Small ones load into memory as uint8 tensors (N, C, H, W); image folders are
listed (each file checked when first decoded) and streamed from disk.

    digits          scikit-learn's bundled 8x8 digits (1,797 images); test = a seeded 20%
    fashion-mnist   60k / 10k 28x28 greyscale, IDX gz files (located or downloaded, SHA-256 checked)
    cifar10/100     the python-version archive (tar.gz or extracted folder)
    imagefolder:P   one sub-folder per class; P/train + P/test (or P/val) when present
    wds:SHARDS      WebDataset shards (vitlab.data.shards), streamed
    hf:NAME         a Hugging Face dataset: hub name, save_to_disk folder, parquet files
                    (vitlab.data.hf)

A source of one split (a wds pattern, one parquet file) is the training split; data.test names
the test split's source, loaded whole (split "all"), and then the training source is loaded whole
too (no test split carved from it). load_run_split reads a run's splits as `vitlab train` does,
for every command that evaluates a run.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import logging
import math
import os
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitlab.config import DataConfig
from vitlab.data.cifar import cifar_root, read_cifar
from vitlab.data.classes import named, numbered
from vitlab.data.decode import GREY_STATS, channels_of
from vitlab.data.download import FASHION_SHA256, DatasetError, find_or_fetch_fashion_mnist
from vitlab.data.folders import FolderSplit, folder_root, load_folder_split, scan_image_folder
from vitlab.data.hf import HFSplit, load_hf
from vitlab.data.shards import ShardSplit, carve_shards, load_shards
from vitlab.runtime import seeded_split

log = logging.getLogger(__name__)


FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot"]  # fmt: skip


@dataclass
class ArraySplit:
    """One split held in memory."""

    images: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: Tensor) -> ArraySplit:
        return ArraySplit(self.images[index], self.labels[index], self.classes)


Split = ArraySplit | FolderSplit | ShardSplit | HFSplit


@dataclass
class DatasetInfo:
    """What the model and the preprocessing need to know about a dataset."""

    name: str
    classes: list[str]
    in_chans: int
    image_size: tuple[int, int] | None  # native size; None for folders of mixed sizes
    mean: tuple[float, ...]
    std: tuple[float, ...]


# (mean, std) per channel in [0, 1] units: the normalisation training uses. digits' are not its
# pixels' (its 8x8 training split's: 0.3050 / 0.3756, all 1,797 images 0.3053 / 0.3759); kept, as
# every digits figure was measured with them (any constant normalises; the presets' are these)
STATS = {
    "digits": ((0.3061,), (0.3954,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet statistics
}


# --- digits ---------------------------------------------------------------------------------------


def load_digits_split(split: str) -> ArraySplit:
    pixels, target = read_digits()
    images = torch.from_numpy(np.rint(pixels * (255.0 / 16.0)).astype(np.uint8))[:, None]
    full = ArraySplit(images, torch.from_numpy(target).long(), [str(i) for i in range(10)])
    train, test = seeded_split(len(full), 0.2, seed=1797)  # fixed: test never moves
    return full.subset(test if split == "test" else train)


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: the images (1797, 8, 8) in 0..16 and the labels (1797,), read from
    the CSV file scikit-learn ships (64 pixels and the label a row), without importing
    scikit-learn, which takes 1.5-3 s (a quarter of a small run's start, paid by every process of
    a torchrun); through sklearn.datasets.load_digits where that file is not found."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    origin = Path(spec.origin).parent if spec and spec.origin else None
    path = origin / "datasets" / "data" / "digits.csv.gz" if origin else None
    if path is not None and path.is_file():
        with gzip.open(path, "rt") as f:
            rows = np.loadtxt(f, delimiter=",", ndmin=2)
        if rows.shape[1] == 65:  # else another scikit-learn's layout: its loader reads it
            return rows[:, :64].reshape(-1, 8, 8), rows[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images, data.target


# --- IDX (MNIST family) ---------------------------------------------------------------------------


def read_idx(path: Path, sha256: str | None = None) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic 0x0000 08 NDIM, NDIM big-endian int32 sizes,
    then uint8 data. With `sha256`, the (decompressed) bytes must have that digest."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged deflate stream
        raise DatasetError(f"cannot read IDX file {path}: {e}") from None
    if sha256 and hashlib.sha256(raw).hexdigest() != sha256:
        raise DatasetError(f"{path} is corrupt: its SHA-256 does not match the published data")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
    ndim = raw[3]
    if ndim > 32:  # numpy holds up to 64 dimensions; an IDX file has a handful
        raise DatasetError(f"{path} is not an IDX file of images or labels: {ndim} dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path} is truncated: no room for its {ndim} sizes")
    shape = struct.unpack(f">{ndim}i", raw[4:header])
    if min(shape, default=0) < 0:
        raise DatasetError(f"{path} is not an IDX file: negative size in its shape {shape}")
    count = math.prod(shape)  # exact: numpy's product of int32 sizes can overflow
    if len(raw) - header != count:
        raise DatasetError(
            f"{path} is truncated or padded: header says {shape} = {count} bytes, "
            f"file holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_fashion_mnist_split(split: str, data_dir: str | None) -> ArraySplit:
    files = find_or_fetch_fashion_mnist(data_dir)
    prefix = "t10k" if split == "test" else "train"
    images_name, labels_name = f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"
    images = read_idx(files[images_name], FASHION_SHA256[images_name])
    labels = read_idx(files[labels_name], FASHION_SHA256[labels_name])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DatasetError(
            f"Fashion-MNIST {prefix} files disagree: images {images.shape}, labels {labels.shape}"
        )
    return ArraySplit(
        torch.from_numpy(images.copy())[:, None],
        torch.from_numpy(labels.astype(np.int64)),
        list(FASHION_CLASSES),
    )


# --- CIFAR ----------------------------------------------------------------------------------------


def load_cifar_split(name: str, split: str, data_dir: str | None) -> ArraySplit:
    images, labels, classes = read_cifar(cifar_root(data_dir), name, split)
    return ArraySplit(torch.from_numpy(images), torch.from_numpy(labels), classes)


# --- by name --------------------------------------------------------------------------------------

NAMES = (
    "digits",
    "fashion-mnist",
    "cifar10",
    "cifar100",
    "imagefolder:PATH",
    "wds:SHARDS",
    "hf:NAME",
)


def check_data_dir(data_dir: str | None) -> None:
    """A DatasetError for a data.dir (--data-dir) that is a file, whatever the dataset: refused,
    not silently ignored."""
    path = os.path.expanduser(data_dir or "")
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise DatasetError(
            f"the data folder {data_dir} (data.dir, --data-dir) is a file, not a folder: "
            "expected the folder that holds the dataset's files"
        )


def load_split(
    name: str,
    split: str,
    data_dir: str | None = None,
    seed: int = 0,
    keys: tuple[str | None, str | None] = (None, None),
    whole: bool = False,
) -> Split:
    """The 'train' or 'test' split of a dataset by name, or 'all' of a folder, shards or HF
    dataset (a test split named by data.test); keys = (data.image_key, data.label_key); whole:
    'train' of a source of one split is all of it (its test split is another source's)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    check_data_dir(data_dir)
    if name.startswith("wds:"):
        return load_shards(name[4:], split, keys)
    if name.startswith("hf:"):
        return load_hf(name[3:], split, keys, seed, whole)
    if split == "all" and name.startswith("imagefolder:"):
        return scan_image_folder(folder_root(name))
    if split == "all":
        raise DatasetError(f"data.test={name}: a test split of its own is an image folder, shards "
                           f"or a Hugging Face dataset; {name} has its own test split")  # fmt: skip
    if name == "digits":
        return load_digits_split(split)
    if name == "fashion-mnist":
        return load_fashion_mnist_split(split, data_dir)
    if name in ("cifar10", "cifar100"):
        return load_cifar_split(name, split, data_dir)
    if name.startswith("imagefolder:"):
        return load_folder_split(folder_root(name), split, seed, whole)
    raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}")


def match_classes(test: Split, classes: list[str], name: str) -> Split:
    """`test` (data.test's source) labelled by the training split's classes: the same list, or
    class indices (numbered classes, no more than training has); else a DatasetError naming both."""
    if test.classes == classes:
        return test
    fits = len(test.classes) <= len(classes) and not isinstance(test, ArraySplit)
    if numbered(test.classes) and fits:
        return replace(test, classes=list(classes))
    raise DatasetError(f"data.test={name} has the classes {named(test.classes)}, the training "
                       f"split {named(classes)}: a test split is labelled with the training "
                       f"split's classes, in its order")  # fmt: skip


def load_run_split(cfg: DataConfig, split: str, classes: list[str] | None = None) -> Split:
    """Split 'train' (before the validation carve), 'val' or 'test' of a run's data as `vitlab
    train` reads it: with data.test, the training source whole and the test split data.test's,
    labelled by the training split's classes (`classes`, or read from the training split)."""
    keys, seed = (cfg.image_key, cfg.label_key), cfg.split_seed
    if split in ("train", "val"):
        full = load_split(cfg.name, "train", cfg.dir, seed, keys, whole=bool(cfg.test))
        if split == "train":
            return full
        _, val = train_val_split(full, cfg.val_fraction, seed)
        if val is None:
            raise DatasetError(f"{cfg.name} has no validation split (data.val_fraction=0)")
        return val
    if not cfg.test:
        return load_split(cfg.name, "test", cfg.dir, seed, keys)
    if classes is None:
        classes = load_run_split(cfg, "train").classes
    return match_classes(load_split(cfg.test, "all", cfg.dir, seed, keys), classes, cfg.test)


def dataset_info(name: str, split: Split) -> DatasetInfo:
    if isinstance(split, ShardSplit | HFSplit):
        return DatasetInfo(name, split.classes, split.in_chans, None, *split.stats)
    key = "imagefolder" if name.startswith("imagefolder:") else name
    mean, std = STATS[key]
    if isinstance(split, ArraySplit):
        chans, size = split.images.shape[1], tuple(split.images.shape[2:])
    else:  # image files: grey where a sample of them all are, as an hf: dataset's rows
        chans, size = channels_of(split, skip_unreadable=True), None
        mean, std = GREY_STATS if chans == 1 else (mean, std)
    return DatasetInfo(name, split.classes, chans, size, mean, std)


def label_subset(
    train: Split, fraction: float, seed: int, key: str = "data.label_fraction"
) -> Split:
    """The same seeded `fraction` of every class (at least one image each; of all images when
    the split has no labels), in the split's order: the labelled part of a few-label run, or the
    test share. `key` is the config key the fraction came from, for the error."""
    if fraction >= 1.0:
        return train
    if isinstance(train, ShardSplit):
        raise DatasetError(f"{key} < 1 picks images by label: shards are streamed, not "
                           f"indexed; got {key}={fraction:g}: write the subset's shards "
                           "instead")  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    groups = [torch.arange(len(train))]
    if train.classes:
        groups = [(train.labels == c).nonzero().squeeze(1) for c in range(len(train.classes))]
    kept = []
    for index in groups:
        if len(index):
            k = max(1, int(round(len(index) * fraction)))
            kept.append(index[torch.randperm(len(index), generator=g)[:k]])
    return train.subset(torch.cat(kept).sort().values)


def train_val_split(train: Split, fraction: float, seed: int) -> tuple[Split, Split | None]:
    """Carve a seeded validation set out of train (none when fraction is 0)."""
    if fraction <= 0:
        return train, None
    if isinstance(train, ShardSplit):
        return carve_shards(train, fraction, seed)
    if len(train) < 2:
        raise DatasetError(
            f"data.val_fraction={fraction} carves a validation split from {len(train)} training "
            "image(s): it needs at least 2; add images, or set data.val_fraction=0"
        )
    kept, carved = seeded_split(len(train), fraction, seed)
    return train.subset(kept), train.subset(carved)
