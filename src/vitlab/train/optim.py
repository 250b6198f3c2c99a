"""Optimisers with the ViT parameter groups, the learning-rate schedule, and an EMA of weights."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vitlab.config import OptimConfig


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
    """Linear warm-up from 0 to cfg.lr over warmup_steps, then cosine / linear decay to min_lr
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
