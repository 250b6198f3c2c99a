"""vitlab's own attention kernel for short sequences on x86 CPUs in float32 (csrc/attention.c):
softmax(scale q k^T) v per (batch, head), forward and backward, read straight from the qkv
projection's output and written in the layout the output projection reads (no permute copies).

PyTorch's fused CPU attention runs at about a quarter of the machine's matrix-product rate on the
50-token sequences of vitlab's 28 px models (BENCHMARKS.md, issue 16); this kernel keeps each
(batch, head) pair's T x T block in cache and computes it with AVX2 + FMA register tiles, the
pairs split over PyTorch's threads (cpu_kernels.run). The qkv projection's bias can be left to
it (layers.Attention runs the projection without it, packed.folds): the kernel adds it as it
copies each pair's q, k and v into cache, instead of PyTorch's linear filling the whole output
with it first (micro's training step 1.02-1.03x). The backward reuses the softmax kept from
the forward (B x H x T x T floats a layer, about a quarter more activation memory). On two
threads at 50 tokens its forward runs 2.3x faster than PyTorch's and forward and backward 2.6x;
1.3x / 1.4x at 128 tokens, level at 197 (BENCHMARKS.md). So the model takes it in training and
inference up to MAX_TOKENS tokens.

Attention runs here when all of these hold, else through F.scaled_dot_product_attention: a head
width that is a multiple of 8, at most MAX_TOKENS tokens, no attention bias or dropout, and what
cpu_kernels.usable() checks (float32 on the CPU outside autocast, AVX2, not traced or
transformed, the library built; `VITLAB_CPU_KERNELS=0` and `cpu_kernels.use_kernel(False)` turn
it off)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from vitlab.models import cpu_kernels
from vitlab.models.cpu_kernels import use_kernel

__all__ = ["MAX_TOKENS", "applies", "attention", "takes", "use_kernel"]

MAX_TOKENS = 128  # measured faster up to 128 tokens on two threads (one: forward 0.97-1.07x)


def applies(qkv: Tensor, heads: int) -> bool:
    """Whether attention over `qkv` (B, T, 3D), the qkv projection's output, runs on the kernel
    (the caller has checked there is no relative-position bias and no attention dropout)."""
    return cpu_kernels.usable(qkv) and _fits(qkv.shape, heads)  # usable first: no shape read
    # under tracing


def takes(x: Tensor, heads: int) -> bool:
    """Whether attention over the qkv projection of the tokens x (B, T, D) would run on the
    kernel (applies() of that projection, decided before it is computed)."""
    return cpu_kernels.usable(x) and x.dim() == 3 and _fits((*x.shape[:2], 3 * x.shape[2]), heads)


def _fits(shape: Sequence[int], heads: int) -> bool:
    """Whether qkv of this shape is one the kernel takes: its layout, at most MAX_TOKENS tokens."""
    return _shape_reason(shape, heads) is None and shape[1] <= MAX_TOKENS


def attention(qkv: Tensor, heads: int, scale: float, bias: Tensor | None = None) -> Tensor:
    """softmax(scale q k^T) v for every head: (B, T, 3D) -> (B, T, D), differentiable once. With
    `bias` (3D,), the qkv projection's bias, qkv is the projection without it and the kernel adds
    it as it reads q, k and v (no pass of its own over the (B, T, 3D) output). A ValueError says
    why if the kernel cannot take `qkv` (applies() says whether it can)."""
    reason = _reason_not(qkv, heads) or (cpu_kernels.library() is None and "it is not built here")
    bad_bias = bias is not None and (
        bias.shape != qkv.shape[-1:] or bias.dtype != qkv.dtype or bias.device != qkv.device
    )
    if bad_bias and not reason:
        reason = (
            f"the bias must be float32 of shape ({qkv.shape[-1]},) on the CPU, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    if reason:
        raise ValueError(f"vitlab's CPU attention kernel cannot take this input: {reason}")
    qkv = qkv.contiguous()
    bias = None if bias is None else bias.contiguous()
    needs = (qkv, bias) if bias is not None else (qkv,)
    if torch.is_grad_enabled() and any(t.requires_grad for t in needs):
        return _Attention.apply(qkv, bias, heads, scale)
    return _forward(qkv, bias, heads, scale, keep=False)[0]


def _reason_not(qkv: Tensor, heads: int) -> str | None:
    """What the kernel needs that qkv lacks, or None."""
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32:
        return f"it computes float32 on the CPU, got {qkv.dtype} on {qkv.device}"
    return _shape_reason(qkv.shape, heads)


def _shape_reason(shape: Sequence[int], heads: int) -> str | None:
    """What the kernel needs of qkv's shape that it lacks, or None."""
    if len(shape) != 3 or shape[-1] % (3 * heads):
        return f"expected (B, T, 3 x {heads} heads x d), got {tuple(shape)}"
    if shape[-1] // (3 * heads) % 8:
        return f"the head width must be a multiple of 8, got {shape[-1] // (3 * heads)}"
    return None


def _forward(
    qkv: Tensor, bias: Tensor | None, heads: int, scale: float, keep: bool
) -> tuple[Tensor, Tensor | None]:
    """The output (B, T, D) and, with `keep`, the softmax for the backward (B, H, T, Tp): each
    row in whole vectors of 8, the padding zero."""
    b, t, width = qkv.shape
    out = qkv.new_empty(b, t, width // 3)  # (B, T, H, d) flat
    probs = qkv.new_empty(b, heads, t, (t + 7) // 8 * 8) if keep else None
    _run("vitlab_attention_forward", [qkv, bias, out, probs], heads, scale)
    return out, probs


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, bias: Tensor | None, heads: int, scale: float) -> Tensor:
        out, probs = _forward(qkv, bias, heads, scale, keep=True)
        ctx.save_for_backward(qkv, bias, probs)
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        qkv, bias, probs = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        tensors = [qkv, bias, probs, grad.contiguous(), dqkv]
        _run("vitlab_attention_backward", tensors, ctx.heads, ctx.scale)
        dbias = dqkv.sum((0, 1)) if ctx.needs_input_grad[1] else None  # as addmm's backward
        return dqkv, dbias, None, None


def _run(name: str, tensors: list[Tensor | None], heads: int, scale: float) -> None:
    """Kernel `name` over every (batch, head) pair, split over PyTorch's threads."""
    b, t, width = tensors[0].shape
    shape = (b, t, heads, width // (3 * heads))  # B, T, H, d
    cpu_kernels.run(name, tensors, (*shape, scale), b * heads)
