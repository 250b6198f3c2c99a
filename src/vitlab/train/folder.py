"""A run's folder: naming a new one, refusing to start over a run it holds, and the config and
length of a run being resumed."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import time
from pathlib import Path

import torch

from vitlab.config import ConfigError, RunConfig, load_run_config
from vitlab.runtime import Dist
from vitlab.train import distributed
from vitlab.train.log import RUN_FILES, saved_tree
from vitlab.train.state import CheckpointError

RESUMABLE_KEYS = ("train.epochs", "train.stop_at_epoch")


def resume_config(run: Path, overrides: list[str]) -> RunConfig:
    """The saved config of run folder `run`; the overrides may change only the run's length
    (train.epochs, train.stop_at_epoch); others may only restate the saved value."""
    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"cannot resume {run}: it has no config.yaml (not a vitlab run)")
    saved = saved_tree(load_run_config(str(path), []))
    for item in overrides:  # compared as saved: data.name=imagefolder:RELATIVE restates it
        key = item.partition("=")[0]
        if key not in RESUMABLE_KEYS and saved_tree(load_run_config(str(path), [item])) != saved:
            raise ConfigError(f"cannot change {key} when resuming (only {RESUMABLE_KEYS})")
    return load_run_config(str(path), overrides)


def check_resume_length(run: Path, cfg: RunConfig, extend: bool) -> int:
    """The run's planned train.epochs (from its saved config). A different cfg.train.epochs
    would silently reshape the learning-rate schedule mid-run: refused unless `extend`."""
    saved = load_run_config(str(run / "config.yaml"), []).train.epochs
    new = cfg.train.epochs
    if new != saved and not extend:
        raise ConfigError(
            f"train.epochs={new} differs from the run's {saved}: the {cfg.optim.schedule} "
            f"learning-rate schedule was planned over {saved} epochs. To stop early keep "
            f"train.epochs and set train.stop_at_epoch; to train to {new} epochs pass --extend "
            f"(extend=True), and the schedule is recomputed as if the run had started with {new} "
            f"epochs"
        )
    return saved


def claim_run_folder(out: Path, overwrite: bool) -> str | None:
    """Why a new run may not start in `out`: it holds a run, whose metrics and checkpoints would
    be lost (None: it may). With `overwrite` it may: replace_run removes that run's files once the
    new run is built (its data, the weights it fine-tunes from, its teacher), so that a start
    that fails on bad input loses nothing."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not overwrite:
        return (
            f"{out} already holds a run ({', '.join(found)}): continue it with "
            f"`vitlab train --resume {out}`, choose another --out, or pass --overwrite to "
            f"replace it"
        )
    return None


def remove_run_files(out: Path) -> str | None:
    """Remove the run's files in `out` (RUN_FILES; a symlink among them is unlinked, not
    followed; other files stay); what went wrong, or None."""
    try:
        for path in (out / name for name in RUN_FILES):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    except OSError as e:
        return f"cannot replace the run in {out}: {e}"
    return None


def replace_run(out: Path, d: Dist, device: torch.device, replace: bool) -> None:
    """--overwrite, once the new run is built: rank 0 removes the old run's files and every rank
    learns whether it could (one ConfigError on all ranks, not a rank left waiting)."""
    if not replace:
        return
    problem = remove_run_files(out) if d.is_main else None
    if distributed.any_rank(problem is not None, d, device):
        raise ConfigError(problem or f"rank 0 could not replace the run in {out}")


def default_run_folder(cfg: RunConfig) -> Path:
    """runs/DATASET-DATE-TIME, with -2, -3, ... when a run started in the same second: made here,
    so that two runs started together cannot both take it (and removed at exit if still empty:
    a start that failed on bad input leaves nothing)."""
    base = Path("runs") / time.strftime(f"{cfg.data.name.split(':')[0]}-%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    out, n = base, 1
    while True:
        try:
            out.mkdir()
            atexit.register(_remove_if_empty, out)
            return out
        except FileExistsError:
            n += 1
            out = base.with_name(f"{base.name}-{n}")


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: a run is in it
        folder.rmdir()
