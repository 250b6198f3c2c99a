"""A run's folder: naming a new one, refusing to start over a run it holds or one another
`vitlab train` is running in (a lock held while the run lasts), and the config and length of a
run being resumed."""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from vitlab.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    load_run_config,
    load_saved_config,
)
from vitlab.runtime import Dist, folder_refusal
from vitlab.train import distributed
from vitlab.train.log import RUN_FILES, saved_tree
from vitlab.train.state import CheckpointError, CheckpointWriteError, has_checkpoint, limit_hit

log = logging.getLogger(__name__)

RESUMABLE_KEYS = ("train.epochs", "train.stop_at_epoch")  # the run's length
MACHINE_KEYS = ("train.threads", "data.workers")  # where it runs (another machine's cores)
LOCK = ".vitlab-lock"  # in a run folder: locked (flock) by the process whose run it is
_TRIES = 5  # attempts at a lock whose file a failed start removes as it is taken


class _Hold(NamedTuple):
    """A lock this process holds."""

    thread: int  # the thread that took it
    fd: int  # its descriptor (-1: a folder that could not be locked, held all the same)
    folder: Path
    made: bool  # whether the claim made the lock file
    first: Path | None  # the first folder the claim made
    run: bool  # a run's (claim_run_folder), else a command's (holding)


_held: list[_Hold] = []
_defaults: list[tuple[int, Path]] = []  # (thread, folder) default_run_folder made, not yet let go


def resume_config(run: Path, overrides: list[str]) -> RunConfig:
    """The saved config of run folder `run`; the overrides may change only the run's length
    (train.epochs, train.stop_at_epoch) and the CPU it takes (train.threads, data.workers: a
    batch's augmentation is seeded by its place, whatever the workers; other threads sum floats
    in another order, so the run goes on, not bit for bit: state.check_threads warns); others
    may only restate the saved value."""
    path = Path(run) / "config.yaml"
    if not Path(run).is_dir():
        what = "not a folder" if Path(run).exists() else "no such folder"
        raise CheckpointError(f"cannot resume {run}: {what} (expected a run folder)")
    if not path.is_file():
        raise CheckpointError(f"cannot resume {run}: it has no config.yaml (not a vitlab run)")
    if not has_checkpoint(Path(run)):  # in, or stopped (or killed) in, its first epoch
        best = Path(run) / "checkpoints" / "best"  # (written before last: killed between them)
        why = (
            "it has no checkpoint yet (a run still in its first epoch, or stopped before it ended)"
        )
        if best.exists():
            why = (f"it has no last checkpoint, only {best} (which vitlab eval reads: killed as "
                   f"its first epoch was saved), not the training state")  # fmt: skip
        raise CheckpointError(f"cannot resume {run}: {why}: start it again, its command with "
                              f"--out {run} --overwrite")  # fmt: skip
    cfg = load_saved_config(path)  # read once; damaged: said, not read as the defaults
    tree, saved = cfg.to_tree(), saved_tree(cfg)
    for item in overrides:  # compared as saved: data.name=imagefolder:RELATIVE restates it
        key = item.partition("=")[0]
        mine = key in RESUMABLE_KEYS + MACHINE_KEYS
        if not mine and saved_tree(RunConfig.from_tree(apply_overrides(tree, [item]))) != saved:
            raise ConfigError(f"cannot change {key} when resuming (only the run's length: "
                              f"{', '.join(RESUMABLE_KEYS)}; and the CPU it takes: "
                              f"{', '.join(MACHINE_KEYS)})")  # fmt: skip
    return RunConfig.from_tree(apply_overrides(tree, overrides))


def check_resume_length(run: Path, cfg: RunConfig, extend: bool, said: bool = True) -> int:
    """The run's planned train.epochs (from its saved config). A different cfg.train.epochs
    would silently reshape the learning-rate schedule mid-run: refused unless `extend` (the
    same one with `extend` is warned, where `said`: rank 0 of many)."""
    saved = load_run_config(str(run / "config.yaml"), []).train.epochs
    new = cfg.train.epochs
    if new != saved and not extend:
        raise ConfigError(
            f"train.epochs={new} differs from the run's {saved}: the {cfg.optim.schedule} "
            f"learning-rate schedule was planned over {saved} epochs. To stop early keep "
            f"train.epochs and set train.stop_at_epoch; to train to {new} epochs pass --extend "
            f"(in Python: train(..., extend=True)), and the schedule is recomputed as if the run "
            f"had started with {new} epochs"
        )
    if extend and new == saved and said:  # not refused: the same command again after a stop
        log.warning("--extend: the run's train.epochs is %d already, so it keeps its length "
                    "(train.epochs=N with --extend lengthens it)", saved)  # fmt: skip
    return saved


