"""Fault trials for distributed training: one of two torchrun ranks (gloo on CPU) is SIGKILLed
(`dies`) or SIGSTOPped (`hangs`, with a 5 s collective timeout) at a random moment after the first
epoch's checkpoint, on a random rank. A trial survives when the run exits non-zero within 60 s
with the survivor's error naming the lost rank, the last checkpoint loads, and `--resume` on two
ranks ends with the weights of an uninterrupted two-rank run. Prints one row per fault for the
reliability table in BENCHMARKS.md.

    .venv/bin/python benchmarks/rank_failure.py --trials 5 --hang-trials 2
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_rank_failure import (  # noqa: E402
    ARGS,
    ENV,
    kill_rank_mid_epoch,
    saved_epoch,
    start,
    stop,
    torchrun,
)
from vitlab import load_checkpoint  # noqa: E402
from vitlab.train.state import load_weights  # noqa: E402

EPOCHS = 4
RUN = [*ARGS, f"train.epochs={EPOCHS}"]


def trial(tmp: Path, n: int, sig: signal.Signals, epoch_s: float, rng: random.Random) -> dict:
    """One run faulted at a random moment in epochs 2-3; what came of it."""
    out, victim = tmp / f"trial{n}", rng.randrange(2)
    env = {**ENV, "VITLAB_DIST_TIMEOUT": "5"} if sig == signal.SIGSTOP else ENV
    proc = start("--out", str(out), *RUN, env=env)
    delay = rng.uniform(0, 2 * epoch_s)
    try:
        rc, output, seconds = kill_rank_mid_epoch(proc, out, victim, delay, sig, timeout=120)
    except AssertionError as e:  # never reached epoch 2, or hung after the fault: not survived
        stop(proc)
        rc, output, seconds = None, str(e), float("inf")
    named = f"vitlab train: error: lost rank {victim} of 2" in output
    epoch = saved_epoch(out)
    loads = epoch is not None and load_checkpoint(out / "checkpoints" / "last") is not None
    resumed = loads and (
        epoch == EPOCHS
        or subprocess.run(torchrun("--resume", str(out)), capture_output=True, env=ENV).returncode
        == 0
    )
    return {
        "victim": victim,
        "delay": delay,
        "rc": rc,
        "seconds": seconds,
        "named": named,
        "epoch": epoch,
        "resumed": resumed,
        "weights": (load_weights(out / "checkpoints/last/model.safetensors") if resumed else None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="trials where a rank dies")
    parser.add_argument("--hang-trials", type=int, default=2, help="trials where a rank hangs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run(torchrun("--out", str(tmp / "ref"), *RUN), check=True, capture_output=True)
        records = (tmp / "ref/metrics.jsonl").read_text().splitlines()
        epoch_s = sum(json.loads(r)["seconds"] for r in records) / len(records)
        reference = load_weights(tmp / "ref/checkpoints/last/model.safetensors")
        rows = []
        n = 0
        for fault, sig, trials in (
            ("a rank dies (SIGKILL)", signal.SIGKILL, args.trials),
            ("a rank hangs (SIGSTOP, 5 s timeout)", signal.SIGSTOP, args.hang_trials),
        ):
            results = []
            for _ in range(trials):
                r = trial(tmp, n, sig, epoch_s, rng)
                n += 1
                equal = r["weights"] is not None and all(
                    torch.equal(reference[k], r["weights"][k]) for k in reference
                )
                ok = r["rc"] != 0 and r["seconds"] < 60 and r["named"] and equal
                r["equal"] = equal
                results.append((ok, r))
                print(
                    f"  {fault}: rank {r['victim']} at +{r['delay']:.2f}s; exit {r['rc']} after "
                    f"{r['seconds']:.1f}s, rank named: {r['named']}, checkpoint epoch "
                    f"{r['epoch']}, resumed equal: {equal}",
                    file=sys.stderr,
                )
            if results:
                lost = sum(1 for ok, r in results if r["weights"] is None or not r["equal"])
                slowest = max(r["seconds"] for _, r in results)
                rows.append((fault, trials, sum(ok for ok, _ in results), lost, slowest))
    print("| fault | trials | survived | data lost | slowest exit |")
    print("|---|---|---|---|---|")
    for fault, trials, survived, lost, slowest in rows:
        data = "none" if lost == 0 else f"{lost} runs not resumable to the same weights"
        print(f"| {fault} | {trials} | {survived}/{trials} | {data} | {slowest:.1f} s |")


if __name__ == "__main__":
    main()
