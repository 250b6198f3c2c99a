"""Linear layers packed once for CPU inference: oneDNN's inner product reads a weight laid out in
its own blocked format, and PyTorch's linear (MKL's GEMM) re-packs the weight at every call and
first copies the bias into every row of the output. Past about a megabyte of weight that costs
measurably: packing each such weight once makes float32 CPU inference of B/16 at batch 8
1.08-1.12x faster; below it (the small ViTs' layers, which stay in cache) packing measured
0.93-1.01x, so those stay PyTorch's linear (BENCHMARKS.md, issue 16). `vitlab eval` and `vitlab
predict` (eval.backends.prepare) run a packed copy of the model; the model is left as it is.

A packed copy is a snapshot for inference, as torch.jit.freeze makes one: its weights are its
own (not the model's), it packs them once, and a packed weight changed in place (its version
counter moves) or moved (.to(), a copy) makes that layer fall back to the plain product. Autograd,
autocast, another dtype or device, tracing and compiling take the plain product too. A write that
PyTorch does not count (through `.data`, or numpy) is not seen: pack again after one.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

ROWS_HINT = 1024  # the rows oneDNN packs for; measured level from 128 to 3,200 rows
PACK_BYTES = 1 << 20  # the smallest weight packed (float32: 262,144 values, e.g. 512 x 512)


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight oneDNN packed once: the same weight and bias (frozen, no
    gradient), the same outputs to float rounding; float32 inference on a CPU runs oneDNN's inner
    product on the packed copy, anything else PyTorch's linear."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        # not a buffer: state_dict and .to() leave it; the weight it was packed from, as it was
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, ROWS_HINT)
        self.packed_from = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: Tensor) -> Tensor:
        if self.takes(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def takes(self, x: Tensor) -> bool:
        """Whether the packed weight computes this call: float32 inference on the CPU, the weight
        as packed (the same memory, no in-place change since: .to() or a copy of the module
        moves it), no tracing or compiling."""
        if torch.is_grad_enabled() or type(x) is not Tensor or x.device.type != "cpu":
            return False
        if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return False
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return False
        weight = self.weight
        return weight.dtype == x.dtype and (weight.data_ptr(), weight._version) == self.packed_from


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def packable(module: nn.Module) -> bool:
    """A plain float32 nn.Linear on the CPU (not a subclass, quantised or wrapped layer) with no
    hook of its own (a packed copy is a new module: the hooks would be lost) and a weight of at
    least PACK_BYTES."""
    return (
        type(module) is nn.Linear
        and "forward" not in vars(module)
        and not any(getattr(module, kind) for kind in HOOKS)
        and type(module.weight) is nn.Parameter
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.numel() * 4 >= PACK_BYTES
    )


def pack_linear(model: nn.Module) -> nn.Module:
    """A copy of `model` (its mode kept) with every packable nn.Linear (a plain float32 CPU one
    of at least PACK_BYTES) replaced by a PackedLinear; `model` itself unchanged. Where there is
    none, or oneDNN cannot pack here (a PyTorch built without it, a CPU it does not support),
    `model` itself."""
    if not any(packable(m) for m in model.modules()):
        return model
    if not torch.backends.mkldnn.is_available():
        log.info("oneDNN is not available: linear layers run unpacked")
        return model
    packed = copy.deepcopy(model)
    try:
        for parent in list(packed.modules()):
            for name, child in list(parent.named_children()):
                if packable(child):
                    setattr(parent, name, PackedLinear(child))
    except RuntimeError as e:  # oneDNN refuses the layout or the CPU
        log.info("oneDNN cannot pack the linear layers here (%s): they run unpacked", e)
        return model
    return packed
