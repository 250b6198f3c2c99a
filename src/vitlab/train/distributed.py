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
    """Leave the process group once every rank is done with it (tearing it down while a peer
    still has collectives in flight can abort the process at exit)."""
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_sharded(d: Dist, strategy: str) -> bool:
    return d.enabled and strategy == "fsdp"


def full_model_state(model: nn.Module, d: Dist, strategy: str) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model state on CPU; under FSDP a collective every rank must call."""
    if not is_sharded(d, strategy):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def full_optimizer_state(model: nn.Module, optimizer, d: Dist, strategy: str) -> dict:
    if not is_sharded(d, strategy):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_state(
    model: nn.Module, optimizer, model_state: dict, optim_state: dict, d: Dist, strategy: str
) -> None:
    """Load whole (unsharded) states into a possibly sharded model and its optimizer (if any)."""
    if not is_sharded(d, strategy):
        model.load_state_dict(model_state)
        if optimizer is not None:
            optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