def note_finished(epoch: int, step: int, cfg: RunConfig) -> None:
    """Say that a resumed run had finished (nothing trained: its test is evaluated again), at the
    limit it reached, and how it trains longer where it can (--extend: an epochs run only)."""
    t = cfg.train
    if t.time_budget is not None:
        limit = f"the steps train.time_budget={t.time_budget} planned, in epoch {epoch}"
    elif t.max_steps is not None and step >= t.max_steps:
        limit = f"train.max_steps={t.max_steps}, in epoch {epoch}"
    else:
        limit = f"epoch {epoch} of {t.epochs}"
    extend = t.time_budget is None and t.max_steps is None  # refused for the others
    how = "; --extend train.epochs=N trains it longer" if extend else ""
    log.info("note: the run had finished (%s): nothing left to train; its test is evaluated"
             "%s", limit, how)  # fmt: skip


class OutOfSpace(ValueError):
    """A run stopped by a full disk or quota while writing its folder: `where` says what could not
    be written, `how` how the run goes on once space is freed."""

    def __init__(self, where: str, how: str) -> None:
        self.where, self.how = where, how
        super().__init__(f"{where}; {how}")


def raise_if_out_of_space(error: BaseException, out: Path | None, d: Dist, ours: bool) -> None:
    """Raise OutOfSpace from `error` where it is a full disk's or quota's (ENOSPC, EDQUOT) writing
    a checkpoint, metrics.jsonl, results.json, a dataset's download ... Checkpoints are written
    whole or not at all (state.save_checkpoint), so the last one is intact: --resume continues from
    it (the epochs after it trained again); a run without one starts again. `ours`: `out` holds
    this command's run (a resumed one, or a new one built, so any earlier run's files are gone);
    else the command itself is what to run again (not the run that --overwrite would replace)."""
    if isinstance(error, CheckpointWriteError):  # its message says the limit and what is kept
        hit, where = limit_hit(error.__cause__ or error), str(error)
    elif isinstance(error, OSError):
        hit = limit_hit(error)
        place = f" {os.fsdecode(error.filename)}" if error.filename else ""
        where = f"cannot write{place}: {hit[1] if hit else error}"
    else:
        return
    if out is None or hit is None or hit[0] not in (errno.ENOSPC, errno.EDQUOT):
        return
    out = Path(out)
    if not ours:
        how = "once space is freed, run the same command again"
    elif has_checkpoint(out):
        command = distributed.resume_command(out, d)
        how = f"once space is freed, continue the run with {command}, from its last checkpoint"
    else:
        files = any((out / name).exists() for name in RUN_FILES)
        again = f": its command with --out {out} --overwrite" if files else ""
        how = f"the run has no checkpoint yet: once space is freed, start it again{again}"
    raise OutOfSpace(where, how) from error


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the locks' descriptors: the
    lock goes as the process whose run it is ends, even where a child outlives it a moment (the
    parent's descriptor keeps it meanwhile)."""
    for held in _held:
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def claim_run_folder(
    out: Path, overwrite: bool, resuming: bool = False, d: Dist | None = None
) -> str | None:
    """Why a run may not start in `out` (None: it may, and this thread now holds the folder's
    lock until release_run_folders, which train() calls as the run ends): another `vitlab train`
    runs there (two runs writing one folder would mix their files), or, for a new run, it holds
    a run, whose metrics and checkpoints would be lost (checked under the lock: a run that ended
    a moment ago is seen). With `overwrite` that run may go: replace_run removes its files once
    the new run is built (its data, the weights it fine-tunes from, its teacher), so that a start
    that fails on bad input loses nothing."""
    if resuming and not out.is_dir():
        return None  # no run: resuming says so
    refusal = _lock(out)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if refusal is None and found and not overwrite and not resuming:
        go_on = f"continue it with {distributed.resume_command(out, d or Dist())}, "  # or:
        go_on = go_on if has_checkpoint(out) else "it has no checkpoint to continue from: "
        refusal = (
            f"{out} already holds a run ({', '.join(found)}): {go_on}choose another --out, or "
            f"pass --overwrite to replace it"
        )
    return refusal


def _lock(out: Path, user: str = "`vitlab train`", run: bool = True) -> str | None:
    """Take out's lock, or say who holds it. An flock: the kernel lets go of it when the process
    ends, however it ends (a killed run leaves no stale lock); none where there is no flock
    (Windows) or the filesystem refuses locks (some NFS mounts: a warning). The lock file stays
    in a run's folder; one this claim made (with the folders above it that it made) goes again
    when the lock is let go with nothing else written there. A lock taken on a file that is no
    longer at its path (a failed start removed it between this open and flock, and a third
    start could lock a new one) is let go, and the lock taken again."""
    try:
        import fcntl
    except ImportError:
        return None
    first = None  # the shallowest folder a claim made, over every try
    for _ in range(_TRIES):
        now = next((p for p in [*reversed(out.parents), out] if not p.exists()), None)
        first = min((p for p in (first, now) if p), key=lambda p: len(p.parts), default=None)
        try:
            out.mkdir(parents=True, exist_ok=True)
            try:
                fd, made = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:  # another user's lock file in a shared folder: read-only
                fd, made = _open_existing(out / LOCK), False
        except OSError as e:
            refusal = None
            if isinstance(e, FileExistsError | NotADirectoryError):
                refusal = folder_refusal(out, "the run" if run else f"the runs of {user}")
            return refusal or f"cannot use {out} as a run folder: {e}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held
            holder = os.read(fd, 200).decode(errors="replace").strip()
            os.close(fd)
            holder = holder if holder.startswith("`") else f"process ({holder or 'unnamed'})"
            return (
                f"{out} is in use by another {holder}: wait for it to end, or choose another --out"
            )
        except OSError as e:  # a filesystem without locks (some NFS mounts): the run goes on
            os.close(fd)
            if made:  # nothing holds it: the run's files are what stays
                with contextlib.suppress(OSError):
                    (out / LOCK).unlink()
            log.warning("could not lock the run folder %s (%s): another run could share it", out, e)
            return None
        if _same_file(fd, out / LOCK):
            break
        os.close(fd)  # a failed start removed the file as it let go of it: a new one's lock
    else:
        return f"cannot lock {out}: its {LOCK} was removed and made again {_TRIES} times"
    with contextlib.suppress(OSError):  # who holds it, for the refusal: not needed to run
        os.ftruncate(fd, 0)
        os.write(fd, f"{user} (pid {os.getpid()} on {os.uname().nodename})".encode())
    _held.append(_Hold(threading.get_ident(), fd, out, made, first, run))
    return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, or replaced, since it was
    opened)."""
    try:
        held, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _open_existing(path: Path) -> int:
    """An existing lock file's descriptor: read-write, or read-only where it is another user's
    (an flock needs no write access)."""
    try:
        return os.open(path, os.O_RDWR)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def release_run_folders() -> None:
    """Let go of the run folders' locks this thread took (its run ended: train() calls it). Where
    nothing but a lock file this claim made is in the folder (a start that failed), it goes, and
    so do the folders the claim made (a start that failed leaves nothing)."""
    for held in [h for h in _held if h.thread == threading.get_ident() and h.run]:
        _let_go(held)
    for made in [m for m in _defaults if m[0] == threading.get_ident()]:  # default_run_folder's,
        _defaults.remove(made)  # now, not at the process's exit (a notebook's failed train())
        _remove_if_empty(made[1], made[1])


def _let_go(held: _Hold) -> None:
    if held not in _held:  # a forked child's copy, which _forget_in_child closed
        return
    _held.remove(held)
    if held.made:
        _remove_if_empty(held.folder, held.first)
    with contextlib.suppress(OSError):
        os.close(held.fd)


@contextlib.contextmanager
def holding(folder: Path, user: str) -> Iterator[None]:
    """`folder` locked as a run's is (its .vitlab-lock) while `user`, a command writing runs
    into it, does (`vitlab reproduce`: another with the same --out would remove the files of a
    run being trained): a ConfigError says who else holds it. Held already by this thread (an
    experiment of `vitlab reproduce all`): as it is."""
    folder = folder.resolve()
    if _own_hold(folder) is not None:
        yield
        return
    if refusal := _lock(folder, user, run=False):
        raise ConfigError(refusal)
    hold = _own_hold(folder)
    if hold is None:  # not lockable here (no flock, NFS; said once): held all the same, by no file
        hold = _Hold(threading.get_ident(), -1, folder, False, None, False)
        _held.append(hold)
    try:
        yield
    finally:
        _let_go(hold)


def _own_hold(folder: Path) -> _Hold | None:
    """This thread's hold (not a run's lock) of `folder`, or None."""
    me = threading.get_ident()
    return next((h for h in _held if h.thread == me and h.folder == folder and not h.run), None)


def remove_run_files(out: Path) -> str | None:
    """Remove the run's files in `out` (RUN_FILES, and the confusion matrices vitlab eval saved
    of its checkpoints; a symlink among them is unlinked, not followed; other files stay); what
    went wrong, or None."""
    try:
        for path in [*(out / name for name in RUN_FILES), *out.glob("confusion_matrix_*.png")]:
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
    so that two runs started together cannot both take it (and removed when the run ends, or at
    the process's exit, if still empty: a start that failed on bad input leaves nothing)."""
    base = Path("runs") / time.strftime(f"{cfg.data.name.split(':')[0]}-%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    out, n = base, 1
    while True:
        try:
            out.mkdir()
            where = out.absolute()  # the same folder after a chdir
            atexit.register(_remove_if_empty, where, where)
            _defaults.append((threading.get_ident(), where))
            return out
        except FileExistsError:
            n += 1
            out = base.with_name(f"{base.name}-{n}")


def _remove_if_empty(folder: Path, made: Path | None) -> None:
    """A run folder that holds nothing but its lock (a run that wrote nothing) loses the lock,
    and goes with the folders above it up to `made`, the first a start made (None: none goes)."""
    with contextlib.suppress(OSError):  # not empty: a run is in it
        if [p.name for p in folder.iterdir()] == [LOCK]:
            (folder / LOCK).unlink()
        for up in [folder, *folder.parents] if made is not None else []:
            up.rmdir()
            if up == made:
                break
