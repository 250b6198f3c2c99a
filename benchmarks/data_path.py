"""Data path: images/s the training loader delivers (with each preset's augmentation) against
images/s one training step of that preset's model consumes, on the same machine.

    .venv/bin/python benchmarks/data_path.py [--configs configs/fashion-mnist-quick.yaml ...]

The loader target is at least 5x the step's rate, so the data path never holds training back.

    .venv/bin/python benchmarks/data_path.py --photos 3000 [--workers 4] [--batches 40]

Sources against timm instead: N distinct JPEGs at ImageNet-like sizes (crops of scikit-learn's two
sample photographs, rescaled to 300-500 px a side, quality 90) in 10 classes, read as an image
folder, as WebDataset shards and as a Hugging Face parquet file by vitlab, and as the same image
folder by timm.data.create_loader; each delivers 224 px batches after RandomResizedCrop and flip.
One row per source: images/s and images/s per worker (target: vitlab >= 1.5x timm's image folder
per core).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

# benchmarks/ is on sys.path when run as a script
from model_speed import median_seconds, optimizer, step_fns

from vitlab.config import DataConfig, load_run_config
from vitlab.data import BatchAugment, Preprocessing, load_split, make_loader
from vitlab.data.workers import shut_down
from vitlab.models.vit import VisionTransformer
from vitlab.runtime import tune_allocator, use_bf16
from vitlab.train.build import load_data, resolve_model_config

DEFAULT = ["configs/fashion-mnist-quick.yaml", "configs/fashion-mnist.yaml", "configs/digits.yaml"]


def loader_rate(loader, batches: int, epoch: int = 0) -> float:
    it = loader.iterate(epoch)
    next(it)  # warm-up
    n, t = 0, time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
        n += len(x)
    return n / (time.perf_counter() - t)


def step_rate(model, x, y, bf16: bool, steps: int) -> float:
    _, train = step_fns(model, x, y, bf16, optimizer(model, "vitlab", "own"))  # as vitlab train
    return len(x) / median_seconds({"step": train}, steps, warmup=1)["step"]


def write_photos(root: Path, n: int, seed: int = 0) -> Path:
    """n distinct JPEGs cut from scikit-learn's sample photographs, in 10 class folders."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(p) for p in load_sample_images().images]  # 427 x 640 each
    rng = np.random.default_rng(seed)
    for i in range(n):
        photo = photos[i % len(photos)]
        w, h = int(rng.integers(200, 640)), int(rng.integers(160, 427))
        x, y = int(rng.integers(0, 641 - w)), int(rng.integers(0, 428 - h))
        side = int(rng.integers(300, 501))  # the longer side, as ImageNet's typical 500 x 375
        crop = photo.crop((x, y, x + w, y + h))
        crop = crop.resize(
            (side, max(1, side * h // w)) if w >= h else (max(1, side * w // h), side)
        )
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.save(folder / f"{i:06d}.jpg", quality=90)
    return root


def write_parquet(folder: Path, out: Path) -> Path:
    import datasets

    files = sorted(folder.glob("*/*.jpg"))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    table = datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [int(f.parent.name[5:]) for f in files]},
        features=features,
    )
    table = table.cast_column("image", datasets.Image(decode=False))
    table = table.map(lambda r: {"image": {"bytes": Path(r["image"]["path"]).read_bytes(),
                                           "path": None}})  # fmt: skip
    table.to_parquet(str(out))
    return out


def timm_loader(folder: Path, batch: int, workers: int):
    from timm.data import create_dataset, create_loader

    dataset = create_dataset("", root=str(folder), is_training=True)
    return create_loader(
        dataset, input_size=(3, 224, 224), batch_size=batch, is_training=True,
        use_prefetcher=False, num_workers=workers, hflip=0.5, scale=(0.08, 1.0),
        no_aug=False, color_jitter=None, persistent_workers=workers > 0,
    )  # fmt: skip


def timm_rate(loader, batches: int) -> float:
    it = iter(loader)  # a new epoch; the persistent workers carry on
    next(it)
    n, t = 0, time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
        n += len(x)
    return n / (time.perf_counter() - t)


