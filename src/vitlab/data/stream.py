"""Loaders for WebDataset shards: sequential reads, every rank and worker its own shards.

Training. The epoch is a fixed number of samples, len(loader) global batches of the dataset's
size // batch_size, so every rank steps together. Each rank reads through K streams, K = shards //
ranks at most MAX_STREAMS: a function of the shard count and the world size alone, never of the
DataLoader workers, so the data order (and an exact resume) is the same with any data.workers on
any machine. Stream k of rank r is global stream g = r * K + k of G = ranks * K, and in epoch e it
reads the shards perm_e[g::G] of a permutation of all shards seeded by (seed, e), so ranks and
streams read distinct shards and every epoch deals them anew. A stream shuffles its samples
through a buffer of data.shuffle_buffer samples, seeded by (seed, e, rank, k); batch b of the rank
comes from stream b % K. The DataLoader's workers serve the streams round-robin (W workers, W the
largest divisor of K not above data.workers: worker w serves the streams k = start + w mod W, each
stream one worker's). A stream that runs out of
samples before its share of the epoch reads its shards again (in a new seeded order); one whose
shards hold more leaves the rest unseen in that epoch (shards of unequal sizes, or a stream's
samples not a whole number of its batches; warned of beyond UNEVEN of the epoch).

Resume is exact: every draw of a stream's shuffle is a function of the number of samples read,
not of their content, so the stream's state after the batches already trained on (the buffer's
positions, the read position, the generator) is replayed on positions alone, and only the
samples still in the buffer and those after it are read again (from the first shard that holds
one). A resumed epoch delivers the samples, in the order, an uninterrupted one would: none
repeated, none skipped. (The issue asked for at most one buffer's worth; this is stronger.)

Evaluation reads rank r's shards r::ranks in order, split among K streams the same way, each
sample once; ranks with fewer batches (or none: fewer shards than ranks) end with padding batches
(labels PADDING, never scored), so all step together.

An undecodable image is named once and replaced, in training, by another image of its batch
(the stream's count stays exact, so resume does too), in evaluation by a padding sample."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from vitlab.data.decode import decode_image
from vitlab.data.download import DatasetError
from vitlab.data.shards import ShardSplit
from vitlab.data.workers import PADDING, Batch, LoaderOptions, from_workers, shut_down, warn_once
from vitlab.runtime import derive_seed

SHUFFLE, PASS, SHARDS = 1, 2, 3  # derive_seed tags: one stream of seeds per purpose
MAX_STREAMS = 8  # streams a rank reads at once (each holds an open shard and a shuffle buffer)
UNEVEN = 0.02  # an epoch whose streams repeat this share of its samples is warned about
log = logging.getLogger(__name__)


def _pop(rng: random.Random, buf: list) -> object:
    j = rng.randrange(len(buf))
    buf[j], buf[-1] = buf[-1], buf[j]
    return buf.pop()


def _shuffled(rng: random.Random, size: int, items: Iterator, buf: list) -> Iterator:
    """Buffer shuffle: each item read goes into buf; once buf holds `size`, a random one leaves
    for each read; at the end the rest leave in random order."""
    for item in items:
        buf.append(item)
        if len(buf) >= size:
            yield _pop(rng, buf)
    while buf:
        yield _pop(rng, buf)


def _replay(rng: random.Random, size: int, length: int, emitted: int) -> tuple[int, list, int]:
    """(pass, buffer positions, next read position) after `emitted` samples of passes of `length`
    samples each, drawing from rng exactly as _shuffled does."""
    done = 0
    for p in range(emitted // max(length, 1) + 2):
        buf, c = [], 0
        while c < length or buf:
            if done == emitted:
                return p, buf, c
            if c < length:
                buf.append(c)
                c += 1
                if len(buf) < size:
                    continue
            _pop(rng, buf)
            done += 1
    raise AssertionError("unreachable: each pass emits `length` samples")


def _worker() -> tuple[int, int]:
    """(this DataLoader worker's id, the number of workers); (0, 1) in the training process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _TrainStreams(IterableDataset):
    """What one rank's DataLoader iterates in one call: batches start.. of epoch `epoch`, worker w
    of W yielding batches start + w, start + w + W, ... (the DataLoader's round-robin order). W
    divides K, so each stream's batches are all one worker's."""

    def __init__(self, loader: StreamLoader, epoch: int, start: int) -> None:
        self.loader, self.epoch, self.start = loader, epoch, start

    def __iter__(self) -> Iterator:
        w, workers = _worker()
        ld, epoch, streams = self.loader, self.epoch, {}
        for b in range(self.start + w, len(ld), workers):
            k, j = b % ld.streams, b // ld.streams  # batch b is stream k's j-th
            if k not in streams:
                streams[k] = ld.stream(epoch, k, j * ld.per_rank)
            chunk = [next(streams[k]) for _ in range(ld.per_rank)]
            yield ld.decode_batch(chunk, ld.batch_seed(epoch, b), train=True)


class _EvalStreams(IterableDataset):
    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator:
        w, workers = _worker()
        ld = self.loader
        for mine in ld.eval_shards()[w::workers]:
            samples = chain.from_iterable(ld.tagged(s) for s in mine)
            while chunk := [x for _, x in zip(range(ld.batch_size), samples)]:
                yield ld.decode_batch(chunk, 0, train=False)


class StreamLoader:
    """Batches from shards, for training (shuffled streams) or evaluation (each sample once)."""

    def __init__(
        self,
        split: ShardSplit,
        batch_size: int,
        per_image: Callable[[Tensor], Tensor],
        prepare: Callable[[Tensor], Tensor],
        finish: Callable[..., Batch],
        *,
        in_chans: int,
        train: bool,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        buffer: int = 1000,
        options: LoaderOptions | None = None,
    ) -> None:
        self.split, self.batch_size, self.train = split, batch_size, train
        self.per_image, self.prepare, self.finish = per_image, prepare, finish
        self.in_chans = in_chans
        self.seed, self.rank, self.world, self.buffer = seed, rank, world, buffer
        self.options = options or LoaderOptions()
        n_shards = len(split.urls)
        if train and n_shards < world:  # evaluation: a rank without shards pads
            raise DatasetError(
                f"{n_shards} training shard{'s' * (n_shards != 1)} for {world} processes: every "
                f"process reads shards of its own; write at least {world} (vitlab data shard "
                f"--shard-size)"
            )
        empty = [u for u, c in zip(split.urls, split.counts, strict=True) if c == 0]
        if train and empty:  # a stream of them would wait forever for a sample
            raise DatasetError(f"training shard {empty[0]} holds no samples ({len(empty)} such): "
                               f"leave empty shards out")  # fmt: skip
        if train and batch_size % world:
            raise ValueError(f"batch size {batch_size} is not divisible by {world} processes")
        if train and len(split) < batch_size:
            raise ValueError(
                f"{len(split)} training images are fewer than one batch of {batch_size}"
            )
        self.streams = max(1, min(MAX_STREAMS, n_shards // world))  # never the worker count
        self.per_rank = batch_size // world
        # DataLoader workers: the most that divide the streams evenly (0: in this process)
        asked = self.options.workers
        self.workers = max(d for d in range(1, self.streams + 1) if self.streams % d == 0
                           and d <= max(asked, 1)) if asked else 0  # fmt: skip
        if train and self.workers < asked and rank == 0:  # a note only when data.workers was set
            say = log.warning if self.options.chosen else log.info
            say("data.workers=%d: %d DataLoader worker(s) serve this process's %d shard "
                "streams (%d shards over %d process(es), at most %d streams, each served by one "
                "worker): a worker count that divides %d, or more shards (vitlab data shard "
                "--shard-size), keep more at work", asked, self.workers, self.streams, n_shards,
                world, MAX_STREAMS, self.streams)  # fmt: skip
        if train:
            self._check_deal()
        self.skipped: set[str] = set()
        self.record: list[str] | None = None  # when a list: every batch's sample keys go there
        self._running: Iterator | None = None  # the DataLoader iterator of the current pass

    def __len__(self) -> int:
        if self.train:
            return len(self.split) // self.batch_size
        counts = [sum(math.ceil(self._size(w) / self.batch_size) for w in self.eval_shards(r))
                  for r in range(self.world)]  # fmt: skip
        return max(counts)

    def _check_deal(self) -> None:
        """Warn when an epoch's batches miss the streams' samples: batch b of a rank comes from
        its stream b % K, so a stream draws its batches' samples in an epoch, repeating some of
        its shards' when they hold fewer and leaving some unseen in that epoch when they hold
        more (shards of unequal sizes, or streams' samples not a whole number of batches)."""
        total, order, n = self.world * self.streams, self._order(0), len(self)
        over = under = 0
        for g in range(total):  # global stream g is stream g % K of rank g // K
            k = g % self.streams
            draw = (n // self.streams + (k < n % self.streams)) * self.per_rank
            size = self._size(order[g::total])
            over, under = over + max(draw - size, 0), under + max(size - draw, 0)
        if over > UNEVEN * n * self.batch_size and self.rank == 0:  # every rank's alike
            log.warning(
                "%d shards deal unevenly to %d streams (%d ranks x %d; a rank's batch b of %d "
                "samples comes from its stream b %% %d): in an epoch of %d samples, %d repeat and "
                "%d are not seen; streams holding equal numbers of samples, each a whole number "
                "of batches, deal evenly",
                len(self.split.urls), total, self.world, self.streams, self.per_rank,
                self.streams, n * self.batch_size, over, under,
            )  # fmt: skip

    # --- the plan ---------------------------------------------------------------------------------

    def shards_of(self, epoch: int, k: int, p: int = 0) -> list[int]:
        """The shards stream k of this rank reads in pass p of epoch `epoch`."""
        order = self._order(epoch)
        g, total = self.rank * self.streams + k, self.world * self.streams
        mine = order[g::total]
        if p:
            random.Random(derive_seed(self.seed, PASS, epoch, g, p)).shuffle(mine)
        return mine

    def _order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s permutation of all shards, dealt to the global streams in turn."""
        gen = torch.Generator().manual_seed(derive_seed(self.seed, SHARDS, epoch))
        return torch.randperm(len(self.split.urls), generator=gen).tolist()

    def eval_shards(self, rank: int | None = None) -> list[list[int]]:
        """Each stream's shards of `rank` (this one by default) in evaluation (none: a rank of
        more than there are shards)."""
        r = self.rank if rank is None else rank
        mine = list(range(len(self.split.urls)))[r :: self.world]
        return [mine[k :: self.streams] for k in range(self.streams)]

    def _size(self, shards: list[int]) -> int:
        return sum(self.split.counts[s] for s in shards)

    def batch_seed(self, epoch: int, batch: int) -> int:
        return derive_seed(self.seed, epoch, batch, self.rank)

    def stream(self, epoch: int, k: int, skip: int) -> Iterator[tuple[str, bytes, int, int]]:
        """Stream k's samples in epoch `epoch` after its first `skip` (endless: pass after pass)."""
        g = self.rank * self.streams + k
        rng = random.Random(derive_seed(self.seed, SHUFFLE, epoch, g))
        length = self._size(self.shards_of(epoch, k))
        p, kept, c = _replay(rng, self.buffer, length, skip)
        while True:
            shards = self.shards_of(epoch, k, p)
            reader = self._positions(shards, c, set(kept))
            stash, first = {}, []
            for pos, sample in reader:
                if pos >= c:
                    first = [(pos, sample)]
                    break
                stash[pos] = sample
            buf = [(q, stash[q]) for q in kept]
            for _, sample in _shuffled(rng, self.buffer, chain(first, reader), buf):
                yield sample
            p, kept, c = p + 1, [], 0

    def tagged(self, shard: int) -> Iterator[tuple[str, bytes, int, int]]:
        """Shard `shard`'s samples (key, bytes, label) with the shard's number (for messages)."""
        return ((*sample, shard) for sample in self.split.read(shard))

    def _positions(self, shards: list[int], start: int, keep: set[int]) -> Iterator[tuple]:
        """(position, sample) of the pass over `shards` from `start` on, and of the positions in
        `keep` before it; shards holding none of those are not opened."""
        low, pos = min(keep, default=start), 0
        for s in shards:
            n = self.split.counts[s]
            if pos + n <= low:
                pos += n
                continue
            for sample in self.tagged(s):
                if pos >= start or pos in keep:
                    yield pos, sample
                pos += 1

    # --- decoding ---------------------------------------------------------------------------------

    def decode_batch(self, chunk: list, seed: int, train: bool) -> tuple:
        """(images, labels, keys, undecodable) of raw samples (key, bytes, label, shard): each
        image's random transforms drawn from the batch's seed."""
        images, labels, bad = [], [], []
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # the CPU's only: fork_rng keeps no other
            for key, data, label, shard in chunk:
                try:
                    x = decode_image(data, self.in_chans, f"{key} of {self.split.urls[shard]}")
                except DatasetError as e:
                    bad.append((key, str(e)))
                    x, label = torch.zeros(self.in_chans, 8, 8, dtype=torch.uint8), PADDING
                images.append(self.per_image(x[None])[0])
                labels.append(label)
        good = [i for i, y in enumerate(labels) if y != PADDING]
        if train and bad:  # the batch keeps its size: other images of it stand in
            if not good:
                raise DatasetError(f"no image of a batch decodes: {bad[-1][1]}")
            for j, i in enumerate(i for i, y in enumerate(labels) if y == PADDING):
                images[i], labels[i] = images[good[j % len(good)]], labels[good[j % len(good)]]
        keys = [sample[0] for sample in chunk]
        images = self.prepare(torch.stack(images))
        return images, torch.tensor(labels, dtype=torch.long), keys, bad

    # --- iteration --------------------------------------------------------------------------------

    def iterate(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Epoch `epoch`'s batches (0-based) from batch `start` on."""
        data = _TrainStreams(self, epoch, start) if self.train else _EvalStreams(self)
        workers = self.workers if self.train or any(self.eval_shards()) else 0
        options = LoaderOptions(workers, self.options.pin_memory, self.options.prefetch, False)
        self.close()
        self._running = iter(options.dataloader(data, batch_size=None))
        n = 0
        for images, labels, keys, bad in from_workers(self._running):
            warn_once(self.skipped, bad)
            if self.record is not None:
                self.record.extend(keys)
            n += 1
            yield self.finish(images, labels)
        for _ in range(0 if self.train else len(self) - n):  # evaluation: padding batches
            x = self.per_image(torch.zeros(1, self.in_chans, 8, 8, dtype=torch.uint8))
            yield self.finish(self.prepare(x), torch.full((1,), PADDING, dtype=torch.long))

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate()

    def close(self) -> None:
        """End the worker processes of a pass left unfinished."""
        shut_down(self._running)
        self._running = None
