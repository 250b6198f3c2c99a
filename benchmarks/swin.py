"""Swin measurements (issue 13), each part on an otherwise idle machine:

    .venv/bin/python benchmarks/swin.py speed    # Swin-T and the 28x28 preset against timm's twin
    .venv/bin/python benchmarks/swin.py memory   # forward time and peak memory, 224 / 512 / 1024 px
    .venv/bin/python benchmarks/swin.py fmnist   # small Swin vs plain and conv-stem ViT, same time

speed: forward and training-step throughput of vitlab's SwinTransformer and timm's with the same
weights (vitlab uses timm's names, so the state dict loads as it is), called in turn (a, b, a, b)
in one process, fp32 and (where the CPU has bf16 arithmetic) bf16 autocast. memory: one image
through Swin-T and ViT-B/16 in float32 without gradients, each size in a fresh process: wall time
and the process's peak resident memory above its state after building the model. fmnist:
`vitlab train` of three models on Fashion-MNIST with the quick preset's recipe, each given the same
wall-clock budget: its epochs are fixed from a measured training throughput so that training
takes about --budget seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from fmnist_runs import same_budget
from machine_info import cpu_flags
from model_speed import median_seconds, optimizer, step_fns

import vitlab
from vitlab.runtime import cpu_has_bf16

SPEED = [("Swin-T", 8), ("swin_nano_patch2_window7_28", 128)]


def timm_swin(model: torch.nn.Module) -> torch.nn.Module:
    """timm's SwinTransformer of model's shape, holding model's weights."""
    from timm.models.swin_transformer import SwinTransformer

    c = model.config
    twin = SwinTransformer(
        img_size=c.img_hw, patch_size=c.patch_size, in_chans=c.in_chans,
        num_classes=c.num_classes, embed_dim=c.embed_dim, depths=c.depths,
        num_heads=c.num_heads, window_size=c.window_size, mlp_ratio=c.mlp_ratio,
        qkv_bias=c.qkv_bias, drop_path_rate=c.drop_path,
    )  # fmt: skip
    twin.load_state_dict(model.state_dict())
    return twin


def speed(steps: int) -> list[dict]:
    torch.manual_seed(0)
    results = []
    for name, batch in SPEED:
        ours = vitlab.create_model(name)
        theirs = timm_swin(ours)
        c = ours.config
        x = torch.randn(batch, c.in_chans, *c.img_hw)
        y = torch.randint(0, c.num_classes, (batch,))
        with torch.no_grad():
            ours.eval(), theirs.eval()
            diff = (ours(x[:2]) - theirs(x[:2])).abs().max().item()
        for bf16 in (False, True) if cpu_has_bf16() else (False,):  # emulated bf16: hours
            row = {"model": name, "batch": batch, "precision": "bf16" if bf16 else "fp32"}
            row["max_logit_diff_fp32"] = diff
            pairs = (("vitlab", ours), ("timm", theirs))
            fns = {lib: step_fns(m, x, y, bf16, optimizer(m, lib, "own")) for lib, m in pairs}
            for i, kind in enumerate(("infer", "train")):
                secs = median_seconds({lib: f[i] for lib, f in fns.items()}, steps)
                for lib, s in secs.items():
                    row[f"{lib}_{kind}_img_s"] = round(batch / s, 1)
                row[f"{kind}_ratio"] = round(secs["timm"] / secs["vitlab"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def _forward_once(name: str, side: int) -> dict:
    """In this process: build, then time one float32 forward of one image; peak RSS above the
    built model's."""
    torch.manual_seed(0)
    model = vitlab.create_model(name, img_size=side).eval()
    x = torch.randn(1, 3, side, side)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.inference_mode():
        model(x[:, :, :side, :side])  # warm-up at the same size
        t0 = time.perf_counter()
        model(x)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"model": name, "side": side, "seconds": round(seconds, 3),
            "peak_mib_above_model": round((peak - base) / 1024, 1)}  # fmt: skip


def memory(sides: list[int]) -> list[dict]:
    results = []
    for name in ("Swin-T", "B/16"):
        for side in sides:
            done = subprocess.run(
                [sys.executable, __file__, "_forward", name, str(side)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


FMNIST = {
    "ViT (patch 4)": ["model.name=vit_nano_patch4_28"],
    "ViT (conv stem)": ["model.name=vit_nano_patch4_28", "model.stem=conv"],
    "Swin (patch 2, window 7)": ["model.name=swin_nano_patch2_window7_28"],
}


def fmnist(budget: float, out: Path) -> list[dict]:
    return same_budget(FMNIST, budget, out)


def main() -> None:
    if sys.argv[1:2] == ["_forward"]:
        print(json.dumps(_forward_once(sys.argv[2], int(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["speed", "memory", "fmnist"])
    p.add_argument("--steps", type=int, default=5, help="speed: timed calls per measurement")
    p.add_argument("--sides", default="224,512,1024", help="memory: image sides")
    p.add_argument("--budget", type=float, default=270.0, help="fmnist: training seconds each")
    p.add_argument("--out", type=Path, default=Path("runs/swin-fmnist"), help="fmnist: runs")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_flags()}")
    if args.part == "speed":
        results = speed(args.steps)
    elif args.part == "memory":
        results = memory([int(s) for s in args.sides.split(",")])
    else:
        results = fmnist(args.budget, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
