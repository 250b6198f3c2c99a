"""Float32 inference of vitlab's small ViTs against timm's twin (model_speed.py's timm_twin, the
same weights), interleaved in one process, under glibc's default allocator or, with
`--allocator tuned`, under runtime.tune_allocator() (what the `vitlab` command sets) for both
libraries. Prints each library's median time a forward (model_speed.median_seconds, after five
warm-up calls each), its page faults a timed forward (getrusage) and timm / vitlab. vitlab's own
paths are as in model_speed.py (batch parts only under the default allocator).

    .venv/bin/python benchmarks/allocator_ratio.py --isa avx2
    .venv/bin/python benchmarks/allocator_ratio.py --isa avx2 --allocator tuned
"""

from __future__ import annotations

import argparse
import resource
from collections.abc import Callable

import torch
from model_speed import AVX2_ENV, hold_to, median_seconds, parse_model, timm_twin

import vitlab
from vitlab.runtime import tune_allocator

MODELS = ["vit_nano_patch4_28:stem=conv", "vit_micro_patch4_28", "vit_nano_patch4_28"]


def counting(model: torch.nn.Module, x: torch.Tensor, faults: list[int]) -> Callable[[], None]:
    """A forward of model on x that adds its page faults (getrusage) to faults[0]."""

    def forward() -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x)
        faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--allocator", choices=("default", "tuned"), default="default")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native", help=str(AVX2_ENV))
    args = parser.parse_args()
    hold_to(args.isa)
    if args.allocator == "tuned":
        tune_allocator()
    torch.manual_seed(0)
    print(f"allocator {args.allocator}, ISA {torch.backends.cpu.get_cpu_capability()}")
    for spec in args.models:
        name, overrides = parse_model(spec)
        model = vitlab.create_model(name, **overrides).eval()
        twin = timm_twin(model).eval()
        cfg = model.config
        x = torch.randn(args.batch, cfg.in_chans, *cfg.img_hw)
        counts = {"vitlab": [0], "timm": [0]}
        fns = {
            "vitlab": counting(model, x, counts["vitlab"]),
            "timm": counting(twin, x, counts["timm"]),
        }
        with torch.inference_mode():
            for fn in fns.values():
                for _ in range(5):
                    fn()
            counts["vitlab"][0] = counts["timm"][0] = 0  # the timed calls' faults only
            seconds = median_seconds(fns, args.rounds, warmup=0)
        med = {k: v * 1e3 for k, v in seconds.items()}
        faults = {k: v[0] / args.rounds for k, v in counts.items()}
        print(
            f"{spec} @ {args.batch}: "
            f"vitlab {med['vitlab']:.2f} ms ({faults['vitlab']:.0f} faults), "
            f"timm {med['timm']:.2f} ms ({faults['timm']:.0f} faults), "
            f"timm / vitlab {med['timm'] / med['vitlab']:.2f}"
        )


if __name__ == "__main__":
    main()
