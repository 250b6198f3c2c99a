"""The feature cache of vitlab.eval.features: what a split's features depend on (the key: the
weights, the dataset and a digest of its files, the split, the preprocessing, the feature kind),
the file named by its hash that holds them and the key, and the files of subsets (the training
images some few-shot draw takes): a subset file holding every row asked for serves it, and a file
of fewer rows is removed when one holding them is written (one of the whole split: every subset's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open
from torch import Tensor

from vitlab.data.cifar import cifar_files, cifar_root, ensure_cifar
from vitlab.data.download import absolute_source
from vitlab.data.folders import folder_files, folder_root
from vitlab.data.shards import remote, shard_files
from vitlab.formats.base import (
    CheckpointError,
    load_weights,
    safetensors_metadata,
    write_safetensors,
)

log = logging.getLogger(__name__)

CACHE_FORMAT = "vitlab-features"
CACHE_VERSION = 2  # 2: gap features of a model with fc_norm are normalised


@dataclass
class Features:
    """One dataset split's frozen features: of every image, or of the split's `rows` only."""

    x: Tensor  # (N, D) float32
    y: Tensor  # (N,) int64 class indices
    classes: list[str]
    cache: Path | None = None  # the file they were read from or written to
    cached: bool = False  # read from the cache: the model did not run
    rows: Tensor | None = None  # (N,) sorted: the split's rows these are (None: every row)
    split_labels: Tensor | None = None  # with rows: the whole split's labels
    skipped: int = 0  # of the whole split's images, those that did not decode

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels(self) -> Tensor:
        """The whole split's labels (of these rows' split where only some were extracted)."""
        return self.y if self.rows is None else self.split_labels

    def at(self, index: np.ndarray) -> Tensor:
        """The features of the split's images `index` (they must be among the rows)."""
        return self.x[index if self.rows is None else np.searchsorted(self.rows.numpy(), index)]


def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def source_identity(source: str, weights: Path | None) -> dict[str, Any]:
    """What identifies the weights: a vitlab weights file's (or any file's) path, size and mtime;
    a folder's files' (config.json and preprocessing too); a hub name as written."""
    if weights is not None:
        return _stat(weights)
    path = Path(source).expanduser()
    if path.is_file():
        return _stat(path)
    if path.is_dir():
        return {"folder": [_stat(p) for p in sorted(path.iterdir()) if p.is_file()]}
    return {"name": source}


def identity(name: str, test: bool = False, data_dir: str | None = None) -> tuple[str, str | None]:
    """(a dataset name as a cache key takes it, a digest of its files or None): an image folder,
    a Hugging Face dataset on disk (save_to_disk's folder, parquet), local WebDataset shards and
    CIFAR (in data.dir, $VITLAB_DATA or the default folder) by their absolute path and a digest of
    their files; anything else (a hub name, a URL, digits, Fashion-MNIST, whose files are checked
    against their SHA-256) by its name alone. `test`: the source is data.test's (an image folder
    is then read whole, every sub-folder a class)."""
    if name in ("cifar10", "cifar100"):  # fetched first where missing: the files read are keyed
        root = cifar_root(data_dir).resolve()
        ensure_cifar(root, name)
        return f"{name}:{root}", files_digest(root, cifar_files(root, name))
    if name.startswith("imagefolder:"):
        root = folder_root(name).resolve()
        return f"imagefolder:{root}", files_digest(root, folder_files(root, whole=test))
    local = absolute_source(name)  # a local path made absolute, a hub name or URL as it is
    if name.startswith("wds:") and not remote(local[4:]):
        return local, files_digest(*shard_files(local[4:]))
    path = Path(local.removeprefix("hf:").partition("#")[0])
    if name.startswith("hf:") and path.is_absolute() and path.exists():
        return local, folder_digest(path)
    return name, None


def folder_digest(root: Path) -> str:
    """A hash over every file under `root` (or of the file `root`): relative path, size,
    modification time."""
    if root.is_file():
        return files_digest(root.parent, [str(root)])
    return files_digest(root, [os.path.join(d, n) for d, _, names in os.walk(root) for n in names])


def files_digest(root: Path, files: Iterable[str]) -> str:
    """A hash over `files` in name order: each one's path relative to `root`, size and
    modification time (a link's target's), or that it is missing."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.split(os.sep)):
        try:
            st = os.stat(path)
            seen = f"{st.st_size}\0{st.st_mtime_ns}"
        except OSError:
            seen = "missing"
        h.update(f"{os.path.relpath(path, root)}\0{seen}\n".encode())
    return h.hexdigest()


def rows_digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()


def cache_file(folder: Path, key: dict[str, Any]) -> Path:
    """FOLDER/DATA_SPLIT_KIND_HASH.safetensors, the hash over the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    data = re.sub(r"[^A-Za-z0-9.-]+", "-", key["data"]).strip("-")[:40]
    return folder / f"{data}_{key['split']}_{key['features']}_{digest}.safetensors"


