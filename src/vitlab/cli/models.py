"""`vitlab models`: list the registered models with their shape and size."""

from __future__ import annotations

import argparse
import sys

import torch

from vitlab.models.registry import (
    aliases_of,
    build_model,
    describe,
    family_of,
    get_config,
    list_models,
)
from vitlab.validation import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list registered models",
        description="List the registered models: name, aliases, input size, patch size, width, "
        "depth, heads, MLP width and parameter count (counted on the meta device, no memory). "
        "Swin rows give the first stage's width, the blocks and heads per stage (e.g. 2-2-6-2) "
        "and the MLP ratio. CNN rows (torchvision ResNets, BiT's resnetv2_50) give the stem's "
        "stride as the patch (1: the small stem, a 3x3 stride-1 conv and no max-pool; 4: the "
        "standard one), the "
        "first stage's width, the residual blocks per stage and their kind (basic or "
        "bottleneck).",
    )
    p.add_argument(
        "pattern",
        nargs="?",
        help="glob filter on names and aliases, e.g. 'vit_base*', 'swin*', 'B/*'",
    )
    p.add_argument(
        "--family", choices=["vit", "swin", "cnn"], help="only this model family (default: all)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per model (a list)")
    p.set_defaults(run=run)


def model_rows(pattern: str | None, family: str | None = None) -> list[dict]:
    rows = []
    for name in list_models(pattern, family=family):
        cfg = get_config(name)
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(cfg).parameters())
        row = {
            "name": name,
            "family": family_of(cfg),
            "aliases": aliases_of(name),
            "img_size": list(cfg.img_hw),
            "patch_size": getattr(cfg, "patch_size", None),  # None: a CNN
            "in_chans": cfg.in_chans,
            "num_classes": cfg.num_classes,
            "embed_dim": getattr(cfg, "embed_dim", None),
        }
        if row["family"] == "cnn":
            row.update(arch=cfg.arch, depths=list(cfg.depths), widths=list(cfg.stage_dims))
            row.update(embed_dim=cfg.stage_dims[0], small_stem=cfg.uses_small_stem)
            row.update(stem_stride=cfg.stem_stride, bottleneck=cfg.bottleneck)
        elif row["family"] == "swin":
            row.update(depths=list(cfg.depths), num_heads=list(cfg.num_heads))
            row.update(window_size=cfg.window_size, mlp_ratio=cfg.mlp_ratio)
        else:
            row.update(depth=cfg.depth, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim)
        rows.append({**row, "params": params, "description": describe(name)})
    return rows


def _cells(r: dict) -> list[str]:
    """depth, heads, MLP: one number each for a ViT, per stage for a Swin; a CNN's blocks per
    stage and their kind."""
    if r["family"] == "cnn":
        return ["-".join(map(str, r["depths"])), "-", "bottleneck" if r["bottleneck"] else "basic"]
    if r["family"] == "swin":
        return ["-".join(map(str, r["depths"])), "-".join(map(str, r["num_heads"])),
                f"{r['mlp_ratio']:g}x"]  # fmt: skip
    return [str(r["depth"]), str(r["num_heads"]), str(r["mlp_dim"])]


def run(args: argparse.Namespace) -> int:
    rows = model_rows(args.pattern, args.family)
    if args.json:  # no match: [] and exit code 1, as the table's "no model matches"
        print(json_text(rows))
        return 0 if rows else 1
    if not rows:  # said on stderr, exit 1 (as grep: nothing found, no error)
        family = f" in family {args.family!r}" if args.family else ""
        print(f"vitlab models: no model matches {args.pattern!r}{family}", file=sys.stderr)
        return 1
    header = ["name", "alias", "input", "patch", "D", "L", "heads", "MLP", "params"]
    table = [
        [
            r["name"],
            ",".join(r["aliases"]) or "-",
            f"{r['img_size'][0]}x{r['img_size'][1]}x{r['in_chans']}",
            str(r["patch_size"] or r["stem_stride"]),
            str(r["embed_dim"]),
            *_cells(r),
            f"{r['params']:,}",
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *table)]
    for i, row in enumerate([header, *table]):
        print(
            "  ".join(
                c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0
