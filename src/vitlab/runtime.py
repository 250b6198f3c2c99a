"""Run-time helpers every layer may use (a leaf: imports nothing from vitlab): the device to run
on and whether it computes in bf16, this process's place in a distributed run (Dist) and its
gloo-safe sum across ranks, seeds, random-number-generator state, a thread's own random stream,
the threads that share a batch, signal handlers installed for a block, the file that stands where
a folder is to be made, and a model in eval mode for a block (each submodule's own mode kept)."""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def pick_device(name: str, setting: str = "device") -> torch.device:
    """The device `name` names (`cpu`, `cuda`, `cuda:N`, `mps`), or for `auto` CUDA where it is
    available, else the CPU. Another name, or a device this machine lacks, is a ValueError
    naming `setting` (what the user set: `train.device`, `--device`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # not a device name: refused below
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{setting}={name!r}: expected auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}={name} but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{setting}={name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{setting}={name} but no MPS (Apple GPU) device is available")
    return device


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether to train under bf16 autocast: `bf16` yes, `fp32` no, `auto` on GPUs that support it
    and on CPUs with bf16 arithmetic (AVX512-BF16 or AMX; elsewhere PyTorch emulates bf16 and
    float32 is faster)."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86 AVX512-BF16 or AMX tiles) and PyTorch
    dispatches its AVX-512 kernels: with them held to AVX2 (ATEN_CPU_CAPABILITY=avx2, how
    benchmarks reproduce an AVX2-only CPU) bf16 is emulated, and float32 is the fast path."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


@dataclass
class Dist:
    """This process's place in a distributed run (torchrun); the defaults are a single process.
    vitlab.train.distributed joins the process group and makes one."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    peers: tuple[str, ...] = ()  # "HOST PID" of every rank, to name one that is lost

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_rank(local: bool = False) -> bool:
    """Whether this process is torchrun's rank 0 (of its machine, `local`), or runs alone: the one
    that says what every process would say alike (read before the process group is joined)."""
    return os.environ.get("LOCAL_RANK" if local else "RANK", "0") == "0"


def launched_processes() -> int:
    """How many processes torchrun started for the run (WORLD_SIZE; 1 without torchrun), read
    before the process group is joined."""
    return int(os.environ.get("WORLD_SIZE", "").strip() or 1)


_let_go_s = 10.0  # how long all_reduce_ waits for gloo (0 once a wait timed out: warned once)


def all_reduce_(t: Tensor) -> Tensor:
    """Sum `t` over all ranks, in place, returning once the collective's gloo work has let go of
    it. A work holds `t` and, in torch's C++, a reference to its Python object; the gloo worker
    thread that drops them right after the wait returns needs the GIL for that, and one still
    asking for it when the interpreter shuts down aborts the process ("terminate called without
    an active exception", SIGABRT) after a run that had finished. NCCL's watchdog drops its works
    much later: not waited for."""
    global _let_go_s
    import torch.distributed as dist

    base = sys.getrefcount(t)
    try:
        dist.all_reduce(t)
    finally:
        deadline, spins = time.monotonic() + _let_go_s, 0
        while t.device.type == "cpu" and (t._use_count() > 1 or sys.getrefcount(t) > base):
            if time.monotonic() > deadline:
                if _let_go_s:
                    logging.getLogger(__name__).warning(  # vitlab's warning, not Python's
                        "gloo kept a summed tensor for %.0f s; no longer waiting for it", _let_go_s
                    )
                _let_go_s = 0.0
                break
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)  # lets the worker take the GIL
    return t


def file_mode() -> int:
    """The mode a new file gets from this process's umask (0644 under 022): for files written
    under a temporary name first, which mkstemp and safetensors create 0600."""
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


