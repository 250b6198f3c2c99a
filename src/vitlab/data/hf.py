"""Hugging Face datasets (`data.name=hf:NAME`), through the `datasets` library.

NAME is a folder `Dataset.save_to_disk` wrote, a parquet file, a folder of parquet files (splits
named by their file names, as `datasets.load_dataset` reads them), or, online, a hub name
(`hf:ILSVRC/imagenet-1k`, `hf:uoft-cs/cifar10`). The image column is the first of type Image
(else one named image / img / jpg / png) unless data.image_key names it; the label column the first
ClassLabel (else label / labels / cls / fine_label / target) unless data.label_key does. Class
names come from the ClassLabel, else are the label values (class indices: integers >= 0). The test
split is `test`, else `validation` / `val` (a split whose labels are all negative, such as
imagenet-1k's unlabelled test, is passed over), labelled with the training split's classes, else
a seeded 20% of the only split (as an image folder's). `hf:NAME#SPLIT` reads split SPLIT alone,
as a source of one split (`data.name=hf:ILSVRC/imagenet-1k#train
data.test=hf:ILSVRC/imagenet-1k#validation`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from vitlab.data.classes import named as named_list
from vitlab.data.classes import numbered
from vitlab.data.decode import GREY_STATS, channels_of
from vitlab.data.download import DatasetError
from vitlab.runtime import bars_off, seeded_split

IMAGE_NAMES = ("image", "img", "jpg", "png")
LABEL_NAMES = ("label", "labels", "cls", "fine_label", "target")
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
log = logging.getLogger(__name__)
_WARNED: set[tuple[str, int]] = set()  # (table, classes) whose label gaps were said
MAX_NUMBERED = 1 << 20  # classes numbered by a label column without names, past the rows' count


@dataclass
class HFSplit:
    """Rows of a Hugging Face dataset (memory-mapped Arrow), images read on demand."""

    table: object  # datasets.Dataset of the image column only, undecoded
    name: str
    rows: Tensor  # (N,) int64: the table's rows in this split
    labels: Tensor  # (N,) int64
    classes: list[str]
    in_chans: int = 3
    stats: tuple[tuple[float, ...], tuple[float, ...]] = IMAGENET_STATS

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: Tensor) -> HFSplit:
        return replace(self, rows=self.rows[index], labels=self.labels[index])

    def read(self, i: int) -> bytes:
        """Row i's encoded image (an OSError when its file cannot be read)."""
        cell = self.table[int(self.rows[i])][self.table.column_names[0]]
        if isinstance(cell, dict) and cell.get("bytes") is None and cell.get("path"):
            with open(cell["path"], "rb") as f:
                return f.read()
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        if not isinstance(data, bytes):
            raise OSError(f"an image cell holds {type(data).__name__}, not encoded bytes")
        return data

    def where(self, i: int) -> str:
        return f"row {int(self.rows[i])} of {self.name}"


def _open(spec: str) -> dict:
    """{split name: datasets.Dataset} of hf:SPEC (SPEC = NAME or NAME#SPLIT: that split only)."""
    import datasets

    spec, _, chosen = spec.partition("#")
    path = Path(spec).expanduser()
    one = {"split": chosen} if chosen else {}
    bars = datasets.utils.logging.is_progress_bar_enabled()  # -q (vitlab's messages at ERROR):
    if bars_off():  # none of theirs
        datasets.utils.logging.disable_progress_bar()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            found = datasets.load_from_disk(str(path))
        elif path.suffix == ".parquet":
            found = datasets.load_dataset("parquet", data_files=str(path), **one)
        else:  # a folder of data files, or a hub name
            found = datasets.load_dataset(str(path) if path.exists() else spec, **one)
    except Exception as e:  # missing, offline, unknown name or split: the library says which
        raise DatasetError(f"cannot load the Hugging Face dataset {spec}"
                           f"{f' (split {chosen})' if chosen else ''}: {type(e).__name__}: "
                           f"{e}") from None  # fmt: skip
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()
    splits = dict(found) if isinstance(found, datasets.DatasetDict) else {chosen or "train": found}
    if chosen and chosen not in splits:
        raise DatasetError(f"hf:{spec} has no split {chosen!r}: it has {sorted(splits)}")
    return {chosen: splits[chosen]} if chosen else splits


