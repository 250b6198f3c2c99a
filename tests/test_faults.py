"""Faults a trusted trainer survives: kill -9 around checkpoint writes, and a disk that fills up (a
file-size limit, or a tiny tmpfs where one can be mounted). Real processes, real limits; the long
trials are in benchmarks/faults.py."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import VITLAB, run_together
from tests.test_train import FAST
from vitlab import load_checkpoint
from vitlab.config import load_run_config
from vitlab.train.run import train
from vitlab.train.state import load_train_state, load_weights, resolve_checkpoint

# one thread: with another process busy on a 2-core machine, two torch threads wait on each
# other (63 img/s against 5,160 img/s with one). The runs trained in this process keep it in their
# config too: their resumes run two at a time.
OVERRIDES = [*FAST, "data.val_fraction=0.1", "train.threads=1"]
TRAIN = [*VITLAB, "train", *OVERRIDES]
RESUME = [*VITLAB, "train", "--resume"]


def train_here(run: Path, *overrides: str) -> Path:
    """A run trained in this process: a run the test starts from, not the command under test
    (no interpreter to start)."""
    return train(load_run_config(None, [*OVERRIDES, *overrides]), out=run)


def checkpoint(run: Path, which: str) -> tuple[dict[str, torch.Tensor], Path]:
    """The weights of run's `which` checkpoint (found where a killed save may have left it)."""
    weights = resolve_checkpoint(run / "checkpoints" / which)
    return load_weights(weights), weights.parent


def kill_during_save(
    run: Path, epochs: int, epoch: int | None, delay: float, resume: bool = False
) -> str:
    """Start `vitlab train` (or resume `run`), SIGKILL it `delay` s after it logs epoch `epoch`
    (any epoch: None); the log line comes just before that epoch's best and last checkpoints are
    written. The tail of its log."""
    cmd = [*RESUME, str(run)] if resume else [*TRAIN, f"train.epochs={epochs}", "--out", str(run)]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if re.match(rf"epoch {epoch or '[0-9]+'}: train loss", line):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            break
    proc.stderr.close()
    assert proc.wait(timeout=300) == -signal.SIGKILL, "".join(lines[-5:])
    return "".join(lines[-5:])


def survived(runs: list[Path], straight: Path) -> None:
    """After a kill: each run's `last` (weights and training state) and `best` load, and --resume
    (the runs at once) finishes with the weights of the uninterrupted run."""
    for run in runs:
        _, folder = checkpoint(run, "last")
        assert load_train_state(folder)["epoch"] >= 1
        checkpoint(run, "best")
    resumed = run_together(*[([*RESUME, str(run)], None) for run in runs])
    a = checkpoint(straight, "last")[0]
    for run, done in zip(runs, resumed):
        assert done.returncode == 0, done.stderr[-2000:]
        b = checkpoint(run, "last")[0]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert (run / "results.json").is_file()


def test_kill_9_around_checkpoint_writes_keeps_a_loadable_checkpoint(tmp_path: Path) -> None:
    epochs, rng = 3, random.Random(0)
    straight = tmp_path / "straight"
    # the uninterrupted run alongside the killed ones (one thread each: two cores take both)
    log = tmp_path / "straight.log"
    with open(log, "w") as f:
        uninterrupted = subprocess.Popen(
            [*TRAIN, f"train.epochs={epochs}", "--out", str(straight)], stdout=f, stderr=f
        )
    try:
        killed = []
        for trial, delay in enumerate((0.0, rng.uniform(0.0, 0.05))):  # saves take ~25-50 ms
            killed.append(tmp_path / f"killed{trial}")
            kill_during_save(killed[-1], epochs, epoch=2, delay=delay)
        assert uninterrupted.wait(timeout=300) == 0, log.read_text()[-2000:]
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
            uninterrupted.wait()
    survived(killed, straight)


# --- a disk that fills up ------------------------------------------------------------------------