def blocking_file(path: Path) -> Path | None:
    """The nearest of `path` and the folders above it that exists, where that is not a folder (so
    nothing can be made at `path`); None when the way is clear."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def folder_refusal(path: Path, purpose: str) -> str | None:
    """Why `path` cannot be the folder for `purpose` (it, or a folder above it, is a file), in
    words; None when the way is clear."""
    blocked = blocking_file(path)
    if blocked == path:
        return f"{path} is a file: expected a folder (new or existing) for {purpose}"
    if blocked is not None:
        return (
            f"{path} cannot be made: {blocked} is a file, not a folder; expected a folder (new or "
            f"existing) for {purpose}"
        )
    return None


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of `parts` (e.g. seed, epoch, batch, rank): the same
    parts give the same seed in every process and run, and neighbouring parts give unrelated
    seeds (a hash, not a sum: seed 1 rank 0 and seed 0 rank 1 do not collide)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rng_state(device: torch.device) -> dict[str, Tensor]:
    """The state of torch's random-number generators: the CPU's, and `device`'s when it is CUDA."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Tensor], device: torch.device) -> None:
    """Restore generators to `state` (from rng_state)."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


_stream = threading.local()


def random_stream() -> torch.Generator | None:
    """The generator a model's own random draws (DropPath, masked patch prediction's corruption)
    take on this thread: a batch part's under train.batch_threads (drawing_from), else None,
    PyTorch's default stream, which threads would share in an order that differs run to run."""
    return getattr(_stream, "generator", None)


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """random_stream() is `generator` on this thread inside the block."""
    _stream.generator = generator
    try:
        yield
    finally:
        _stream.generator = None


def quiet() -> bool:
    """Whether -q asked for fewer messages (vitlab's loggers at ERROR): no progress bars then."""
    return logging.getLogger("vitlab").getEffectiveLevel() >= logging.ERROR


def progress(text: str) -> None:
    """A progress line on stderr (`vitlab reproduce`'s arm by arm), which -q hides as it hides
    the bars: results and errors are what -q leaves."""
    if not quiet():
        print(text, file=sys.stderr, flush=True)


_no_bars: contextvars.ContextVar[bool] = contextvars.ContextVar("no_bars", default=False)


def bars_off() -> bool:
    """Whether progress bars (vitlab's and the libraries' it calls) are off: -q, or inside
    without_bars."""
    return quiet() or _no_bars.get()


@contextmanager
def without_bars(off: bool = True) -> Iterator[None]:
    """No progress bars inside, where `off` (`data shard --no-progress`: the datasets library's
    as it loads an hf: source too)."""
    token = _no_bars.set(off or _no_bars.get())
    try:
        yield
    finally:
        _no_bars.reset(token)


_quiet_status: contextvars.ContextVar[bool] = contextvars.ContextVar("quiet_status", default=False)


class _Nowhere:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def status_file() -> Any:
    """Where a run's status lines go (its header, epochs, test line, plans): stderr, or nowhere
    inside quiet_status() (`vitlab reproduce -q`: its report holds each run's results). Warnings
    and errors go to stderr in any case."""
    return _Nowhere() if _quiet_status.get() else sys.stderr