def one_split(spec: str, splits: dict | None = None) -> bool:
    """Whether hf:SPEC is a source of one split (NAME#SPLIT picks one): its test split would be a
    seeded fifth of it, where `vitlab eval --data` of it means all of it. `splits`: _open's, if
    opened already."""
    return "#" in spec or len(_open(spec) if splits is None else splits) == 1


def _labels(table, column: str, where: str) -> Tensor:
    """The label column as class indices, or a DatasetError saying what it holds instead."""
    values, fine = list(table[column]), object()
    wrong = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), fine)
    if wrong is not fine:  # None too: a missing label
        raise DatasetError(f"{where}: label column {column!r} holds {type(wrong).__name__} "
                           f"values (such as {wrong!r}), not class indices: name another with "
                           f"data.label_key (data shard: --label-key)")  # fmt: skip
    return torch.as_tensor(values, dtype=torch.long)


def _labelled(table, key: str | None) -> bool:
    """Whether a split has a label other than negative (unlabelled) ones (a column of other
    values, strings or images, has none: _labels names them, where they are read)."""
    try:
        column = _column(table, key, "ClassLabel", LABEL_NAMES, "label")
    except DatasetError:
        return False
    return any(isinstance(v, int) and v >= 0 for v in table[column])


def _column(table, key: str | None, kind: str, names: tuple[str, ...], what: str) -> str:
    if key is not None:
        if key not in table.column_names:
            raise DatasetError(
                f"data.{what}_key={key} (data shard: --{what}-key): no such column; it has "
                f"{table.column_names}"
            )
        return key
    typed = [c for c, f in table.features.items() if type(f).__name__ == kind]
    named = [c for c in names if c in table.column_names]
    if not typed + named:
        raise DatasetError(f"no {what} column found (a {kind} feature, or one named "
                           f"{' / '.join(names)}) among {table.column_names}: set "
                           f"data.{what}_key (data shard: --{what}-key)")  # fmt: skip
    return (typed + named)[0]


def _classes(table, column: str, labels: Tensor | None, where: str, named: str) -> list[str]:
    """A split's class names: its ClassLabel's, else its labels numbered 0..max (`labels`: the
    column read already, or None to read it)."""
    import datasets

    if isinstance(table.features[column], datasets.ClassLabel):
        return list(table.features[column].names)
    labels = _labels(table, column, where) if labels is None else labels
    # numbered by the labels, 0..max (a stray 10**12 made a list that exhausted memory: past
    top = int(labels.max()) + 1 if len(labels) else 0  # 2^20 classes and the rows, no)
    if top > max(len(labels), MAX_NUMBERED):
        raise DatasetError(f"{where}: label {top - 1} in a column of {len(labels)} rows: "
                           f"labels are class indices 0..K-1 (a ClassLabel feature names "
                           f"them)")  # fmt: skip
    empty = top - len(labels[labels >= 0].unique())
    if top > 0 and empty and (named, top) not in _WARNED:  # once: each split reads the table
        _WARNED.add((named, top))
        log.warning("%s: labels 0..%d number %d classes, %d of them with no row (a stray "
                    "label makes a class of its own)", named, top - 1, top, empty)  # fmt: skip
    return [str(i) for i in range(top)]


