"""WebDataset shards (`data.name=wds:SHARDS`): tar files of samples `KEY.jpg` (or .png / .webp)
and `KEY.cls` (the class index as text), read with the `webdataset` library.

SHARDS is a folder that `vitlab data shard` wrote (its index.json lists each split's shards, their
sample counts, the class names and the image statistics), or a brace pattern of local paths
(`/data/in1k/train-{000000..001023}.tar`): the training shards, the test split then named by
data.test. Shards are read from local (or mounted network) file systems; URL patterns are not
supported, as no index is fetched for them. A pattern's sample counts come from an index.json
beside its shards when there is one, else every shard is read once to count it, by every rank at
every start: write an index (`vitlab data shard`) for large datasets."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from vitlab.data.download import DatasetError

log = logging.getLogger(__name__)

INDEX = "index.json"
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
LABEL_KEYS = ("cls", "label")
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass
class ShardSplit:
    """One split as shards: where each is and how many samples it holds."""

    urls: list[str]
    counts: list[int]
    classes: list[str]
    in_chans: int = 3
    stats: tuple[tuple[float, ...], tuple[float, ...]] = IMAGENET_STATS  # (mean, std)
    image_key: str | None = None  # None: the first of IMAGE_KEYS a sample has
    label_key: str | None = None  # None: the first of LABEL_KEYS a sample has
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(self.counts)

    def shards(self, index: list[int]) -> ShardSplit:
        return replace(
            self, urls=[self.urls[i] for i in index], counts=[self.counts[i] for i in index]
        )

    def read(self, shard: int) -> Iterator[tuple[str, bytes, int]]:
        """(key, image bytes, label) of each sample of shard `shard`, in order; a DatasetError
        naming the shard when it cannot be read or holds other than its indexed count."""
        import webdataset as wds

        url, n = self.urls[shard], 0
        try:
            for sample in wds.tarfile_samples([{"url": url}]):
                n += 1
                yield sample["__key__"], *self._fields(sample, url)
        except DatasetError:
            raise
        except Exception as e:  # gopen, tarfile and the network fail in many ways
            raise DatasetError(f"cannot read shard {url}: {type(e).__name__}: {e}") from None
        if self.counts[shard] >= 0 and n != self.counts[shard]:  # -1: being counted
            raise DatasetError(
                f"shard {url} holds {n} samples, its index says {self.counts[shard]}"
            )

    def _fields(self, sample: dict, url: str) -> tuple[bytes, int]:
        key = sample["__key__"]
        image = _pick(sample, self.image_key, IMAGE_KEYS, f"image of sample {key} in {url}")
        label = _pick(sample, self.label_key, LABEL_KEYS, f"label of sample {key} in {url}")
        try:
            return image, int(label.decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise DatasetError(
                f"sample {key} in {url}: its label {label[:20]!r} is not a class index"
            ) from None


def _pick(sample: dict, key: str | None, defaults: tuple[str, ...], what: str) -> bytes:
    for k in (key,) if key else defaults:
        if k in sample:
            return sample[k]
    have = sorted(k for k in sample if not k.startswith("__"))
    raise DatasetError(f"no {what}: expected a file .{' or .'.join((key,) if key else defaults)}, "
                       f"the sample has {have}")  # fmt: skip


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read shard index {path}: {e}") from None
    if not isinstance(index, dict) or not isinstance(index.get("splits"), dict):
        raise DatasetError(f"{path} is not a vitlab shard index (no 'splits' table)")
    return index


def _split_of(index: dict, root: Path, split: str, keys: tuple, where: Path) -> ShardSplit:
    names = [split] if split != "test" else ["test", "val", "validation"]
    found = next((index["splits"][n] for n in names if n in index["splits"]), None)
    if found is None:
        raise DatasetError(f"{where} has no {' or '.join(names)} split: it has "
                           f"{sorted(index['splits'])}")  # fmt: skip
    shards = found.get("shards", [])
    urls = [s["name"] if "://" in s["name"] else str(root / s["name"]) for s in shards]
    stats = index.get("mean"), index.get("std")
    return ShardSplit(
        urls,
        [int(s["count"]) for s in shards],
        [str(c) for c in index.get("classes", [])],
        int(index.get("in_chans", 3)),
        (tuple(stats[0]), tuple(stats[1])) if all(stats) else IMAGENET_STATS,
        *keys,
    )


def load_shards(spec: str, split: str, keys: tuple[str | None, str | None]) -> ShardSplit:
    """Split `split` ('train', 'test', or 'all': a pattern's every shard) of `wds:SPEC`;
    keys = (data.image_key, data.label_key)."""
    path = Path(spec).expanduser()
    if path.is_dir() or path.name == INDEX:
        index_path = path / INDEX if path.is_dir() else path
        if not index_path.is_file():
            raise DatasetError(
                f"{path} has no {INDEX}: write shards with `vitlab data shard`, or name them "
                f"with a pattern such as {path}/train-{{0000..0009}}.tar"
            )
        index = _read_index(index_path)
        return _split_of(index, index_path.parent, "test" if split == "all" else split, keys, path)
    if split == "test":
        raise DatasetError(
            f"wds:{spec} names one split's shards: set data.test (e.g. wds:/data/val-{{0..9}}.tar, "
            f"or any dataset name) for the test split"
        )
    return _pattern_split(spec, keys)


def _pattern_split(pattern: str, keys: tuple) -> ShardSplit:
    from braceexpand import braceexpand

    if "://" in pattern:
        raise DatasetError(f"wds:{pattern}: URL patterns are not supported (no index is fetched "
                           f"for them): copy or mount the shards and name their paths")  # fmt: skip
    urls = list(braceexpand(pattern))
    beside = Path(urls[0]).parent / INDEX
    counts: dict[str, int] = {}
    classes: list[str] = []
    in_chans, stats = 3, IMAGENET_STATS
    if beside.is_file():
        index = _read_index(beside)
        for table in index["splits"].values():
            for s in table.get("shards", []):
                counts[Path(s["name"]).name] = int(s["count"])
        classes = [str(c) for c in index.get("classes", [])]
        in_chans = int(index.get("in_chans", 3))
        if index.get("mean") and index.get("std"):
            stats = (tuple(index["mean"]), tuple(index["std"]))
    missing = [u for u in urls if Path(u).name not in counts]
    top = -1
    for u in missing:
        if not Path(u).is_file():
            raise DatasetError(f"shard {u} (from the pattern {pattern}) does not exist")
        counts[Path(u).name], top = _count(u, keys, top)
    if missing:
        log.warning("counted the samples of %d shards without an index (reading them once)",
                    len(missing))  # fmt: skip
    if not classes:
        classes = [str(i) for i in range(top + 1)]
    split = ShardSplit(urls, [counts[Path(u).name] for u in urls], classes, in_chans, stats, *keys)
    return split


def _count(url: str, keys: tuple, top: int) -> tuple[int, int]:
    """(samples in a local shard, the largest label seen so far)."""
    probe = ShardSplit([url], [-1], [], image_key=keys[0], label_key=keys[1])
    n = 0
    for _, _, label in probe.read(0):
        n, top = n + 1, max(top, label)
    return n, top


def carve_shards(split: ShardSplit, fraction: float, seed: int) -> tuple[ShardSplit, ShardSplit]:
    """(kept, carved): a seeded `fraction` of the shards (at least one each) carved out, as the
    validation split of a sharded training set; warned about when the carved share of samples is
    far (more than 1.5 times off) from `fraction`."""
    import torch

    n = len(split.urls)
    if n < 2:
        raise DatasetError(
            f"data.val_fraction={fraction} carves whole shards, and {split.urls[0]} is the only "
            f"one: write more shards, or set data.val_fraction=0"
        )
    k = min(n - 1, max(1, int(round(n * fraction))))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    kept, carved = split.shards(sorted(perm[k:])), split.shards(sorted(perm[:k]))
    share = len(carved) / max(len(split), 1)
    if not fraction / 1.5 <= share <= fraction * 1.5:
        log.warning("data.val_fraction carves whole shards: %d of %d carves %.0f%% of the samples "
                    "for data.val_fraction=%g; write more (smaller) shards for a closer share",
                    k, n, 100 * share, fraction)  # fmt: skip
    return kept, carved
