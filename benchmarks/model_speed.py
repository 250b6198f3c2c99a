"""Forward (inference) and training-step throughput of vitlab against timm's VisionTransformer of
the same shape, side by side in one process, fp32 and bf16 autocast.

    .venv/bin/python benchmarks/model_speed.py                       # the default set
    .venv/bin/python benchmarks/model_speed.py --models Ti/16 --batch 32 --steps 10 --json out.json

Both models get identical weights (the test suite checks that they then agree to 1e-5), so the
comparison is of implementations only. Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

import vitlab
from vitlab.formats.timm import timm_model_args, vitlab_to_timm
from vitlab.models.vit import VisionTransformer
from vitlab.runtime import use_bf16

DEFAULT = [("vit_nano_patch4_28", 256), ("Ti/16", 32), ("S/16", 16), ("B/16", 8)]


def timm_twin(model: VisionTransformer) -> torch.nn.Module:
    """timm's VisionTransformer with model's shape and weights (built from the same model_args
    that `vitlab convert --to timm` writes)."""
    import timm

    arch, args = timm_model_args(model.config)
    twin = timm.create_model(arch, **args)
    twin.load_state_dict(vitlab_to_timm(model.state_dict()))
    return twin


def median_seconds(fns: dict[str, Callable[[], None]], steps: int, warmup: int = 2) -> dict:
    """Median seconds per call of each fn, the fns called in turn (a, b, a, b, ...) so that both
    see the same machine state; the shared machine's noise hits them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def step_fns(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool):
    """(inference call, training step) for model on batch (x, y)."""
    ctx = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def infer() -> None:
        model.eval()
        with torch.inference_mode(), ctx():
            model(x)

    def train() -> None:
        model.train()
        with ctx():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return infer, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", help="names or aliases (default: a standard set)")
    parser.add_argument("--batch", type=int, help="batch size for every model")
    parser.add_argument("--steps", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    runs = [(m, 16) for m in args.models] if args.models else DEFAULT
    if args.batch:
        runs = [(m, args.batch) for m, _ in runs]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor()}")
    results = []
    for name, batch in runs:
        ours = vitlab.create_model(name)
        torch.nn.init.normal_(ours.head.weight, std=0.02)
        theirs = timm_twin(ours)
        cfg = ours.config
        x = torch.randn(batch, cfg.in_chans, *cfg.img_hw)
        y = torch.randint(0, cfg.num_classes, (batch,))
        by_precision = {}
        for bf16 in (False, True):
            row = {"model": name, "batch": batch, "precision": "bf16" if bf16 else "fp32"}
            fns = {lib: step_fns(m, x, y, bf16) for lib, m in (("vitlab", ours), ("timm", theirs))}
            for i, kind in enumerate(("infer", "train")):
                secs = median_seconds({lib: f[i] for lib, f in fns.items()}, args.steps)
                for lib, s in secs.items():
                    row[f"{lib}_{kind}_img_s"] = round(batch / s, 1)
                row[f"{kind}_ratio"] = round(secs["timm"] / secs["vitlab"], 3)
            results.append(row)
            by_precision[row["precision"]] = row
            print(json.dumps(row), flush=True)
        # vitlab's default path (train.precision=auto) against timm's eager fp32
        default = "bf16" if use_bf16("auto", x.device) else "fp32"
        summary = {
            "model": name,
            "default_precision": default,
            "default_train_vs_timm_fp32": round(
                by_precision[default]["vitlab_train_img_s"]
                / by_precision["fp32"]["timm_train_img_s"],
                2,
            ),
        }
        results.append(summary)
        print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
