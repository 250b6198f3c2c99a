"""`vitlab fewshot`: the paper's few-shot linear evaluation of frozen features."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.cli.eval import positive_int_list
from vitlab.validation import json_text

SOURCES = (
    "RUN_OR_CKPT: a run folder (its best checkpoint), a checkpoint folder, a .safetensors file, "
    "or any timm / HF / torchvision / .npz source `vitlab convert` reads."
)


def add_feature_options(p: argparse.ArgumentParser) -> None:
    """The options `fewshot` and `probe` share: data, features, extraction and the cache."""
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    p.add_argument("--data", help="dataset name (default: the run's data.name; a checkpoint "
                   "outside a vitlab run needs it)")  # fmt: skip
    p.add_argument("--data-dir", help="where the dataset's files are (default: the run's data.dir)")
    p.add_argument(
        "--features",
        choices=["prelogits", "gap"],
        default="prelogits",
        help="prelogits: what the classifier reads (default, the paper's); gap: mean of the "
        "patch tokens after the final norm (for a class token that had no training signal)",
    )
    p.add_argument("--batch-size", type=int, default=256, help="for extraction (default 256)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where to cache features (default: RUN/features for a vitlab run, else no cache)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fewshot",
        help="few-shot linear evaluation of frozen features (paper §4.1)",
        description="Regularised least squares from the frozen features of k training images "
        "per class to {-1, 1} targets, in closed form (big_vision's fewshot_lsr): per seed, "
        "each class's images drawn with numpy.random.default_rng(seed), features standardised "
        "with the k-shot subset's statistics, a constant 100 appended as bias. Prints the test "
        "top-1 per shot count, mean and std over seeds. " + SOURCES,
    )
    add_feature_options(p)
    p.add_argument(
        "--shots",
        type=positive_int_list,
        default=[1, 5, 10, 25],
        help="images per class (1,5,10,25)",
    )
    p.add_argument("--seeds", type=int, default=3, help="draws per shot count, seeds 0..N-1 (3)")
    p.add_argument("--l2", type=float, default=1024.0, help="ridge penalty λ (default 2^10)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.eval.fewshot import fewshot_checkpoint, format_fewshot

    report = fewshot_checkpoint(
        args.checkpoint,
        data=args.data,
        data_dir=args.data_dir,
        shots=args.shots,
        seeds=args.seeds,
        l2=args.l2,
        features=args.features,
        batch_size=args.batch_size,
        device=args.device,
        cache_dir=args.cache_dir,
        progress=args.quiet <= args.verbose,
    )
    print(json_text(report) if args.json else format_fewshot(report))
    return 0
