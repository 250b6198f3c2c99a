"""The paper's variants on Fashion-MNIST (issue 12), each part on an otherwise idle machine:

    .venv/bin/python benchmarks/variants.py teacher   # ResNet-18 (small stem) trained by vitlab
    .venv/bin/python benchmarks/variants.py deit      # the full preset's ViT, hard distillation
                                                      # from that ResNet-18 against none, 2 seeds
    .venv/bin/python benchmarks/variants.py stems     # hybrid vs patch 4 vs conv stem, same time

teacher: `vitlab train model.name=resnet18_28` with SGD (lr 0.1, momentum 0.9, weight decay 5e-4,
cosine, label smoothing 0.1), 1-pixel shifts and flips, --teacher-epochs epochs. deit:
configs/fashion-mnist.yaml (the full preset: conv-stem nano ViT, shifts, flips, random erasing;
without its time budget and with the one-conv-a-stage stem it had when measured) for --epochs
epochs, seeds 0 and 1, as it is and with model.distilled=true distill.type=hard
distill.teacher=<the teacher run>; the distilled runs report each head alone too. stems: the quick
preset's recipe for a patch-4 ViT, the same ViT with a conv stem and with a ResNet stem
(vit_nano_r_s4_28), each given --budget seconds of training. Runs that already hold results are
not repeated: the figures are read back from their folders.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from fmnist_runs import same_budget, train
from machine_info import cpu_flags

FULL_PRESET = Path(__file__).resolve().parent.parent / "configs" / "fashion-mnist.yaml"
TEACHER = ["model.name=resnet18_28", "data.name=fashion-mnist", "data.crop_padding=1",
           "data.hflip=0.5", "optim.name=sgd", "optim.lr=0.1", "optim.weight_decay=0.0005",
           "optim.warmup_epochs=0.3", "optim.label_smoothing=0.1",
           "train.batch_size=128"]  # fmt: skip
STEMS = {
    "ViT (patch 4)": ["model.name=vit_nano_patch4_28"],
    "ViT (conv stem)": ["model.name=vit_nano_patch4_28", "model.stem=conv"],
    "Hybrid (ResNet stem)": ["model.name=vit_nano_r_s4_28"],
}


def teacher(out: Path, epochs: int) -> dict:
    r, wall = train(out, [*TEACHER, f"train.epochs={epochs}"])
    row = {"model": "resnet18_28", "epochs": epochs, "test_top1": r["top1"], "wall_s": wall}
    print(json.dumps(row), flush=True)
    return row


def deit(teacher_run: Path, epochs: int, seeds: list[int], out: Path) -> list[dict]:
    if not (teacher_run / "results.json").is_file():
        raise SystemExit(f"no trained teacher in {teacher_run}: run the `teacher` part first")
    results = []
    for seed in seeds:
        for distilled in (False, True):
            args = ["--config", str(FULL_PRESET), "train.time_budget=null",
                    "model.stem_depths=[]", f"train.epochs={epochs}",
                    f"train.seed={seed}"]  # fmt: skip
            if distilled:
                args += ["model.distilled=true", f"distill.teacher={teacher_run}",
                         "distill.type=hard"]  # fmt: skip
            run = out / f"{'distilled' if distilled else 'plain'}-seed{seed}"
            r, wall = train(run, args)
            row = {"student": "distilled (hard)" if distilled else "plain", "seed": seed,
                   "epochs": epochs, "test_top1": r["top1"], "wall_s": wall}  # fmt: skip
            row.update({k: r[k] for k in ("top1_cls", "top1_dist") if k in r})
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["teacher", "deit", "stems"])
    p.add_argument("--out", type=Path, default=Path("runs/variants"), help="run folders")
    p.add_argument("--teacher-epochs", type=int, default=5, help="teacher: epochs")
    p.add_argument("--teacher", type=Path, help="deit: the teacher run (default: OUT/teacher)")
    p.add_argument("--epochs", type=int, default=10, help="deit: epochs of every student")
    p.add_argument("--seeds", default="0,1", help="deit: seeds")
    p.add_argument("--budget", type=float, default=150.0, help="stems: training seconds each")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_flags()}")
    if args.part == "teacher":
        results: object = teacher(args.teacher or args.out / "teacher", args.teacher_epochs)
    elif args.part == "deit":
        seeds = [int(s) for s in args.seeds.split(",")]
        results = deit(args.teacher or args.out / "teacher", args.epochs, seeds, args.out / "deit")
    else:
        results = same_budget(STEMS, args.budget, args.out / "stems")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
