"""What an experiment is: its claim and the paper's numbers, the arms it trains at a budget, and
how it turns the arms' results into a table, plots and a verdict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vitlab.experiments.arms import Arm, Context
from vitlab.experiments.verdict import Stat, Verdict, stat


@dataclass
class Summary:
    """An experiment's findings: a table (header + rows of text), its verdict, its plots."""

    header: list[str]
    rows: list[list[str]]
    verdict: Verdict
    plots: list[tuple[str, str]] = field(default_factory=list)  # (file in the folder, caption)
    notes: list[str] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)  # what results.json keeps besides the arms
    measured: str | None = None  # what the arms are measured on, where not the default's words


@dataclass
class Experiment:
    name: str
    title: str
    source: str  # where in the paper
    claim: str  # one sentence
    paper: list[tuple[str, str]]  # the paper's numbers: (what, value)
    arms: Callable[[Context], list[Arm]]
    summarize: Callable[[Context, list[dict], Path], Summary]
    metric: str = "test top-1"  # what the verdict compares


def by_group(rows: list[dict], key: str) -> dict[str, Stat]:
    """group -> the statistic of `key` over that group's seeds (groups in first-seen order)."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            groups.setdefault(r["group"], []).append(r[key])
    return {g: stat(v) for g, v in groups.items()}


def seeds_text(s: Stat) -> str:
    return f"{s.n} seed{'s' if s.n != 1 else ''}"
