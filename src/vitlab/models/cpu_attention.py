"""vitlab's own attention kernel for short sequences on x86 CPUs in float32 (csrc/attention.c):
softmax(scale q k^T) v per (batch, head), forward and backward, read straight from the qkv
projection's output and written in the layout the output projection reads (no permute copies).

PyTorch's fused CPU attention runs at about a quarter of the machine's matrix-product rate on the
50-token sequences of vitlab's 28 px models (BENCHMARKS.md, issue 16); this kernel keeps each
(batch, head) pair's T x T block in cache and computes it with AVX2 + FMA register tiles, on this
thread and PyTorch's other threads (pairs split evenly; each pair is computed by the same code
whatever the split). The backward reuses the softmax kept from the forward (B x H x T x T floats
a layer, about a quarter more activation memory). Its gain is mostly in the backward: forward
and backward together run 1.57-2.16x faster than PyTorch's at 50 tokens, 1.11-1.55x at 65, level
at 197; the forward alone 1.05-1.45x at 50 tokens and slower from 65 on two threads
(BENCHMARKS.md). So the model takes it where gradients are computed, up to MAX_TOKENS tokens.

Attention runs here when all of these hold, else through F.scaled_dot_product_attention:
gradients are computed (grad mode on, qkv requires grad), float32 tensors on the CPU, a head
width that is a multiple of 8, at most MAX_TOKENS tokens, no attention bias or dropout, not
traced or transformed (torch.jit, torch.compile, torch.export, torch.func, forward-mode AD), the
CPU has AVX2 (PyTorch dispatches its AVX2 or AVX-512 kernels; Linux or macOS), and the kernel
could be built: the C compiler (`$CC`, else `cc`) compiles it once into ~/.cache/vitlab/kernels
(`$XDG_CACHE_HOME`), in about a second; a library found there is loaded only if it and its
folder belong to this user and no one else may write them. `VITLAB_CPU_ATTENTION=0` turns the
kernel off; `use_kernel(False)` does so inside a block."""

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
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

MAX_TOKENS = 128  # measured faster at 50 and 65 tokens, level at 197
_SOURCE = Path(__file__).with_name("csrc") / "attention.c"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
_switch = {"enabled": True}
_helpers = threading.local()  # each calling thread's own helper threads


@contextmanager
def use_kernel(enabled: bool) -> Iterator[None]:
    """Inside the block, attention (in every thread of this process, as torch.backends' switches)
    takes the kernel where it applies (True) or always F.scaled_dot_product_attention (False)."""
    before = _switch["enabled"]
    _switch["enabled"] = enabled
    try:
        yield
    finally:
        _switch["enabled"] = before


def applies(qkv: Tensor, heads: int) -> bool:
    """Whether attention over `qkv` (B, T, 3D), the qkv projection's output, runs on the kernel
    (the caller has checked there is no bias and no dropout)."""
    if not _switch["enabled"] or type(qkv) is not Tensor:  # not a FakeTensor, DTensor, ...
        return False
    if not (torch.is_grad_enabled() and qkv.requires_grad):  # its forward alone gains nothing
        return False
    if _reason_not(qkv, heads) is not None or qkv.shape[1] > MAX_TOKENS:
        return False
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or _transformed(qkv):
        return False
    return _library() is not None


def attention(qkv: Tensor, heads: int, scale: float) -> Tensor:
    """softmax(scale q k^T) v for every head: (B, T, 3D) -> (B, T, D), differentiable once. A
    ValueError says why if the kernel cannot take `qkv` (applies() says whether it can)."""
    reason = _reason_not(qkv, heads) or (_library() is None and "the kernel is not built here")
    if reason:
        raise ValueError(f"vitlab's CPU attention kernel cannot take this input: {reason}")
    qkv = qkv.contiguous()
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _Attention.apply(qkv, heads, scale)
    return _forward(qkv, heads, scale, keep=False)[0]


def _reason_not(qkv: Tensor, heads: int) -> str | None:
    """What the kernel needs that qkv lacks, or None."""
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32:
        return f"it computes float32 on the CPU, got {qkv.dtype} on {qkv.device}"
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * heads):
        return f"expected (B, T, 3 x {heads} heads x d), got {tuple(qkv.shape)}"
    if qkv.shape[-1] // (3 * heads) % 8:
        return f"the head width must be a multiple of 8, got {qkv.shape[-1] // (3 * heads)}"
    return None


def _transformed(qkv: Tensor) -> bool:
    """Whether qkv is wrapped by torch.func (vmap, grad, jacrev) or forward-mode AD is on."""
    functorch = torch._C._functorch
    return functorch.is_functorch_wrapped_tensor(qkv) or forward_ad._current_level >= 0


