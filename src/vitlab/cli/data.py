"""`vitlab data shard SRC DST`: write a dataset as WebDataset shards (vitlab.data.writer)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare datasets: write WebDataset shards",
        description="Dataset tools. `vitlab data shard SRC DST` writes dataset SRC (any name "
        "data.name takes: imagefolder:PATH, cifar10, fashion-mnist, hf:NAME, wds:SHARDS, ...) as "
        "WebDataset shards DST/train-NNNNNN.tar and DST/test-NNNNNN.tar (KEY.jpg/png/webp + "
        "KEY.cls, in a seeded random order) with DST/index.json (class names, channels, the "
        "normalisation statistics training uses (the dataset's published ones; ImageNet's for "
        "image folders and hf: sources: not measured), each shard's sample count); train from "
        "them with data.name=wds:DST.",
    )
    commands = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    shard = commands.add_parser(
        "shard",
        help="write a dataset as WebDataset shards with a JSON index",
        description="Write dataset SRC's train and test splits as WebDataset shards under "
        "DST (a folder holding no shards yet), with a progress bar. Every image is decoded once"
        " on the way (by --workers processes; wds: sources in this one); one that does not "
        "decode is skipped, named in a warning (-q hides it) and counted in the index (a split "
        "none of whose images decodes is an error). Image files keep their bytes; in-memory "
        "datasets (CIFAR, Fashion-MNIST, digits) and formats other than JPEG / PNG / "
        "WebP are stored as PNG. Shards are written under temporary names and renamed when "
        "whole, index.json last; a failure or Ctrl-C removes what the run wrote.",
        epilog="Example: vitlab data shard imagefolder:/data/imagenet /data/in1k-shards "
        "--shard-size 1GB, then torchrun --nproc_per_node=8 -m vitlab train "
        "data.name=wds:/data/in1k-shards ...",
    )
    shard.add_argument("src", help="dataset name, as data.name takes it")
    shard.add_argument("dst", type=Path, help="output folder")
    shard.add_argument(
        "--shard-size",
        default="1GB",
        help="a shard's file size: the next starts once "
        "a shard reaches it, tar headers included (default 1GB)",
    )
    shard.add_argument("--data-dir", help="where SRC's files are (as data.dir)")
    shard.add_argument(
        "--image-key", help="hf: the image column; wds: the image extension (default: found)"
    )
    shard.add_argument(
        "--label-key", help="hf: the label column; wds: the label extension (default: found)"
    )
    shard.add_argument(
        "--seed", type=int, default=0, help="sample order (and a carved test split; default 0)"
    )
    shard.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that read and check the images (default: one per core, at most 8)",
    )
    shard.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.data.download import DatasetError
    from vitlab.data.writer import parse_size, write_shards

    if (args.image_key or args.label_key) and not args.src.startswith(("hf:", "wds:")):
        raise ValueError(f"--image-key / --label-key name an hf: dataset's columns or wds: "
                         f"shards' extensions; {args.src} is neither")  # fmt: skip
    bar = not args.no_progress and args.quiet <= args.verbose  # -q hides it too
    try:
        index = write_shards(
            args.src, args.dst, parse_size(args.shard_size), args.data_dir,
            (args.image_key, args.label_key), args.seed, bar, args.workers,
        )  # fmt: skip
    except DatasetError as e:
        raise ValueError(str(e)) from None
    for name, split in index["splits"].items():
        skipped = f" ({split['skipped']:,} undecodable skipped)" if split["skipped"] else ""
        shards, count = len(split["shards"]), split["count"]
        print(f"{name}: {count:,} sample{'s' * (count != 1)} in {shards} shard"
              f"{'s' * (shards != 1)}{skipped}")  # fmt: skip
    print(args.dst / "index.json")
    return 0
