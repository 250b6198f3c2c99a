"""`vitlab cost`: the paper's cost argument for one model (see vitlab.analysis.cost)."""

from __future__ import annotations

import argparse
import json

from vitlab.analysis.cost import DEFAULT_PATCH_SIZES, cost_report, format_cost_report

DEFAULTS = ",".join(map(str, DEFAULT_PATCH_SIZES))


def parse_size(text: str) -> int | tuple[int, int]:
    """'224' -> 224; '224x320' -> (224, 320)."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 224 or 224x320, got {text!r}"
        ) from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise argparse.ArgumentTypeError(f"expected a size like 224 or 224x320, got {text!r}")


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one patch size")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cost",
        help="per-layer cost by patch size, parameter breakdown, crossover length",
        description="Reproduce the paper's cost argument for MODEL's width and heads: for each "
        "patch size, the patch tokens N, attention MACs (2 N^2 D), linear MACs (4 N D^2 + 2 N D M, "
        "= 12 N D^2 when M = 4D), the attention share, and one layer's attention matrix size in "
        "fp32 bytes (heads x T^2 x 4, T = N + prefix tokens); then the model's parameters counted "
        "from the real module, by part with shares; then the crossover length N = 2D + M (= 6D).",
    )
    p.add_argument("model", help="registered name or alias, e.g. B/16 or vit_base_patch16_384")
    p.add_argument(
        "--img-size",
        type=parse_size,
        default=None,
        metavar="S",
        help="input side (or HxW) instead of the model's own; also changes the parameter count "
        "(position embeddings)",
    )
    p.add_argument(
        "--patch-sizes",
        type=parse_int_list,
        default=None,
        metavar="P,P,...",
        help=f"patch sides for the per-layer table (default: those of {DEFAULTS} that tile the "
        "image, and the model's own)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = cost_report(args.model, img_size=args.img_size, patch_sizes=args.patch_sizes)
    print(json.dumps(report, indent=2) if args.json else format_cost_report(report))
    return 0