def _forward(qkv: Tensor, heads: int, scale: float, keep: bool) -> tuple[Tensor, Tensor | None]:
    """The output (B, T, D) and, with `keep`, the softmax for the backward (B, H, T, Tp): each
    row in whole vectors of 8, the padding zero."""
    b, t, width = qkv.shape
    out = qkv.new_empty(b, t, width // 3)  # (B, T, H, d) flat
    probs = qkv.new_empty(b, heads, t, (t + 7) // 8 * 8) if keep else None
    _run("vitlab_attention_forward", [qkv, out, probs], heads, scale)
    return out, probs


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, heads: int, scale: float) -> Tensor:
        out, probs = _forward(qkv, heads, scale, keep=True)
        ctx.save_for_backward(qkv, probs)
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        qkv, probs = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        tensors = [qkv, probs, grad.contiguous(), dqkv]
        _run("vitlab_attention_backward", tensors, ctx.heads, ctx.scale)
        return dqkv, None, None


def _run(name: str, tensors: list[Tensor | None], heads: int, scale: float) -> None:
    """Call the kernel `name` on `tensors` (qkv first), its (batch, head) pairs split evenly over
    this thread and PyTorch's other threads (ctypes lets go of the GIL during each call)."""
    b, t, width = tensors[0].shape
    shape = (b, t, heads, width // (3 * heads))  # B, T, H, d
    kernel = getattr(_library(), name)
    pointers = [None if x is None else x.data_ptr() for x in tensors]
    pairs = b * heads
    n = max(1, min(torch.get_num_threads(), pairs))

    def part(i: int) -> int:
        return kernel(*pointers, *shape, scale, pairs * i // n, pairs * (i + 1) // n)

    pool = _helper_pool(n - 1) if n > 1 else None
    others = [pool.submit(part, i) for i in range(1, n)] if pool else []
    try:
        first = part(0)  # this thread computes the first part
    finally:
        wait(others)  # no helper may still write into tensors about to be freed
    if first or any(job.result() for job in others):
        raise MemoryError(f"vitlab's attention kernel could not allocate its scratch ({name})")


def _helper_pool(n: int) -> ThreadPoolExecutor:
    """n helper threads of the calling thread's own (callers that run at once, such as
    train.batch_threads' parts, never queue behind each other)."""
    pool, size = getattr(_helpers, "pool", None), getattr(_helpers, "size", 0)
    if size != n:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = _helpers.pool = ThreadPoolExecutor(n, "vitlab-attention")
        _helpers.size = n
    return pool


@cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot run here (a warning says why once when building
    or loading failed)."""
    if os.environ.get("VITLAB_CPU_ATTENTION", "1") == "0" or sys.platform == "win32":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        reason = e.stderr if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(
            f"vitlab's CPU attention kernel could not be built ({reason.strip()[-400:]}); "
            "attention runs through F.scaled_dot_product_attention",
            stacklevel=2,
        )
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    shape = [size] * 4 + [ctypes.c_float, size, size]  # B, T, H, d, scale, start, end
    library.vitlab_attention_forward.argtypes = [pointer] * 3 + shape
    library.vitlab_attention_backward.argtypes = [pointer] * 4 + shape
    for kernel in (library.vitlab_attention_forward, library.vitlab_attention_backward):
        kernel.restype = ctypes.c_int
    return library


def _build() -> Path:
    """The kernel's library: from the cache folder if this source and compiler built it before
    and only this user may write it there, else compiled (under a temporary name, then renamed:
    a half-written library is never loaded; into a private temporary folder where the cache
    folder is not safe to load from)."""
    command = shlex.split(os.environ.get("CC") or "cc")
    compiler = shutil.which(command[0]) if command else None
    if compiler is None:
        raise OSError(f"no C compiler: {os.environ.get('CC') or 'cc'} is not on PATH")
    command[0] = compiler
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join((*command, *_FLAGS)).encode())
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache_home / "vitlab" / "kernels"
    path = folder / f"attention-{key.hexdigest()[:16]}.so"
    with suppress(OSError):  # a folder that cannot be made is not private: a temporary one
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(folder):  # someone else's or shared: a library for this process only
        folder = Path(tempfile.mkdtemp(prefix="vitlab-kernels-"))
        path = folder / path.name
    if not _private(path):
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = Path(tmp) / "attention.so"
            compile_ = [*command, *_FLAGS, "-o", str(built), str(_SOURCE)]
            subprocess.run(compile_, capture_output=True, text=True, timeout=300, check=True)
            os.replace(built, path)
    return path


def _private(path: Path) -> bool:
    """Whether path exists, belongs to this user, and no one else may write it."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
