"""Float32 inference of vitlab's ViTs with the encoder taking a large batch a part at a time
(models/chunks.batch_chunk, the default under glibc's default allocator: parts of about
CHUNK_BYTES of the widest activation and about CHUNK_ROWS token rows at least) against the whole
batch at once, interleaved in one process, with timm's twin of the same weights timed in the same
loop (as model_speed.py's inference rows).

    .venv/bin/python benchmarks/batch_chunk.py --isa avx2
    .venv/bin/python benchmarks/batch_chunk.py --models vit_micro_patch4_28@128 Ti/16@64 --isa avx2
    .venv/bin/python benchmarks/batch_chunk.py --allocator tuned --no-timm

A model is NAME[:field=value,...]@BATCH (model_speed.py's names). `--allocator tuned` sets glibc's
allocator as the vitlab command does (runtime.tune_allocator) and takes the parts anyway (vitlab
takes them under the default allocator only), to show what they would give there; by default the
allocator is left as a user's own script has it. `--no-timm` times vitlab's two variants alone
in the process: the allocator's state then is vitlab's own (timm's allocations raise glibc's
thresholds for both). Prints one JSON line a model: milliseconds a forward, parts_gain (the whole
batch's time over the parts'), and the ratios to timm. Results go in BENCHMARKS.md (issue 16).
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial

import torch

# benchmarks/ is on sys.path when run as a script
from model_speed import hold_to, median_seconds, parse_model, randomize_heads, timm_twin

import vitlab
from vitlab.experiments.report import machine
from vitlab.models import chunks
from vitlab.runtime import tune_allocator

DEFAULT = ["vit_micro_patch4_28@128", "vit_nano_patch4_28@256", "Ti/16@64", "B/16@8"]


def whole_batch(model: torch.nn.Module, x: torch.Tensor) -> None:
    """model(x) with the encoder taking the whole batch at once."""
    before = chunks.CHUNK_BYTES
    chunks.CHUNK_BYTES = math.inf
    try:
        model(x)
    finally:
        chunks.CHUNK_BYTES = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=DEFAULT, help="NAME[:overrides]@BATCH")
    parser.add_argument("--steps", type=int, default=21, help="timed calls per variant")
    parser.add_argument("--allocator", choices=("default", "tuned"), default="default")
    parser.add_argument("--no-timm", action="store_true", help="time vitlab's variants only")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    args = parser.parse_args()
    hold_to(args.isa)
    if args.allocator == "tuned":
        if not tune_allocator():
            raise SystemExit("glibc's allocator could not be tuned here")
        chunks.allocator_returns_memory = lambda: True  # parts all the same: what they would give
    print(json.dumps({**machine(), "isa": args.isa, "allocator": args.allocator}))
    torch.manual_seed(0)
    for spec in args.models:
        name, _, batch = spec.rpartition("@")
        base, overrides = parse_model(name)
        model = vitlab.create_model(base, **overrides).eval()
        randomize_heads(model)
        cfg = model.config
        x = torch.randn(int(batch), cfg.in_chans, *cfg.img_hw)
        fns = {"parts": partial(model, x), "whole": partial(whole_batch, model, x)}
        if not args.no_timm:
            fns["timm"] = partial(timm_twin(model).eval(), x)
        with torch.inference_mode():
            times = median_seconds(fns, args.steps)
        row = {"model": spec, **{f"{k}_ms": round(v * 1e3, 2) for k, v in times.items()}}
        row["parts_gain"] = round(times["whole"] / times["parts"], 3)
        if "timm" in times:
            row["parts_vs_timm"] = round(times["timm"] / times["parts"], 3)
            row["whole_vs_timm"] = round(times["timm"] / times["whole"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