def read_cache(path: Path, key: dict[str, Any]) -> Features | None:
    """The features cached at `path` for `key`, or None (no file, another key, a damaged file)."""
    if not path.is_file():
        return None
    try:
        meta = safetensors_metadata(path)
        if meta.get("format") != CACHE_FORMAT or json.loads(meta.get("key", "null")) != key:
            log.debug("%s holds features for another key: extracting again", path)
            return None
        if "sha256" not in meta:  # written before caches had a checksum
            log.debug("%s has no checksum (an earlier version's): extracting again", path)
            return None
        tensors = load_weights(path)
        if meta["sha256"] != _digest(tensors):
            raise ValueError("its data do not match the checksum written with them")
        x, y, classes = tensors["features"], tensors["labels"], json.loads(meta["classes"])
        skipped = int(meta.get("skipped", 0))
    except (CheckpointError, KeyError, ValueError) as e:
        if path.exists():  # else removed meanwhile (a process that wrote a file holding it)
            log.warning("feature cache %s is unreadable (%s): extracting again", path, e)
        return None
    if skipped:  # named when they were met: said again, or a cached run would not tell
        log.warning("%d of the %s %s images did not decode when these features were cached "
                    "(%s): they are left out", skipped, key["data"], key["split"],
                    path.name)  # fmt: skip
    rows, labels = tensors.get("rows"), tensors.get("split_labels")
    return Features(x, y, classes, path, True, rows, labels, skipped)


def write_cache(path: Path, key: dict[str, Any], features: Features) -> None:
    """Write `features` with `key` in the metadata (a subset's with its rows; a whole split's
    with the count of its images that did not decode), atomically; then remove the files of the
    same split's subsets that these hold (of the whole split: all)."""
    metadata = {
        "format": CACHE_FORMAT,
        "key": json.dumps(key, sort_keys=True),
        "classes": json.dumps(features.classes),
        "skipped": str(features.skipped),
    }
    tensors = {"features": features.x.contiguous(), "labels": features.y.contiguous()}
    if features.rows is not None:
        tensors["rows"] = features.rows.contiguous()
    if features.rows is not None and "rows" not in key:  # a whole split's, some images left out
        tensors["split_labels"] = features.split_labels.contiguous()
    metadata["sha256"] = _digest(tensors)  # safetensors checks the header, not the data
    write_safetensors(path, tensors, metadata)
    held, whole = None if features.rows is None else features.rows.numpy(), "rows" not in key
    for other, _, rows in _subsets(path.parent, key):  # a subset's images all decode: the whole
        if other != path and (whole or (rows is not None and _covers(held, rows))):  # holds it
            other.unlink(missing_ok=True)
            log.info("removed feature cache %s: %s holds its features", other, path)


def _digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over the tensors' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())  # no copy
    return h.hexdigest()


def read_covering(folder: Path, key: dict[str, Any], rows: np.ndarray) -> Features | None:
    """The features of the split's `rows` (sorted) from a subset file of the same key (but its
    rows) holding every one of them (for more shots or seeds), or None."""
    for path, other, held in _subsets(folder, key):
        if held is not None and _covers(held, rows):
            found = read_cache(path, other)
            if found is not None and found.rows is not None:
                at = torch.from_numpy(np.searchsorted(found.rows.numpy(), rows))
                return Features(found.x[at], found.y[at], found.classes, cache=path, cached=True,
                                rows=torch.as_tensor(rows))  # fmt: skip
    return None


def _covers(held: np.ndarray, rows: np.ndarray) -> bool:
    return bool(np.isin(rows, held, assume_unique=True).all())


def _subsets(folder: Path, key: dict[str, Any]) -> Iterator[tuple[Path, dict, np.ndarray | None]]:
    """(file, its key, its rows or None: written before rows were kept) of each subset file in
    `folder` with `key` but its rows (file names share the data, split and kind)."""
    base = {k: v for k, v in key.items() if k != "rows"}
    name = cache_file(folder, base).name.rsplit("_", 1)[0]
    for path in sorted(folder.glob(f"{name}_*.safetensors")):
        try:
            meta = safetensors_metadata(path)
            other = json.loads(meta.get("key", "null"))
            if meta.get("format") != CACHE_FORMAT or not isinstance(other, dict):
                continue
            if "rows" not in other or {k: v for k, v in other.items() if k != "rows"} != base:
                continue
            with safe_open(str(path), framework="pt") as f:
                names = f.keys()
                rows = f.get_tensor("rows").numpy() if "rows" in names else None
        except (CheckpointError, SafetensorError, OSError, ValueError):
            continue  # unreadable, or removed meanwhile: left as it is
        yield path, other, rows
