"""A float32 CPU inference batch taken a part at a time by the ViT's blocks while glibc's
allocator has its defaults (batch_chunk): the parts' activations stay in memory the allocator
keeps, and in cache (BENCHMARKS.md, issue 16)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vitlab.models import cpu_kernels
from vitlab.models.packed import watched
from vitlab.runtime import allocator_returns_memory

CHUNK_BYTES = 8 << 20  # of the widest activation a part (measured: BENCHMARKS.md, issue 16)
CHUNK_ROWS = 2048  # about the fewest token rows a part: the products keep their pace


def batch_chunk(x: Tensor, width: int, *modules: nn.Module) -> int | None:
    """Into how many parts the encoder `modules` should take the tokens x (B, T, D) of a float32
    inference batch on a CPU while glibc's allocator has its defaults
    (runtime.allocator_returns_memory): it gives large freed blocks back to the OS, and every
    forward faults them in again; parts whose widest activation (B T rows of `width` floats) is
    about CHUNK_BYTES are served from memory it keeps, and stay in cache. At least about
    CHUNK_ROWS rows a part. None: the whole batch at once, where it fits, the allocator keeps
    its memory (tuned, as the vitlab command does, or another allocator), with autograd,
    autocast, another device or dtype, tracing, compiling or torch.func, and where a part could
    differ from its share of the batch: a module in training mode (random draws), a quantised
    one (torch.ao: one activation scale per call), sharded parameters (FSDP gathers them per
    call), or a hook on a module that would see parts of the batch. Each image is computed as
    in the whole batch, to float rounding."""
    if torch.is_grad_enabled() or type(x) is not Tensor or x.device.type != "cpu":
        return None
    if x.dtype != torch.float32 or x.dim() != 3 or torch.is_autocast_enabled("cpu"):
        return None  # under bf16 autocast: 1.09x at micro, 0.96x at nano batch 256
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or cpu_kernels.transformed(x):
        return None
    b, t = x.shape[:2]
    parts = min(math.ceil(b * t * width * 4 / CHUNK_BYTES), b * t // CHUNK_ROWS, b)
    if parts < 2 or not allocator_returns_memory():
        return None
    inner = [m for top in modules for m in top.modules()]
    if any(m.training or type(m).__module__.startswith("torch.ao.") for m in inner):
        return None
    params = (p for m in modules for p in m.parameters())
    if any(type(p) is not nn.Parameter for p in params) or watched(*inner):
        return None
    return parts
