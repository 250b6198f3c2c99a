"""The experiments' figures: bars with seed spreads, curves against dataset size, and accuracy
against training compute with its frontier. PNG, matplotlib without a display."""

from __future__ import annotations

from pathlib import Path

from vitlab.analysis.page import pyplot
from vitlab.experiments.verdict import Stat


def _err(s: Stat) -> float:
    return 0.0 if s.spread is None else 100 * s.spread


def bars(groups: dict[str, Stat], path: Path, ylabel: str, title: str) -> None:
    """One bar per group: mean over seeds, the seed spread as an error bar (percent)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = list(groups)
    means = [100 * groups[n].mean for n in names]
    ax.bar(range(len(names)), means, yerr=[_err(groups[n]) for n in names], capsize=4,
           color="#4c78a8")  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    top = max(m + _err(groups[n]) for m, n in zip(means, names))
    ax.set_ylim(0.0, min(100.0, top + 3))  # from 0: a bar's length is its accuracy
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curves(
    series: dict[str, dict[int, Stat]], path: Path, ylabel: str, title: str, xlabel: str
) -> None:
    """One line per series over a log x axis (dataset size), seed spreads as error bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in series.items():
        xs = sorted(points)
        ax.errorbar(xs, [100 * points[x].mean for x in xs], yerr=[_err(points[x]) for x in xs],
                    marker="o", capsize=3, label=name)  # fmt: skip
    ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compute_curves(
    series: dict[str, list[tuple[float, Stat]]], path: Path, title: str, levels: list[float]
) -> list[tuple[str, int]]:
    """Accuracy against training FLOPs (log x): one line per model through its points (compute
    levels, drawn as dotted verticals), seed spreads as error bars, and the compute-accuracy
    frontier (the points no point of less or equal compute beats) as a black step line. Returns
    the frontier's points as (model, index of the point), cheapest first."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for level in levels:
        ax.axvline(level, color="grey", linestyle=":", linewidth=1)
    for name, points in series.items():
        xs, ys = [f for f, _ in points], [100 * s.mean for _, s in points]
        ax.errorbar(xs, ys, yerr=[_err(s) for _, s in points], marker="o", capsize=3, label=name)
    every = sorted(((f, s.mean, name, i) for name, points in series.items()
                    for i, (f, s) in enumerate(points)), key=lambda p: (p[0], -p[1]))  # fmt: skip
    best, front = float("-inf"), []
    for flops, mean, name, i in every:
        if mean > best:
            best, front = mean, [*front, (flops, mean, name, i)]
    xs = [p[0] for p in front] + [every[-1][0]]
    ys = [100 * p[1] for p in front]
    ys.append(ys[-1])  # the best accuracy reached stays reachable at any larger compute
    ax.step(xs, ys, where="post", color="black", alpha=0.5, label="frontier")
    ax.set_xscale("log")
    ax.set(xlabel="training compute (FLOPs)", ylabel="test top-1 (%)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [(name, i) for _, _, name, i in front]
