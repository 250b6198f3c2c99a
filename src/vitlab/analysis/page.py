"""Pieces every analysis page shares: the images analysed, the page's list of figures and notes,
the output folder's check, index.html, matplotlib without a display, and the patch-embedding
filter figure."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from vitlab.runtime import folder_refusal

# the figures an analysis page may show: one of an earlier analysis into the same folder that this
# page does not show (more images then, a Swin's windows, a similarity skipped now) is removed
FIGURES = re.compile(
    r"(mean_attention_distance|pos_embed_similarity|embedding_filters"
    r"|(rollout|window_attention)_\d{3,})\.png"
)


@dataclass
class Images:
    names: list[str]
    display: Tensor  # (B, C, H, W) uint8 at the model's size, for overlays
    inputs: Tensor  # (B, C, H, W) normalised model input


@dataclass
class Report:
    out: Path
    files: list[tuple[str, str]] = field(default_factory=list)  # (file, caption)
    notes: list[str] = field(default_factory=list)


def out_folder(out: Path) -> Path:
    """`out` as a folder the figures can go into (existing, or made later); a ValueError saying
    what came when it, or a folder above it, is a file."""
    out = Path(out)
    if refusal := folder_refusal(out, "the figures"):
        raise ValueError(refusal)
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_filters(filters: Tensor, path: Path) -> None:
    plt = pyplot()
    k, c = filters.shape[:2]
    cols = min(7, k)
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.1, rows * 1.1 + 0.4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= k:
            continue
        f = filters[i]
        f = (f - f.min()) / (f.max() - f.min()).clamp(min=1e-12)
        ax.imshow(f[0].numpy() if c == 1 else f[:3].permute(1, 2, 0).numpy(), cmap="gray")
    fig.suptitle("embedding filters (first principal components)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_index(report: Report, title: str, summary: str) -> Path:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "figure{display:inline-block;margin:1em;vertical-align:top}"
        "img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.9em;color:#333;"
        "max-width:520px}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(summary)}</p>",
    ]
    if report.notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>")
    for file, caption in report.files:
        parts.append(
            f'<figure><img src="{html.escape(file)}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    parts.append('<p><a href="analysis.json">analysis.json</a>: the raw numbers.</p>')
    shown = {file for file, _ in report.files}
    for old in report.out.iterdir():
        if FIGURES.fullmatch(old.name) and old.name not in shown and old.is_file():
            old.unlink()  # an earlier analysis's, which this page would not show
    # lets a headless browser (and a curious reader) see that every image really decoded
    parts.append(
        "<script>window.addEventListener('load',()=>{const a=[...document.images];"
        "const ok=a.filter(i=>i.complete&&i.naturalWidth>0).length;"
        "document.body.dataset.imagesLoaded=ok+'/'+a.length;});</script></body></html>"
    )
    path = report.out / "index.html"
    path.write_text("\n".join(parts) + "\n")
    return path
