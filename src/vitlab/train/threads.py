"""train.batch_threads: each training batch in N parts (as even as can be), each part's forward and
backward on its own thread with 1/N of the CPU threads, the parts' gradients summed in order.

Why: at the widths trained on a CPU a step is many small kernels (LayerNorm, GELU, adds, copies,
attention over 50 tokens, matrix products with 64 columns) that two OpenMP threads share poorly;
two single-threaded halves kept both cores busy (1.12-1.39x a float32 step; since vitlab's CPU
kernels run on PyTorch's OpenMP team, 0.95-1.17x: BENCHMARKS.md, issue 16, goal 1). The step is the
same sum of per-image gradients, with these differences from one thread: BatchNorm normalises each
part by the part's statistics (as DDP's ranks do; its running statistics become the parts' mean,
where DDP keeps rank 0's); the model's own random draws (DropPath, masked patch prediction's
corruption) come from a generator per part seeded from (train.seed, rank, epoch, batch, part): a
run is reproducible (and resumable) but draws other masks than with one thread, while the default
stream (augmentation of in-memory datasets, mixup) goes on as with one thread; masked patch
prediction's `random` replacements come from the part's patches. Dropout layers draw from the
default stream, and gradient checkpointing recomputes with its state: both refused
(build.check_batch_threads), as are compile, torchrun and GPUs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import wait
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from vitlab.runtime import derive_seed, drawing_from, thread_pool
from vitlab.train.optim import laid_out_as

PARTS = 4  # the derive_seed tag of the parts' streams (data.stream's are 1-3)
Part = tuple[Tensor, Tensor | None, int, tuple[Tensor | None, ...]]  # loss, right, made, grads


class BatchThreads:
    """The parts' replicas of `model` (the model itself and n - 1 copies sharing its parameters
    and constant buffers, each with its own BatchNorm statistics) and the threads that run them."""

    def __init__(self, model: nn.Module, n: int) -> None:
        self.replicas = [model] + [_replica(model) for _ in range(n - 1)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norms = [_norms(r) for r in self.replicas]
        self.pool = thread_pool(n)
        self.grads: list[Tensor | None] = []

    def forward_backward(
        self,
        objective: Callable[[nn.Module, Tensor, Tensor], tuple],  # engine.Objective
        x: Tensor,
        y: Tensor,
        autocast: Callable[[], AbstractContextManager],
        accum: int,
        seed: int,
    ) -> tuple[Tensor, Tensor | None, int]:
        """The whole batch's (loss, right, made), as objective(model, x, y) gives them, after each
        part's forward and backward on its thread. The gradients (of loss / accum) are held until
        add_gradients(): a non-finite loss leaves the model's untouched. Part i draws its random
        numbers from a generator seeded with derive_seed(seed, i)."""
        main = self.replicas[0]
        for replica in self.replicas[1:]:
            replica.train(main.training)
        _copy_statistics(self.norms)
        xs, ys = _split(x, len(self.replicas)), _split(y, len(self.replicas))
        seeds = [derive_seed(seed, i) for i in range(len(xs))]
        jobs = [
            self.pool.submit(self._part, r, objective, a, b, s, autocast, len(a) / len(x) / accum)
            for r, a, b, s in zip(self.replicas, xs, ys, seeds)
        ]
        wait(jobs)  # all parts done, failed or not, before the model is touched again
        parts = [job.result() for job in jobs]  # in order; a part's exception is raised here
        _mean_statistics(self.norms[: len(parts)])
        self.grads = [_sum(g) for g in zip(*(grads for *_, grads in parts))]
        weights = [len(a) / len(x) for a in xs]
        loss = sum(w * loss for w, (loss, *_) in zip(weights, parts))
        scored = parts[0][1] is not None
        right = sum(right for _, right, *_ in parts) if scored else None
        return loss, right, sum(made for _, _, made, _ in parts)

    def add_gradients(self) -> None:
        """Add the held gradients to the parameters' .grad, laid out as the parameter."""
        for p, g in zip(self.params, self.grads):
            if g is None:
                continue
            if p.grad is not None:
                p.grad.add_(g)
            else:
                p.grad = laid_out_as(g, p)
        self.grads = []

    def _part(self, replica, objective, x, y, seed, autocast, weight) -> Part:
        with drawing_from(torch.Generator().manual_seed(seed)), autocast():
            loss, right, made = objective(replica, x, y)
        grads = torch.autograd.grad(loss * weight, self.params, allow_unused=True)
        return loss.detach(), right, made, grads


def _split(t: Tensor, n: int) -> tuple[Tensor, ...]:
    """t in n parts as even as can be (sizes differing by at most 1), none empty."""
    return tuple(part for part in torch.tensor_split(t, n) if len(part))


def _replica(model: nn.Module) -> nn.Module:
    """A copy of `model` sharing its parameters and buffers, except BatchNorm's statistics."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for m in _norms(model):
        for t in (m.running_mean, m.running_var, m.num_batches_tracked):
            shared.pop(id(t), None)
    return copy.deepcopy(model, memo=shared)


def _norms(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _copy_statistics(norms: list[list[_BatchNorm]]) -> None:
    """Every part's BatchNorm statistics: the model's (norms[0]), which may have been loaded."""
    for mine, *theirs in zip(*norms):
        for other in theirs:
            for name in _STATISTICS:
                getattr(other, name).copy_(getattr(mine, name))


def _mean_statistics(norms: list[list[_BatchNorm]]) -> None:
    """The model's BatchNorm running mean and variance: the mean over the parts' (one update each
    from the same start: the update by the parts' mean statistics)."""
    for mine, *theirs in zip(*norms):
        for name in ("running_mean", "running_var"):
            getattr(mine, name).add_(sum(getattr(t, name) for t in theirs)).div_(1 + len(theirs))


def _sum(grads: tuple[Tensor | None, ...]) -> Tensor | None:
    """The parts' gradients of one parameter, added in part order (None: no part used it)."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    total = present[0]
    for g in present[1:]:
        total = total + g
    return total
