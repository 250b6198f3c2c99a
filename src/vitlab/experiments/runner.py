"""The experiments by name, and running one (or all): train or reuse every arm, summarise,
write the report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from vitlab.experiments import data_scale, inside, mpp, patch_size, pos_embed
from vitlab.experiments.arms import Arm, Context, run_arm
from vitlab.experiments.base import Experiment
from vitlab.experiments.report import machine, write_report
from vitlab.formats.base import write_text
from vitlab.runtime import progress
from vitlab.train.folder import holding

REPRODUCE = "`vitlab reproduce`"

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        pos_embed.EXPERIMENT,
        data_scale.EXPERIMENT,
        patch_size.EXPERIMENT,
        inside.EXPERIMENT,
        mpp.EXPERIMENT,
    )
}


class UnknownExperimentError(ValueError):
    """An experiment name that is not registered."""


def get_experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise UnknownExperimentError(
            f"unknown experiment {name!r}: choose one of {', '.join(EXPERIMENTS)} (or all); "
            f"`vitlab reproduce --list` describes them"
        )
    return EXPERIMENTS[name]


def format_list() -> str:
    lines = []
    for e in EXPERIMENTS.values():
        lines += [f"{e.name:<11} {e.title}", f"{'':<11} claim: {e.claim}", ""]
    return "\n".join(lines).rstrip()


def estimate_seconds(arms: list[Arm], ctx: Context, done: set[str] | None = None) -> float:
    """The budget's estimate of these arms on 2 AVX2 cores (budgets.py), each folder once."""
    done = set() if done is None else done
    total = 0.0
    for arm in arms:
        if arm.folder not in done:
            done.add(arm.folder)
            total += arm.estimate_s()
    return total


def run_experiment(name: str, ctx: Context) -> dict[str, Path]:
    """Every arm of experiment `name` (trained, resumed or reused), then its report in
    OUT/NAME/, with OUT locked throughout (another run with this --out is refused). Returns the
    report's paths."""
    with holding(ctx.out, REPRODUCE):
        return _experiment(name, ctx)


def _experiment(name: str, ctx: Context) -> dict[str, Path]:
    exp = get_experiment(name)
    t0 = time.perf_counter()
    arms = exp.arms(ctx)
    folder = ctx.out / name
    folder.mkdir(parents=True, exist_ok=True)
    progress(f"vitlab reproduce {name}: {len(arms)} arm(s), budget {ctx.budget.name} on "
             f"{ctx.data} (estimated {estimate_seconds(arms, ctx) / 60:.1f} min on 2 AVX2 cores "
             f"from scratch)")  # fmt: skip
    rows = [run_arm(arm, ctx.out, i + 1, len(arms), ctx) for i, arm in enumerate(arms)]
    summary = exp.summarize(ctx, rows, folder)
    seeds = len({r["seed"] for r in rows})
    run = {
        "budget": ctx.budget.name,
        "data": ctx.data,
        "seeds": seeds,
        "test_images": rows[0]["test_images"],
        "fewshot_seeds": ctx.budget.fewshot_seeds,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    paths = write_report(exp, summary, rows, folder, run)
    print(f"vitlab reproduce {name}: {summary.verdict.outcome} ({summary.verdict.reason})",
          file=sys.stderr, flush=True)  # fmt: skip
    return paths


def run_all(ctx: Context) -> dict[str, dict[str, Path]]:
    """Every experiment in order (inside after pos-embed, whose runs it analyses), then an
    index OUT/README.md with each verdict."""
    with holding(ctx.out, REPRODUCE):  # a second run with this --out is refused
        reports = {name: run_experiment(name, ctx) for name in EXPERIMENTS}
        lines = [f"# vitlab reproduce all: budget {ctx.budget.name} on {ctx.data}", "",
                 "| experiment | verdict | report |", "|---|---|---|"]  # fmt: skip
        for name, paths in reports.items():
            outcome = json.loads(paths["results.json"].read_text())["verdict"]["outcome"]
            lines.append(f"| {EXPERIMENTS[name].title} | {outcome} | [{name}/report.md]"
                         f"({name}/report.md) |")  # fmt: skip
        write_text(ctx.out / "README.md", "\n".join(lines) + "\n")
    return reports
