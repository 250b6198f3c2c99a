"""WebDataset shards (`data.name=wds:SHARDS`): tar files of samples `KEY.jpg` (or .png / .webp)
and `KEY.cls` (the class index as text), read with the `webdataset` library.

SHARDS is a folder that `vitlab data shard` wrote (its index.json lists each split's shards, their
sample counts, the class names and the image statistics), the URL of such a folder's index.json,
or a brace pattern of paths or of URLs webdataset's gopen opens (`/data/in1k/train-{000000..001023}
.tar`, `https://host/in1k/train-{000000..001023}.tar`, `pipe:aws s3 cp s3://b/train-{0..9}.tar -`):
the training shards, the test split then named by data.test. A pattern's sample counts come from
an index.json beside its shards (fetched, for URLs) when there is one, else every shard is read
once to count it, by every rank at every start: write an index (`vitlab data shard`) for large
datasets."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from vitlab.data.download import DatasetError
from vitlab.runtime import first_rank
from vitlab.validation import shown

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
            raise DatasetError(f"cannot read shard {url}: {_reason(e)}") from None
        if self.counts[shard] >= 0 and n != self.counts[shard]:  # -1: being counted
            raise DatasetError(
                f"shard {url} holds {n} samples, its index says {self.counts[shard]}"
            )

    def _fields(self, sample: dict, url: str) -> tuple[bytes, int]:
        key = sample["__key__"]
        image = _pick(sample, self.image_key, IMAGE_KEYS, f"image of sample {key} in {url}")
        label = _pick(sample, self.label_key, LABEL_KEYS, f"label of sample {key} in {url}")
        try:
            value = int(label.decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise DatasetError(
                f"sample {key} in {url}: its label {label[:20]!r} is not a class index"
            ) from None
        if value < 0 or (self.classes and value >= len(self.classes)):
            span = f"0..{len(self.classes) - 1}" if self.classes else ">= 0"
            raise DatasetError(f"sample {key} in {url}: its label {value} is not a class index "
                               f"({span})")  # fmt: skip
        return image, value


def _pick(sample: dict, key: str | None, defaults: tuple[str, ...], what: str) -> bytes:
    for k in (key,) if key else defaults:
        if k in sample:
            return sample[k]
    have = sorted(k for k in sample if not k.startswith("__"))
    raise DatasetError(f"no {what}: expected a file .{' or .'.join((key,) if key else defaults)}, "
                       f"the sample has {have}")  # fmt: skip


CURL = {6: "could not resolve the host", 7: "could not connect to the host", 22: "the server "
        "answered with an HTTP error (404: no such file?)", 28: "timed out", 35: "TLS failed",
        56: "the connection broke"}  # fmt: skip


def _reason(e: Exception) -> str:
    """Why a read failed, in words: webdataset's curl pipe (http(s) URLs) fails with its
    arguments and exit code, or as tarfile's 'empty file' with the pipe, read before curl's exit
    status: either says little."""
    code = re.search(r"'curl'.*exit (\d+)", str(e))
    pipes = [a.proc for a in e.args if hasattr(a, "proc") and "curl" in str(a.args)]
    if code is None and pipes:  # after 'empty file' curl is ending; else it may still send
        with suppress(subprocess.TimeoutExpired):
            status = pipes[0].wait(timeout=5) if "empty file" in str(e) else pipes[0].poll()
            code = re.match(r"(\d+)", str(status))
    if code is None or code.group(1) == "0":
        # webdataset appends the stream to an error's args (tarfile's): its words, not the
        # objects' reprs; an OSError's own text names its errno
        plain = pipes or getattr(e, "errno", None) is None
        said = ([str(a) for a in e.args if isinstance(a, str)] if plain else []) or [str(e)]
        return f"{type(e).__name__}: {', '.join(said)}"  # not the Pipe object's repr
    n = int(code.group(1))
    retried = ", after curl's retries" if n in (6, 28) else ""  # --retry's transient errors
    return f"curl exit {n}{f' ({CURL[n]})' if n in CURL else ''}{retried}"


def remote(spec: str) -> bool:
    """Whether wds:SPEC names URLs (http(s)://, file://, pipe:, ...) rather than local paths."""
    return "://" in spec or spec.startswith("pipe:")


def _fetch(url: str) -> bytes:
    """An index's bytes: over http(s) by urllib, once, with a 30 s timeout and the reason in its
    error (webdataset's curl retried an unknown host for a minute, then gave its arguments);
    other URLs (pipe:, s3:// ...) by webdataset's gopen, as the shards are read."""
    if url.startswith(("http://", "https://")):
        import urllib.request

        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read()
    import webdataset as wds

    with wds.gopen(url, "rb") as f:
        return f.read()


def _read_index(path: Path | str) -> dict:
    try:
        text = _fetch(path) if isinstance(path, str) else path.read_bytes()
        index = json.loads(text)
    except Exception as e:  # a missing file, the network, curl's exit, bad JSON
        raise DatasetError(f"cannot read shard index {path}: {type(e).__name__}: {e}") from None
    if not isinstance(index, dict) or not isinstance(index.get("splits"), dict):
        raise DatasetError(f"{path} is not a vitlab shard index (no 'splits' table)")
    return index


def _split_of(
    index: dict, root: Path | str, split: str, keys: tuple, where: Path | str
) -> ShardSplit:
    """`split` of an index whose shard names are relative to `root` (a folder or a base URL)."""
    names = [split] if split != "test" else ["test", "val", "validation"]
    found = next((index["splits"][n] for n in names if n in index["splits"]), None)
    if found is None:
        raise DatasetError(f"{where} has no {' or '.join(names)} split: it has "
                           f"{sorted(index['splits'])}")  # fmt: skip
    shards = found.get("shards", [])
    urls = [_shard_url(s, root, where) for s in shards]
    stats = index.get("mean"), index.get("std")
    return ShardSplit(
        urls,
        [int(s["count"]) for s in shards],
        [str(c) for c in index.get("classes", [])],
        int(index.get("in_chans", 3)),
        (tuple(stats[0]), tuple(stats[1])) if all(stats) else IMAGENET_STATS,
        *keys,
    )


# what an index may name its shards by: paths (relative to it, or absolute) and these URLs; not
# pipe: (webdataset runs it in a shell: a downloaded or shared index would run its commands) nor
# the other programs' schemes. A pipe: source is given where it is typed: wds:pipe:CMD
_INDEX_SCHEMES = ("file", "http", "https", "gs")


def _shard_url(shard: object, root: Path | str, where: Path | str) -> str:
    """Where an index's shard entry is read from; a DatasetError for one that is no
    {name, count} entry, or whose name is a command or a URL of another scheme."""
    name = shard.get("name") if isinstance(shard, dict) else None
    if not isinstance(name, str) or not isinstance(shard.get("count"), int):
        raise DatasetError(f"{where} is not a vitlab shard index: a shard entry {shown(shard)} "
                           f"is not {{name, count}}")  # fmt: skip
    url = name if remote(name) else _join(root, name)  # as webdataset's gopen will see it
    if url.strip() == "-" or urlparse(url).scheme not in ("", *_INDEX_SCHEMES):
        raise DatasetError(f"{where} names a shard {shown(name)}: an index names its shards by "
                           f"path or {', '.join(_INDEX_SCHEMES)} URL (a pipe: command runs only "
                           f"where it is typed, as wds:pipe:CMD)")  # fmt: skip
    return url


def is_pattern(spec: str) -> bool:
    """Whether wds:SPEC names shards by a pattern (one split's) rather than an index (a folder
    `vitlab data shard` wrote, its index.json, or an index's URL: every split)."""
    if remote(spec):
        return not (spec.endswith("/") or spec.endswith(INDEX))
    path = Path(spec).expanduser()
    return not (path.is_dir() or path.name == INDEX)


def shard_files(spec: str) -> tuple[Path, list[str]]:
    """(a folder, the local files wds:SPEC is read from): a pattern's shards and the index
    beside them (where _pattern_split looks for it), or every file in an index's folder and
    every local shard the index names (a hand-written index's in sub-folders or elsewhere)."""
    path = Path(spec).expanduser()
    if not is_pattern(spec):
        folder = path if path.is_dir() else path.parent
        if not folder.is_dir():
            return folder, []
        files = [str(p) for p in sorted(folder.iterdir())]
        try:  # a vitlab index (else loading it fails, and the folder's files are the key)
            splits = _read_index(path / INDEX if path.is_dir() else path)["splits"].values()
            named = [s["name"] for split in splits for s in split.get("shards", [])
                     if isinstance(s["name"], str) and not remote(s["name"])]  # fmt: skip
        except (DatasetError, AttributeError, KeyError, TypeError):
            named = []
        return folder, sorted({*files, *(_join(folder, n) for n in named)})
    from braceexpand import braceexpand

    shards = list(braceexpand(spec))
    return Path(shards[0]).parent, [*shards, str(Path(shards[0]).parent / INDEX)]


def load_shards(spec: str, split: str, keys: tuple[str | None, str | None]) -> ShardSplit:
    """Split `split` ('train', 'test', or 'all': a pattern's every shard) of `wds:SPEC`;
    keys = (data.image_key, data.label_key)."""
    if remote(spec) and (spec.endswith("/") or spec.endswith(INDEX)):  # an index's URL
        url = spec if spec.endswith(INDEX) else spec + INDEX
        return _split_of(_read_index(url), url[: -len(INDEX)], "test" if split == "all" else split,
                         keys, url)  # fmt: skip
    path = Path(spec).expanduser()
    if not is_pattern(spec):
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

    urls = list(braceexpand(pattern))
    counts: dict[str, int] = {}
    classes: list[str] = []
    in_chans, stats = 3, IMAGENET_STATS
    index = None
    if pattern.startswith("pipe:"):  # a command per shard: nothing beside them to fetch
        pass
    elif remote(pattern):  # an index beside the shards, if the server has one
        try:
            index = _read_index(_join(urls[0].rsplit("/", 1)[0], INDEX))
        except DatasetError as e:
            log.info("no index beside %s (%s): counting the shards", pattern, e)
    elif (Path(urls[0]).parent / INDEX).is_file():
        index = _read_index(Path(urls[0]).parent / INDEX)
    if index is not None:
        for table in index["splits"].values():
            for s in table.get("shards", []):
                counts[_name(s["name"])] = int(s["count"])
        classes = [str(c) for c in index.get("classes", [])]
        in_chans = int(index.get("in_chans", 3))
        if index.get("mean") and index.get("std"):
            stats = (tuple(index["mean"]), tuple(index["std"]))
    missing = [u for u in urls if _name(u) not in counts]
    top = -1
    for u in missing:
        if not remote(u) and not Path(u).is_file():
            raise DatasetError(f"shard {u} (from the pattern {pattern}) does not exist")
        counts[_name(u)], top = _count(u, keys, top)
    if missing:
        log.warning("counted the samples of %d shards without an index (reading them once)",
                    len(missing))  # fmt: skip
    if not classes:
        classes = [str(i) for i in range(top + 1)]
    split = ShardSplit(urls, [counts[_name(u)] for u in urls], classes, in_chans, stats, *keys)
    return split


def _name(url: str) -> str:
    """A shard's file name, of a path or a URL."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def _join(root: Path | str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if isinstance(root, str) else str(root / name)


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
    if not fraction / 1.5 <= share <= fraction * 1.5 and first_rank():  # every rank's alike
        log.warning("data.val_fraction carves whole shards: %d of %d carves %.0f%% of the samples "
                    "for data.val_fraction=%g; write more (smaller) shards for a closer share",
                    k, n, 100 * share, fraction)  # fmt: skip
    return kept, carved
