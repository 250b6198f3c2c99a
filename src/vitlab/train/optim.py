"""Optimisers with the ViT parameter groups, the learning-rate schedule, and an EMA of weights."""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn

from vitlab.config import OptimConfig, RunConfig

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and what model.no_weight_decay() names (biases, norms,
    position embeddings, class token) with weight decay 0."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name in skip or p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def laid_out_as(t: Tensor, p: Tensor) -> Tensor:
    """t (p's shape) in p's memory layout: fused AdamW reads gradients and moments in the
    parameter's memory order, and ones laid out otherwise (NCHW against channels-last) would be
    silently scrambled."""
    return t if t.stride() == p.stride() else torch.empty_like(p).copy_(t)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (fused: one kernel for all tensors instead of PyTorch's per-tensor CPU default; FSDP's
    sharded parameters keep the default) or SGD."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        plain = all(type(p.data) is torch.Tensor for p in model.parameters())
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=plain or None)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def learning_rate(cfg: OptimConfig, step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up to cfg.lr over warmup_steps (step i at (i + 1) / warmup_steps of it: the
    first step trains, the last warm-up step and the first decay step are at cfg.lr; timm's
    CosineLRScheduler starts at 0 and is one step behind), then cosine / linear decay to min_lr
    (or constant) until total_steps."""
    if step < warmup_steps:
        return cfg.lr * (step + 1) / warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if cfg.schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def warn_warmup(cfg: RunConfig, total_steps: int, warmup_steps: int, said: bool = True) -> None:
    """Warn when the warm-up takes every step (train.epochs=2, or train.max_steps=30, with the
    default optim.warmup_epochs=2): the rate only rises, and never decays. A time budget lays its
    own schedule (warm-up at most a fifth of its steps): not warned. `said`: this process says
    it (rank 0 of many)."""
    if not said or cfg.train.time_budget is not None or not 0 < total_steps <= warmup_steps:
        return
    o = cfg.optim
    decay = "" if o.schedule == "constant" else f", with no {o.schedule} decay"
    log.warning(
        "optim.warmup_epochs=%g (%d step%s) spans the whole run (%d step%s): the learning rate "
        "only rises, to %.3g at the last step (optim.lr=%g)%s; optim.warmup_epochs=%.3g (a fifth "
        "of the steps, as a time budget lays it) leaves the rest to the schedule", o.warmup_epochs,
        warmup_steps, "s" * (warmup_steps != 1), total_steps, "s" * (total_steps != 1),
        learning_rate(o, total_steps - 1, total_steps, warmup_steps), o.lr, decay,
        o.warmup_epochs * total_steps / warmup_steps / 5,
    )  # fmt: skip


def warn_schedule(cfg: RunConfig, total_steps: int, warmup_steps: int, said: bool = True) -> None:
    """warn_warmup, and a length the run will not reach: train.max_steps past train.epochs (the
    run ends with the epochs: a timm user expects the steps) or train.stop_at_epoch past them."""
    if not said:
        return
    warn_warmup(cfg, total_steps, warmup_steps)
    t = cfg.train
    if t.time_budget is None and t.max_steps and t.max_steps > total_steps:
        log.warning("train.max_steps=%d is more than train.epochs=%d take (%d steps): the run ends "
                    "at step %d; raise train.epochs for more (it is the most a run may take)",
                    t.max_steps, t.epochs, total_steps, total_steps)  # fmt: skip
    if t.stop_at_epoch is not None and t.stop_at_epoch > t.epochs:
        log.warning("train.stop_at_epoch=%d is past train.epochs=%d: the run ends at epoch %d",
                    t.stop_at_epoch, t.epochs, t.epochs)  # fmt: skip


class EMA:
    """Exponential moving average of a model's floating-point state: ema = d ema + (1 - d) w."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {
            k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        state = model.state_dict()
        keys = list(self.shadow)
        torch._foreach_lerp_(
            [self.shadow[k] for k in keys], [state[k].detach() for k in keys], 1.0 - self.decay
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)

    def apply_to(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Copy the averaged weights into model; returns the raw weights to restore later."""
        raw = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict({**raw, **self.shadow})
        return raw
