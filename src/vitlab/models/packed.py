"""Linear layers packed once for CPU inference: oneDNN's inner product reads a weight laid out in
its own blocked format, and PyTorch's linear (MKL's GEMM) re-packs the weight at every call and
first copies the bias into every row of the output. Past about a megabyte of weight that costs
measurably: packing each such weight once makes float32 CPU inference of B/16 at batch 8
1.08-1.14x faster; below it (the small ViTs' layers, which stay in cache) packing measured
0.93-1.01x, so those stay PyTorch's linear (BENCHMARKS.md, issue 16). `vitlab eval` and `vitlab
predict` (eval.backends.prepare) run a packed copy of the model; the model is left as it is.

A packed copy is a snapshot for inference, as torch.jit.freeze makes one: its weights are its
own (not the model's), it packs them once, and a packed weight changed in place (its version
counter moves) or moved (.to()) makes that layer fall back to the plain product; a copy of it
(deepcopy, pickle) packs its own. Autograd, autocast, another dtype or device, tracing, compiling
and torch.func take the plain product too. A write that PyTorch does not count (through `.data`,
or numpy) is not seen: pack again after one.

A plain (unpacked) layer's copy of the bias into every row is skipped, in training and
inference, where the kernel that reads its output adds the bias as it reads (`folds`: qkv's in
vitlab's attention kernel, fc1's in its GELU, the output projection's and fc2's in the residual
join; cpu_kernels). `plain`, `folds`, `linear` and `watched` say where such a shortcut may run.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models import cpu_kernels

log = logging.getLogger(__name__)

ROWS_HINT = 1024  # the rows oneDNN packs for; measured level from 128 to 3,200 rows
PACK_BYTES = 1 << 20  # the smallest weight packed (float32: 262,144 values, e.g. 512 x 512)


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight oneDNN packed once: the same weight and bias (frozen, no
    gradient; `linear`'s own tensors with share=True, else copies), the same outputs to float
    rounding, the same mode; float32 inference on a CPU runs oneDNN's inner product on the packed
    copy, anything else PyTorch's linear. A copy of the module (deepcopy, pickle) packs again."""

    def __init__(self, linear: nn.Linear, share: bool = False) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        own = (lambda t: t.detach()) if share else (lambda t: t.detach().clone())
        self.weight = nn.Parameter(own(linear.weight), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(own(bias), requires_grad=False)
        self.train(linear.training)
        self._pack()

    def _pack(self) -> None:
        # not buffers: state_dict and .to() leave them. The weight as packed is kept (its memory
        # cannot be reused for another weight while this holds it) with its version then. Only a
        # float32 CPU weight is packed: a copy of a moved one (float64, meta, a GPU) has none.
        w = self.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            self.packed, self.packed_from, self.packed_version = None, w.detach(), -1
            return
        with torch.inference_mode(False):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        self.packed_from, self.packed_version = w.detach(), w._version

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # oneDNN's packed tensor cannot be copied or pickled
        for name in ("packed", "packed_from", "packed_version"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pack()

    def forward(self, x: Tensor) -> Tensor:
        if self.takes(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def takes(self, x: Tensor) -> bool:
        """Whether the packed weight computes this call: float32 inference on the CPU, the weight
        as packed (the same memory, no in-place change since: .to() gives it new memory), no
        tracing, compiling or torch.func / forward-mode AD."""
        if torch.is_grad_enabled() or type(x) is not Tensor or x.device.type != "cpu":
            return False
        if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return False
        if torch.jit.is_tracing() or torch.compiler.is_compiling() or cpu_kernels.transformed(x):
            return False
        w = self.weight  # another dtype or device (.to()) is new memory: packed_from holds the old
        return w.data_ptr() == self.packed_from.data_ptr() and w._version == self.packed_version


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def plain(module: nn.Module, kind: type[nn.Module] = nn.Linear) -> bool:
    """Whether module is a `kind` as PyTorch defines it (not a quantised, parametrised or wrapped
    one, no forward of its own), so its weight and bias can be used directly."""
    return type(module) is kind and "forward" not in vars(module)


def folds(layer: nn.Module, width: int = 1) -> bool:
    """Whether vitlab's kernel that reads this layer's output may add its bias instead (one pass
    over a fresh output fewer: micro's float32 training step 1.03x, BENCHMARKS.md, issue 16): a
    plain nn.Linear with a float32 bias of a multiple of `width` outputs, its weight a plain
    tensor (not a shard)."""
    bias = getattr(layer, "bias", None)
    if not plain(layer) or bias is None or type(layer.weight.data) is not Tensor:
        return False
    return bias.dtype == torch.float32 and bias.shape[0] % width == 0


def watched(*modules: nn.Module) -> bool:
    """Whether a hook (forward or backward; global, or on one of `modules`) may look at what
    they compute, so a shortcut that changes it must not run. FSDP's own hooks do not count
    (fully_shard gathers and frees parameters around a forward, whatever it returns)."""
    hooks = nn.modules.module
    if any(getattr(hooks, "_global" + kind) for kind in HOOKS):
        return True
    return any(
        not type(getattr(hook, "__self__", None)).__module__.startswith("torch.distributed.fsdp.")
        for m in modules
        for kind in HOOKS
        for hook in getattr(m, kind).values()
    )


def linear(module: nn.Module) -> bool:
    """A plain nn.Linear, or its packed form for inference (PackedLinear, above)."""
    return plain(module) or plain(module, PackedLinear)


def packable(module: nn.Module) -> bool:
    """A plain float32 nn.Linear on the CPU (not a subclass, quantised or wrapped layer) with no
    hook of its own (a packed copy is a new module: the hooks would be lost) and a weight of at
    least PACK_BYTES."""
    return (
        plain(module)
        and not any(getattr(module, kind) for kind in HOOKS)
        and type(module.weight) is nn.Parameter
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.numel() * 4 >= PACK_BYTES
    )


def pack_linear(model: nn.Module) -> nn.Module:
    """A copy of `model` (its modes kept) with every packable nn.Linear (a plain float32 CPU one
    of at least PACK_BYTES) replaced by a PackedLinear on the copy's weights; `model` itself
    unchanged. Where there is none, or oneDNN cannot pack here (a PyTorch built without it or
    with it switched off, a CPU it does not support), `model` itself."""
    names = [name for name, m in model.named_modules() if name and packable(m)]  # not the root
    if not names:
        return model
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        log.info("oneDNN is not available or switched off: linear layers run unpacked")
        return model
    with torch.inference_mode(False):  # the copy's tensors: not inference tensors
        packed = copy.deepcopy(model)
    try:
        for name in names:
            parent, _, attr = name.rpartition(".")
            layer = PackedLinear(packed.get_submodule(name), share=True)
            setattr(packed.get_submodule(parent), attr, layer)
    except RuntimeError as e:  # oneDNN refuses the layout or the CPU
        log.info("oneDNN cannot pack the linear layers here (%s): they run unpacked", e)
        return model
    return packed
