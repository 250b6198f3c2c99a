"""`vitlab export`: ONNX and torch.export programs of a checkpoint, checked against PyTorch."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX (checked with onnxruntime) or a torch.export program",
        description="Export RUN_OR_CKPT (any checkpoint vitlab reads) for deployment. The ONNX "
        "model takes `images` (B, C, H, W) float32, normalised as the checkpoint's preprocessing "
        "says (stored in the file's metadata), and returns `logits` (`features`, the pooled "
        "features, for a model without a classifier, num_classes=0); onnxruntime's output is "
        "compared with PyTorch's (each image's max abs diff <= 1e-4 of its largest |logit|, 1e-4 "
        "below 1) "
        "before the command succeeds; a model of 1.8 GB or more keeps its weights in a file "
        "beside OUT that OUT names (OUT.<8 hex digits>.data). "
        "--torch-export writes a program for torch.export.load(OUT).module(). H and W are the "
        "checkpoint's, fixed in both (a CNN's too); only the batch can be dynamic: for another "
        "size, `vitlab convert RUN_OR_CKPT DST.safetensors img_size=S` (a Swin: window_size= "
        "too), then export DST. An existing OUT is replaced (written whole, then renamed).",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    p.add_argument("--onnx", type=Path, metavar="OUT.onnx", help="write an ONNX model")
    p.add_argument(
        "--torch-export", type=Path, metavar="OUT.pt2", help="write a torch.export program"
    )
    p.add_argument(
        "--dynamic-batch", action="store_true", help="any batch size (default: fixed at 2)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.models.checkpoint import load_checkpoint
    from vitlab.models.export import check_out, export_onnx, export_program

    if not args.onnx and not args.torch_export:
        raise ValueError("nothing to do: give --onnx OUT.onnx and/or --torch-export OUT.pt2")
    for out, suffix, option in ((args.onnx, ".onnx", "--onnx"),
                                (args.torch_export, ".pt2", "--torch-export")):  # fmt: skip
        if out:  # both, before either is written (one file for both: a suffix is wrong)
            check_out(Path(out), suffix, option)
    model, meta = load_checkpoint(args.checkpoint)
    if args.onnx:
        r = export_onnx(model, meta, args.onnx, args.dynamic_batch)
        beside = f" and its weights {r['data']} (keep the two together)" if "data" in r else ""
        print(
            f"wrote {args.onnx}{beside}: onnxruntime matches PyTorch (max abs diff "
            f"{r['max_abs_diff']:.2e} at batch {', '.join(map(str, r['batches_checked']))})"
        )
    if args.torch_export:
        r = export_program(model, meta, args.torch_export, args.dynamic_batch)
        print(
            f"wrote {args.torch_export}: reloaded program matches (max abs diff "
            f"{r['max_abs_diff']:.2e} at batch {', '.join(map(str, r['batches_checked']))})"
        )
    return 0
