"""`vitlab reproduce`: parse, then call vitlab.experiments.runner."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitlab.experiments.budgets import BUDGETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce",
        help="re-run the paper's claims in miniature, with verdicts computed from the data",
        description="Re-run one of the paper's claims (or all) in miniature: train every arm "
        "through the same code as `vitlab train` (one run folder per arm, OUT/EXPERIMENT/"
        "ARM-seedS; a finished run is reused, an interrupted one resumed), then write "
        "OUT/EXPERIMENT/results.json, its plots (PNG), report.md and report.html: the claim, "
        "the paper's numbers, ours (mean ± seed spread), and a verdict (holds / does not hold / "
        "inconclusive) computed by the rule the report states. Experiments: pos-embed (Table "
        "8), data-scale (§4.3), patch-size (Fig. 5), inside (Fig. 7, on pos-embed's models), "
        "mpp (§4.6); `--list` describes them. Budgets: smoke (seconds, for tests), fast (each "
        "experiment <= 15 min on 2 CPU cores, all <= 75), full (each <= 90 min).",
        epilog="Example: vitlab reproduce pos-embed --budget fast; vitlab reproduce all "
        "--budget fast --out docs/reproduction/fast",
    )
    p.add_argument("experiment", nargs="?", help="pos-embed | data-scale | patch-size | inside | "
                   "mpp | all")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the experiments and their claims")
    p.add_argument("--data", default="fashion-mnist",
                   help="dataset (default fashion-mnist; digits for a quick look)")  # fmt: skip
    p.add_argument("--budget", choices=BUDGETS, default="fast",
                   help="smoke | fast | full (default fast)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="seeds per arm (default: the budget's, 1-3 by experiment)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where run folders and reports go (default runs/reproduce/DATA-BUDGET); "
                   "rerun with the same --out to continue")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.experiments.arms import Context
    from vitlab.experiments.budgets import get_budget
    from vitlab.experiments.runner import format_list, get_experiment, run_all, run_experiment
    from vitlab.train.folder import OutOfSpace
    from vitlab.train.stop import TrainingStopped

    if args.list:
        if args.experiment:
            raise ValueError(f"--list describes every experiment; drop {args.experiment!r}")
        print(format_list())
        return 0
    if not args.experiment:
        raise ValueError("name an experiment (or all), or pass --list")
    if args.experiment != "all":
        get_experiment(args.experiment)  # an unknown name fails before any data is read
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    out = args.out or Path("runs") / "reproduce" / f"{args.data}-{args.budget}"
    ctx = Context(args.data, get_budget(args.budget), out, args.seeds)
    try:
        if args.experiment == "all":
            reports = run_all(ctx)
            for paths in reports.values():
                print(paths["report.md"])
            print(out / "README.md")
        else:
            print(run_experiment(args.experiment, ctx)["report.md"])
    except TrainingStopped as e:
        print(f"vitlab reproduce: {e.where}; rerun the same command to continue", file=sys.stderr)
        return 128 + e.signum  # 130 for Ctrl-C, 143 for SIGTERM, as train
    except OutOfSpace as e:  # an arm's run: rerunning resumes it (its --resume is not the way)
        print(f"vitlab reproduce: error: {e.where}; once space is freed, rerun the same command "
              f"to continue", file=sys.stderr)  # fmt: skip
        return 2
    return 0
