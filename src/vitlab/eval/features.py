"""Frozen features of any checkpoint vitlab reads, for the few-shot and probe evaluators:
extracted once per dataset split in float32 and cached as safetensors.

    prelogits   the vector the classifier reads (forward_head(pre_logits=True)): the paper's
                representation (§4.1)
    gap         the mean of the patch tokens after the final norm, prefix tokens skipped (a model
                with fc_norm, whose final norm comes after pooling: the norm of the mean): for
                models whose class token never had a training signal (masked patch prediction)

For a CNN both are the mean of the last stage's map, the vector its classifier reads.

A vitlab run (or a checkpoint inside one) keeps its cache in RUN/features/; other sources only
with an explicit cache folder. A cache file is named by a hash of what its features depend on
(the weights file's path, size and mtime, the dataset, its folder and split, the preprocessing
and the feature kind), and holds that key in its metadata: a file whose key differs is extracted
again."""

from __future__ import annotations

import copy
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitlab.config import DataConfig
from vitlab.data import DatasetError, make_loader
from vitlab.data.datasets import load_run_split
from vitlab.eval.feature_cache import (
    CACHE_VERSION,
    Features,
    cache_file,
    identity,
    read_cache,
    read_covering,
    rows_digest,
    source_identity,
    write_cache,
)
from vitlab.eval.run import data_config, match_channels, run_config_of, run_folder
from vitlab.formats.vitlab import read_metadata, vitlab_weights
from vitlab.models.registry import family_of
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import eval_mode, pick_device

log = logging.getLogger(__name__)

Pick = Callable[[np.ndarray, list[str]], "np.ndarray | None"]  # (labels, classes) -> rows

FEATURE_KINDS = ("prelogits", "gap")


# --- extraction ----------------------------------------------------------------------------------


def represent(model: nn.Module, images: Tensor, kind: str) -> Tensor:
    """(B, C, H, W) normalised images -> (B, D) features of `kind` (FEATURE_KINDS)."""
    family = family_of(model.config)
    if kind == "prelogits" and family == "vit":  # the tokens the head reads
        tokens = model.forward_features(images, head_only=True)
    else:
        tokens = model.forward_features(images)  # (B, T, D); a Swin's map (B, h, w, D)
    if kind == "gap" and family == "cnn":
        kind = "prelogits"  # a CNN's pooled vector is its (B, C, h, w) map's mean already
    if kind == "prelogits":
        return model.forward_head(tokens, pre_logits=True)  # (B, num_features)
    if kind == "gap":
        tokens = tokens.flatten(1, -2)  # (B, T, D) for both
        pooled = tokens[:, model.num_prefix_tokens :].mean(dim=1)  # (B, D)
        fc_norm = getattr(model, "fc_norm", None)  # its final norm, after pooling (timm's avg)
        return pooled if fc_norm is None else fc_norm(pooled)
    raise ValueError(f"features must be one of {', '.join(FEATURE_KINDS)}, got {kind!r}")


@torch.no_grad()
def extract(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    kind: str,
    device: torch.device,
    progress: bool = True,
    desc: str = "features",
) -> tuple[Tensor, Tensor]:
    """Features (N, D) float32 and labels (N,) of every batch, on the CPU, the model in eval mode
    and float32 (a float32 copy of a model in another dtype: the caller's keeps its dtype, and
    each submodule its mode); a tqdm bar on stderr while it runs. Samples labelled below 0
    (loader padding) are dropped."""
    from tqdm import tqdm

    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors):
        model = copy.deepcopy(model).float()
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm(
        total=total,
        desc=desc,
        unit="batch",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,  # keep logs short
        file=sys.stderr,
    )
    xs, ys, seen, t0 = [], [], 0, time.perf_counter()
    with eval_mode(model), bar:  # (tqdm closes the bar)
        for images, labels in batches:
            feats = represent(model, images.to(device).float(), kind).float().cpu()
            kept = labels >= 0
            xs.append(feats[kept])
            ys.append(labels[kept].long())
            seen += len(labels)
            rate = seen / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(img_s=f"{rate:.0f}", refresh=False)
            bar.update(1)
    if not xs:
        raise DatasetError("the split has no images to extract features from")
    return torch.cat(xs), torch.cat(ys)


# --- a checkpoint's features ---------------------------------------------------------------------


