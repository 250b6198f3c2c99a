"""A candidate float32 inference path for the conv stem, written here (not in vitlab), timed in the
whole model against vitlab's own model and timm's twin (model_speed.py's timm_twin), interleaved
in one process under glibc's default allocator (model_speed.py's conditions). The candidate:
each BatchNorm folded into its conv (weight times gamma / sqrt(var + eps), bias beta - mean times
that), the convs in channels-last memory with ReLU in place, the 1x1 projection as a matrix
product that writes the (B, N, D) tokens directly (no transpose copy); the folding is done at
every call, as a forward that must see the current weights would. The BatchNorms' statistics,
scales and shifts are randomised so that the folding is exercised, and the candidate's logits
checked against the model's first. Prints the three medians a forward and the ratios. (Measured
at 0.98-1.06x the model's own forward, mean 1.02, and at 0.99 once written into ConvStem.forward
with the guards it needs: not adopted; BENCHMARKS.md, issue 16.)

    .venv/bin/python benchmarks/conv_stem_inference.py --isa avx2
"""

from __future__ import annotations

import argparse
import copy
import types

import torch
import torch.nn.functional as F
from model_speed import AVX2_ENV, hold_to, median_seconds, parse_model, randomize_heads, timm_twin
from torch import Tensor, nn

import vitlab


def folded(conv: nn.Conv2d, norm: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """The conv's weight (channels-last) and bias, the eval-mode BatchNorm after it folded in."""
    scale = norm.weight * torch.rsqrt(norm.running_var + norm.eps)
    bias = norm.bias - norm.running_mean * scale
    if conv.bias is not None:
        bias = bias + conv.bias * scale
    weight = conv.weight * scale.view(-1, 1, 1, 1)
    return weight.contiguous(memory_format=torch.channels_last), bias


def folded_forward(self, x: Tensor) -> Tensor:
    """The candidate ConvStem.forward (self: vitlab's ConvStem; its stem is conv, BN, ReLU, ...)."""
    self.check_input(x)
    y = x.contiguous(memory_format=torch.channels_last)
    layers = list(self.stem)
    for conv, norm in zip(layers[0::3], layers[1::3]):
        weight, bias = folded(conv, norm)
        y = F.relu_(F.conv2d(y, weight, bias, conv.stride, conv.padding))
    tokens = F.linear(y.permute(0, 2, 3, 1), self.proj.weight.flatten(1), self.proj.bias)
    return tokens.flatten(1, 2)  # (B, gh, gw, D) contiguous -> (B, N, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_nano_patch4_28:stem=conv")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--isa", choices=("native", "avx2"), default="native", help=str(AVX2_ENV))
    args = parser.parse_args()
    hold_to(args.isa)
    torch.manual_seed(0)
    name, overrides = parse_model(args.model)
    model = vitlab.create_model(name, **overrides).eval()
    if model.config.stem != "conv":
        raise SystemExit(f"{args.model} has no conv stem: give one with ':stem=conv'")
    randomize_heads(model)
    with torch.no_grad():
        for norm in model.patch_embed.stem:
            if isinstance(norm, nn.BatchNorm2d):  # what a trained stem would have
                norm.running_mean.normal_(0.0, 0.1)
                norm.running_var.uniform_(0.5, 2.0)
                norm.weight.normal_(1.0, 0.2)
                norm.bias.normal_(0.0, 0.1)
    twin = timm_twin(model).eval()
    candidate = copy.deepcopy(model)
    stem = candidate.patch_embed
    stem.forward = types.MethodType(folded_forward, stem)
    cfg = model.config
    x = torch.randn(args.batch, cfg.in_chans, *cfg.img_hw)
    fns = {"vitlab": lambda: model(x), "folded": lambda: candidate(x), "timm": lambda: twin(x)}
    with torch.inference_mode():
        diff = (candidate(x) - model(x)).abs().max().item()
        if diff > 1e-4:
            raise SystemExit(f"the folded stem's logits differ from the model's by {diff:.2e}")
        seconds = median_seconds(fns, args.rounds, warmup=5)
    ms = {k: v * 1e3 for k, v in seconds.items()}
    print(
        f"{args.model} @ {args.batch}, ISA {torch.backends.cpu.get_cpu_capability()}: "
        f"vitlab {ms['vitlab']:.2f} ms, folded stem {ms['folded']:.2f} ms, timm {ms['timm']:.2f} "
        f"ms; vitlab / folded {ms['vitlab'] / ms['folded']:.3f}, timm / vitlab "
        f"{ms['timm'] / ms['vitlab']:.3f}, timm / folded {ms['timm'] / ms['folded']:.3f} "
        f"(max logit difference {diff:.1e})"
    )


if __name__ == "__main__":
    main()
