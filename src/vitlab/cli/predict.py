"""`vitlab predict`: top classes for image files."""

from __future__ import annotations

import argparse
import sys

from vitlab.cli.eval import add_backend_arguments, positive_int
from vitlab.validation import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="top classes with probabilities for image files",
        description="Classify image files (any format PIL reads, any size or mode) with "
        "RUN_OR_CKPT (a vitlab run or checkpoint, or any source `vitlab convert` reads); each "
        "image is converted, resized, centre-cropped and normalised as the checkpoint's "
        "preprocessing says.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument(
        "--topk", type=positive_int, default=5, help="classes to show per image (default 5)"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="images a forward pass (default 32; 1 with --int8, whose activations are quantised "
        "per batch, so that each image's scores are its own)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_backend_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per image")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.eval.run import predict_files

    results = predict_files(
        args.checkpoint,
        args.images,
        topk=args.topk,
        device=args.device,
        backend=args.backend,
        int8=args.int8,
        tta=args.tta,
        batch_size=args.batch_size,
    )
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"vitlab predict: error: {r['error']}", file=sys.stderr)
    if failed and len(failed) < len(results):  # "error:" alone reads as if the command stopped
        kept = len(results) - len(failed)
        print(f"vitlab predict: {len(failed)} of {len(results)} images skipped; the other "
              f"{kept} {'is' if kept == 1 else 'are'} classified", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json_text(results))
    else:
        for r in results:
            if "top" in r:
                print(r["image"])
                for p in r["top"]:
                    print(f"  {100 * p['probability']:6.2f}%  {p['class']}")
    return 2 if failed else 0
