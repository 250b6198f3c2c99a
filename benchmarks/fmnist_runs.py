"""What the Fashion-MNIST benchmarks share: the CPU's description, the training throughput of a
model, and `vitlab train` runs that are skipped when their folder already holds results (so a
benchmark interrupted by the session's end continues where it stopped)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from model_speed import median_seconds, optimizer, step_fns

from vitlab.config import load_run_config
from vitlab.models.registry import build_model, config_of
from vitlab.runtime import use_bf16

# the quick preset's optimiser, which the same-budget comparisons share
RECIPE = ["data.name=fashion-mnist", "train.batch_size=128", "optim.lr=0.002",
          "optim.weight_decay=0.05", "optim.warmup_epochs=0.3",
          "optim.label_smoothing=0.1"]  # fmt: skip
TRAIN_IMAGES = 54_000  # Fashion-MNIST's training split less the 10% validation


def training_img_s(overrides: list[str]) -> float:
    """Images/s of the training step on a batch of 128 28x28 greyscale images in the run's default
    precision."""
    config = config_of(load_run_config(None, overrides).model)
    model = build_model(config.replace(num_classes=10, in_chans=1, img_size=28))
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    opt = optimizer(model, "vitlab", "own")
    _, train = step_fns(model, x, y, use_bf16("auto", x.device), opt)
    return 128 / median_seconds({"m": train}, 10)["m"]


def train(run: Path, args: list[str]) -> tuple[dict, float]:
    """`vitlab train --out RUN ARGS` unless RUN already has its results: (results.json, wall-clock
    seconds of the run that wrote them)."""
    if not (run / "results.json").is_file():
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "vitlab", "-q", "train", "--out", str(run), "--overwrite"]
        subprocess.run([*cmd, *args], check=True)
        (run / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    return json.loads((run / "results.json").read_text()), float((run / "wall_s.txt").read_text())


def same_budget(models: dict[str, list[str]], budget: float, out: Path) -> list[dict]:
    """`vitlab train` of each model on Fashion-MNIST with RECIPE, each given about `budget`
    seconds of training: its epochs are fixed from its measured training throughput."""
    results = []
    for label, overrides in models.items():
        img_s = training_img_s(overrides)
        epochs = max(1, round(budget * img_s / TRAIN_IMAGES))
        run = out / label.split()[0].lower() / label.split("(")[1].rstrip(")").replace(" ", "-")
        r, wall = train(run, [*RECIPE, *overrides, f"train.epochs={epochs}"])
        row = {"model": label, "measured_train_img_s": round(img_s), "epochs": epochs,
               "test_top1": r["top1"], "wall_s": wall}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    return results
