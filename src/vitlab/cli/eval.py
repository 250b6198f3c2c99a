"""`vitlab eval`: metrics of a checkpoint on a dataset split."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.validation import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="top-1/top-5, per-class accuracy, loss and confusion matrix of a checkpoint",
        description="Evaluate RUN_OR_CKPT (a run folder: its best checkpoint; a checkpoint folder; "
        "a .safetensors file; or any timm / HF / torchvision / .npz source `vitlab convert` "
        "reads) on a dataset split. Prints top-1, top-5, loss, per-class accuracy "
        "and the confusion matrix, and saves the confusion matrix as a PNG. For a distilled "
        "model (DeiT), whose top-1 is its two heads' average, also each head's top-1 alone "
        "(top1_cls, top1_dist; by the eager float32 torch backend only: not with --int8, "
        "--backend onnxruntime, --tta or --batch-threads).",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    p.add_argument("--data", help="dataset name (default: the run's data.name, else digits)")
    p.add_argument("--data-dir", help="where the dataset's files are (default: the run's data.dir)")
    p.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="test split (default), or the run's validation split carved from train",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=256,
        help="images a forward pass (default 256; with --int8 the activations are quantised per "
        "batch, so scores move slightly with it)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--out",
        type=Path,
        help="where to save confusion_matrix_SPLIT.png (confusion_matrix_DATA_SPLIT.png with "
        "--data naming another dataset than the run's, or for a checkpoint outside a run; "
        "_last after SPLIT for "
        "RUN/checkpoints/last when the run has a best one; default: the run folder, else the "
        "current one)",
    )
    add_backend_arguments(p)
    p.add_argument(
        "--batch-threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="cut each batch into N parts, each run on its own thread with 1/N of PyTorch's CPU "
        "threads (--backend torch on the CPU; default 1: with vitlab's CPU kernels on the float32 "
        "path mostly slower, so time it first; int8 quantises each part's activations on their "
        "own). A distilled model's per-head top-1 is not reported with it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.eval.run import evaluate_checkpoint

    report = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        data_dir=args.data_dir,
        split=args.split,
        batch_size=args.batch_size,
        device=args.device,
        out=args.out,
        backend=args.backend,
        int8=args.int8,
        tta=args.tta,
        batch_threads=args.batch_threads,
    )
    if args.json:
        print(json_text(report))
    else:
        from vitlab.eval.run import format_report

        print(format_report(report))
    return 0


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """'1,5,10' -> [1, 5, 10]: comma-separated whole numbers >= 1, each once (an empty entry or a
    repeat, which would add nothing or give one row twice, is refused as a slip)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1 like 1,5,10, got {text!r}"
        )
    twice = sorted({str(v) for v in values if values.count(v) > 1}, key=int)
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}: each once")
    return values


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend, --int8 and --tta, as `vitlab eval` and `vitlab predict` take them."""
    p.add_argument(
        "--backend",
        choices=["torch", "onnxruntime"],
        default="torch",
        help="torch: eager PyTorch (default); onnxruntime: the model exported to ONNX (checked "
        "against PyTorch as vitlab export checks it) and run by an onnxruntime CPU session "
        "(needs pip install 'vitlab[export]')",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="int8 dynamic quantisation of the linear layers' weights (torch: torch.ao "
        "quantize_dynamic; onnxruntime: its quantize_dynamic of the exported MatMul/Gemm "
        "weights; activations quantised per batch); CPU only, not for CNNs",
    )
    p.add_argument(
        "--tta",
        choices=["none", "flip", "flip-shift"],
        default="none",
        help="test-time augmentation; flip: average each image's class probabilities with its "
        "left-right mirror image's (twice the compute; for models trained with data.hflip); "
        "flip-shift: also with both shifted by one pixel up, down, left and right, black pixels "
        "moved in (10 views, 10x the compute; for models trained with data.hflip and "
        "data.crop_padding). A distilled model's per-head top-1 is not reported with either",
    )
