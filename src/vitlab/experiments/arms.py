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
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vitlab.config import ConfigError, load_run_config
from vitlab.data import label_subset, load_split
from vitlab.data.datasets import ArraySplit, DatasetError
from vitlab.eval.features import match_channels, represent
from vitlab.eval.fewshot import fit_ridge, kshot_indices
from vitlab.experiments.budgets import Budget, Plan, arm_seconds
from vitlab.formats.vitlab import read_metadata, resolve_checkpoint
from vitlab.models.checkpoint import load_checkpoint
from vitlab.models.registry import ModelConfig
from vitlab.train.folder import resume_config
from vitlab.train.run import train

# the quick preset's optimiser (configs/fashion-mnist-quick.yaml) without its epoch-based warm-up:
# warm-up is WARMUP of each arm's steps; no validation split, so every image trains and the best
# checkpoint is the one of lowest training loss
RECIPE = ("optim.name=adamw", "optim.lr=0.002", "optim.weight_decay=0.05", "optim.schedule=cosine",
          "optim.label_smoothing=0.1", "data.val_fraction=0")  # fmt: skip
WARMUP = 0.05
SHOTS = 5
STATE = "reproduce.json"  # what `vitlab reproduce` adds to a run folder: wall time, 5-shot


@dataclass
class Arm:
    """One run of an experiment."""

    folder: str  # OUT/folder: EXPERIMENT/SLUG-seedS
    group: str  # the arms pooled over seeds share it, e.g. "learned 1-D"
    seed: int
    kind: str  # throughput class, budgets.TRAIN_IMG_S
    overrides: list[str]  # the whole run config, as `vitlab train` key=value overrides
    images: int  # training images of the run
    batch: int
    steps: int
    epochs: int  # train.epochs: ceil(steps / steps per epoch)
    test_fraction: float  # data.test_fraction
    test_images: int  # what that leaves
    fewshot: bool = True  # a classifier whose 5-shot accuracy is measured
    info: dict = field(default_factory=dict)  # what the experiment groups by (size, patch, ...)

    @property
    def images_seen(self) -> int:
        return self.steps * self.batch

    @property
    def passes(self) -> float:
        """Passes over the training set (below 1: part of it is never seen)."""
        return self.images_seen / self.images

    def estimate_s(self) -> float:
        extra = self.test_images * (2 if self.fewshot else 1)
        return arm_seconds(self.kind, self.images_seen, self.epochs, extra)


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
        fewshot: bool = True,
        info: dict | None = None,
    ) -> Arm:
        """An arm of `steps` (default: the plan's) steps on `size` training images (None:
        all), its config the recipe, the data, the budget's test share, then `overrides`."""
        plan = self.plan(experiment)
        steps = steps or plan.steps
        labels = self.train_split.labels
        total = len(labels)
        fraction = min(size or total, total) / total
        images = _subset_size(labels, fraction)
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
            f"optim.warmup_epochs={WARMUP * steps / per_epoch!r}",
            *overrides,
        ]
        return Arm(
            f"{experiment}/{slug}-seed{seed}", group, seed, kind, config, images, plan.batch, steps,
            epochs, self.test_fraction(experiment), self.test_images(experiment), fewshot,
            dict(info or {}),
        )  # fmt: skip


@functools.cache
def _split(data: str, split: str) -> ArraySplit:
    s = load_split(data, split)
    if not isinstance(s, ArraySplit):
        raise DatasetError(f"vitlab reproduce takes in-memory datasets (digits, fashion-mnist, "
                           f"cifar10), not {data}")  # fmt: skip
    return s


def test_share(data: str, fraction: float) -> ArraySplit:
    """The test images a run with data.test_fraction=fraction is tested on."""
    return label_subset(_split(data, "test"), fraction, 0)


def _subset_size(labels: torch.Tensor, fraction: float) -> int:
    """How many images data.label_fraction keeps (vitlab.data.label_subset's rounding)."""
    if fraction >= 1.0:
        return len(labels)
    counts = torch.bincount(labels).tolist()
    return sum(max(1, int(round(c * fraction))) for c in counts if c)


# --- running -------------------------------------------------------------------------------------


def _state(folder: Path) -> dict:
    path = folder / STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_state(folder: Path, state: dict) -> None:
    (folder / STATE).write_text(json.dumps(state, indent=2) + "\n")


