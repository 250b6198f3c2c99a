"""An experiment's arms: one `vitlab train` run each, in OUT/EXPERIMENT/ARM-seedS/, trained through
vitlab.train.run.train (what `vitlab train` calls) with the overrides the arm needs. A folder
that holds a finished run (results.json) is reused, one that holds a checkpoint is resumed, so an
interrupted experiment continues where it stopped.

Every arm trains exactly `steps` optimizer steps (train.max_steps; train.epochs is the epochs
they need, the last one cut short), so arms of one experiment see the same number of images
whatever the size of their training set: a small set is passed over many times, a set larger than
steps x batch images less than once."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vitlab.config import ConfigError, load_run_config
from vitlab.data import dataset_info, label_subset, load_split
from vitlab.data.datasets import ArraySplit, DatasetError
from vitlab.eval.features import match_channels
from vitlab.eval.fewshot import DEFAULT_L2, kshot_accuracies
from vitlab.experiments.budgets import Budget, Plan, arm_seconds
from vitlab.formats.base import write_json
from vitlab.models.checkpoint import load_checkpoint
from vitlab.models.registry import ModelConfig
from vitlab.runtime import progress, quiet, quiet_status  # -q: no arm run's status lines
from vitlab.train.build import resolve_model_config
from vitlab.train.folder import remove_run_files, resume_config
from vitlab.train.log import saved_tree
from vitlab.train.run import train

log = logging.getLogger(__name__)

# the quick preset's optimiser (configs/fashion-mnist-quick.yaml) without its epoch-based warm-up:
# warm-up is WARMUP of each arm's steps; no validation split, so every image trains (and the run's
# best checkpoint is merely the one of lowest training loss: the arms are measured at their last)
RECIPE = ("optim.name=adamw", "optim.lr=0.002", "optim.weight_decay=0.05", "optim.schedule=cosine",
          "optim.label_smoothing=0.1", "data.val_fraction=0")  # fmt: skip
WARMUP = 0.05
SHOTS = 5
STATE = "reproduce.json"  # what `vitlab reproduce` adds to a run folder: wall time, measurements
LAST = "last"  # the checkpoint every arm is measured (and fine-tuned) from


@dataclass
class Arm:
    """One run of an experiment."""

    folder: str  # OUT/folder: EXPERIMENT/SLUG-seedS
    group: str  # the arms pooled over seeds share it, e.g. "learned 1-D"
    seed: int
    kind: str  # throughput class, budgets.TRAIN_IMG_S
    overrides: list[str]  # the run config, as `vitlab train` key=value overrides (but `source`)
    images: int  # training images of the run
    batch: int
    steps: int
    epochs: int  # train.epochs: ceil(steps / steps per epoch)
    test_fraction: float  # data.test_fraction
    test_images: int  # what that leaves
    classifier: bool = True  # its last checkpoint's test top-1 and 5-shot accuracy are measured
    # fine-tuning: the checkpoint to start from, relative to the --out folder (finetune.from is
    # resolved against the --out of each invocation, so a moved output folder is still reused)
    source: str | None = None
    info: dict = field(default_factory=dict)  # what the experiment groups by (size, patch, ...)

    @property
    def images_seen(self) -> int:
        return self.steps * self.batch

    @property
    def passes(self) -> float:
        """Passes over the training set (below 1: part of it is never seen)."""
        return self.images_seen / self.images

    def estimate_s(self) -> float:
        extra = self.test_images * (2 if self.classifier else 1)  # the run's test, then ours
        return arm_seconds(self.kind, self.images_seen, self.epochs, extra)

    def config(self, out: Path) -> list[str]:
        """The run's overrides, with the fine-tuning source inside `out` (the --out folder)."""
        if self.source is None:
            return list(self.overrides)
        return [*self.overrides, f"finetune.from={(out / self.source).resolve()}"]


