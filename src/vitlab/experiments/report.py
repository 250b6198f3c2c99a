"""An experiment's record: results.json (every arm's numbers, the table, the verdict), report.md
and report.html (claim, the paper's numbers, ours, the rule, the verdict, budget, wall time,
machine, plots). The HTML page opens from disk, in the style of `vitlab analyze`'s."""

from __future__ import annotations

import html
import platform
from pathlib import Path

import torch

from vitlab.experiments.base import Experiment, Summary
from vitlab.experiments.verdict import Verdict
from vitlab.formats.base import write_text
from vitlab.runtime import cpu_has_bf16, pick_device
from vitlab.validation import json_text

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict:
    """The CPU's model name and the flags that decide the fast path, bf16, threads, device."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.processor()):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    device = pick_device("auto")
    return {
        "cpu": name or platform.machine(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "bf16_native": cpu_has_bf16(),
        "threads": torch.get_num_threads(),
        "device": str(device)
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),  # fmt: skip
        "torch": torch.__version__,
    }


def _machine_text(m: dict) -> str:
    bf16 = "native bf16 (bf16 autocast)" if m["bf16_native"] else "no native bf16 (float32)"
    return (f"{m['cpu']} ({', '.join(m['cpu_flags']) or 'no AVX2'}), {bf16}, {m['threads']} "
            f"threads, device {m['device']}, torch {m['torch']}")  # fmt: skip


def _verdict_md(v: Verdict, depth: int = 0) -> list[str]:
    pad = "  " * depth
    lines = [f"{pad}- **{v.outcome}**: {v.reason}", f"{pad}  - rule: {v.rule}"]
    for part in v.parts:
        lines += _verdict_md(part, depth + 1)
    return lines


def _table_md(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _reused(rows: list[dict]) -> str:
    """How many of the run folders this experiment trained, and how many it found finished
    (by an earlier invocation, or an earlier experiment of `all`: inside reuses pos-embed's)."""
    folders: dict[str, bool] = {}  # reused unless any of its rows trained it (levels can share)
    for r in rows:
        folders[r["arm"]] = folders.get(r["arm"], True) and r.get("reused", False)
    reused = sum(folders.values())
    if reused == len(folders):
        return "every run folder found finished, trained before this experiment"
    return f"{len(folders) - reused} run folder(s) trained or resumed in it, {reused} reused"


def write_report(
    exp: Experiment, summary: Summary, rows: list[dict], folder: Path, run: dict
) -> dict[str, Path]:
    """Write results.json, report.md and report.html into `folder`; `run` holds the budget, data,
    seeds, wall time and machine. Returns the three paths."""
    v = summary.verdict
    record = {
        "experiment": exp.name,
        "title": exp.title,
        "claim": exp.claim,
        "source": exp.source,
        "paper": dict(exp.paper),
        "metric": exp.metric,
        "verdict": v.to_dict(),
        "table": {"header": summary.header, "rows": summary.rows},
        "arms": rows,
        "notes": summary.notes,
        "plots": [f for f, _ in summary.plots],
        **summary.numbers,
        **run,
    }
    write_text(folder / "results.json", json_text(record, default=str) + "\n")
    seconds = sum({r["arm"]: r.get("train_seconds") or 0.0 for r in rows}.values())
    facts = [
        f"Budget `{run['budget']}` on `{run['data']}`, {run['seeds']} seed(s) per arm, "
        f"{len(rows)} arm(s) in {len({r['arm'] for r in rows})} run folder(s). Wall time of this "
        f"experiment: {run['wall_seconds']:.0f} s ({_reused(rows)}); "
        f"training time of the arms (summed over the invocations that trained them): "
        f"{seconds:.0f} s.",
        summary.measured
        or f"Every arm trains a fixed number of optimizer steps (train.max_steps; see the table "
        f"or results.json) and is measured at its last checkpoint on {run['test_images']:,} test "
        f"images (a share of every class drawn by the seed, or all of them); 5-shot accuracy: "
        f"the paper's linear few-shot protocol on the pre-logits features, "
        f"{_draws(run['fewshot_seeds'])} of the 5 images per class. Each seed also draws its own "
        f"training subsets (data.split_seed = the seed). Each run folder's own results.json "
        f"holds its best checkpoint's test score (the one of lowest training loss), not the "
        f"last checkpoint's reported here (kept in its reproduce.json).",
        f"Machine: {_machine_text(run['machine'])}.",
    ]
    md = [
        f"# {exp.title}: {v.outcome}",
        "",
        f"**Claim** ({exp.source}): {exp.claim}",
        "",
        "**The paper's numbers:**",
        "",
        *_table_md(["what", "paper"], [list(p) for p in exp.paper]),
        "",
        f"**Ours** ({exp.metric} is what the verdict compares; mean ± seed spread, the sample "
        f"standard deviation over seeds):",
        "",
        *_table_md(summary.header, summary.rows),
        "",
        f"**Verdict: {v.outcome}**",
        "",
        *_verdict_md(v),
        "",
        *[f"- {n}" for n in summary.notes],
        "",
        *facts,
        "",
        *[f"![{cap}]({file})\n\n{cap}\n" for file, cap in summary.plots],
        "Raw numbers: [results.json](results.json). Run folders: "
        + ", ".join(sorted({f"`{r['arm']}`" for r in rows})),
        "",
    ]
    write_text(folder / "report.md", "\n".join(md))
    page = _html(exp, summary, facts)
    write_text(folder / "report.html", page)
    return {n: folder / n for n in ("results.json", "report.md", "report.html")}


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _html_verdict(v: Verdict) -> str:
    e = html.escape
    parts = "".join(f"<li>{_html_verdict(p)}</li>" for p in v.parts)
    return (f'<p><b class="v">{e(v.outcome)}</b>: {e(v.reason)}</p><p class="rule">Rule: '
            f"{e(v.rule)}</p>" + (f"<ul>{parts}</ul>" if parts else ""))  # fmt: skip


def _html(exp: Experiment, summary: Summary, facts: list[str]) -> str:
    e = html.escape
    v = summary.verdict
    parts = [
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(exp.title)}: {e(v.outcome)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em "
        ".6em;text-align:left}figure{display:inline-block;margin:1em;vertical-align:top}"
        "img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.9em;color:#333;"
        "max-width:520px}.rule{color:#333;font-size:.95em}</style></head><body>",
        f"<h1>{e(exp.title)}: {e(v.outcome)}</h1>",
        f"<p><b>Claim</b> ({e(exp.source)}): {e(exp.claim)}</p>",
        "<h2>The paper's numbers</h2>",
        _html_table(["what", "paper"], [list(p) for p in exp.paper]),
        f"<h2>Ours</h2><p>{e(exp.metric)} is what the verdict compares; mean ± seed spread (the "
        f"sample standard deviation over seeds).</p>",
        _html_table(summary.header, summary.rows),
        f"<h2>Verdict: {e(v.outcome)}</h2>",
        _html_verdict(v),
        "<ul>" + "".join(f"<li>{e(n)}</li>" for n in summary.notes) + "</ul>",
        *[f"<p>{e(f.replace('`', ''))}</p>" for f in facts],
        *[
            f'<figure><img src="{e(f)}" alt="{e(c)}"><figcaption>{e(c)}</figcaption></figure>'
            for f, c in summary.plots
        ],  # fmt: skip
        '<p><a href="results.json">results.json</a>: the raw numbers.</p></body></html>',
    ]
    return "\n".join(parts) + "\n"


def _draws(n: int) -> str:
    """'averaged over N draws', or 'one draw'."""
    return "one draw" if n == 1 else f"averaged over {n} draws"
