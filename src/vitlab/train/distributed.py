"""torchrun set-up: process group (gloo on CPU, NCCL on GPU), model wrapping (DDP or FSDP's
fully_shard), and reductions of metrics across ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: torch.device) -> Dist:
    """Join the process group torchrun describes in the environment (a single process otherwise)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def wrap(model: nn.Module, d: Dist, strategy: str, device: torch.device) -> nn.Module:
    """DDP, or FSDP2 (fully_shard on each block, then the root) for models too big for one GPU."""
    if not d.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_sum(values: list[float], d: Dist, device: torch.device) -> list[float]:
    """Element-wise sum of a list of numbers over all ranks."""
    if not d.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool, d: Dist, device: torch.device) -> bool:
    """True on every rank when flag is True on any rank (keeps ranks stepping together)."""
    if not d.enabled:
        return flag
    return all_sum([float(flag)], d, device)[0] > 0


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