def _as_training(
    labels: Tensor, classes: list[str], own: list[str], where: str, train: str
) -> tuple[Tensor, list[str]]:
    """A test split's (labels, classes) in its training split's classes `own`: numbered classes
    (either side) as indices, which must be training's; names mapped onto training's (a
    ClassLabel may list them in another order, or fewer); a name of a row that training lacks is
    a DatasetError naming it. (Not classes.name_order: a model's classes may be only indices
    where a dataset's are names, a test split's are its training split's.)"""
    if classes == own:
        return labels, classes
    if numbered(classes) or numbered(own):
        top = int(labels.max()) if len(labels) else -1
        if top >= len(own):
            raise DatasetError(f"{where} has label {top}, past the training split {train}'s "
                               f"classes 0..{len(own) - 1}: a test split is labelled with the "
                               f"training split's classes")  # fmt: skip
        return labels, own
    used = sorted({int(y) for y in labels.unique()})
    if missing := [classes[y] for y in used if classes[y] not in own]:
        raise DatasetError(f"{where} has classes the training split {train} has not: "
                           f"{named_list(missing)} (training's: {named_list(own)})")  # fmt: skip
    order = torch.tensor([own.index(c) if c in own else -1 for c in classes], dtype=torch.long)
    return order[labels], own


def _unlabelled(labels: Tensor, bad: Tensor, column: str) -> str:
    """How to train on the labelled rows of a split whose only wrong labels (rows `bad`) are
    negative, unlabelled (not where every row is, nor where others are wrong too: filtering
    out the negative ones would not do)."""
    if not bool((labels[bad] < 0).all()) or not bool((labels >= 0).any()):
        return ""
    return (f": to use the labelled rows, drop the others and save them, e.g. `ds.filter(lambda r: "
            f"r[{column!r}] >= 0).save_to_disk(PATH)`, then data.name=hf:PATH")  # fmt: skip


def load_hf(
    spec: str, split: str, keys: tuple[str | None, str | None], seed: int, whole: bool = False
) -> HFSplit:
    """Split 'train', 'test' or 'all' of hf:SPEC; keys = (data.image_key, data.label_key); whole:
    the training split of a source of one split not carved (the test split is another's)."""
    import datasets

    splits = _open(spec)
    train = "train" if "train" in splits else next(iter(splits))
    candidates = [n for n in ("test", "validation", "val") if n in splits and n != train]
    test = next((n for n in candidates if _labelled(splits[n], keys[1])), None)  # not train
    if split == "all" and len(splits) > 1 and test is None:
        raise DatasetError(f"hf:{spec} has splits {sorted(splits)}: which is the test split? "
                           f"name it: hf:{spec}#SPLIT")  # fmt: skip
    chosen = test if split != "train" and test else train
    table, where = splits[chosen], f"hf:{spec}"
    named = where if one_split(spec, splits) else f"{where}#{chosen}"  # "row 3 of" it
    image = _column(table, keys[0], "Image", IMAGE_NAMES, "image")
    label = _column(table, keys[1], "ClassLabel", LABEL_NAMES, "label")
    labels = _labels(table, label, where)
    classes = _classes(table, label, labels, where, named)
    bad = ((labels < 0) | (labels >= len(classes))).nonzero().flatten()
    if len(bad):
        span = f" {0}..{len(classes) - 1}" if classes else ""
        raise DatasetError(f"{where}: {len(bad)} labels are not class indices{span} (row "
                           f"{int(bad[0])}: {int(labels[bad[0]])}; negative labels mark "
                           f"unlabelled rows){_unlabelled(labels, bad, label)}")  # fmt: skip
    if chosen != train:  # a test split of its own: labelled as the training split is
        base = splits[train]
        column = _column(base, keys[1], "ClassLabel", LABEL_NAMES, "label")
        own = _classes(base, column, None, where, f"{where}#{train}")
        labels, classes = _as_training(labels, classes, own, f"{where}#{chosen}", train)
    images = table.select_columns([image])
    if isinstance(images.features[image], datasets.Image):
        images = images.cast_column(image, datasets.Image(decode=False))
    full = HFSplit(images, named, torch.arange(len(labels)), labels, classes)
    if not len(full):
        raise DatasetError(f"{named} has no rows")
    full.in_chans = channels_of(full)
    if full.in_chans == 1:
        full.stats = GREY_STATS
    if split == "all" or test is not None or (whole and split == "train"):
        return full
    kept, carved = seeded_split(len(full), 0.2, seed)
    return full.subset(carved if split == "test" else kept)
