"""vitlab's own C kernels for x86 CPUs in float32 (csrc/), and what they share: building,
loading, the switch, and running one kernel's work over PyTorch's threads.

- attention for short sequences, forward and backward (csrc/attention.c; cpu_attention.py says
  when it runs);
- LayerNorm for inference (csrc/norm_gelu.c): under torch.no_grad / inference_mode, float32 on
  the CPU. PyTorch's takes 2.8x as long over rows this short (D = 64, 128);
- GELU (the erf form), in place on fc1's output, for inference and training: with autograd the
  same pass writes the derivative, so the backward is one product (PyTorch's recomputes erf and
  exp): forward and backward 1.5x PyTorch's alone, about 1.02-1.04x a training step of the 28 px
  ViTs (BENCHMARKS.md, issue 16). With fc1's bias, added in the same pass (fc1 then runs as a
  matrix product without it: layers.Mlp, packed.folds).
- the residual join (csrc/norm_gelu.c), training and inference: a branch's last linear layer's
  output, computed without its bias, becomes output + bias + residual in place, one pass
  (layers.Block._joins says when).

They run when the CPU has AVX2 (PyTorch dispatches its AVX2 or AVX-512 kernels; Linux or macOS),
the tensors are plain float32 outside autocast (not traced or transformed by torch.jit,
torch.compile, torch.export or torch.func) and the kernels could be built: the C compiler (`$CC`,
else `cc`) compiles csrc/ once into ~/.cache/vitlab/kernels (`$XDG_CACHE_HOME`), in a few seconds;
a library found there is loaded only if it and its folder belong to this user and no one else
may write them. Where building fails, one warning, then PyTorch's operators.
`VITLAB_CPU_KERNELS=0` turns them off; `use_kernel(False)` does so inside a block.

Threads: built with -fopenmp, the library links libgomp.so.1, the OpenMP runtime PyTorch has
already loaded, so a kernel's parallel region runs on PyTorch's own thread team (a pool of
Python threads ran no faster on two threads than on one: its threads waited behind PyTorch's
spinning OpenMP threads). Where the compiler has no OpenMP (Apple's clang), one thread. Each
element is computed by the same code whatever the number of threads, so results do not depend
on it."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
_OPENMP = "-fopenmp"  # threads from PyTorch's own OpenMP runtime; built without it where refused
_switch = {"enabled": True}
_pointer, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # the last argument: threads; every kernel returns 0, or -1 when refused memory
    # qkv, bias, out, probs | B, T, H, d, scale
    "vitlab_attention_forward": [_pointer] * 4 + [_int] * 4 + [_float, _int],
    # qkv, bias, probs, dout, dqkv | B, T, H, d, scale
    "vitlab_attention_backward": [_pointer] * 5 + [_int] * 4 + [_float, _int],
    # x, weight, bias, y | D, eps, rows
    "vitlab_layer_norm": [_pointer] * 4 + [_int, _float, _int, _int],
    # x, slope, bias | n, width
    "vitlab_gelu": [_pointer] * 3 + [_int, _int, _int],
    # h, x, bias | n, width
    "vitlab_join": [_pointer] * 3 + [_int, _int, _int],
    "vitlab_openmp": [],  # 1 where built with OpenMP
}


@contextmanager
def use_kernel(enabled: bool) -> Iterator[None]:
    """Inside the block, vitlab's CPU kernels run where they apply (True) or never (False: PyTorch's
    operators), in every thread of this process (as torch.backends' switches)."""
    before = _switch["enabled"]
    _switch["enabled"] = enabled
    try:
        yield
    finally:
        _switch["enabled"] = before


def usable(x: Tensor) -> bool:
    """Whether a kernel may take x: the switch is on, x is a plain float32 CPU tensor (not a
    FakeTensor, DTensor, torch.func wrapper), nothing traces or compiles, no forward-mode AD, and
    the library is built."""
    if not _switch["enabled"] or type(x) is not Tensor:
        return False
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return False  # under bf16 autocast, PyTorch's operators as before
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or transformed(x):
        return False
    return library() is not None


def transformed(x: Tensor) -> bool:
    """Whether x is wrapped by torch.func (vmap, grad, jacrev) or forward-mode AD is on."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x) or forward_ad._current_level >= 0


def infers(x: Tensor) -> bool:
    """Whether LayerNorm over x may run on the kernel: no autograd (torch.no_grad or
    inference_mode) and a usable tensor (layer_norm also needs a width that is a multiple of 8)."""
    return not torch.is_grad_enabled() and usable(x)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """F.layer_norm over the last dimension (a multiple of 8) with weight and bias, float32, no
    autograd (infers(x) says whether it can run here)."""
    _check_takes(x, "layer_norm", weight, bias)
    width = x.shape[-1] if x.dim() else 0
    if width % 8 or weight.shape != (width,) or bias.shape != (width,) or width == 0:
        raise ValueError(
            f"layer_norm takes rows of a width that is a multiple of 8 and a weight and bias of "
            f"that width, got {tuple(x.shape)}, {tuple(weight.shape)} and {tuple(bias.shape)}"
        )
    if not (
        weight.dtype == bias.dtype == torch.float32 and weight.device == bias.device == x.device
    ):
        raise ValueError("layer_norm's weight and bias must be float32 on the CPU as x")
    x = x.contiguous()
    out = torch.empty_like(x)
    tensors = [x, weight.contiguous(), bias.contiguous(), out]
    rows = x.numel() // width
    run("vitlab_layer_norm", tensors, (width, eps, rows), rows, grain=64)
    return out


def gelu_(x: Tensor, bias: Tensor | None = None) -> Tensor:
    """x becomes F.gelu(x) (the erf form), in place, or with `bias` (x's last dimension, a
    multiple of 8) F.gelu(x + bias): a linear layer's bias added in the same pass, not in one of
    its own; float32 on the CPU, x contiguous. Where x or bias needs a gradient, differentiable
    once (a second derivative raises): the pass also writes GELU'(x) (the exp inside erf serves
    the density too), which the backward multiplies the gradient by (PyTorch's recomputes erf
    and exp from the input it keeps); bias's gradient is that summed over the rows. As PyTorch's
    in-place operators: a leaf that needs a gradient is refused untouched, and where autograd
    saved x for another operation's backward, that backward raises."""
    _check_takes(x, "gelu_", grad=True)
    if not x.is_contiguous():
        raise ValueError("gelu_ needs a contiguous tensor")
    if bias is not None:
        width = x.shape[-1] if x.dim() else 0
        wrong = bias.shape != (width,) or bias.dtype != x.dtype or bias.device != x.device
        if wrong or width % 8 or width == 0:
            raise ValueError(
                "gelu_'s bias is float32 on the CPU and as wide as x's last dimension, a multiple "
                f"of 8: got {tuple(bias.shape)} {bias.dtype} for x {tuple(x.shape)}"
            )
        bias = bias.contiguous()
    with_grad, plain = (lambda: _Gelu.apply(x, bias)), (lambda: _gelu(x, None, bias))
    return _in_place("gelu_", x, (x, bias), with_grad, plain)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None) -> Tensor:
        slope = torch.empty_like(x)
        _gelu(x, slope, bias)
        ctx.mark_dirty(x)
        ctx.save_for_backward(slope)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        (slope,) = ctx.saved_tensors
        g = grad * slope
        return g, g.reshape(-1, g.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None


def _gelu(x: Tensor, slope: Tensor | None, bias: Tensor | None = None) -> None:
    """x = GELU(x + bias) (bias None: GELU(x)), in place, and, given slope, slope = GELU'(x +
    bias); contiguous float32, bias as wide as x's rows (a multiple of 8)."""
    width = x.shape[-1] if bias is not None else 1
    tensors = [x, slope, bias]
    run("vitlab_gelu", tensors, (x.numel(), width), (x.numel() + 7) // 8, grain=2048)


def join_(h: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """h becomes h + bias + x, in place: a residual branch's last linear layer's output h,
    computed without its bias, joined to the residual stream x (h's shape) in one pass, where
    PyTorch's linear first fills h with the bias and the sum then writes a fresh tensor. Float32
    on the CPU, h contiguous, its last dimension a multiple of 8 and bias (or None) that wide. With
    autograd, differentiable once: the gradient passes to h and x as it comes, and bias's is its
    sum over the rows. As PyTorch's in-place operators: a leaf that needs a gradient is refused
    untouched, and where autograd saved h for another operation's backward, that backward
    raises."""
    _check_takes(h, "join_", grad=True)
    width = h.shape[-1] if h.dim() else 0
    if not h.is_contiguous() or width % 8 or width == 0 or x.shape != h.shape:
        raise ValueError(
            "join_ takes a contiguous h with rows of a multiple of 8 floats and an x of its shape, "
            f"got {tuple(h.shape)} and {tuple(x.shape)}"
        )
    for t in (x,) if bias is None else (x, bias):
        if t.dtype != torch.float32 or t.device != h.device:
            raise ValueError(f"join_'s x and bias are float32 on the CPU, got {t.dtype}")
    if bias is not None and bias.shape != (width,):
        raise ValueError(f"join_'s bias is as wide as h's rows ({width}), got {tuple(bias.shape)}")
    x, bias = x.contiguous(), None if bias is None else bias.contiguous()
    with_grad, plain = (lambda: _Join.apply(h, x, bias)), (lambda: _join(h, x, bias))
    return _in_place("join_", h, (h, x, bias), with_grad, plain)


def _in_place(
    what: str,
    x: Tensor,
    inputs: tuple[Tensor | None, ...],
    with_grad: Callable[[], Tensor],
    plain: Callable[[], None],
) -> Tensor:
    """Kernel `what` changes x in place as PyTorch's in-place operators do: through its autograd
    Function (with_grad) where grad mode is on and an input needs a gradient (a leaf x that needs
    one is refused untouched), else directly (plain), x's version moving (a backward that kept x
    then raises instead of computing a wrong gradient)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        if x.is_leaf and x.requires_grad:
            raise RuntimeError(
                f"{what}: a leaf Variable that requires grad cannot be changed in place"
            )
        return with_grad()
    plain()
    if not x.is_inference():  # autograd may have saved x: its version says it changed
        torch.autograd.graph.increment_version(x)
    return x


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
        _join(h, x, bias)
        ctx.mark_dirty(h)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_h, need_x, need_bias = ctx.needs_input_grad
        summed = grad.reshape(-1, grad.shape[-1]).sum(0) if need_bias else None
        return grad if need_h else None, grad if need_x else None, summed


def _join(h: Tensor, x: Tensor, bias: Tensor | None) -> None:
    """h = h + bias + x, in place; contiguous float32 of one shape, rows of a multiple of 8."""
    tensors = [h, x, bias]
    run("vitlab_join", tensors, (h.numel(), h.shape[-1]), h.numel() // 8, grain=2048)


def _check_takes(x: Tensor, what: str, *params: Tensor, grad: bool = False) -> None:
    """A ValueError unless the kernel `what` can take x (and its params): float32 on the CPU, no
    autograd through it unless it records a gradient (`grad`), the library built."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"{what} computes float32 on the CPU, got {x.dtype} on {x.device}")
    if not grad and torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)):
        raise ValueError(f"{what} records no gradient: call it under torch.no_grad()")
    if library() is None:
        raise ValueError(f"{what}: vitlab's CPU kernels are not built here")


def run(
    name: str, tensors: Sequence[Tensor | None], args: tuple, items: int, grain: int = 1
) -> None:
    """Call kernel `name` on `tensors` and `args`; it splits its `items` evenly over PyTorch's
    threads (its OpenMP team; at least `grain` items a thread), or runs on this thread where the
    library was built without OpenMP. ctypes lets go of the GIL during the call."""
    kernel = getattr(library(), name)
    pointers = [None if x is None else x.data_ptr() for x in tensors]
    threads = max(1, min(torch.get_num_threads(), items // grain))
    if kernel(*pointers, *args, threads):
        raise MemoryError(f"vitlab's CPU kernel {name} could not allocate its scratch memory")


@cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot run here (a warning says why once when
    building or loading failed)."""
    if os.environ.get("VITLAB_CPU_KERNELS", "1") == "0" or sys.platform == "win32":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        built = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        reason = e.stderr if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(
            f"vitlab's CPU kernels could not be built ({reason.strip()[-400:]}); PyTorch's "
            "operators run instead",
            stacklevel=2,
        )
        return None
    for name, argtypes in _SIGNATURES.items():
        kernel = getattr(built, name)
        kernel.argtypes, kernel.restype = argtypes, ctypes.c_int
    if not built.vitlab_openmp():
        warnings.warn(
            "vitlab's CPU kernels were built without OpenMP (the C compiler has none): they run "
            "on one thread",
            stacklevel=2,
        )
    return built


def _build() -> Path:
    """The kernels' library: from the cache folder if these sources and compiler built it before
    and only this user may write it there, else compiled (under a temporary name, then renamed:
    a half-written library is never loaded; into a private temporary folder where the cache
    folder is not safe to load from)."""
    command = shlex.split(os.environ.get("CC") or "cc")
    compiler = shutil.which(command[0]) if command else None
    if compiler is None:
        raise OSError(f"no C compiler: {os.environ.get('CC') or 'cc'} is not on PATH")
    command[0] = compiler
    sources = sorted(_CSRC.glob("*.c"))
    code = b"".join(p.read_bytes() for p in [*sources, *sorted(_CSRC.glob("*.h"))])
    key = hashlib.sha256(code + " ".join((*command, *_FLAGS)).encode())
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache_home / "vitlab" / "kernels"
    path = folder / f"kernels-{key.hexdigest()[:16]}.so"
    with suppress(OSError):  # a folder that cannot be made is not private: a temporary one
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):  # someone else's or shared: a library for this process only
        folder = Path(tempfile.mkdtemp(prefix="vitlab-kernels-"))
        path = folder / path.name
    single = path.with_name(path.stem + "-1thread.so")  # kept apart: a compiler may gain OpenMP
    if _private(path):
        return path
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / "kernels.so"
        compile_ = [*command, *_FLAGS, "-o", str(built), *map(str, sources)]
        try:  # with OpenMP where the compiler has it (Apple's clang has not: one thread)
            subprocess.run([*compile_, _OPENMP], capture_output=True, timeout=300, check=True)
        except subprocess.CalledProcessError:
            if _private(single):
                return single
            subprocess.run(compile_, capture_output=True, text=True, timeout=300, check=True)
            path = single
        os.replace(built, path)
    return path


def _private(path: Path) -> bool:
    """Whether path exists, belongs to this user, and no one else may write it."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
