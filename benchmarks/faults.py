"""Faults a trusted trainer survives, by the trial: kill -9 at random moments around checkpoint
writes, and saves that hit a file-size limit or a full disk. Prints a table row per fault: trials,
survived, data lost.

    .venv/bin/python benchmarks/faults.py [--kills 24] [--seed 0]

A kill trial SIGKILLs `vitlab train` (the tiny FAST model on digits, many short epochs, so saves
are frequent) a random 0-60 ms after an epoch's log line, which comes just before that epoch's
best and last checkpoints are written; the next trial resumes the same run (see chain). A kill
survives when `last` (weights and training state) and `best` load; each run, resumed to its end,
must equal an uninterrupted run. Data is lost when a checkpoint is missing or unloadable, the
resumed weights differ, or metrics.jsonl does not hold each epoch once."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.test_faults import RESUME_UNDER_LIMIT, TRAIN, checkpoint, kill_during_save  # noqa: E402
from vitlab.train.state import load_train_state  # noqa: E402

EPOCHS = 13
SAVE_WINDOW = 0.06  # s after an epoch's log line: best (~8 ms) and last (~16-34 ms) are written


def log_epoch(run: Path) -> str:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return f"after epoch {json.loads(lines[-1])['epoch']}'s log line" if lines else "early"


def chain(root: Path, straight: Path, kills: int, rng: random.Random) -> tuple[int, list[str]]:
    """Train one run through `kills` kills: each process is SIGKILLed a random 0-60 ms after its
    first epoch log line (inside or just after that epoch's saves) and the next resumes it. After
    each kill `last` (weights and state) and `best` must load; at the end the run is resumed to
    its last epoch and must equal the uninterrupted one. (survived kills, what was lost)."""
    run, survived, lost = root / f"chain-{rng.random():.6f}", 0, []
    for i in range(kills):
        delay = rng.uniform(0.0, SAVE_WINDOW)
        if i and load_train_state(checkpoint(run, "last")[1])["epoch"] >= EPOCHS - 1:
            break  # the run is about to end: start another chain
        # the first process at epoch 2's saves (epoch 1's have nothing before them to keep)
        kill_during_save(run, EPOCHS, None if i else 2, delay, resume=i > 0)
        try:
            left = sorted(p.name for p in (run / "checkpoints").iterdir())
            state = load_train_state(checkpoint(run, "last")[1])
            checkpoint(run, "best")
            survived += 1
            # where the kill landed: before `last` was replaced (it still holds the epoch
            # before), mid-save (a .tmp or .old folder left), or after
            landed = "mid-save" if len(left) > 2 else f"last at epoch {state['epoch']}"
            print(f"  kill {log_epoch(run)} +{delay * 1000:.0f} ms: {landed} {left}: loadable",
                  flush=True)  # fmt: skip
        except Exception as e:
            lost.append(f"checkpoint after kill {i + 1}: {e}")
            return survived, lost
    done = subprocess.run([sys.executable, "-m", "vitlab", "train", "--resume", str(run)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        return survived, [*lost, f"resume failed: {done.stderr[-300:]}"]
    a, b = checkpoint(straight, "last")[0], checkpoint(run, "last")[0]
    if not all(torch.equal(a[k], b[k]) for k in a):
        lost.append("resumed weights differ from the uninterrupted run")
    epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    if epochs != list(range(1, EPOCHS + 1)):
        lost.append(f"metrics.jsonl epochs {epochs}")
    if not (run / "results.json").is_file():
        lost.append("no results.json")
    return survived, lost


def limit_trial(root: Path, limit: int) -> tuple[bool, list[str]]:
    run = root / f"limit-{limit}"
    subprocess.run([*TRAIN, "train.epochs=2", "train.stop_at_epoch=1", "--out", str(run)],
                   check=True, capture_output=True)  # fmt: skip
    before = {w: checkpoint(run, w)[0] for w in ("best", "last")}
    out = subprocess.run([sys.executable, "-c", RESUME_UNDER_LIMIT, str(run), str(limit)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    lost = []
    if not report["error"] or "CheckpointWriteError" not in report["error"]:
        lost.append(f"no CheckpointWriteError: {report}")
    for which, weights in before.items():
        after, folder = checkpoint(run, which)
        failed = f"checkpoint {run / 'checkpoints' / which}:" in report.get("message", "")
        if folder.name != which or (failed and not all(torch.equal(weights[k], after[k])
                                                       for k in weights)):  # fmt: skip
            lost.append(f"{which} changed or moved")
    if sorted(p.name for p in (run / "checkpoints").iterdir()) != ["best", "last"]:
        lost.append("temporary folder left")
    return not lost, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        straight = root / "straight"
        subprocess.run([*TRAIN, f"train.epochs={EPOCHS}", "--out", str(straight)], check=True,
                       capture_output=True)  # fmt: skip
        t0, survived, lost, trials = time.time(), 0, [], 0
        while trials < args.kills:
            ok, why = chain(root, straight, min(args.kills - trials, EPOCHS - 1), rng)
            trials, survived, lost = trials + ok + bool(why), survived + ok, lost + why
        rows.append(("kill -9 during a save", trials, survived, lost, time.time() - t0))
        t0, survived, lost = time.time(), 0, []
        limits = [
            20_000,
            50_000,
            70_000,
            100_000,
            130_000,
            160_000,
        ]  # weights ~76 KB, state ~177 KB
        for limit in limits:
            ok, why = limit_trial(root, limit)
            survived += ok
            lost += why
            print(f"  file-size limit {limit:,} B: {'survived' if ok else why}", flush=True)
        rows.append(("file-size limit (RLIMIT_FSIZE)", len(limits), survived, lost,
                     time.time() - t0))  # fmt: skip
    print("\n| fault | trials | survived | data lost | seconds |\n|---|---|---|---|---|")
    for fault, trials, ok, why, secs in rows:
        print(f"| {fault} | {trials} | {ok} | {'none' if not why else '; '.join(why)} | "
              f"{secs:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