@dataclass
class Context:
    """What every arm of one invocation shares."""

    data: str
    budget: Budget
    out: Path
    seeds: int | None = None  # --seeds (None: the plan's)

    def plan(self, experiment: str) -> Plan:
        return self.budget.plans[experiment]

    def seed_list(self, experiment: str) -> list[int]:
        return list(range(self.seeds or self.plan(experiment).seeds))

    @property
    def train_split(self) -> ArraySplit:
        return _split(self.data, "train")

    def model_config(self, overrides: list[str]) -> ModelConfig:
        """The model a run of these overrides on this dataset builds (before training)."""
        cfg = load_run_config(None, [f"data.name={self.data}", *overrides])
        return resolve_model_config(cfg, dataset_info(self.data, self.train_split))

    def test_fraction(self, experiment: str) -> float:
        """data.test_fraction of the experiment's arms (its plan's test images, or the budget's;
        None: all)."""
        plan = self.budget.plans.get(experiment)
        want = (plan.test_images if plan else None) or self.budget.test_images
        return 1.0 if want is None else min(1.0, want / len(_split(self.data, "test")))

    def test_images(self, experiment: str) -> int:
        return len(test_share(self.data, self.test_fraction(experiment)))

    def arm(
        self,
        experiment: str,
        slug: str,
        group: str,
        seed: int,
        kind: str,
        overrides: list[str],
        *,
        size: int | None = None,
        steps: int | None = None,
        classifier: bool = True,
        source: str | None = None,
        info: dict | None = None,
    ) -> Arm:
        """An arm of `steps` (default: the plan's) steps on `size` training images (None:
        all), its config the recipe, the data, the budget's test share, the seed (of the
        weights, the order, the subsets), then `overrides`; `source`: see Arm."""
        plan = self.plan(experiment)
        steps = steps or plan.steps
        total = len(self.train_split)
        fraction = min(size or total, total) / total
        images = subset_size(self.data, fraction, seed)
        if images < plan.batch:
            raise ValueError(f"{images} training images are fewer than one batch ({plan.batch})")
        per_epoch = images // plan.batch
        epochs = -(-steps // per_epoch)
        config = [
            *RECIPE,
            f"data.name={self.data}",
            f"data.label_fraction={fraction!r}",
            f"data.test_fraction={self.test_fraction(experiment)!r}",
            f"train.batch_size={plan.batch}",
            f"train.epochs={epochs}",
            f"train.max_steps={steps}",
            f"train.seed={seed}",
            f"data.split_seed={seed}",
            f"optim.warmup_epochs={WARMUP * steps / per_epoch!r}",
            *overrides,
        ]
        return Arm(
            f"{experiment}/{slug}-seed{seed}", group, seed, kind, config, images, plan.batch, steps,
            epochs, self.test_fraction(experiment), self.test_images(experiment), classifier,
            source, dict(info or {}),
        )  # fmt: skip


@functools.cache
def _split(data: str, split: str) -> ArraySplit:
    s = load_split(data, split)
    if not isinstance(s, ArraySplit):
        raise DatasetError(f"vitlab reproduce takes in-memory datasets (digits, fashion-mnist, "
                           f"cifar10), not {data}")  # fmt: skip
    return s


def test_share(data: str, fraction: float, seed: int = 0) -> ArraySplit:
    """The test images a run with data.test_fraction=fraction, data.split_seed=seed is tested on."""
    return label_subset(_split(data, "test"), fraction, seed)


@functools.cache
def subset_size(data: str, fraction: float, seed: int) -> int:
    """How many training images data.label_fraction=fraction keeps (vitlab.data.label_subset)."""
    return len(label_subset(_split(data, "train"), fraction, seed))


# --- running -------------------------------------------------------------------------------------


# what run_arm writes to reproduce.json, each entry when it has it: KEY or KEY.SUBKEY -> its type
RECORD = {"train_seconds": float, "source.path": str, "source.sha256": str, f"{LAST}.top1": float,
          f"{LAST}.fewshot{SHOTS}": float}  # fmt: skip


def _state(folder: Path, arm: Arm) -> dict:
    """What reproduce.json of `arm` (in `folder`) holds; a damaged one (from before its writes
    were atomic) is named, and taken as empty: the arm is measured again, its earlier training
    time lost. Values of other types (an edit) are a ValueError naming the file, arm and value."""
    path = folder / STATE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        log.warning("%s is damaged (%s): measuring the run again", path, e)
        return {}
    if problem := _wrong_record(state):
        again = "trained" if arm.source else "measured"  # the record names a fine-tuning source
        raise ValueError(f"{path} (arm {arm.folder}): {problem}; correct it, or delete it to have "
                         f"the arm {again} again")  # fmt: skip
    return state


def _wrong_record(state: object) -> str | None:
    """What in reproduce.json's contents is not as RECORD has it (None: all is)."""
    if not isinstance(state, dict):
        return f"expected a mapping (train_seconds, source, {LAST}), got a {type(state).__name__}"
    for name, kind in RECORD.items():
        key, _, sub = name.partition(".")
        if key not in state:
            continue
        value = state[key]
        if sub and not isinstance(value, dict):
            subs = ", ".join(n.partition(".")[2] for n in RECORD if n.startswith(f"{key}."))
            return f"{key} is {value!r} (a {type(value).__name__}): expected a mapping of {subs}"
        if sub and sub not in value:
            return f"{key} has no {sub}"
        value = value[sub] if sub else value
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number if kind is float else isinstance(value, kind)):
            expected = "a number" if kind is float else "text"
            return f"{name} is {value!r} (a {type(value).__name__}): expected {expected}"
    return None


