"""torchrun set-up: process group (gloo on CPU, NCCL on GPU) and its teardown, naming a lost rank,
model wrapping (DDP or FSDP's fully_shard), and reductions of metrics across ranks. The handle
these take, Dist, is vitlab.runtime's."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vitlab.runtime import Dist, all_reduce_, derive_seed, launched_processes
from vitlab.train.optim import laid_out_as

TIMEOUT_ENV = "VITLAB_DIST_TIMEOUT"
# the longest a rank waits in a collective for a peer (torch's default is 30 minutes). A peer that
# dies is noticed at once (its sockets close); this bounds a peer that hangs or whose host vanishes.
# It must exceed the longest one-rank pause between collectives: rank 0 writing a checkpoint.
DEFAULT_TIMEOUT_S = 600.0


class RankLost(RuntimeError):
    """A peer process left a distributed run (died, or stopped answering): the process group is
    unusable and the run must be restarted from its last checkpoint."""

    def __init__(self, message: str, lost: dict[int, str]) -> None:
        super().__init__(message)
        self.lost = lost  # {rank: what became of it}


def init(device: torch.device, timeout_s: float | None = None) -> Dist:
    """Join the process group torchrun describes in the environment (a single process otherwise).
    A collective waits at most `timeout_s` for a peer (default: $VITLAB_DIST_TIMEOUT, else
    DEFAULT_TIMEOUT_S); every rank leaves its host and process id in the store, so that a rank
    that is lost can be named (lost_ranks)."""
    world = launched_processes()
    if world <= 1:
        return Dist()
    seconds = collective_timeout() if timeout_s is None else timeout_s
    if not dist.is_initialized():
        # torch.distributed.nn.functional's functions take the default group as a default
        # argument, evaluated on import: imported once the group exists (torch's checkpoint
        # helpers and FSDP import it, vitlab's full_model_state under DDP too), they would keep
        # the group alive past shutdown, and with it gloo's threads into the interpreter's exit
        import torch.distributed.nn.functional  # noqa: F401

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=seconds))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"vitlab/process/{rank}", f"{socket.gethostname()} {os.getpid()}")
    peers = tuple(store.get(f"vitlab/process/{r}").decode() for r in range(world))
    return Dist(rank, world, int(os.environ.get("LOCAL_RANK", "0")), peers)


def collective_timeout() -> float:
    """Seconds a collective waits for a peer: $VITLAB_DIST_TIMEOUT or DEFAULT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} is a number of seconds > 0, got {raw!r}")
    return seconds


def is_comm_error(e: BaseException) -> bool:
    """Whether e came from a collective or the store (gloo raises plain RuntimeErrors that name
    its transport; NCCL and the store raise DistError)."""
    text = str(e)
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and ("gloo" in text or "Timed out" in text)
    )


def lost_ranks(d: Dist, grace_s: float = 5.0) -> dict[int, str]:
    """The peers that left, {rank: what became of it}, asked after a collective failed. A peer on
    this host is lost when its process is gone; any other peer is lost unless it too checks in at
    the store (as every survivor of a failure does here) within `grace_s`. Empty: all are here."""
    host = socket.gethostname()
    others = {r: p.rsplit(" ", 1) for r, p in enumerate(d.peers) if r != d.rank}
    lost: dict[int, str] = {}

    def local_deaths() -> None:
        for r, (peer_host, pid) in others.items():
            if r not in lost and peer_host == host and not process_alive(int(pid)):
                lost[r] = f"its process {pid} on {host} is gone"

    local_deaths()
    if grace_s <= 0:
        return lost
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(f"vitlab/failed/{d.rank}", "here")
        waiting = [r for r in others if r not in lost]
        deadline = time.monotonic() + grace_s
        while waiting and time.monotonic() < deadline:
            time.sleep(0.1)
            local_deaths()
            waiting = [r for r in waiting if r not in lost]
            waiting = [r for r in waiting if not store.check([f"vitlab/failed/{r}"])]
    except (RuntimeError, OSError) as e:  # the store is gone with its host (rank 0 or the agent)
        waiting = [r for r in others if r not in lost]
        for r in waiting:
            lost[r] = f"no answer, and the rendezvous store is unreachable ({e})"
        return lost
    for r in waiting:
        peer_host, pid = others[r]
        lost[r] = (
            f"process {pid} on {peer_host} did not answer within {grace_s:.0f}s: hung or cut off"
        )
    return lost


def process_alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (a zombie, dead but not yet reaped by its
    parent, does not)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat.read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def rank_lost(d: Dist, error: BaseException) -> RankLost | None:
    """A RankLost naming the peers that left, when `error` (raised on this rank) came from losing
    them; None when every peer is still here or the error (or one it was raised from) is not
    about communication: an error every rank raises (a NaN loss, a bad config) stays itself even
    when a faster peer has already exited on it."""
    if not d.enabled or not d.peers or not any(map(is_comm_error, _chain(error))):
        return None
    lost = lost_ranks(d, grace_s=5.0)
    if not lost:
        return None
    names = ", ".join(f"rank {r} of {d.world} ({why})" for r, why in sorted(lost.items()))
    return RankLost(f"lost {names}; rank {d.rank} stops too", lost)