def compare_sources(args: argparse.Namespace) -> None:
    """Every source's loader built first (its workers persistent), then `rounds` rounds in which
    each delivers `batches` batches in turn: the median round per source, so a disturbance of
    the machine hits every source alike."""
    from vitlab.data.writer import write_shards

    with tempfile.TemporaryDirectory() as tmp:
        root = write_photos(Path(tmp) / "photos", args.photos)
        # about 16 training shards (80% of the photos): vitlab deals whole shards to its streams
        # (8 at most, served by the workers), and 16 deals evenly to 1, 2, 4 or 8 of them
        size = args.shard_size or sum(f.stat().st_size for f in root.glob("*/*.jpg")) // 21
        write_shards(f"imagefolder:{root}", Path(tmp) / "shards", size, progress=False)
        parquet = write_parquet(root, Path(tmp) / "photos.parquet")
        sources = {
            "vitlab imagefolder": f"imagefolder:{root}",
            "vitlab wds": f"wds:{Path(tmp) / 'shards'}",
            "vitlab hf": f"hf:{parquet}",
        }
        cfg = DataConfig(random_resized_crop=True, hflip=0.5)
        pre = Preprocessing((224, 224), 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        aug = BatchAugment(cfg, pre, 10)
        batches = min(args.batches, args.photos * 4 // 5 // args.batch - 2)
        loaders = {}
        for label, name in sources.items():
            split = load_split(name, "train" if not name.startswith("hf:") else "all")
            loader = make_loader(split, args.batch, pre, augment=aug, shuffle=True,
                                 workers=args.workers)  # fmt: skip
            loaders[label] = partial(loader_rate, loader, batches)
        timm = timm_loader(root, args.batch, args.workers)  # forks after vitlab's workers
        loaders["timm imagefolder"] = partial(timm_rate, timm, batches)
        rates = {label: [] for label in loaders}
        for _ in range(args.rounds):
            for label, rate in loaders.items():
                rates[label].append(rate())
        for rate in loaders.values():  # every worker ended before the files go
            loader = rate.args[0]
            if loader is timm:
                shut_down(loader)
            else:
                loader.close()
        medians = {label: float(np.median(r)) for label, r in rates.items()}
        for label, rate in medians.items():
            per = rate / max(args.workers, 1)
            print(json.dumps({"source": label, "img_s": round(rate), "img_s_per_worker":
                              round(per), "vs_timm": round(rate / medians["timm imagefolder"], 2),
                              "rounds": [round(r) for r in rates[label]]}),
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=DEFAULT)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--photos", type=int, default=0, help="compare sources on N JPEGs")
    parser.add_argument("--workers", type=int, default=2, help="loader workers (--photos)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (--photos)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per source (--photos)")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc settings as they are (vitlab tunes them)",
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=0,
        help="bytes per shard (--photos; default: the photos' size / 21, ~16 training shards)",
    )
    args = parser.parse_args()
    if not args.default_allocator:
        tune_allocator()  # as the vitlab command does; this process's timm loader gets it too
    if args.photos:
        return compare_sources(args)
    for path in args.configs:
        cfg = load_run_config(path)
        data = load_data(cfg)
        mc = resolve_model_config(cfg, data.info)
        pre = Preprocessing(mc.img_hw, mc.in_chans, data.info.mean, data.info.std)
        aug = BatchAugment(cfg.data, pre, mc.num_classes)
        loader = make_loader(data.train, cfg.train.batch_size, pre, augment=aug, shuffle=True)
        delivered = loader_rate(loader, min(args.batches, len(loader) - 1))
        x, y = next(iter(loader))
        if y.ndim == 2:
            y = y.argmax(dim=1)
        consumed = step_rate(VisionTransformer(mc), x, y, use_bf16("auto", x.device), 10)
        row = {
            "config": path,
            "batch": cfg.train.batch_size,
            "loader_img_s": round(delivered),
            "step_img_s": round(consumed),
            "ratio": round(delivered / consumed, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
