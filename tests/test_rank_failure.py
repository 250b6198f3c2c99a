"""A rank dies: SIGKILL one of two torchrun workers (gloo on CPU) mid-epoch. The survivor must exit
non-zero quickly with an error naming the lost rank, the run folder's last checkpoint must load,
and `--resume` on two ranks must end with the weights of an uninterrupted two-rank run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from tests.helpers import TINY_MODEL, TORCHRUN, kill_tree, one_thread_env
from vitlab import load_checkpoint
from vitlab.train.state import load_train_state, load_weights, resolve_checkpoint

# tiny and deterministic; batch 8 gives 179 steps an epoch, so "mid-epoch" is a window of seconds
ARGS = [
    *TINY_MODEL,
    "train.batch_size=8",
    "train.epochs=2",
    "train.precision=fp32",
    "data.val_fraction=0",
]
ENV = one_thread_env()


def torchrun(*args: str) -> list[str]:
    """A 2-process torchrun command line (standalone: a free port of its own)."""
    return [*TORCHRUN, "-m", "vitlab", "train", *args]


def worker_pids(agent: int) -> dict[int, int]:
    """{rank: pid} of the torchrun agent's worker processes, read from /proc."""
    kids = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    ranks = {}
    for pid in map(int, kids):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def saved_epoch(run: Path) -> int | None:
    """The epoch of the run's last checkpoint, None while there is none (or it is being written)."""
    try:
        return load_train_state(run / "checkpoints" / "last")["epoch"]
    except Exception:
        return None


def start(*args: str, env: dict[str, str] = ENV) -> subprocess.Popen:
    """A 2-rank torchrun in a session of its own (see stop)."""
    return subprocess.Popen(
        torchrun(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    """Kill the agent and every worker it started, if still there (a failed test leaks none)."""
    if proc.poll() is None:
        kill_tree(proc)


def kill_rank_mid_epoch(
    proc: subprocess.Popen,
    out: Path,
    victim: int,
    delay: float,
    sig: signal.Signals = signal.SIGKILL,
    timeout: float = 90,
):
    """Send `sig` to rank `victim` of the run `proc` (writing `out`) `delay` seconds into epoch 2.
    Returns the exit code, the whole output and the seconds from the signal to the exit; an
    AssertionError when the run never reached epoch 2 or did not exit within `timeout`."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("epoch 1: "):  # epoch 1's summary, printed before its checkpoint
            break
    deadline = time.monotonic() + 120
    while saved_epoch(out) != 1:  # then epoch 2 begins (tqdm's bar shows only at its end)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError("the run never saved epoch 1:\n" + "".join(lines)[-3000:])
        time.sleep(0.02)
    time.sleep(delay)
    os.kill(worker_pids(proc.pid)[victim], sig)
    killed = time.monotonic()
    try:
        rest, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        rest, _ = kill_tree(proc)  # the agent and every rank
        lines.append(rest)
        raise AssertionError("hung after a rank was killed:\n" + "".join(lines)[-4000:]) from None
    return proc.returncode, "".join(lines) + rest, time.monotonic() - killed


def test_a_killed_rank_fails_fast_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    uninterrupted = start("--out", str(straight), *ARGS)  # alongside, to halve the wall time
    interrupted = start("--out", str(broken), *ARGS)
    try:
        check_kill_and_resume(uninterrupted, interrupted, straight, broken)
    finally:
        stop(uninterrupted)
        stop(interrupted)


def check_kill_and_resume(uninterrupted, interrupted, straight: Path, broken: Path) -> None:
    # rank 0 writes the checkpoints and the log; rank 1 must name it
    rc, output, seconds = kill_rank_mid_epoch(interrupted, broken, victim=0, delay=0.3)
    assert rc != 0, output[-3000:]
    assert seconds < 60, f"took {seconds:.0f}s to exit after the kill"
    # the survivor's own report, not torchrun's summary (which names the root cause anyway)
    assert "vitlab train: error: lost rank 0 of 2" in output, output[-3000:]
    assert f"`torchrun --nproc_per_node=2 -m vitlab train --resume {broken}`" in output

    state = load_train_state(resolve_checkpoint(broken / "checkpoints" / "last").parent)
    assert (state["epoch"], state["batch"]) == (1, 0)  # killed in epoch 2: epoch 1's checkpoint
    model, meta = load_checkpoint(broken / "checkpoints" / "last")
    assert meta.config.embed_dim == 32 and torch.isfinite(model.head.weight).all()

    resumed = subprocess.run(
        torchrun("--resume", str(broken)), capture_output=True, text=True, env=ENV, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out, _ = uninterrupted.communicate(timeout=180)
    assert uninterrupted.returncode == 0, out[-3000:]
    a = load_weights(straight / "checkpoints" / "last" / "model.safetensors")
    b = load_weights(broken / "checkpoints" / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert load_train_state(broken / "checkpoints" / "last")["epoch"] == 2