@dataclass
class Extractor:
    """The frozen features of checkpoint `source` (any source load_checkpoint reads: a run folder
    means its best checkpoint) for dataset splits. A vitlab checkpoint is only loaded when a split
    is not in the cache; other sources are loaded first (their preprocessing is part of the key).

    `cache_dir`: where to cache; None: RUN/features for a vitlab run, else no cache."""

    source: str
    kind: str = "prelogits"
    device: str = "auto"
    batch_size: int = 256
    cache_dir: Path | None = None
    progress: bool = True
    weights: Path | None = field(init=False, default=None)  # a vitlab weights file
    run: Path | None = field(init=False, default=None)  # the run folder it belongs to
    preprocessing: Preprocessing = field(init=False)
    dev: torch.device = field(init=False)
    forward_batches: int = field(init=False, default=0)  # batches run through the model
    _model: nn.Module | None = field(init=False, default=None, repr=False)
    _skipped: set[str] = field(init=False, default_factory=set, repr=False)  # named once, by any
    _held: dict | None = field(init=False, default=None, repr=False)  # identities (held_keys)

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise ValueError(
                f"features must be one of {', '.join(FEATURE_KINDS)}, got {self.kind!r}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {self.batch_size}")
        self.dev = pick_device(self.device, "--device")
        self.weights = vitlab_weights(self.source)
        self.run = run_folder(self.weights) if self.weights else None
        if self.weights is not None:
            self.preprocessing = read_metadata(self.weights).preprocessing
        else:
            self.preprocessing = self.model().preprocessing
        if self.cache_dir is None and self.run is not None:
            self.cache_dir = self.run / "features"

    @property
    def loaded(self) -> bool:
        """Whether the model has been loaded."""
        return self._model is not None

    def model(self) -> nn.Module:
        """The model, loaded on first use."""
        if self._model is None:
            from vitlab.models.checkpoint import load_checkpoint

            model, meta = load_checkpoint(self.weights or self.source, device=self.dev)
            model.preprocessing = meta.preprocessing
            self._model = model
        return self._model

    def dataset(self, data: str | None, data_dir: str | None) -> DataConfig:
        """The run's data (its test source and columns too) when no other is named, as `vitlab
        eval` reads it."""
        cfg = run_config_of(self.weights) if self.weights else None
        if data is None and cfg is None:
            raise ValueError(f"--data is needed: {self.source} is not a vitlab run with a dataset")
        return data_config(cfg, data, data_dir)

    def key(self, cfg: DataConfig, split: str) -> dict[str, Any]:
        """What the features of one split depend on (an image folder or a Hugging Face dataset
        on disk, data.name's or data.test's: its absolute path and a digest of its files' names,
        sizes and times, so added or replaced images count)."""
        folder, seed = cfg.dir, cfg.split_seed
        name, files = self._identity(cfg.name, False, cfg.dir)
        test, test_files = self._identity(cfg.test, True, cfg.dir) if cfg.test else (None, None)
        return {
            "version": CACHE_VERSION,
            "weights": source_identity(self.source, self.weights),
            "data": name,
            "files": files,
            "data_dir": str(Path(folder).expanduser().resolve()) if folder else None,
            "split": split,
            "split_seed": seed,
            "test": test,
            "test_files": test_files,
            "keys": [cfg.image_key, cfg.label_key],
            "preprocessing": self.preprocessing.to_dict(),
            "features": self.kind,
        }

    def _identity(self, name: str, test: bool, data_dir: str | None) -> tuple[str, str | None]:
        """identity(name, test, data_dir), digested once while held_keys holds (a split each: an
        image folder of a million files was stat-ed twice a command)."""
        if self._held is None:
            return identity(name, test, data_dir)
        if (name, test, data_dir) not in self._held:
            self._held[name, test, data_dir] = identity(name, test, data_dir)
        return self._held[name, test, data_dir]

    @contextmanager
    def held_keys(self) -> Iterator[None]:
        """Within: each dataset's files are digested once, for every split's key (one command's
        splits, read together); outside, each key digests them anew (changes count)."""
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    def features(
        self,
        data: str | None,
        data_dir: str | None,
        split: str,
        pick: Pick | None = None,
        labelled: bool = False,
    ) -> Features:
        """The features of `split` ('train' or 'test') of dataset `data`, from the cache when
        there is one for exactly this key. `pick(labels, classes)`: the rows of the split that
        are needed (read from its labels before any image is; None: every row), extracted (and
        cached) alone, where the whole split's features are not cached already and its labels
        are known before its images are read (not WebDataset shards). `labelled`: a split
        without labels is refused before any image is read."""
        cfg = self.dataset(data, data_dir)
        name, key = cfg.name, self.key(cfg, split)
        path = cache_file(self.cache_dir, key) if self.cache_dir else None
        found = read_cache(path, key) if path else None
        if found is not None:
            log.info("%s %s features from %s", name, split, path)
            return found
        part = match_channels(load_run_split(cfg, split), self.preprocessing, name)
        if labelled and not part.classes:
            raise unlabelled(name)
        rows = pick(part.labels.numpy(), part.classes) if pick and hasattr(part, "subset") else None
        if rows is not None and len(rows := np.unique(rows)) < len(part):
            picked, what = torch.as_tensor(rows), f"{name} {split} ({len(rows):,} images)"
            rows_key = {**key, "rows": rows_digest(rows)}
            got = read_covering(self.cache_dir, rows_key, rows) if self.cache_dir else None
            if got is not None:
                log.info("%s features from %s", what, got.cache)
            else:
                got = self._extract(part.subset(picked), rows_key, what, rows=picked)
            if got.rows is not None:  # every picked image (or more) is there
                got.split_labels = part.labels
                return got
            log.warning("%d of the images picked did not decode: every image's features then, "
                        "drawn from those that do", len(rows) - len(got))  # fmt: skip
        return self._extract(part, key, f"{name} {split}", look=False)  # looked for above

    def _extract(
        self, part: Any, key: dict[str, Any], what: str, look: bool = True, rows: Any = None
    ) -> Features:
        """The features of `part`, from the cache for `key` (if `look`) or extracted and cached
        (`rows`: part is these rows of its split, and is not cached where some image did not
        decode: the features would stand for rows they are not; their rows are then None)."""
        path = cache_file(self.cache_dir, key) if self.cache_dir else None
        found = read_cache(path, key) if path and look else None
        if found is not None:
            found.rows = rows if rows is not None else found.rows  # a file from before rows
            return found
        loader = make_loader(part, self.batch_size, self.preprocessing)
        if hasattr(loader, "skipped"):  # an undecodable image, named by the picked rows' loader
            loader.skipped = self._skipped  # and met again by the whole split's: named once
        self.forward_batches += len(loader)
        x, y = extract(self.model(), loader, self.kind, self.dev, self.progress, f"{what} features")
        out = Features(x, y, list(part.classes), cache=path)
        if rows is not None:
            out.rows = rows if len(out) == len(part) else None
        else:  # the whole split: how many did not decode, and which rows did
            out.skipped = len(part) - len(out)
            if out.skipped and hasattr(part, "subset"):
                kept = [i for i in range(len(part)) if part.where(i) not in self._skipped]
                if len(kept) == len(out):  # (few-shot draws from every listed label: fewshot.py)
                    out.rows, out.split_labels = torch.tensor(kept), part.labels
        if path is not None and (rows is None or out.rows is not None):
            try:
                write_cache(path, key, out)
                log.info("cached %s features in %s", what, path)
            except OSError as e:  # a read-only run folder: the features stand, uncached
                if isinstance(e, FileExistsError | NotADirectoryError):
                    raise  # --cache-dir at or under a file: said as such (cli.main)
                log.warning("cannot cache the %s features in %s (%s): they are extracted "
                            "again next time; --cache-dir DIR keeps them elsewhere", what, path,
                            e)  # fmt: skip
        return out

    def describe(self) -> dict[str, Any]:
        """Where the features come from, for reports."""
        return {
            "source": str(self.source),
            "checkpoint": str(self.weights) if self.weights else None,
            "features": self.kind,
            "preprocessing": self.preprocessing.to_dict(),
            "cache_dir": str(self.cache_dir) if self.cache_dir else None,
        }


