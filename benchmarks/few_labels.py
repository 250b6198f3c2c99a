"""Learning from few labels on Fashion-MNIST (issue 14's figures): masked-patch-prediction
pre-training without labels, then fine-tuning on 1%, 10% and 100% of the labels against the same
model trained from scratch on the same labels with the same budget; then few-shot (1/5/10/25) and
probe (linear, k-NN) accuracy of a random-init, the MPP-pretrained and the supervised ViT.

    python benchmarks/few_labels.py [--stage train|eval|all] [--out runs/few-labels] [--threads N]

Every run goes through `vitlab train` / `vitlab fewshot` / `vitlab probe` as a user would type them;
a run folder that already holds results.json is reused, so an interrupted benchmark continues.
Writes OUT/summary.json and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VITLAB = [sys.executable, "-m", "vitlab"]
# the paper's plain patch embedding (a conv stem's receptive fields overlap neighbouring patches,
# which would leak corrupted patches' colours); the quick preset's optimiser and batch
MODEL = ["model.name=vit_nano_patch4_28", "data.name=fashion-mnist", "train.batch_size=128"]
RECIPE = [*MODEL, "optim.lr=0.002", "optim.weight_decay=0.05", "optim.label_smoothing=0.1"]
PRETRAIN = [*MODEL, "train.objective=mpp", "train.epochs=10", "optim.warmup_epochs=0.5"]
# label fraction -> (epochs, warm-up epochs): about 1, 2 and 5 passes' worth of images
ARMS = {0.01: (100, 5.0), 0.1: (20, 1.0), 1.0: (5, 0.3)}


def train(out: Path, overrides: list[str], extra: list[str]) -> dict:
    if not (out / "results.json").is_file():
        args = ["train", "--out", str(out), *overrides, *extra]
        if (out / "config.yaml").is_file():  # interrupted: continue it
            args = ["train", "--resume", str(out)]
        t0 = time.perf_counter()
        subprocess.run([*VITLAB, "-q", *args], check=True)
        (out / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    result = json.loads((out / "results.json").read_text())
    wall = out / "wall_s.txt"
    result["wall_s"] = float(wall.read_text()) if wall.is_file() else None
    return result


def stage_train(root: Path, extra: list[str]) -> dict:
    out = {"pretrain": train(root / "mpp", PRETRAIN, extra)}
    for fraction, (epochs, warmup) in ARMS.items():
        common = [*RECIPE, f"data.label_fraction={fraction}", f"train.epochs={epochs}",
                  f"optim.warmup_epochs={warmup}"]  # fmt: skip
        for arm, more in (("scratch", []), ("mpp", [f"finetune.from={root / 'mpp'}"])):
            result = train(root / f"{arm}-{fraction:g}", [*common, *more], extra)
            out[f"{arm}-{fraction:g}"] = {"top1": result["top1"], "wall_s": result["wall_s"]}
    return out


def random_init(root: Path) -> Path:
    """The architecture with its initial weights (seed 0), as a checkpoint the commands read."""
    path = root / "random-init.safetensors"
    if not path.is_file():
        import torch

        from vitlab import Preprocessing, create_model, save_pretrained
        from vitlab.data.datasets import STATS

        torch.manual_seed(0)
        model = create_model("vit_nano_patch4_28", in_chans=1, num_classes=10)
        model.preprocessing = Preprocessing((28, 28), 1, *STATS["fashion-mnist"])
        save_pretrained(model, path)
    return path


def command_json(args: list[str]) -> dict:
    done = subprocess.run([*VITLAB, "-q", *args, "--json"], check=True, capture_output=True)
    return json.loads(done.stdout)


def stage_eval(root: Path) -> dict:
    sources = {
        "random init": str(random_init(root)),
        "MPP (no labels)": str(root / "mpp"),
        "supervised (100%)": str(root / "scratch-1"),
    }
    out = {}
    for name, source in sources.items():
        for features in ("prelogits", "gap"):
            data = ["--data", "fashion-mnist", "--features", features]
            few = command_json(["fewshot", source, *data])
            probe = command_json(["probe", source, *data, "--kind", "both"])
            out[f"{name} [{features}]"] = {"fewshot": few, "probe": probe}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=["train", "eval", "all"], default="all")
    p.add_argument("--out", type=Path, default=Path("runs/few-labels"))
    p.add_argument("--threads", type=int, help="train.threads for every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = [f"train.threads={args.threads}"] if args.threads else []
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if args.stage in ("train", "all"):
        summary["train"] = stage_train(args.out, extra)
    if args.stage in ("eval", "all"):
        summary["eval"] = stage_eval(args.out)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
