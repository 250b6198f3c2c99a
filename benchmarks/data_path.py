"""Data path: images/s the training loader delivers (with each preset's augmentation) against
images/s one training step of that preset's model consumes, on the same machine.

    .venv/bin/python benchmarks/data_path.py [--configs configs/fashion-mnist-quick.yaml ...]

The loader target is at least 5x the step's rate, so the data path never holds training back.
"""

from __future__ import annotations

import argparse
import json
import time

from model_speed import median_seconds, step_fns  # benchmarks/ is on sys.path when run as a script

from vitlab.config import load_run_config
from vitlab.data import BatchAugment, Preprocessing, make_loader
from vitlab.models.vit import VisionTransformer
from vitlab.runtime import use_bf16
from vitlab.train.build import load_data, resolve_model_config

DEFAULT = ["configs/fashion-mnist-quick.yaml", "configs/fashion-mnist.yaml", "configs/digits.yaml"]


def loader_rate(loader, batches: int) -> float:
    it = loader.iterate()
    next(it)  # warm-up
    n, t = 0, time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
        n += len(x)
    return n / (time.perf_counter() - t)


def step_rate(model, x, y, bf16: bool, steps: int) -> float:
    _, train = step_fns(model, x, y, bf16)
    return len(x) / median_seconds({"step": train}, steps, warmup=1)["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=DEFAULT)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()
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
