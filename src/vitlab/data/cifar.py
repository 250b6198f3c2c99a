"""CIFAR-10 / -100's python-version batches (pickles by definition), read without ever running
code: only dicts, lists, bytes and numpy arrays are unpickled. The archive is downloaded (SHA-256
checked) into the folder it is looked for in when neither it nor its extracted folder is there."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import urllib.error
import zlib
from pathlib import Path

import numpy as np

from vitlab.data import download
from vitlab.data.download import DatasetError, cache_dir


class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's python archive is pickles by definition; allow only what those hold (dicts, lists,
    bytes and numpy arrays), never arbitrary callables."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise DatasetError(f"refusing to unpickle {module}.{name}: not part of a CIFAR batch")
        if name == "ndarray":  # only ever _reconstruct's argument: called itself, it would
            return _NDARRAY  # make an array of any shape from a few bytes (strides 0)
        found = super().find_class(module, name)
        return _empty_array if name == "_reconstruct" else found


class _NdarrayMark:
    """numpy.ndarray as a CIFAR pickle names it: _empty_array's first argument, never called."""

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise DatasetError("refusing to unpickle a call of numpy.ndarray: numpy pickles arrays "
                           "with their data (through _reconstruct)")  # fmt: skip


_NDARRAY = _NdarrayMark()


def _empty_array(subtype: object, shape: tuple, dtype: object) -> np.ndarray:
    """numpy's _reconstruct as numpy pickles it: an empty array that __setstate__ then fills with
    the bytes the file holds (numpy checks they match its shape). Any other shape would allocate
    what the file does not hold (a hostile batch could claim terabytes, or a billion labels to
    check one by one)."""
    if subtype is not _NDARRAY or tuple(shape) != (0,):
        raise DatasetError(f"refusing to unpickle an array of shape {shape!r} without its data")
    return np.ndarray((0,), dtype=dtype)


def _load_cifar_batch(raw: bytes, where: str) -> dict:
    try:
        batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except DatasetError as e:  # a refused callable or array: said with the file's name
        raise DatasetError(f"{where}: {e}") from None
    except Exception as e:  # truncated or damaged pickles fail in many ways, memory included
        raise DatasetError(f"{where} is not a readable CIFAR batch: {e}") from None
    if not isinstance(batch, dict):
        raise DatasetError(f"{where} is not a CIFAR batch: a {type(batch).__name__}, not a dict")
    return {k.decode("latin-1") if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _cifar_field(batch: dict, key: str, where: str) -> object:
    if key not in batch:
        raise DatasetError(f"CIFAR file {where} has no {key!r} entry")
    return batch[key]


def _cifar_names(meta: dict, key: str, where: str) -> list[str]:
    names = _cifar_field(meta, key, where)
    if not isinstance(names, list) or not all(isinstance(n, (bytes, str)) for n in names):
        raise DatasetError(f"CIFAR file {where}: {key!r} is not a list of names")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names]


def _cifar_arrays(batch: dict, label_key: str, classes: int, where: str) -> tuple:
    """(images (N, 3, 32, 32) uint8, labels (N,) int64) of one batch, checked."""
    data = _cifar_field(batch, "data", where)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape[1:] != (3072,):
        shape = getattr(data, "shape", type(data).__name__)
        raise DatasetError(f"CIFAR batch {where}: expected (N, 3072) bytes, got {shape}")
    labels = _cifar_field(batch, label_key, where)
    if isinstance(labels, (list, np.ndarray)) and len(labels) != len(data):
        raise DatasetError(f"CIFAR batch {where}: {len(data)} images but {len(labels)} labels")
    if not isinstance(labels, (list, np.ndarray)):
        raise DatasetError(f"CIFAR batch {where}: {label_key!r} is a {type(labels).__name__}, "
                           f"not a list of class indices")  # fmt: skip
    bad = next((i for i, y in enumerate(labels) if not isinstance(y, (int, np.integer))
                or isinstance(y, bool) or not 0 <= y < classes), None)  # fmt: skip
    if bad is not None:
        raise DatasetError(f"CIFAR batch {where}: {label_key}[{bad}] is {labels[bad]!r}, not a "
                           f"class index 0..{classes - 1}")  # fmt: skip
    return data.reshape(-1, 3, 32, 32), np.array([int(y) for y in labels], dtype=np.int64)


MIRROR = "https://www.cs.toronto.edu/~kriz/"
ARCHIVES = {  # the python-version archives and the SHA-256 of each file
    "cifar10": ("cifar-10-python.tar.gz",
                "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"),
    "cifar100": ("cifar-100-python.tar.gz",
                 "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7"),
}  # fmt: skip
LAYOUT = {  # dataset: training batches, test batch, meta file, its class-name key, label key
    "cifar10": ([f"data_batch_{i}" for i in range(1, 6)], "test_batch", "batches.meta",
                "label_names", "labels"),
    "cifar100": (["train"], "test", "meta", "fine_label_names", "fine_labels"),
}  # fmt: skip


