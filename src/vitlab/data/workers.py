"""DataLoader plumbing shared by the loaders of streamed data (image files, HF rows, shards): the
worker settings, ending the workers, naming undecodable images once, and the padding label."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitlab.config import DataConfig
from vitlab.data.decode import available_cores
from vitlab.runtime import first_rank

Batch = tuple[Tensor, Tensor]
PADDING = -1  # the label of a padding sample: evaluated so ranks step together, never counted
MAX_WORKERS = 8  # data.workers' default at most: more rarely helps and each holds memory
log = logging.getLogger(__name__)
_said_workers: set[tuple[int, int]] = set()  # (workers, cores) said of in this process


class _Loader(DataLoader):
    """PyTorch's DataLoader without its more-workers-than-cores warning, which it gives at each
    iterator it starts (four times a run, mid progress bar): make_loader says it once."""

    def check_worker_number_rationality(self) -> None:
        pass


def signals_to_main(worker_id: int = 0) -> None:
    """A loader worker's start (worker_init_fn): a process group of its own, so that Ctrl-C and a
    SIGTERM sent to the command's group (a terminal's, a scheduler's, `timeout`'s) reach the main
    process alone, which ends the workers as it stops (PyTorch's terminate() of a stuck one still
    works: a worker exits on its parent's SIGTERM). In the group, a SIGTERM killed the workers
    first, and the main's loader then raised "DataLoader worker ... is killed by signal" mid-step
    (training stopped without saving), and the main's handlers ran in each worker (training's
    "stop requested" once a worker). Out of the group, a kill of it no longer reaches a worker:
    on Linux it gets SIGKILL when its parent ends (a worker stuck in a read would outlive a
    killed main). Nothing on systems without process groups (Windows)."""
    if not hasattr(os, "setpgid"):
        return
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # it ended before the prctl
            os._exit(0)


def warn_once(seen: set[str], bad: list[tuple[str, str]]) -> None:
    """Log each undecodable image, (name, why), the first time it comes."""
    for where, why in bad:
        if where not in seen:
            seen.add(where)
            log.warning("skipping an image that does not decode: %s", why)


def from_workers(batches: Iterator) -> Iterator:
    """`batches` from DataLoader workers, a vitlab error raised in a worker (a damaged shard, a
    sample without a label) raised here as itself: PyTorch re-raises it with its message replaced
    by "Caught DatasetError in DataLoader worker process 0" and the worker's whole traceback."""
    try:
        yield from batches
    except Exception as e:
        raised = _as_raised(e)
        if raised is e:
            raise  # as it came, its cause and traceback kept
        raise raised from None


def _as_raised(e: Exception) -> Exception:
    """A worker's vitlab error as raised there (its own message), else `e`."""
    kind, text = type(e), str(e)
    said = f"{kind.__module__}.{kind.__qualname__}: "  # the traceback's last line's start
    if not (kind.__module__.startswith("vitlab.") and text.startswith("Caught ")):
        return e
    if "in DataLoader worker process" not in text.partition("\n")[0] or said not in text:
        return e
    try:
        return kind(text[text.rindex(said) + len(said) :].rstrip())
    except Exception:  # a type that takes other arguments: as PyTorch raised it
        return e


def shut_down(loader: DataLoader | Iterator | None) -> None:
    """End the worker processes of a DataLoader (of its persistent iterator) or of one of its
    iterators now."""
    it = getattr(loader, "_iterator", None) if isinstance(loader, DataLoader) else loader
    if it is not None and hasattr(it, "_shutdown_workers"):  # torch's multi-process iterator
        it._shutdown_workers()
    if isinstance(loader, DataLoader):
        loader._iterator = None


@dataclass
class LoaderOptions:
    """DataLoader settings for streamed data (files, shards, HF rows)."""

    workers: int = 0
    pin_memory: bool = False  # page-locked batches: faster, asynchronous copies to a GPU
    prefetch: int = 2  # batches each worker prepares ahead
    persistent: bool = True  # keep the workers from one epoch to the next
    chosen: bool = True  # workers set by data.workers (False: the default, this process's share)

    def say_if_many(self) -> None:
        """Warn (once a process for each count) where the workers outnumber the cores."""
        cores = available_cores()
        said = first_rank(local=True)  # each machine's processes alike: one says it
        if said and self.workers > cores and (self.workers, cores) not in _said_workers:
            _said_workers.add((self.workers, cores))
            log.warning(
                "data.workers=%d starts %d loader processes on the %d core%s this process may "
                "use, where they compete with training's threads (more workers than cores help "
                "only where loading waits on storage; the default is this process's share of the "
                "cores)",
                self.workers, self.workers, cores, "" if cores == 1 else "s",
            )  # fmt: skip

    def dataloader(self, dataset: Dataset, **kw: object) -> DataLoader:
        extra = {}
        if self.workers:
            extra = {"prefetch_factor": self.prefetch, "persistent_workers": self.persistent,
                     "worker_init_fn": signals_to_main}  # fmt: skip
        # the workers' base seed (unused: each batch has its own), not from the global RNG
        gen = torch.Generator().manual_seed(0)
        return _Loader(
            dataset, num_workers=self.workers, pin_memory=self.pin_memory, generator=gen,
            **extra, **kw,
        )  # fmt: skip


def loader_options(cfg: DataConfig, device: torch.device) -> dict:
    """make_loader's keyword arguments for a run: cfg's workers (default: this process's share
    of the cores it may use, among torchrun's processes on this machine, at most MAX_WORKERS),
    pinned memory when training on a GPU, cfg's prefetch depth."""
    workers = cfg.workers
    if workers is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        workers = max(1, min(MAX_WORKERS, available_cores() // max(local_world, 1)))
    return {
        "workers": workers,
        "workers_chosen": cfg.workers is not None,
        "pin_memory": device.type == "cuda",
        "prefetch": cfg.prefetch,
        "buffer": cfg.shuffle_buffer,
    }
