"""Masked-patch-prediction metrics (a train.objective=mpp run's validation and test), summed over
all ranks under torchrun."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from vitlab.models.mpp import MaskedPatchViT, mpp_loss
from vitlab.runtime import Dist, all_reduce_, eval_mode


@torch.no_grad()
def evaluate_mpp(
    model: MaskedPatchViT,
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
    autocast: AbstractContextManager | None = None,
    d: Dist | None = None,
    seed: int = 0,
) -> dict:
    """{"loss", "top1", "num_images", "num_patches"}: the loss per corrupted patch and the share
    of corrupted patches whose mean colour is predicted right (top1; None for patch_l2). The
    corruption is drawn from a generator of its own seeded by (seed, rank), so every evaluation
    of a split on the same number of processes sees the same draws, and the training random
    streams are untouched. Samples labelled below 0 (the loaders' padding, which keeps ranks
    stepping together) run through the model but are not counted."""
    target = model.mpp_config.target
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, right, patches, images
    rank = d.rank if d is not None else 0
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + rank)
    with eval_mode(model):  # each submodule's own mode back after, errors too
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            scored = y >= 0
            with autocast or nullcontext():
                predictions, targets = model(x, scored, generator)
            if len(targets):  # the mean over no patches is NaN
                loss, right = mpp_loss(predictions, targets, target)
                totals[0] += loss.double() * len(targets)
                totals[1] += 0 if right is None else right
                totals[2] += len(targets)
            totals[3] += scored.sum()
    if d is not None and d.enabled:
        all_reduce_(totals)
    patches = max(totals[2].item(), 1.0)
    return {
        "loss": totals[0].item() / patches,
        "top1": None if target == "patch_l2" else totals[1].item() / patches,
        "num_images": int(totals[3].item()),
        "num_patches": int(totals[2].item()),
    }
