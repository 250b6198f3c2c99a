"""One training epoch: forward, loss, backward, accumulation, clipping, optimizer step, EMA, and the
checks that keep a run safe (non-finite loss, a stop request), all with explicit arguments."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vitlab.config import DistillConfig
from vitlab.data.loader import Loader
from vitlab.models.mpp import mpp_loss
from vitlab.runtime import Dist, derive_seed, rng_state
from vitlab.train.distill import TwoHeads, distillation_loss
from vitlab.train.distributed import all_sum, any_rank
from vitlab.train.optim import EMA
from vitlab.train.threads import PARTS, BatchThreads

log = logging.getLogger(__name__)
MAX_SKIPPED_STEPS = 10  # steps in a row with non-finite gradients before the run stops


class NonFiniteLoss(RuntimeError):
    """The loss, or the gradients, became NaN or infinite."""


@dataclass
class Position:
    """Where training stands: enough to resume exactly."""

    epoch: int = 0  # the epoch in progress (0-based)
    batch: int = 0  # batches of it already done
    step: int = 0  # optimizer steps done in all
    rng: dict[str, Tensor] = field(default_factory=dict)  # RNG states at (epoch, batch)
    # a stopped epoch's totals so far (all ranks): loss sum, right, predictions, images, seconds
    partial: list[float] = field(default_factory=list)


# (model, images, labels) -> (loss, predictions right or None, predictions made)
Objective = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor | None, int]]


def classification(label_smoothing: float = 0.0) -> Objective:
    """Cross-entropy against the labels (one-hot rows under mixup / cutmix); accuracy against
    their argmax."""

    def step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None, int]:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y, label_smoothing=label_smoothing)
        target = y.argmax(dim=1) if y.ndim == 2 else y
        return loss, (logits.argmax(dim=1) == target).sum(), len(y)

    return step


def distillation(
    cfg: DistillConfig, teacher: Callable[[Tensor], Tensor] | None, label_smoothing: float = 0.0
) -> Objective:
    """DeiT: the model (a distill.TwoHeads) returns its class and distillation heads' logits,
    `teacher` (None: the labels stand in) its logits for the same batch; distill's loss.
    Accuracy: the two heads' average (the model's prediction) against the labels."""

    def step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None, int]:
        cls, dist = model(x)
        target = teacher(x) if teacher is not None else None
        loss = distillation_loss(cls, dist, y, target, cfg, label_smoothing)
        labels = y.argmax(dim=1) if y.ndim == 2 else y
        return loss, ((cls.float() + dist.float()).argmax(dim=1) == labels).sum(), len(y)

    return step


def masked_patch_prediction(target: str) -> Objective:
    """vitlab.models.mpp's loss over the corrupted patches; the labels are not used. Accuracy:
    corrupted patches whose mean colour is predicted right (none for patch_l2)."""

    def step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None, int]:
        predictions, targets = model(x)
        loss, right = mpp_loss(predictions, targets, target)
        return loss, right, len(targets)

    return step


@dataclass
class StepSettings:
    accum_steps: int
    clip_grad: float | None
    lr_at: Callable[[int], float]  # optimizer step -> learning rate
    autocast: Callable[[], AbstractContextManager]
    objective: Objective = field(default_factory=classification)
    max_steps: int | None = None  # the run ends at this step (train.max_steps or time_budget)
    memory_format: torch.memory_format = torch.preserve_format  # the images' (train.channels_last)
    batch_threads: int = 1  # each batch's parts on this many threads (train.batch_threads)
    seed: int = 0  # train.seed: the batch parts' random streams derive from it


def train_epoch(
    model: nn.Module,
    loader: Loader,
    optimizer: torch.optim.Optimizer,
    settings: StepSettings,
    pos: Position,
    device: torch.device,
    d: Dist,
    ema: EMA | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    progress: Callable[[dict], None] = lambda stats: None,
) -> tuple[dict, bool]:
    """Train from pos.batch to the end of the epoch (or until a stop request, honoured at an
    optimizer-step boundary, where `pos` is then left). Returns (stats, stopped)."""
    model.train()
    accum = settings.accum_steps
    usable = len(loader) - len(loader) % accum  # whole accumulation windows only
    sums = [0.0, 0.0, 0.0, 0.0]  # loss sum, right, predictions, images (this rank)
    scored = True  # the objective's predictions are right or wrong (not a regression)
    start_time = time.perf_counter()
    skips = 0  # optimizer steps skipped in a row for non-finite gradients
    if pos.partial:  # resumed mid-epoch: the epoch's figures go on from the stop's (rank 0 adds)
        sums = list(pos.partial[:4]) if d.rank == 0 else sums
        start_time -= pos.partial[4]
    ddp = _ddp(model)
    threads = BatchThreads(model, settings.batch_threads) if settings.batch_threads > 1 else None
    pos.rng = rng_state(device)
    for i, (x, y) in enumerate(loader.iterate(pos.epoch, pos.batch), start=pos.batch):
        if i >= usable:
            break
        first, last = (i % accum == 0), ((i + 1) % accum == 0)
        if first and settings.max_steps is not None and pos.step >= settings.max_steps:
            break  # the run's last step (train.max_steps, or time_budget's plan, which may move
            # while the epoch runs): the epoch ends here
        if first and any_rank(stop_requested(), d, device):
            stats = _stats(sums, scored, start_time, d, device)
            pos.partial = [*stats.pop("sums"), stats["seconds"]]
            return stats, True
        x = x.to(device, non_blocking=True, memory_format=settings.memory_format)
        y = y.to(device, non_blocking=True)
        sync = last or ddp is None  # accumulating: no gradient all-reduce until the last
        with settings.autocast(), nullcontext() if sync else ddp.no_sync():
            if threads is None:
                loss, right, made = settings.objective(model, x, y)
            else:  # forward and backward already, the gradients held until the loss is checked
                loss, right, made = threads.forward_backward(
                    settings.objective,
                    x,
                    y,
                    settings.autocast,
                    accum,
                    derive_seed(settings.seed, PARTS, d.rank, pos.epoch, i),
                )
            value = loss.item()  # the step's one host sync
            if any_rank(not math.isfinite(value), d, device):
                raise NonFiniteLoss(
                    f"loss became {value} at step {pos.step} (epoch {pos.epoch + 1}, batch {i + 1})"
                )
            if threads is None:
                (loss / accum).backward()
            else:
                threads.add_gradients()
        if last:
            norm = grad_norm(model, settings.clip_grad)  # clipped to clip_grad, if set
            if any_rank(not math.isfinite(norm), d, device):  # skipped, as AMP's scaler does
                skips += 1
                where = f"step {pos.step} (epoch {pos.epoch + 1}, batch {i + 1})"
                if skips > MAX_SKIPPED_STEPS:
                    raise NonFiniteLoss(f"the gradients became {norm} at {where}, the loss "
                                        f"{value}, {skips} steps in a row")  # fmt: skip
                if d.is_main:  # every rank skips; one says so
                    log.warning("the gradients became %s at %s, the loss %s: step skipped, the "
                                "weights unchanged", norm, where, value)  # fmt: skip
            else:
                skips = 0
                for group in optimizer.param_groups:
                    group["lr"] = settings.lr_at(pos.step)
                optimizer.step()
                if ema is not None:
                    ema.update(_unwrap(model))
            optimizer.zero_grad(set_to_none=True)
            pos.step += 1
            pos.batch = i + 1
            pos.rng = rng_state(device)
        scored = right is not None
        sums[0] += value * len(y)
        sums[1] += right.item() if scored else 0.0
        sums[2] += made
        sums[3] += len(y)
        if last:
            acc = sums[1] / max(sums[2], 1) if scored else None
            progress({"loss": sums[0] / sums[3], "acc": acc, "batch": i + 1})
    # a batch past the last whole window was drawn (augmented) but not stepped on: the next
    # epoch goes on from the random state after it, and so must a run resumed from here
    pos.rng = rng_state(device)
    pos.partial = []
    stats = _stats(sums, scored, start_time, d, device)
    del stats["sums"]
    return stats, False


def grad_norm(model: nn.Module, clip: float | None = None) -> float:
    """The global 2-norm of the model's gradients (all ranks' shards under FSDP), after clipping
    them to `clip` when given (inf or NaN when any gradient is)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip:
        norm = nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP's DTensor
    return float(norm)


def _ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DDP module that `model` is or that torch.compile wrapped (None: not DDP)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    return model if isinstance(model, nn.parallel.DistributedDataParallel) else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain model under torch.compile, DDP and TwoHeads wrappers (whose state-dict keys
    carry `_orig_mod.`, `module.` and `student.`)."""
    model = getattr(model, "_orig_mod", model)
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return model.student if isinstance(model, TwoHeads) else model


def _stats(sums: list[float], scored: bool, t0: float, d: Dist, device: torch.device) -> dict:
    """The epoch's loss per image, accuracy (None for a regression objective), throughput, and
    the totals over all ranks (`sums`)."""
    loss, right, made, n = totals = all_sum(sums, d, device)
    seconds = time.perf_counter() - t0
    return {
        "sums": [float(v) for v in totals],
        "loss": loss / max(n, 1),
        "acc": right / max(made, 1) if scored else None,
        "images": int(n),
        "seconds": seconds,
        "images_per_s": n / seconds if seconds > 0 else 0.0,
    }