def _save_state(folder: Path, state: dict) -> None:
    write_json(folder / STATE, state)


def _same_config(folder: Path, arm: Arm, out: Path) -> None:
    """Refuse a folder whose run was made with another config (another budget, data, ...). A
    fine-tuning source is compared by its place in the output folder (as reproduce.json keeps
    it), wherever that folder now is."""
    saved = saved_tree(load_run_config(str(folder / "config.yaml"), []))
    wanted = saved_tree(load_run_config(None, arm.config(out)))  # paths as config.yaml has them
    diff = [
        f"{s}.{k}: {saved.get(s, {}).get(k)!r} there, {v!r} here"
        for s, body in wanted.items()
        for k, v in body.items()
        if saved.get(s, {}).get(k) != v
        and not ((s, k) == ("finetune", "from") and _same_source(folder, arm))
    ]
    if diff:
        raise ConfigError(
            f"{folder} holds a run of another configuration ({'; '.join(diff[:4])}): it was made "
            f"with another budget or dataset, or by an earlier vitlab reproduce; use another --out "
            f"or delete that folder"
        )


def _same_source(folder: Path, arm: Arm) -> bool:
    """Whether the run in `folder` was fine-tuned from the arm's source (relative to its --out)."""
    source = arm.source
    return source is not None and _state(folder, arm).get("source", {}).get("path") == source


