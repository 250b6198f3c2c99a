"""--resume and --extend: the training state a run's `last` checkpoint keeps beside its weights
(written by vitlab.train.state.save_checkpoint), and putting it back into a freshly built
train.run.Run, so that a stopped run continues exactly where it stopped."""

from __future__ import annotations

from pathlib import Path

import torch

from vitlab.config import ConfigError
from vitlab.runtime import set_rng_state, status_file
from vitlab.train import distill, distributed
from vitlab.train.engine import Position
from vitlab.train.optim import learning_rate
from vitlab.train.state import (
    check_threads,
    load_train_state,
    load_weights,
    resolve_checkpoint,
    saved_rng,
)


def train_state(run, optimizer: dict, rngs: list | None) -> dict:  # run: a train.run.Run
    """What `restore` reads back: the optimizer's full state, the position in the run, every
    rank's random stream, the best score so far, EMA, and digests of the teacher and data."""
    return {
        "optimizer": optimizer,
        "epoch": run.pos.epoch,
        "batch": run.pos.batch,
        "step": run.pos.step,
        "rng": run.pos.rng,
        "rng_ranks": rngs,
        "threads": torch.get_num_threads(),  # float sums' order (check_threads)
        "partial": run.pos.partial,  # a stopped epoch's figures so far
        "best": run.best,
        "ema": run.ema.state_dict() if run.ema else None,
        "teacher": run.teacher.digest if run.teacher else None,
        "data": run.data.digest,  # what --resume checks its data against
    }


def restore(run, folder: Path) -> None:
    """Put run folder's `last` checkpoint into a freshly built run: weights, optimizer, EMA,
    position, random streams and best score; check the teacher and data are the ones it used."""
    weights = resolve_checkpoint(folder / "checkpoints" / "last")
    state = load_train_state(weights.parent)
    distributed.load_full_state(
        run.model,
        run.optimizer,
        load_weights(weights),
        state["optimizer"],
        run.d,
        run.strategy,
        f"{weights} (the model is the run's config.yaml's)",
    )
    if run.ema is not None and state.get("ema") is not None:
        run.ema.load_state_dict(state["ema"])
    rng = saved_rng(state, run.d, run.cfg.train.seed, run.device)
    check_threads(state, run.d, run.device)
    partial = state.get("partial") or []
    run.pos = Position(state["epoch"], state["batch"], state["step"], rng, partial)
    set_rng_state(run.pos.rng, run.device)
    run.best = float(state["best"])
    if run.d.is_main:
        distill.check_resumed(run.teacher, state.get("teacher"))
        run.data.check_same(state.get("data"))


def extend(run, planned: int) -> None:
    """Say how the learning-rate schedule changes when a resumed run's length changes from
    `planned` epochs: it now spans the new length, as if the run had been started with it (warm-up
    unchanged)."""
    cfg, step, new = run.cfg, run.pos.step, run.cfg.train.epochs
    if new <= run.pos.epoch:
        raise ConfigError(
            f"train.epochs={new}, but the run has trained {run.pos.epoch} epochs already: "
            f"a new length must be longer than that"
        )
    if not run.d.is_main:
        return
    old_total, total = run.steps_per_epoch * planned, run.total_steps()
    old_lr = learning_rate(cfg.optim, step, old_total, run.warmup_steps())
    print(
        f"{'extending' if new > planned else 'shortening'} the run from {planned} to {new} "
        f"epochs (--extend): the {cfg.optim.schedule} schedule is recomputed as if the run had "
        f"started with {new} epochs, {total:,} steps instead of {old_total:,}; the next "
        f"step's learning rate (step {step + 1:,}) is {run.settings.lr_at(step):.3e} (was "
        f"{old_lr:.3e}), the last's (step {total:,}) {run.settings.lr_at(total - 1):.3e}",
        file=status_file(),
    )
