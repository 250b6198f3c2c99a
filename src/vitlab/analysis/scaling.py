"""Attention cost against image side for two models (`vitlab cost MODEL --scaling`): Swin's window
attention grows with the number of tokens, a ViT's global attention with its square.

Per forward pass, attention products (QK^T and AV) only, at side S:
    ViT:   depth x 2 N^2 D,           N = (S / P)^2 patch tokens (prefix tokens left out)
    Swin:  sum over blocks 2 Np M^2 C  (vitlab.analysis.swin_cost; Np: the stage's map padded to
           whole windows, so a little above the line where the window does not tile the map)
Each model keeps its window and widths; only img_size changes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from vitlab.analysis.cost import layer_cost
from vitlab.analysis.page import pyplot
from vitlab.analysis.swin_cost import swin_attention_macs
from vitlab.analysis.tables import human, table
from vitlab.models.registry import ModelConfig, aliases_of, family_of, named_config, resolve_name
from vitlab.models.swin import SwinConfig
from vitlab.runtime import blocking_file

DEFAULT_SIDES = (224, 384, 512, 768, 1024, 1536)
DEFAULT_PLOT = "attention_scaling.png"


def attention_macs(cfg: ModelConfig) -> int:
    """Attention products of one forward pass of a ViT or a Swin (formulas above)."""
    if isinstance(cfg, SwinConfig):
        return swin_attention_macs(cfg)
    return cfg.depth * layer_cost(cfg, cfg.patch_size).attention_macs


def first_tokens(cfg: ModelConfig) -> int:
    """Tokens of the first map: a ViT's patch tokens, a Swin's first stage."""
    h, w = cfg.grid
    return h * w


def short_name(name: str) -> str:
    """An alias (Swin-T, B/16) where the model has one, else the registered name."""
    aliases = aliases_of(resolve_name(name))
    return aliases[0] if aliases else resolve_name(name)


def attention_scaling(
    model: str | ModelConfig,
    vs: str | ModelConfig,
    sides: Sequence[int] = DEFAULT_SIDES,
    labels: Sequence[str | None] = (None, None),
) -> dict:
    """Attention MACs of `model` and `vs` (registered names or configs, each under its label where
    given) at each square image side, with the ratio vs / model and each one's growth over the
    first side. JSON-ready."""
    if not sides:
        raise ValueError("expected at least one image side")
    named = [named_config(m, label) for m, label in zip((model, vs), labels, strict=True)]
    for name, cfg in named:
        if family_of(cfg) == "cnn":
            raise ValueError(f"{name} is a CNN, which has no attention: --scaling compares ViTs "
                             "and Swins")  # fmt: skip
    names = [
        short_name(m) if isinstance(m, str) and not label else n
        for m, label, (n, _) in zip((model, vs), labels, named)
    ]
    rows = []
    for side in sides:
        cfgs = [cfg.replace(img_size=side) for _, cfg in named]
        macs = [attention_macs(c) for c in cfgs]
        rows.append(
            {
                "side": side,
                "tokens": [first_tokens(c) for c in cfgs],
                "attention_macs": macs,
                "ratio": macs[1] / macs[0],
            }
        )
    first = rows[0]["attention_macs"]
    for row in rows:
        row["growth"] = [m / f for m, f in zip(row["attention_macs"], first)]
    registered = [resolve_name(m) if isinstance(m, str) else None for m in (model, vs)]
    return {"models": names, "registered": registered, "rows": rows}  # None: a config


def format_scaling(result: dict) -> str:
    """The table as text, and a line on what it shows."""
    a, b = result["models"]
    header = ["side", f"{a} tokens", f"{a} attention", "growth", f"{b} tokens", f"{b} attention"]
    header += ["growth", f"{b} / {a}"]
    rows = [
        [
            str(r["side"]),
            f"{r['tokens'][0]:,}",
            human(r["attention_macs"][0]),
            f"x{r['growth'][0]:.1f}",
            f"{r['tokens'][1]:,}",
            human(r["attention_macs"][1]),
            f"x{r['growth'][1]:.1f}",
            f"{r['ratio']:.1f}" if r["ratio"] >= 10 else f"{r['ratio']:.3g}",  # 0.0043, not 0.0
        ]
        for r in result["rows"]
    ]
    first, last = result["rows"][0], result["rows"][-1]
    pixels = (last["side"] / first["side"]) ** 2
    return "\n".join(
        [
            f"Attention MACs (QK^T and AV products) per image against the image side: {a} beside "
            f"{b}, each with its own window and widths.",
            *table(header, rows),
            "",
            f"From {first['side']} to {last['side']} pixels the pixel count grows x{pixels:.1f}: "
            f"{a}'s attention x{last['growth'][0]:.1f}, {b}'s x{last['growth'][1]:.1f} "
            f"(linear growth follows the pixels, quadratic their square, x{pixels**2:.0f}).",
        ]
    )


def plot_path(path: Path | str) -> Path:
    """Where plot_scaling writes for `path`: DEFAULT_PLOT inside an existing folder or a path
    ending in a separator (a folder to make), PATH.png for a path without a suffix (as matplotlib
    names it), else `path`; a ValueError saying what came when a folder above it is a file."""
    folder = str(path).endswith(("/", os.sep))  # (pathlib drops the separator)
    path = Path(path)
    if folder or path.is_dir():
        path = path / DEFAULT_PLOT
    elif not path.suffix:
        path = path.with_name(path.name.rstrip(".") + ".png")
    blocked = blocking_file(path.parent)
    if blocked is not None:
        raise ValueError(
            f"cannot write the plot to {path}: {blocked} is a file, not a folder; expected a "
            "plot file name (PATH.png) or a folder"
        )
    return path


def plot_scaling(result: dict, path: Path | str) -> Path:
    """A log-log plot of the table, with dashed guides of slope 2 (tokens) and 4 (tokens squared)
    through each model's first point, written where plot_path(path) says (folders made as
    needed); returns that path."""
    path = plot_path(path)
    plt = pyplot()
    sides = [r["side"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, (name, colour) in enumerate(zip(result["models"], ("tab:blue", "tab:red"))):
        macs = [r["attention_macs"][i] for r in result["rows"]]
        ax.plot(sides, macs, "o-", color=colour, label=f"{name}")
        for slope, style in ((2, ":"), (4, "--")):
            guide = [macs[0] * (s / sides[0]) ** slope for s in sides]
            ax.plot(sides, guide, style, color=colour, alpha=0.35, lw=1)
    ax.plot([], [], "k:", alpha=0.5, label="~ side^2 (linear in tokens)")
    ax.plot([], [], "k--", alpha=0.5, label="~ side^4 (quadratic in tokens)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="image side (pixels)",
        ylabel="attention MACs per image",
        title="attention cost against image size",
    )
    ax.set_xticks(sides, [str(s) for s in sides])
    ax.minorticks_off()
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