def source_id(out: Path, source: str) -> dict:
    """What identifies a fine-tuning source: its place in --out and a digest of its weights."""
    weights = out / source / "model.safetensors"
    return {"path": source, "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}


def run_arm(arm: Arm, out: Path, index: int, total: int, ctx: Context) -> dict:
    """Train (or reuse, or resume) one arm and measure what its experiment needs: its last
    checkpoint's test top-1 and 5-shot accuracy (a classifier's), wall time. A fine-tuning arm
    whose source checkpoint changed since it was trained (the source retrained) is trained
    again. Progress lines go to stderr."""
    folder = out / arm.folder
    tag = f"vitlab reproduce: arm {index}/{total} ({total - index} after it): {arm.folder}"
    if (folder / "config.yaml").is_file():  # before anything in it is reused or overwritten
        _same_config(folder, arm, out)
    state = _state(folder, arm)
    source = source_id(out, arm.source) if arm.source else None
    has_last = (folder / "checkpoints" / LAST).exists()
    finished = (folder / "results.json").is_file()
    redo = None
    if finished and not has_last:  # its weights deleted
        redo = f"finished run without checkpoints/{LAST}"
    elif source and (finished or has_last) and state.get("source") != source:
        redo = f"its source {arm.source} changed since it was trained"
    if redo:
        progress(f"{tag}: {redo}, training it again")
        finished, has_last, state = False, False, {}
    if finished:
        progress(f"{tag}: finished run found, reusing it")
    else:
        t0, trained = time.perf_counter(), False
        try:
            if has_last and not redo:
                progress(f"{tag}: resuming its run")
                with quiet_status(quiet()):
                    train(resume_config(folder, []), resume=folder)
            else:
                progress(f"{tag}: training {arm.steps} step{'s' * (arm.steps != 1)} of "
                         f"{arm.batch} on {arm.images:,} images")  # fmt: skip
                state = {"source": source} if source else {}
                if folder.is_dir():  # no earlier measurement outlives the retraining, killed or not
                    if problem := remove_run_files(folder):  # nor its run (train removes it late)
                        raise ConfigError(problem)
                    _save_state(folder, state)
                with quiet_status(quiet()):
                    train(load_run_config(None, arm.config(out)), out=folder, overwrite=True)
            trained = True
        finally:  # stopped (Ctrl-C) or not, the time spent counts
            if (folder / "config.yaml").is_file():
                state["train_seconds"] = state.get("train_seconds", 0.0) + time.perf_counter() - t0
                try:
                    _save_state(folder, state)
                except OSError:  # a full disk: what stopped the run is the error to say, not this
                    if trained:
                        raise
    if arm.classifier and LAST not in state:
        state[LAST] = measure_last(folder, ctx, arm.seed, arm.test_fraction)
        _save_state(folder, state)
    # a pre-training arm without a classifier: its run's own metric (masked-colour accuracy)
    top1 = state[LAST]["top1"] if arm.classifier else _results(folder)["top1"]
    return {
        "arm": arm.folder,
        "group": arm.group,
        "seed": arm.seed,
        "checkpoint": LAST if arm.classifier else "best",
        "top1": top1,
        f"fewshot{SHOTS}": state[LAST][f"fewshot{SHOTS}"] if arm.classifier else None,
        "images": arm.images,
        "steps": arm.steps,
        "epochs": arm.epochs,
        "batch": arm.batch,
        "images_seen": arm.images_seen,
        "passes": round(arm.passes, 3),
        "test_images": arm.test_images,
        "train_seconds": round(state.get("train_seconds", 0.0), 1),
        "reused": finished,  # a finished run of an earlier invocation
        **arm.info,
    }


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


@torch.no_grad()
def measure_last(folder: Path, ctx: Context, seed: int, test_fraction: float) -> dict:
    """The last checkpoint's test top-1 (float32, as the run's own test) and the mean test top-1
    of the paper's 5-shot linear classifier on its pre-logits features (vitlab.eval.fewshot's
    protocol: closed-form ridge, l2 2^10) over the budget's draws of the 5 images per class, on
    the run's own test share, in one pass over the test images. Only the drawn training images
    are run through the model besides."""
    model, meta = load_checkpoint(str(folder / "checkpoints" / LAST))
    model.eval()
    pre = meta.preprocessing
    train_split = match_channels(ctx.train_split, pre, ctx.data)
    test = match_channels(test_share(ctx.data, test_fraction, seed), pre, ctx.data)

    def run(images: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """(N, C, H, W) uint8 -> (N, D) pre-logits features, (N, classes) logits."""
        features, logits = [], []
        for batch in images.split(256):
            tokens = model.forward_features(pre.batch(batch))
            features.append(model.forward_head(tokens, pre_logits=True))
            logits.append(model.forward_head(tokens))
        return torch.cat(features).double().numpy(), torch.cat(logits)

    x_test, logits = run(test.images)
    y_test = test.labels.numpy()
    labels = train_split.labels.numpy()
    accs = kshot_accuracies(
        lambda idx: run(train_split.images[idx])[0],
        labels, x_test, y_test, SHOTS, ctx.budget.fewshot_seeds, train_split.classes, DEFAULT_L2,
    )  # fmt: skip
    top1 = float((logits.argmax(dim=1) == test.labels).float().mean())
    return {"top1": top1, f"fewshot{SHOTS}": float(np.mean(accs))}