def raise_if_rank_lost(d: Dist, error: Exception, out: Path | None) -> None:
    """After `error` in a distributed run: RankLost naming the ranks that left, if any did, with
    how to resume. SIGTERM is ignored from here on (see StopFlag)."""
    with contextlib.suppress(ValueError):  # ValueError: not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lost = rank_lost(d, error)
    if lost is None:
        return
    from vitlab.train.state import has_checkpoint

    folder = out if out is not None else "RUN_FOLDER (named when the run started)"
    how = (
        f"The run folder keeps the checkpoint of the last finished epoch; continue with "
        f"{resume_command(folder, d)} (as many processes: an exact continuation)"
    )
    if out is not None and not has_checkpoint(out):
        how = "No epoch had finished, so the run folder holds no checkpoint: start it again"
    raise RankLost(f"{lost}. {how}", lost.lost) from error


def resume_command(out: object, d: Dist) -> str:
    """How to continue run folder `out` as it ran: `vitlab train --resume OUT`, or under torchrun
    torchrun's command for as many processes (per node, and nodes)."""
    if not d.enabled:
        return f"`vitlab train --resume {out}`"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", d.world))
    nodes = f"--nnodes={d.world // local} (and your rendezvous options) " if local < d.world else ""
    return f"`torchrun {nodes}--nproc_per_node={local} -m vitlab train --resume {out}`"


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or during."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def sync_buffers(model: nn.Module, d: Dist, extra: Iterable[Tensor] = ()) -> None:
    """Rank 0's floating-point buffers (BatchNorm running statistics: DDP copies them to the other
    ranks only at the start of a forward, FSDP never) and `extra` tensors (the EMA's) on every
    rank, so that validation, the saved weights and the EMA are one model's."""
    if not d.enabled:
        return
    for t in [*(b for b in model.buffers() if b.is_floating_point()), *extra]:
        dist.broadcast(t, src=0)


def wrap(model: nn.Module, d: Dist, strategy: str, device: torch.device) -> nn.Module:
    """DDP, or FSDP2 (fully_shard on each block, then the root) for models too big for one GPU."""
    if not d.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # a ViT's blocks, a Swin's blocks of every stage
        stages = model.layers if hasattr(model, "layers") else [model]
        for block in (b for stage in stages for b in stage.blocks):
            fully_shard(block)
        return fully_shard(model)
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_sum(values: list[float], d: Dist, device: torch.device) -> list[float]:
    """Element-wise sum of a list of numbers over all ranks."""
    if not d.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    return all_reduce_(t).tolist()


def any_rank(flag: bool, d: Dist, device: torch.device) -> bool:
    """True on every rank when flag is True on any rank (keeps ranks stepping together)."""
    if not d.enabled:
        return flag
    return all_sum([float(flag)], d, device)[0] > 0


def broadcast(value: object, d: Dist) -> object:
    """Rank 0's `value` (picklable) on every rank."""
    if not d.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: object, d: Dist) -> list | None:
    """Every rank's `value` (picklable), in rank order, on rank 0; None on the others."""
    if not d.enabled:
        return [value]
    values = [None] * d.world if d.is_main else None
    dist.gather_object(value, values, dst=0)
    return values


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s random stream: `seed` itself on rank 0 (a single process's
    stream), a derived one elsewhere, so ranks draw their own dropout and augmentation."""
    return seed if rank == 0 else derive_seed(seed, rank)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def shutdown(d: Dist, device: torch.device, failed: bool = False) -> None:
    """Leave the process group once every rank is done with it, and free it while Python still
    runs, so that no gloo thread is left dropping a collective's tensors when the interpreter
    exits (see vitlab.runtime.all_reduce_). The caller drops its model first (DDP and FSDP hold
    the group); the group then goes with its last reference here, joining its threads. Under
    FSDP, torch's DTensor caches keep the group to the end; there vitlab's sums (this meeting
    the last of them) return only once gloo has let go of them, and FSDP's own collectives
    ended long before.

    The ranks meet in a sum rather than dist.barrier: gloo's barrier keeps the works still in
    flight when it started until a worker thread drops it, just as this one returns. After a
    failure the group is left as it is: a peer may be gone, or still in another collective,
    which this would wait on until the timeout. A peer lost at this last meeting cost nothing
    (every rank's work was done and saved): it is named in a note, not raised."""
    if d.enabled and dist.is_initialized() and not failed:
        try:
            all_sum([0.0], d, device)
        except RuntimeError as e:
            lost = rank_lost(d, e)
            if lost is None:
                raise
            print(f"note: {lost}, after the run had finished", file=sys.stderr)
            return
        dist.destroy_process_group()
        gc.collect()  # the model's reference cycles, with their references to the group


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
    model: nn.Module, optimizer, model_state: dict, optim_state: dict, d: Dist, strategy: str,
    where: str = "the checkpoint",
) -> None:  # fmt: skip
    """Load whole (unsharded) states into a possibly sharded model and its optimizer (if any);
    weights that do not fit the model are a CheckpointError naming the tensors, from `where`."""
    from vitlab.models.checkpoint import load_state_strict

    load_state_strict(model, model_state, where, load=False)  # a sharded model's whole shapes
    if not is_sharded(d, strategy):
        model.load_state_dict(model_state)
        if optimizer is not None:
            optimizer.load_state_dict(optim_state)
            _match_layouts(optimizer)
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


def _match_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter's optimizer state its memory layout (laid_out_as: a checkpoint's
    moments keep the layout they were saved in, e.g. NCHW restored into a channels-last run)."""
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                state[k] = laid_out_as(v, p)