def batch_files(name: str) -> list[str]:
    """Every file of `name`'s python-version batches."""
    train, test, meta, *_ = LAYOUT[name]
    return [*train, test, meta]


def cifar_root(data_dir: str | None) -> Path:
    """Where cifar10 / cifar100 are read from: data.dir, $VITLAB_DATA or ~/.cache/vitlab."""
    return Path(data_dir or os.environ.get("VITLAB_DATA") or cache_dir()).expanduser()


def cifar_files(root: Path, name: str) -> list[str]:
    """Every file under root that read_cifar may read for `name` (its batches, in root or an
    extracted cifar-* folder, and the .tar.gz archives but the other dataset's): what a digest
    of the data read covers."""
    found = [str(f / n) for f in _folders(root) for n in batch_files(name) if (f / n).is_file()]
    other = {a for d, (a, _) in ARCHIVES.items() if d != name}
    return found + [str(p) for p in sorted(root.glob("*.tar.gz")) if p.name not in other]


def ensure_cifar(root: Path, name: str) -> None:
    """Download `name`'s archive into root when root holds none of its files (a digest of them
    is then the data's, before the first read)."""
    if not cifar_files(root, name):
        _fetch_archive(root, name, batch_files(name))


def _cifar_members(root: Path, names: list[str], dataset: str) -> dict[str, bytes]:
    """The named batch files, read from an extracted folder or a .tar.gz archive under root; the
    archive is downloaded there (SHA-256 checked) when neither is."""
    found = _found_members(root, names)
    if found is not None:
        return found
    archive = _fetch_archive(root, dataset, names)
    found = _found_members(root, names)
    if found is None:  # the archive whose SHA-256 was checked holds them all
        raise DatasetError(f"{archive} does not hold the CIFAR files {names}")
    return found


def _fetch_archive(root: Path, dataset: str, names: list[str]) -> Path:
    archive, sha256 = ARCHIVES[dataset]
    try:
        download.fetch(MIRROR + archive, root / archive, sha256, gzipped=False)
    except (OSError, urllib.error.URLError) as e:
        raise DatasetError(
            f"{_missing(root, names)}, and the download of {archive} from "
            f"{MIRROR} failed ({e}): put the python-version archive ({archive}) or its extracted "
            f"folder there (or in {download.ELSEWHERE})"
        ) from None
    return root / archive


def _folders(root: Path) -> list[Path]:
    """Where CIFAR's batch files are looked for: root and its extracted cifar-* folders."""
    return [root, *sorted(p for p in root.glob("cifar-*") if p.is_dir())]


def _missing(root: Path, names: list[str]) -> str:
    """Which of the CIFAR files `names` the folder holding most of them lacks, or that root holds
    none."""
    most = max(_folders(root), key=lambda f: sum((f / n).is_file() for n in names))
    lacks = [n for n in names if not (most / n).is_file()]
    if len(lacks) == len(names):
        return f"CIFAR files {names} not found under {root}"
    return f"{most} holds CIFAR files but not {lacks}"


def _found_members(root: Path, names: list[str]) -> dict[str, bytes] | None:
    for folder in _folders(root):
        if all((folder / n).is_file() for n in names):
            return {n: (folder / n).read_bytes() for n in names}
    for archive in sorted(root.glob("cifar-*python.tar.gz")) + sorted(root.glob("*.tar.gz")):
        try:
            with tarfile.open(archive, "r:gz") as tar:
                found = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
                if all(n in found for n in names):
                    return {n: tar.extractfile(found[n]).read() for n in names}
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"cannot read archive {archive}: {e}") from None
    return None


def read_cifar(root: Path, name: str, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images (N, 3, 32, 32) uint8, labels (N,) int64, class names) of split 'train' or 'test'
    of `name` ('cifar10' or 'cifar100') from an extracted folder or archive under `root`."""
    train, test, meta_name, names_key, label_key = LAYOUT[name]
    names = [test] if split == "test" else train
    members = _cifar_members(root, [*names, meta_name], name)
    meta = f"{meta_name} (under {root})"
    classes = _cifar_names(_load_cifar_batch(members[meta_name], meta), names_key, meta)
    images, labels = [], []
    for n in names:
        where = f"{n} (under {root})"
        x, y = _cifar_arrays(_load_cifar_batch(members[n], where), label_key, len(classes), where)
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels), classes
