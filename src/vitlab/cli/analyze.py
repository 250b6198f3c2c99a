"""`vitlab analyze`: attention distance, rollout, position similarity, filters of a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.cli.eval import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="the paper's Fig. 6-7 analyses of a checkpoint, as images and an HTML page",
        description="Writes into --out: mean_attention_distance.png (per layer and head), "
        "pos_embed_similarity.png, embedding_filters.png, rollout_NNN.png (attention rollout "
        "overlays per image), analysis.json (the raw numbers) and index.html (all of it, opens "
        "from disk). Attention is held one layer at a time. For a Swin: mean attention distance "
        "within windows per block and head, window_attention_NNN.png (each window's centre query "
        "in the first and last block of the first and last stage) and embedding_filters.png; "
        "position similarity and rollout do not apply and are noted on the page.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CKPT")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--data",
        help="dataset whose first test images to use (default: the run's test split, as vitlab "
        "eval reads it; digits for a checkpoint that is not a vitlab run): in-memory datasets "
        "(grey images repeated to RGB for an RGB model, RGB made grey for a grey one), "
        "imagefolder:PATH and hf:NAME; not wds: shards, which cannot be indexed",
    )
    src.add_argument("--images", nargs="+", metavar="FILE", help="image files to analyse")
    p.add_argument("--data-dir", help="where the dataset's files are")
    p.add_argument(
        "--num-images",
        type=positive_int,
        metavar="N",
        help="the dataset's first N test images (default 8; not with --images: every file is used)",
    )
    p.add_argument(
        "--head-fusion",
        choices=["mean", "max", "min"],
        default=None,
        help="how rollout fuses the heads of each layer (default mean; ViTs only: a Swin has no "
        "rollout)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the model's forward passes run: auto | cpu | cuda | cuda:N (the figures are "
        "made on the CPU)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for the figures and index.html (made if missing; not a file)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.analysis.page import out_folder
    from vitlab.analysis.report import analyze, load_images
    from vitlab.eval.run import run_config_of
    from vitlab.formats.vitlab import vitlab_weights
    from vitlab.models.checkpoint import load_checkpoint
    from vitlab.models.vit import VisionTransformer
    from vitlab.runtime import pick_device

    if args.images and args.num_images is not None:
        raise ValueError("--num-images counts a dataset's test images; with --images every file "
                         "given is analysed (drop --num-images)")  # fmt: skip
    out_folder(args.out)  # before the checkpoint is loaded
    num_images = 8 if args.num_images is None else args.num_images
    model, meta = load_checkpoint(args.checkpoint, device=pick_device(args.device, "--device"))
    weights = vitlab_weights(args.checkpoint)  # a vitlab run's folder holds the data config
    run_cfg = run_config_of(weights) if weights else None
    pre = meta.preprocessing
    if args.head_fusion and not isinstance(model, VisionTransformer):  # a Swin's has no rollout
        raise ValueError(f"--head-fusion fuses a ViT's rollout; {type(model).__name__} has none")
    images = load_images(
        pre, args.images, args.data, args.data_dir, num_images, run_cfg, meta.classes
    )
    title = f"vitlab analyze: {weights or args.checkpoint}"
    index = analyze(model, pre, images, args.out, title, args.head_fusion or "mean")
    print(index)
    return 0