@contextmanager
def quiet_status(quiet: bool = True) -> Iterator[None]:
    token = _quiet_status.set(quiet)
    try:
        yield
    finally:
        _quiet_status.reset(token)


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode inside (no dropout, no drop path: the same numbers every call); every
    submodule's own mode as the caller left it after, errors included."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def thread_pool(n: int) -> ThreadPoolExecutor:
    """n worker threads sharing this thread's PyTorch threads (each torch.get_num_threads() // n,
    at least 1), for a batch's parts (train.batch_threads, --batch-threads). Kept for the process
    (idle threads cost nothing), one pool per (n, threads each)."""
    return _pool(n, max(1, torch.get_num_threads() // n))


@cache
def _pool(n: int, threads: int) -> ThreadPoolExecutor:
    total = torch.get_num_threads()
    ready = threading.Barrier(n)
    pool = ThreadPoolExecutor(n, "vitlab-part", initializer=_set_threads, initargs=(threads,))
    for job in [pool.submit(ready.wait) for _ in range(n)]:  # n threads, each initialised
        job.result()
    torch.set_num_threads(total)  # the count threads started later begin with, which the
    return pool  # workers' torch.set_num_threads set too


def _set_threads(threads: int) -> None:
    """This thread's kernels run on `threads` threads (after it took the process's count once:
    a thread does so at its first parallel kernel, which would undo a count set before)."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def seeded_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(kept, carved) index tensors: a seeded `fraction` of range(n) carved out, rounded, and at
    least one item on each side when 0 < fraction < 1 and n >= 2."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = int(round(n * fraction))
    if 0 < fraction < 1 and n >= 2:
        k = min(n - 1, max(1, k))
    return perm[k:].sort().values, perm[:k].sort().values


# glibc mallopt parameters (malloc.h) and what vitlab sets them to
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_ALLOCATOR = {_M_MMAP_THRESHOLD: 1 << 30, _M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 1 << 28}
_OLD_GLIBC_MMAP_MAX = 32 << 20  # glibc before 2.35 refuses a larger mmap threshold
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_USER_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad")  # glibc.malloc.NAME
_allocator = {"tuned": False}  # set by tune_allocator()


def allocator_returns_memory() -> bool:
    """Whether glibc's allocator runs with its defaults here, returning large freed blocks to the
    OS (faulted in again at the next allocation): not after tune_allocator(), nor with a user's
    own settings, another allocator preloaded (jemalloc, tcmalloc), or another C library (where
    it is not known)."""
    return not _allocator["tuned"] and _glibc_defaults()


@cache
def _glibc_defaults() -> bool:
    """glibc's malloc, not another one preloaded, without a user's settings of the thresholds
    vitlab sets (the environment, which glibc reads at start only)."""
    import ctypes
    import os
    import platform

    if platform.libc_ver()[0] != "glibc" or any(k in os.environ for k in _USER_SETTINGS):
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{name}" in tunables for name in _USER_TUNABLES):
        return False
    try:  # the malloc every library calls is libc's own, not an interposed one
        called, own = ctypes.CDLL(None).malloc, ctypes.CDLL("libc.so.6").malloc
    except (OSError, AttributeError):
        return False
    address = ctypes.cast(called, ctypes.c_void_p).value
    return address == ctypes.cast(own, ctypes.c_void_p).value


def tune_allocator() -> bool:
    """Keep freed memory for the next allocation instead of returning it to the OS (glibc only).

    glibc's malloc serves every block over its mmap threshold (32 MiB at most) with fresh pages,
    returns them on free, and the next allocation faults them in again: for the 10-100 MB
    activations and batches of CPU training, those page faults cost about a quarter of a step
    (the nano preset's fp32 training step 1,035 -> 1,353 img/s, its inference 2,795 -> 5,403,
    measured on 2 cores). With thresholds of 1 GiB the heap keeps what a step frees, so a
    process's memory stays at its peak rather than rising and falling (DataLoader workers, forked
    from it, inherit the setting). The vitlab command calls this at start; a user's own settings
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, or the same glibc.malloc
    tunables) and another malloc preloaded (jemalloc, tcmalloc) win; elsewhere than glibc this
    does nothing. True when every setting was applied."""
    import ctypes

    if not _glibc_defaults():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    applied = [mallopt(param, value) == 1 for param, value in _ALLOCATOR.items()]
    if not applied[0]:  # an older glibc: the largest threshold it takes
        applied[0] = mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_MAX) == 1
    _allocator["tuned"] = any(applied)
    return all(applied)


class Terminated(BaseException):
    """SIGTERM outside training's loop (which saves and stops on it: train.stop.StopFlag), as the
    command raises it (cli.main.sigterm_raises): a BaseException, as KeyboardInterrupt is."""


@contextmanager
def handling(signals: tuple[int, ...], handler: Any, keep_ignored: bool = False) -> Iterator[dict]:
    """`handler` for each of `signals` while the block runs, each one's previous handler put back
    after; yields {signal: previous handler}, which the block may change. Installs nothing off the
    main thread, nor, with keep_ignored, for a signal the caller ignores (SIG_IGN). A previous
    handler set from C (getsignal's None) cannot be put back, and becomes SIG_DFL."""
    old: dict[int, Any] = {}
    try:  # what was installed is put back, also when a later install fails
        for sig in signals:
            previous = signal.getsignal(sig)
            if keep_ignored and previous is signal.SIG_IGN:
                continue
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                continue
            old[sig] = previous
        yield old
    finally:
        for sig, previous in old.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