RESUME_UNDER_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from vitlab.config import load_run_config
from vitlab.train.run import train
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
run, limit = Path(sys.argv[1]), int(sys.argv[2])
cfg = load_run_config(str(run / "config.yaml"))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    train(cfg, resume=run)
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": [c.__name__ for c in type(e).__mro__], "message": str(e)}))
"""


def stopped_run(parent: Path, name: str) -> Path:
    """A run of 2 epochs stopped after the first, in folder `parent / name`."""
    return train_here(parent / name, "train.epochs=2", "train.stop_at_epoch=1")


def assert_previous_intact(run: Path, before: dict[str, dict[str, torch.Tensor]], message: str):
    """The checkpoint whose save failed (named in `message`) holds its previous weights, in its
    own folder; every checkpoint loads; no temporary folder is left."""
    failed = [w for w in before if f"cannot save checkpoint {run / 'checkpoints' / w}:" in message]
    assert len(failed) == 1, message
    for which, weights in before.items():
        after, folder = checkpoint(run, which)
        assert folder == run / "checkpoints" / which
        if which == failed[0]:
            assert all(torch.equal(weights[k], after[k]) for k in weights)
    load_train_state(run / "checkpoints" / "last")
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["best", "last"], left  # the temporary folder is gone


def test_a_save_past_the_file_size_limit_fails_clearly_and_keeps_the_previous(tmp_path) -> None:
    """RLIMIT_FSIZE below the weights file (the safetensors writer fails), then between the
    weights and the training state (torch.save fails): each time a CheckpointWriteError naming
    the limit and the folder, the previous best and last intact, no temporary folder left."""
    run = stopped_run(tmp_path, "run")
    weights = (run / "checkpoints/last/model.safetensors").stat().st_size
    state = (run / "checkpoints/last/state.pt").stat().st_size
    assert weights < state
    before = {w: checkpoint(run, w)[0] for w in ("best", "last")}
    limits = {run: weights // 2, shutil.copytree(run, tmp_path / "copy"): (weights + state) // 2}
    outs = run_together(  # each limit on its own copy of the run, at once
        *[
            ([sys.executable, "-c", RESUME_UNDER_LIMIT, str(r), str(n)], None)
            for r, n in limits.items()
        ]
    )
    for folder, out in zip(limits, outs):
        assert out.returncode == 0, out.stderr[-2000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["error"] and "CheckpointWriteError" in report["error"], report
        assert "CheckpointError" in report["error"]
        assert "file-size limit was hit" in report["message"], report
        assert_previous_intact(folder, before, report["message"])


def test_a_full_disk_fails_clearly_and_keeps_the_previous(tmp_path: Path) -> None:
    """A tmpfs with room for one checkpoint set but not two (the new one is written before the
    old one goes): the CLI fails with exit status 2 saying the disk is full."""
    mount = tmp_path / "small"
    mount.mkdir()
    probe = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                           capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}")
    try:
        run = stopped_run(mount, "run")
        before = {w: checkpoint(run, w)[0] for w in ("best", "last")}
        used = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
        with open(mount / "filler", "wb") as f:  # leave less room than a second checkpoint
            f.write(b"\0" * max(os.statvfs(mount).f_bavail * 4096 - used // 2, 0))
        out = subprocess.run(
            [*RESUME, str(run)],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2, out.stderr[-2000:]
        assert "the disk is full (ENOSPC)" in out.stderr and "cannot save checkpoint" in out.stderr
        assert_previous_intact(run, before, out.stderr)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_mid_run_says_how_the_run_goes_on(tmp_path: Path, capsys, monkeypatch):
    """ENOSPC saving a checkpoint said only that the previous one was intact, and one appending to
    metrics.jsonl stopped `vitlab train` with the bare OSError (exit 1); each now says how the
    run goes on once space is freed: --resume from the last checkpoint (intact: checkpoints are
    written whole or not at all), which finishes the run, or a new start where none was saved."""
    import builtins
    import errno

    from vitlab.cli.main import main
    from vitlab.train import log as log_mod
    from vitlab.train import state as state_mod

    def full(path: object) -> OSError:
        return OSError(errno.ENOSPC, "No space left on device", str(path))

    real_write, written = state_mod.write_weights, []

    def write_twice(path, *args, **kwargs):  # epoch 1's best and last, then no room
        written.append(path)
        if len(written) > 2:
            raise full(path)
        return real_write(path, *args, **kwargs)

    args = ["train", *FAST, "train.epochs=2", "optim.warmup_epochs=0"]
    run = tmp_path / "run"
    monkeypatch.setattr(state_mod, "write_weights", write_twice)
    assert main([*args, "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"cannot save checkpoint {run / 'checkpoints'}" in err and "(ENOSPC)" in err, err
    assert f"once space is freed, continue the run with `vitlab train --resume {run}`" in err
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0  # as said: the run goes on, and ends
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "results.json").is_file()

    def no_appending(path, mode="r", *args, **kwargs):  # epoch 1's metrics line
        if "a" in mode:
            raise full(path)
        return builtins.open(path, mode, *args, **kwargs)

    run = tmp_path / "first"
    monkeypatch.setattr(log_mod, "open", no_appending, raising=False)
    assert main([*args, "--out", str(run)]) == 2  # the bare OSError's exit status was 1
    err = capsys.readouterr().err
    assert f"error: cannot write {run / 'metrics.jsonl'}: the disk is full (ENOSPC)" in err, err
    assert (f"the run has no checkpoint yet: once space is freed, start it again: its command "
            f"with --out {run} --overwrite") in err  # fmt: skip


def test_a_run_killed_mid_swap_of_best_still_serves_its_best(tmp_path: Path) -> None:
    """A kill between the two renames of a `best` save leaves best under its aside name: a run
    folder then resolves to that best (it resolved to `last`, so `vitlab eval RUN` silently
    evaluated other weights)."""
    run = tmp_path / "run"
    # with EMA, best holds the averaged weights and last the raw ones
    train_here(run, "train.epochs=2", "train.ema=0.9")
    best = load_weights(run / "checkpoints/best/model.safetensors")
    last = load_weights(run / "checkpoints/last/model.safetensors")
    assert any(not torch.equal(best[k], last[k]) for k in best)
    (run / "checkpoints/best").rename(run / "checkpoints/.best.old")  # what the kill leaves
    assert resolve_checkpoint(run).parent.name == ".best.old"
    model, _ = load_checkpoint(run)
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())


def test_the_cli_under_a_file_size_limit_fails_with_an_error_not_a_signal(tmp_path: Path) -> None:
    """`ulimit -f` smaller than a checkpoint: `vitlab train` says so and exits 2 (CPython ignores
    SIGXFSZ from start-up, so the write fails with EFBIG instead of the signal killing it)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # below the weights file

    r = subprocess.run(
        [*TRAIN, "train.epochs=1", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "file-size limit was hit" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*tmp*"))


class _Pwn:
    """A pickle that would create a file when loaded without weights_only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_damaged_or_crafted_training_state_is_one_line_and_runs_nothing(tmp_path, capsys):
    """state.pt with a pickle that runs code, or with flipped bytes: `--resume` printed
    PyTorch's four-line refusal, which advises loading with weights_only=False ("will likely
    succeed"); it is one line now, exit 2, and the code never runs."""
    from vitlab.cli.main import main

    run = stopped_run(tmp_path, "run")
    capsys.readouterr()
    state = run / "checkpoints" / "last" / "state.pt"
    good = state.read_bytes()
    pwned = tmp_path / "PWNED"
    torch.save({"epoch": 1, "evil": _Pwn(pwned)}, state)
    flipped = bytearray(good)
    for i in range(len(flipped) // 3, len(flipped) // 3 + 64):
        flipped[i] ^= 0xFF
    for damage in (state.read_bytes(), bytes(flipped), good[: len(good) // 2]):
        state.write_bytes(damage)
        assert main(["train", "--resume", str(run)]) == 2
        err = capsys.readouterr().err
        errors = [x for x in err.splitlines() if x.startswith("vitlab train: error:")]
        assert len(errors) == 1 and str(state) in errors[0], err
        assert "weights_only" not in err and "Please file an issue" not in err, err
    assert not pwned.exists()
    state.write_bytes(good)
    assert main(["train", "--resume", str(run)]) == 0  # the real one goes on


def test_a_full_disk_before_an_overwriting_run_is_built_does_not_offer_the_old_run(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`--out OLD --overwrite` keeps OLD's files until the new run is built: a full disk before
    that (a dataset's download) advised `--resume OLD`, which trains the old run with its old
    config, not the command given. The advice is now that command again."""
    import errno

    from vitlab.cli.main import main
    from vitlab.train import run as run_mod

    run = tmp_path / "old"
    assert main(["train", *FAST, "train.epochs=1", "--out", str(run)]) == 0
    capsys.readouterr()

    def full(cfg):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "x.gz"))

    monkeypatch.setattr(run_mod, "load_data", full)
    assert main(["train", *FAST, "train.epochs=2", "--out", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'cache' / 'x.gz'}: the disk is full (ENOSPC)" in err, err
    assert "once space is freed, run the same command again" in err and "--resume" not in err
    assert (run / "results.json").is_file()  # the old run is still whole
