"""CPU inference throughput of vitlab's backends (vitlab.eval.backends: torch fp32, torch int8,
onnxruntime fp32, onnxruntime int8) against timm's eager fp32 twin of the same model, calls
interleaved in one process; and, for a trained Fashion-MNIST checkpoint, each backend's accuracy
change and logit difference on the test set (issue 16).

    .venv/bin/python benchmarks/inference_backends.py                       # B/16 b8, nano b256
    .venv/bin/python benchmarks/inference_backends.py --checkpoint runs/quick --json out.json
    .venv/bin/python benchmarks/inference_backends.py --cases nano --repeats 1   # a smoke run

Speed cases: B/16 at batch 8 (224 px, timm.create_model('vit_base_patch16_224') with vitlab's
weights) and vit_nano_patch4_28 at batch 256 (its timm twin as benchmarks/model_speed.py builds it:
timm has no conv stem, so this is the registered patch-stem nano, not a preset's model: the quick
preset trains the hybrid vit_pico_r_s4_28, the full one a conv stem). Each backend's max |logit
diff| against vitlab's eager fp32 on the timed batch is reported beside its img/s and its ratio to
timm (above 1: faster). Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from machine_info import cpu_flags
from model_speed import median_seconds, randomize_heads, timm_twin

import vitlab
from vitlab.data import load_split, make_loader
from vitlab.eval.backends import describe, prepare
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models.checkpoint import load_checkpoint
from vitlab.preprocessing import Preprocessing

CASES = {"b16": ("B/16", 8), "nano": ("vit_nano_patch4_28", 256)}
BACKENDS = [("torch", False), ("torch", True), ("onnxruntime", False), ("onnxruntime", True)]
FASHION = "/usr/share/datasets/fashion-mnist"


def runners(model: torch.nn.Module, meta: CheckpointMeta, threads: int) -> dict:
    """Backend label -> (images -> logits), with how long each took to prepare."""
    out = {}
    for backend, int8 in BACKENDS:
        t = time.perf_counter()
        out[describe(backend, int8)] = prepare(model, meta, backend, int8, threads)
        print(f"  prepared {describe(backend, int8)} in {time.perf_counter() - t:.1f} s")
    return out


def speed(case: str, repeats: int, threads: int) -> dict:
    """img/s of timm eager fp32 and of each vitlab backend on one batch, calls interleaved."""
    name, batch = CASES[case]
    torch.manual_seed(0)
    model = vitlab.create_model(name).eval()
    randomize_heads(model)
    twin = timm_twin(model).eval()
    cfg = model.config
    meta = CheckpointMeta(
        cfg, Preprocessing(cfg.img_hw, cfg.in_chans, (0.5,), (0.5,)), list(map(str, range(10)))
    )
    x = torch.randn(batch, cfg.in_chans, *cfg.img_hw)
    fns = {"timm": twin, **runners(model, meta, threads)}
    with torch.inference_mode():
        want = model(x)
        diffs = {k: (f(x) - want).abs().max().item() for k, f in fns.items()}

    def call(f):
        def run() -> None:
            with torch.inference_mode():
                f(x)

        return run

    secs = median_seconds({k: call(f) for k, f in fns.items()}, repeats, warmup=2)
    row = {"model": name, "batch": batch, "threads": threads}
    for k, s in secs.items():
        row[k] = {"img_s": round(batch / s, 1), "vs_timm": round(secs["timm"] / s, 2),
                  "max_abs_logit_diff": float(f"{diffs[k]:.1e}")}  # fmt: skip
    return row


def accuracy(checkpoint: str, data_dir: str, threads: int, limit: int | None) -> dict:
    """Test top-1 of each backend on Fashion-MNIST, its change from eager fp32, the max |logit
    diff| against eager fp32 and the share of images whose top-1 class changed."""
    model, meta = load_checkpoint(checkpoint, device=torch.device("cpu"))
    part = load_split("fashion-mnist", "test", data_dir)
    loader = make_loader(part, 256, meta.preprocessing)
    fns = runners(model, meta, threads)
    logits = {k: [] for k in fns}
    labels = []
    with torch.inference_mode():
        for i, (x, y) in enumerate(loader):
            if limit is not None and i * 256 >= limit:
                break
            if limit is not None:  # the last batch cut to the limit (it ran whole batches)
                x, y = x[: limit - i * 256], y[: limit - i * 256]
            labels.append(y)
            for k, f in fns.items():
                logits[k].append(f(x).float())
    y = torch.cat(labels)
    keep = y >= 0
    ref = torch.cat(logits["torch"])[keep]
    out = {"checkpoint": checkpoint, "images": int(keep.sum())}
    base = (ref.argmax(1) == y[keep]).float().mean().item()
    for k, parts in logits.items():
        got = torch.cat(parts)[keep]
        top1 = (got.argmax(1) == y[keep]).float().mean().item()
        out[k] = {"top1": round(100 * top1, 2), "change": round(100 * (top1 - base), 2),
                  "max_abs_logit_diff": float(f"{(got - ref).abs().max().item():.1e}"),
                  "top1_class_changed": round(100 * (got.argmax(1) != ref.argmax(1))
                                              .float().mean().item(), 2)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per backend")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--checkpoint", help="a trained Fashion-MNIST run or checkpoint")
    parser.add_argument("--data-dir", default=FASHION)
    parser.add_argument("--limit", type=int, help="test images for the accuracy (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import onnxruntime

    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, {args.threads} "
          f"threads, {cpu_flags()}")  # fmt: skip
    results = []
    for case in args.cases:
        row = speed(case, args.repeats, args.threads)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.checkpoint:
        row = accuracy(args.checkpoint, args.data_dir, args.threads, args.limit)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