def unlabelled(name: str) -> DatasetError:
    return DatasetError(
        f"{name} has no labels (an image folder without class sub-folders): few-shot and probe "
        f"accuracy need labelled data; name a labelled dataset with --data"
    )


def train_and_test(
    extractor: Extractor, data: str | None, data_dir: str | None, pick: Pick | None = None
) -> tuple[Features, Features, dict[str, Any]]:
    """The train and test features of a dataset (of the training images `pick` names only,
    Extractor.features) and what a report says about them."""
    cfg = extractor.dataset(data, data_dir)
    name, folder = cfg.name, cfg.dir
    with extractor.held_keys():  # the dataset's files digested once for both splits' keys
        train = extractor.features(name, folder, "train", pick, labelled=True)
        if not train.classes:
            raise unlabelled(name)
        test = extractor.features(name, folder, "test")
    if train.classes != test.classes:
        raise DatasetError(f"{name}: the train and test splits name different classes")
    about = {
        **extractor.describe(),
        "data": name,
        "data_dir": folder,
        "feature_dim": int(train.x.shape[1]),
        "num_classes": len(train.classes),
        "num_train_images": len(train) if train.skipped else len(train.labels),  # that decode
        "train_images_extracted": len(train),
        "num_test_images": len(test),
        "cache": {
            s: str(f.cache) if f.cache else None for s, f in (("train", train), ("test", test))
        },
        "cached": {"train": train.cached, "test": test.cached},
    }
    return train, test, about
