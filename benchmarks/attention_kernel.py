"""Attention alone: vitlab's CPU kernel (models/cpu_attention.py) against PyTorch's fused
F.scaled_dot_product_attention, each called the way the model calls it (from the qkv projection's
(B, T, 3D) output to the (B, T, D) input of the output projection, permutes and copies included),
forward and forward + backward, timed interleaved in one process, float32 (the model takes the
kernel for training only, up to MAX_TOKENS tokens: these figures are why).

    .venv/bin/python benchmarks/attention_kernel.py                   # the default shapes
    .venv/bin/python benchmarks/attention_kernel.py --shapes 128,50,4,16 --threads 1 2 --isa avx2

A shape is B,T,H,d. GFLOP/s counts the two products (4 B H T^2 d forward, twice that backward)
against the same run's 2048x2048 float32 matrix product. `--isa avx2` holds PyTorch's kernels,
oneDNN and MKL to AVX2 (the kernel itself is always AVX2 + FMA). Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from vitlab.models.cpu_attention import attention
from vitlab.models.cpu_kernels import use_kernel

sys.path.insert(0, os.path.dirname(__file__))
from machine_info import cpu_flags  # noqa: E402
from model_speed import hold_to, matmul_peak, median_seconds  # noqa: E402

DEFAULT = [
    (128, 50, 4, 16),  # nano at 28 px, patch 4 (the Fashion-MNIST presets)
    (128, 50, 4, 32),  # micro
    (64, 65, 3, 64),  # Ti/16 at 128 px
    (32, 197, 3, 64),  # Ti/16 at 224 px: this and the next above MAX_TOKENS (the model then
    (32, 257, 6, 64),  # S/16 at 256 px    takes PyTorch's attention): measured to show why
]


def sdpa(qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """Attention as the model runs it without the kernel (layers.Attention)."""
    b, t, width = qkv.shape
    q, k, v = qkv.reshape(b, t, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2).reshape(b, t, width // 3)


def calls(fn, qkv: torch.Tensor, grad: torch.Tensor, heads: int, scale: float, kernel: bool):
    """(forward, forward + backward) of fn with the kernel switched on or off."""

    def forward() -> None:
        with use_kernel(kernel), torch.inference_mode():
            fn(qkv.detach(), heads, scale)

    def train() -> None:
        with use_kernel(kernel):
            out = fn(qkv, heads, scale)
        out.backward(grad)
        qkv.grad = None

    return forward, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", help="B,T,H,d (default: a standard set)")
    parser.add_argument("--threads", nargs="*", type=int, help="PyTorch thread counts to try")
    parser.add_argument("--steps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    args = parser.parse_args()
    hold_to(args.isa)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else DEFAULT
    threads = args.threads or [torch.get_num_threads()]
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {cpu_flags()}, kernels {isa}")
    torch.manual_seed(0)
    for n in threads:
        torch.set_num_threads(n)
        peak = matmul_peak(torch.float32)
        print(json.dumps({"threads": n, "matmul_2048_gflop_s": round(peak / 1e9, 1)}))
        for b, t, h, d in shapes:
            qkv = torch.randn(b, t, 3 * h * d, requires_grad=True)
            grad = torch.randn(b, t, h * d)
            fns = {
                "kernel": calls(attention, qkv, grad, h, d**-0.5, True),
                "sdpa": calls(sdpa, qkv, grad, h, d**-0.5, False),
            }
            flops = {"forward": 4 * b * h * t * t * d}
            flops["train"] = 3 * flops["forward"]
            row = {"threads": n, "B,T,H,d": [b, t, h, d]}
            for i, kind in enumerate(("forward", "train")):
                secs = median_seconds({k: f[i] for k, f in fns.items()}, args.steps)
                for k, s in secs.items():
                    row[f"{k}_{kind}_ms"] = round(s * 1e3, 3)
                    row[f"{k}_{kind}_gflop_s"] = round(flops[kind] / s / 1e9, 1)
                row[f"{kind}_gain"] = round(secs["sdpa"] / secs["kernel"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