def _same_config(folder: Path, overrides: list[str]) -> None:
    """Refuse a folder whose run was made with another config (another budget, data, ...)."""
    saved = load_run_config(str(folder / "config.yaml"), []).to_tree()
    wanted = load_run_config(None, overrides).to_tree()
    diff = [
        f"{s}.{k}: {saved.get(s, {}).get(k)!r} there, {v!r} here"
        for s, body in wanted.items()
        for k, v in body.items()
        if saved.get(s, {}).get(k) != v
    ]
    if diff:
        raise ConfigError(
            f"{folder} holds a run of another configuration ({'; '.join(diff[:4])}): use another "
            f"--out for another budget or dataset, or delete that folder"
        )


def run_arm(arm: Arm, out: Path, index: int, total: int, ctx: Context) -> dict:
    """Train (or reuse, or resume) one arm and measure what its experiment needs: its results,
    5-shot accuracy, wall time. Progress lines go to stderr."""
    folder = out / arm.folder
    tag = f"vitlab reproduce: arm {index}/{total} ({total - index} after it): {arm.folder}"
    state = _state(folder)
    finished = (folder / "results.json").is_file()
    if finished and not (folder / "checkpoints" / "best").exists():  # its weights deleted
        print(f"{tag}: finished run without checkpoints/best, training it again", file=sys.stderr)
        finished, state = False, {}
    if finished:
        _same_config(folder, arm.overrides)
        print(f"{tag}: finished run found, reusing it", file=sys.stderr, flush=True)
    else:
        t0 = time.perf_counter()
        try:
            resumable = not (folder / "results.json").is_file()  # else: a finished run, redone
            if resumable and (folder / "checkpoints" / "last").exists():
                _same_config(folder, arm.overrides)
                print(f"{tag}: resuming its run", file=sys.stderr, flush=True)
                train(resume_config(folder, []), resume=folder)
            else:
                print(f"{tag}: training {arm.steps} steps of {arm.batch} on {arm.images:,} "
                      f"images", file=sys.stderr, flush=True)  # fmt: skip
                train(load_run_config(None, arm.overrides), out=folder, overwrite=True)
        finally:  # stopped (Ctrl-C) or not, the time spent counts
            if (folder / "config.yaml").is_file():
                state["train_seconds"] = state.get("train_seconds", 0.0) + time.perf_counter() - t0
                _save_state(folder, state)
    results = json.loads((folder / "results.json").read_text())
    if arm.fewshot and f"fewshot{SHOTS}" not in state:
        state[f"fewshot{SHOTS}"] = fewshot_accuracy(folder, ctx, arm.test_fraction)
        _save_state(folder, state)
    return {
        "arm": arm.folder,
        "group": arm.group,
        "seed": arm.seed,
        "top1": results["top1"],
        f"fewshot{SHOTS}": state.get(f"fewshot{SHOTS}"),
        "images": arm.images,
        "steps": arm.steps,
        "epochs": arm.epochs,
        "batch": arm.batch,
        "images_seen": arm.images_seen,
        "passes": round(arm.passes, 3),
        "test_images": arm.test_images,
        "train_seconds": round(state.get("train_seconds", 0.0), 1),
        **arm.info,
    }


@torch.no_grad()
def fewshot_accuracy(folder: Path, ctx: Context, test_fraction: float) -> float:
    """Mean test top-1 of the paper's 5-shot linear classifier (vitlab.eval.fewshot's protocol:
    prelogits features, closed-form ridge, l2 2^10) over the budget's seeds of the 5-shot draw,
    on the run's own test share. Only the drawn training images are run through the model."""
    model, meta = load_checkpoint(str(folder / "checkpoints" / "best"))
    model.eval()
    pre = meta.preprocessing
    train_split = match_channels(ctx.train_split, pre, ctx.data)
    test = match_channels(test_share(ctx.data, test_fraction), pre, ctx.data)

    def features(images: torch.Tensor) -> np.ndarray:
        chunks = [represent(model, pre.batch(b), "prelogits") for b in images.split(256)]
        return torch.cat(chunks).double().numpy()

    x_test, y_test = features(test.images), test.labels.numpy()
    labels = train_split.labels.numpy()
    accs = []
    for seed in range(ctx.budget.fewshot_seeds):
        idx = kshot_indices(labels, SHOTS, seed, train_split.classes)
        fit = fit_ridge(features(train_split.images[idx]), labels[idx], len(train_split.classes),
                        2.0**10)  # fmt: skip
        accs.append(float((fit.predict(x_test) == y_test).mean()))
    return float(np.mean(accs))


def model_config(folder: Path) -> ModelConfig:
    """The model config a run trained (from its best checkpoint's metadata)."""
    return read_metadata(resolve_checkpoint(folder / "checkpoints" / "best")).config
