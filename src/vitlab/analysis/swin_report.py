"""`vitlab analyze` for a Swin Transformer: mean attention distance per block and head within the
windows, the centre query's attention of every window in the first and last stage, the patch
embedding filters; analysis.json and index.html as for a ViT (vitlab.analysis.report). What has no
Swin counterpart (position-embedding similarity, attention rollout) is a note on the page."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vitlab.analysis.attention import embedding_filters
from vitlab.analysis.page import Images, Report, out_folder, plot_filters, pyplot, write_index
from vitlab.analysis.windows import (
    block_stride,
    swin_attention_statistics,
    swin_blocks,
    uniform_distance,
    window_token_centres,
)
from vitlab.models.swin import SwinTransformer
from vitlab.models.swin_layers import SwinBlock
from vitlab.validation import json_text

NOT_APPLICABLE = [
    "position-embedding similarity does not apply: Swin has no absolute position embeddings "
    "(each block adds a learned bias per relative offset within a window)",
    "attention rollout does not apply: each block attends only within its windows, which shift "
    "between blocks and merge between stages, so there is no image-wide token-to-token attention "
    "to multiply through the layers; the window maps show the attention itself",
]
DISTANCE_NOTE = (
    "mean attention distance: per head, the pixel distance between query and key token centres "
    "within a window, weighted by attention, averaged over queries, windows and images; stage i's "
    "tokens are P 2^i pixels apart. In shifted blocks the distance is between the tokens' places "
    "in the image (the roll undone); keys the shift mask separates get ~zero weight. Padding "
    "tokens are left out (keys' weights re-normalised)."
)


def map_blocks(model: SwinTransformer) -> list[tuple[int, int]]:
    """(stage, block) of the first and last block of the first and last stage, in order."""
    last = len(model.layers) - 1
    keys = [(s, j) for s in (0, last) for j in (0, len(model.layers[s].blocks) - 1)]
    return sorted(set(keys))


def plot_swin_distances(
    model: SwinTransformer, distances: list[Tensor], uniform: list[float], path: Path
) -> None:
    """One dot per head and block, coloured by stage, hollow for shifted blocks; a grey dash marks
    each block's value for uniform attention over what a query may see."""
    plt = pyplot()
    blocks = swin_blocks(model)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(blocks) + 2), 4.5))
    colours = plt.get_cmap("tab10")
    for k, ((stage, _, block), dist) in enumerate(zip(blocks, distances)):
        x = torch.full((len(dist),), k + 1.0)
        face = "none" if any(block.shift) else colours(stage)
        label = None
        if k == 0 or blocks[k - 1][0] != stage:
            m = "x".join(map(str, block.window))
            label = f"stage {stage}: {block_stride(model, stage)} px tokens, window {m}"
        ax.scatter(x, dist, s=20, facecolors=face, edgecolors=colours(stage), label=label)
        ax.hlines(uniform[k], k + 0.7, k + 1.3, colors="grey", lw=1.5)
        if label and k:
            ax.axvline(k + 0.5, color="grey", lw=0.5, ls=":")
    ax.hlines([], 0, 0, colors="grey", label="uniform attention")
    ax.scatter([], [], s=20, facecolors="none", edgecolors="k", label="shifted windows")
    ax.set(
        xlabel="network depth (block)",
        ylabel="mean attention distance (pixels)",
        title="mean attention distance within windows",
    )
    ax.set_xticks(range(1, len(blocks) + 1))
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the dots
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _window_lines(length: int, window: int, shift: int, stride: int) -> list[float]:
    """Pixel positions of the window borders along one axis of the image (the roll undone)."""
    starts = {(k * window + shift) % length for k in range(-(-length // window))}
    return [s * stride for s in sorted(starts) if s]


def plot_window_maps(
    model: SwinTransformer,
    image: Tensor,
    maps: dict[tuple[int, int], Tensor],
    path: Path,
    name: str,
) -> None:
    """The input, then per block the centre query's attention of every window over that window
    (heads averaged), on the image, with the window borders and the centre queries marked."""
    plt = pyplot()
    blocks = {(s, j): b for s, j, b in swin_blocks(model)}
    img = image.float() / 255
    shown = img[0].numpy() if img.shape[0] == 1 else img[:3].permute(1, 2, 0).numpy()
    h_img, w_img = image.shape[-2:]
    fig, axes = plt.subplots(1, len(maps) + 1, figsize=(2.6 * (len(maps) + 1), 3.0))
    extent = (0, w_img, h_img, 0)  # pixel edges, as the heat maps, window lines and queries
    axes[0].imshow(shown, cmap="gray", extent=extent)
    axes[0].set_title("input", fontsize=8)
    for ax, (key, heat) in zip(axes[1:], maps.items()):
        block: SwinBlock = blocks[key]
        stride = block_stride(model, key[0])
        (h, w), (mh, mw), (sh, sw) = block.grid, block.window, block.shift
        ax.imshow(shown, cmap="gray", extent=extent)
        ax.imshow(heat.numpy(), cmap="inferno", alpha=0.6, extent=(0, w * stride, h * stride, 0))
        for y in _window_lines(h, mh, sh, stride):
            ax.axhline(y, color="cyan", lw=0.6)
        for x in _window_lines(w, mw, sw, stride):
            ax.axvline(x, color="cyan", lw=0.6)
        centres, real = window_token_centres(block.grid, block.window, block.shift, stride)
        slot = (mh // 2) * mw + mw // 2
        queries = centres[real[:, slot], slot]  # (windows, 2): y, x
        ax.scatter(queries[:, 1], queries[:, 0], s=6, c="lime", marker="+", lw=0.8)
        ax.set_xlim(0, w_img)
        ax.set_ylim(h_img, 0)
        kind = f"shifted {sh}x{sw}" if sh or sw else "plain"
        ax.set_title(f"stage {key[0]} block {key[1]} ({kind})", fontsize=8)
    for ax in axes:
        ax.axis("off")
    fig.suptitle(f"{name}: centre query's attention in each window (+), heads averaged", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _listed(heat: Tensor) -> list[list[float | None]]:
    """A map as nested lists for JSON, None where it is NaN (windows centred on padding)."""
    return [[None if v != v else v for v in row] for row in heat.tolist()]


def analyze_swin(model: SwinTransformer, images: Images, out: Path, title: str) -> Path:
    """Write the Swin figures, analysis.json and index.html into `out`; returns index.html's
    path. The model runs in eval mode and is left in its own."""
    cfg = model.config
    out_folder(out)
    chosen = map_blocks(model)
    distances, maps = swin_attention_statistics(model, images.inputs, chosen)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, notes=[*NOT_APPLICABLE, DISTANCE_NOTE])
    blocks = swin_blocks(model)
    uniform = [uniform_distance(b, block_stride(model, s)) for s, _, b in blocks]
    plot_swin_distances(model, distances, uniform, out / "mean_attention_distance.png")
    report.files.append(
        (
            "mean_attention_distance.png",
            f"Mean attention distance within windows: one dot per head and block (hollow: shifted "
            f"windows), over {len(images.names)} images, in input pixels; grey dashes: uniform "
            f"attention over what each query may see.",
        )
    )
    filters = embedding_filters(model, k=28)
    plot_filters(filters, out / "embedding_filters.png")
    report.files.append(
        (
            "embedding_filters.png",
            f"Patch embedding filters: the top {len(filters)} principal components of the "
            f"{cfg.patch_size}x{cfg.patch_size} patch projection.",
        )
    )
    for i, name in enumerate(images.names):
        file = f"window_attention_{i:03d}.png"
        heats = {k: maps[k][i] for k in chosen}
        plot_window_maps(model, images.display[i], heats, out / file, name)
        report.files.append(
            (
                file,
                f"Window attention for {name}: in the first and last block of the first and last "
                f"stage, each window's centre query (+) and its attention over the window (mean "
                f"of the heads); cyan lines are the window borders in the image; windows "
                f"centred on padding are left uncoloured.",
            )
        )
    result = {
        "family": "swin",
        "image_size": list(cfg.img_hw),
        "patch_size": cfg.patch_size,
        "window_size": list(cfg.window_hw),
        "num_images": len(images.names),
        "blocks": [
            {
                "stage": s,
                "block": j,
                "grid": list(b.grid),
                "window": list(b.window),
                "shift": list(b.shift),
                "stride": block_stride(model, s),
                "heads": b.attn.num_heads,
                "uniform_distance": uniform[k],
            }
            for k, (s, j, b) in enumerate(blocks)
        ],
        "mean_attention_distance": [d.tolist() for d in distances],  # per block, per head, pixels
        "window_maps": {
            f"stage{s}_block{j}": {n: _listed(maps[(s, j)][i]) for i, n in enumerate(images.names)}
            for s, j in chosen
        },
        "files": [f for f, _ in report.files],
        "notes": report.notes,
    }
    (out / "analysis.json").write_text(json_text(result, indent=1) + "\n")
    depths = ", ".join(map(str, cfg.depths))
    summary = (
        f"Swin Transformer: {cfg.num_stages} stages of depths ({depths}), window "
        f"{cfg.window_hw[0]}x{cfg.window_hw[1]}, width {cfg.embed_dim}, {len(images.names)} images."
    )
    return write_index(report, title, summary)
