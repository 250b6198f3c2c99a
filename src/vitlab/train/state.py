"""Training checkpoints: a folder with the weights (model.safetensors, the model config,
preprocessing and class names in its metadata: see vitlab.formats.vitlab) and the training
state beside them (state.pt: optimizer, EMA, RNG, step; loaded with weights_only=True, so it can
never run code).

Writes are atomic: the new checkpoint is written and fsynced in a temporary folder, the old one is
renamed aside, the new one renamed into place, the old one removed. A kill at any point leaves a
loadable checkpoint: the old one, the new one, or (mid-swap) the old one under its aside name, which
`resolve_checkpoint` finds."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from vitlab.formats.base import WEIGHTS, CheckpointError, fsync, load_weights, read_torch
from vitlab.formats.vitlab import CheckpointMeta, read_metadata, resolve_checkpoint, write_weights
from vitlab.runtime import Dist, derive_seed, rng_state

log = logging.getLogger(__name__)

STATE = "state.pt"

__all__ = [
    "STATE",
    "WEIGHTS",
    "CheckpointMeta",
    "CheckpointError",
    "CheckpointWriteError",
    "load_train_state",
    "load_weights",
    "read_metadata",
    "resolve_checkpoint",
    "save_checkpoint",
]


def save_checkpoint(
    folder: Path,
    model_state: dict[str, torch.Tensor],
    meta: CheckpointMeta,
    train_state: dict[str, Any] | None = None,
) -> None:
    """Atomically (re)write checkpoint `folder` (e.g. run/checkpoints/last)."""
    folder = Path(folder)
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp, aside = parent / f".{folder.name}.tmp", parent / f".{folder.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_weights(tmp / WEIGHTS, model_state, meta)
        if train_state is not None:
            with open(tmp / STATE, "wb") as f:  # a Python file: a failed write keeps its errno
                torch.save(train_state, f)
            fsync(tmp / STATE)
        fsync(tmp)
    except BaseException as e:  # disk full, file-size limit, Ctrl-C: no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise CheckpointWriteError(_write_failure(folder, e)) from e
        raise
    if folder.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, aside)
    os.replace(tmp, folder)
    fsync(parent)
    shutil.rmtree(aside, ignore_errors=True)


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, file-size limit, I/O error); the previous
    checkpoint in its place is intact."""


def limit_hit(e: BaseException) -> tuple[int, str] | None:
    """(errno, in words) of the limit a failed write hit: a full disk, the file-size limit, a
    quota, from the errno wherever it was kept (torch raises a RuntimeError whose context is the
    OSError of the failed write; safetensors' error only says it); None: another failure."""
    text, no, link = str(e), None, e
    while link is not None and no is None:
        no, link = getattr(link, "errno", None), link.__cause__ or link.__context__
    if no == errno.ENOSPC or "No space left" in text or "os error 28" in text:
        return errno.ENOSPC, "the disk is full (ENOSPC)"
    if no == errno.EFBIG or "File too large" in text or "os error 27" in text:
        return errno.EFBIG, "the file-size limit was hit (EFBIG, e.g. ulimit -f)"
    if no == errno.EDQUOT or "quota" in text.lower():
        return errno.EDQUOT, "the disk quota is exceeded (EDQUOT)"
    return None


def _write_failure(folder: Path, e: BaseException) -> str:
    """Why writing checkpoint `folder` failed, in words."""
    text, hit = str(e), limit_hit(e)
    first = text.splitlines()[0][:200] if text else ""
    why = hit[1] if hit else f"writing failed ({type(e).__name__}: {first})"
    kept = f"the previous checkpoint {folder} is intact" if folder.exists() else "nothing replaced"
    return f"cannot save checkpoint {folder}: {why}; {kept}, the partial copy removed"


def has_checkpoint(run: Path) -> bool:
    """Whether run folder `run` holds a last checkpoint to resume from (one mid-swap too)."""
    try:
        resolve_checkpoint(Path(run) / "checkpoints" / "last")
    except CheckpointError:
        return False
    return True


def load_train_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / STATE
    if not path.is_file():
        raise CheckpointError(f"{folder} has no training state ({STATE}) to resume from")
    state = read_torch(path, state_dict=False)  # damaged or crafted: one line saying so
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a vitlab training state (a {type(state).__name__})")
    return state


def check_threads(state: dict, d: Dist, device: torch.device) -> None:
    """Warn (rank 0) when a CPU run goes on with another number of PyTorch threads than saved
    its checkpoint (train.threads changed, or unset on a machine with other cores): float sums
    run in another order, so the run goes on as the same computation but not bit for bit. Not
    where the process count changed too (saved_rng says that), nor for a checkpoint saved
    before the count was kept (2026-12-05)."""
    saved, now = state.get("threads"), torch.get_num_threads()
    ranks = len(state.get("rng_ranks") or [None])
    if saved is None or saved == now or ranks != d.world or device.type != "cpu" or not d.is_main:
        return
    log.warning("the checkpoint was saved by a run on %d thread%s and goes on with %d: float sums "
                "run in another order, so training goes on as the same computation but not bit "
                "for bit as it would have (in bf16 the runs part visibly within an epoch); "
                "train.threads=%d restores it", saved, "s" * (saved > 1), now, saved)  # fmt: skip


def saved_rng(state: dict, d: Dist, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG state at the checkpoint (each rank's is saved). A rank the saving run
    did not have, or any rank but 0 of a checkpoint from before per-rank states, starts a
    stream seeded by (seed, rank, step) instead: reproducible, but not the run it continues; a
    checkpoint resumed on another number of processes says so."""
    ranks = state.get("rng_ranks") or [state["rng"]]
    if "rng_ranks" in state and len(ranks) != d.world and d.is_main:
        n = [f"{k} process" + "es" * (k > 1) for k in (len(ranks), d.world)]
        log.warning(
            "the checkpoint was saved by %s and is resumed on %s: training goes on "
            "reproducibly, but not exactly as the run would have (each process has its own "
            "random stream); resume on %s for that", n[0], n[1], n[0],
        )  # fmt: skip
    if d.rank < len(ranks):
        return ranks[d.rank]
    torch.manual_seed(derive_seed(seed, d.rank, state["step"]))
    return rng_state(device)
