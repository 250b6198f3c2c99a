"""Batches for training and evaluation.

Each epoch's order is a fresh permutation seeded by (seed, epoch), the epoch passed explicitly by
the caller on every pass: a resumed run sees the same batches, and no two epochs share an order.
Under torchrun each global batch is cut into equal per-rank slices: N ranks see exactly the samples
one process would see with the same global batch. Evaluation deals samples out to ranks in turn, and
every rank gets the same number of batches (a short rank's last one is a padding batch: one image
labelled PADDING, to run the model on, not to count), so ranks whose forward is a collective (FSDP)
step together.

Image files are decoded and augmented in DataLoader workers, each batch with the random draws of
its own seed, a pure function of (seed, epoch, batch, rank): the same from any start and with any
number of workers, and never drawn from the trainer's global RNG (whose saved state makes resume
exact)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitlab.data.datasets import ArraySplit, DatasetError, ShardSplit, Split
from vitlab.data.decode import decode_image
from vitlab.data.stream import StreamLoader
from vitlab.data.transforms import BatchAugment
from vitlab.data.workers import PADDING, Batch, LoaderOptions, from_workers, shut_down, warn_once
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import derive_seed

MAX_SUBSTITUTES = 100  # undecodable images in a row before a training batch gives up


class BatchPlan:
    """Which sample indices this rank gets, batch by batch, in one epoch."""

    def __init__(
        self, n: int, batch_size: int, shuffle: bool, seed: int, rank: int = 0, world: int = 1
    ) -> None:
        if shuffle and batch_size % world:
            raise ValueError(f"batch size {batch_size} is not divisible by {world} processes")
        if shuffle and n < batch_size:
            raise ValueError(f"{n} training images are fewer than one batch of {batch_size}")
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle
        self.seed, self.rank, self.world = seed, rank, world

    def __len__(self) -> int:
        if self.shuffle:  # full global batches only, so every rank steps together
            return self.n // self.batch_size
        most = -(-self.n // self.world)  # the most samples a rank is dealt
        return -(-most // self.batch_size)  # the same on every rank

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Tensor]:
        """Epoch `epoch`'s batches (0-based) from batch `start` on."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.n, generator=gen)
            per_rank = self.batch_size // self.world
            for b in range(start, len(self)):
                chunk = order[b * self.batch_size : (b + 1) * self.batch_size]
                yield chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
        else:  # evaluation: every sample exactly once across ranks, empty batches to pad
            mine = torch.arange(self.n)[self.rank :: self.world].split(self.batch_size)
            mine = [b for b in mine if len(b)]
            mine += [torch.zeros(0, dtype=torch.long)] * (len(self) - len(mine))
            yield from mine[start:]

    def batch_seed(self, epoch: int, batch: int) -> int:
        """The seed of batch `batch` of epoch `epoch` on this rank."""
        return derive_seed(self.seed, epoch, batch, self.rank)


def _padded(index: Tensor) -> tuple[Tensor, bool]:
    """An empty (padding) batch becomes one real sample (index 0) to run the model on."""
    return (index, False) if len(index) else (torch.zeros(1, dtype=torch.long), True)


class ArrayLoader:
    """In-memory uint8 images, augmented a batch at a time in the training process."""

    def __init__(self, split: ArraySplit, plan: BatchPlan, transform: Callable[..., Batch]) -> None:
        self.split, self.plan, self.transform = split, plan, transform

    def __len__(self) -> int:
        return len(self.plan)

    def iterate(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for index in self.plan.batches(epoch, start):
            index, pad = _padded(index)
            x, y = self.transform(self.split.images[index], self.split.labels[index])
            yield x, torch.full_like(y, PADDING) if pad else y

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate()

    def close(self) -> None:
        """Nothing to release: no workers."""


class _FileImages(Dataset):
    """Decodes a split's images (files, or rows of a Hugging Face dataset: anything with read(i)
    -> bytes and where(i) -> name) to uint8 (C, H, W), with the per-image random transforms, in
    workers. A DataLoader fetches whole batches, `(seed, indices)`, through __getitems__.

    An image that does not decode is skipped: in training the next readable one in the split
    takes its place (the batch keeps its size), in evaluation a padding sample (never counted)."""

    def __init__(
        self, split: Split, per_image: Callable, prepare: Callable, in_chans: int, train: bool
    ) -> None:
        self.split, self.per_image, self.prepare = split, per_image, prepare
        self.in_chans, self.train = in_chans, train

    def __len__(self) -> int:
        return len(self.split)

    def _decode(self, i: int) -> Tensor:
        try:
            data = self.split.read(i)
        except OSError as e:
            raise DatasetError(f"cannot read image {self.split.where(i)}: {e}") from None
        return decode_image(data, self.in_chans, self.split.where(i))  # or DatasetError

    def _sample(self, i: int, bad: list[tuple[str, str]]) -> tuple[Tensor, Tensor]:
        n = len(self.split)
        for j in range(i, i + min(n, MAX_SUBSTITUTES)):
            try:
                x = self._decode(j % n)
            except DatasetError as e:
                bad.append((self.split.where(j % n), str(e)))
                if not self.train:
                    return self.per_image(torch.zeros(1, self.in_chans, 8, 8, dtype=torch.uint8))[
                        0
                    ], torch.tensor(PADDING)
                continue
            return self.per_image(x[None])[0], self.split.labels[j % n]
        raise DatasetError(f"none of {min(n, MAX_SUBSTITUTES)} images from {self.split.where(i)} "
                           f"on decodes: {bad[-1][1]}")  # fmt: skip

    def __getitems__(self, batch: tuple[int, list[int]]) -> tuple[Tensor, Tensor, list]:
        """One batch (images, labels, why each undecodable image was skipped), its random
        transforms drawn from its own seed (the process's RNG, in a worker or with workers=0 the
        trainer's, is left as it was)."""
        seed, indices = batch
        bad: list[tuple[str, str]] = []
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # the CPU's only: fork_rng keeps no other
            samples = [self._sample(i, bad) for i in indices]
        images = self.prepare(torch.stack([x for x, _ in samples]))
        return images, torch.stack([y for _, y in samples]), bad


def _as_is(batch: object) -> object:
    """The DataLoader's collate function: __getitems__ returns the batch already stacked."""
    return batch


class _Batches:
    """A batch sampler whose batches are replaced every epoch: one DataLoader, and with
    persistent workers one set of worker processes, serves every epoch."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class FolderLoader:
    """Image files (or Hugging Face rows) decoded and augmented in DataLoader workers."""

    def __init__(
        self,
        split: Split,
        plan: BatchPlan,
        per_image: Callable[[Tensor], Tensor],
        prepare: Callable[[Tensor], Tensor],
        finish: Callable[..., Batch],
        in_chans: int,
        options: LoaderOptions,
    ) -> None:
        self.plan, self.finish, self.options = plan, finish, options
        self.dataset = _FileImages(split, per_image, prepare, in_chans, train=plan.shuffle)
        self.skipped: set[str] = set()  # the undecodable images, each named once
        self._sampler, self._loader = _Batches(), None

    def __len__(self) -> int:
        return len(self.plan)

    def _dataloader(self) -> DataLoader:
        if self._loader is None:
            self._loader = self.options.dataloader(
                self.dataset, batch_sampler=self._sampler, collate_fn=_as_is
            )
        return self._loader

    def iterate(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        plan, batches, pads = self.plan, [], []
        for b, index in enumerate(plan.batches(epoch, start), start=start):
            index, pad = _padded(index)
            batches.append((plan.batch_seed(epoch, b), index.tolist()))
            pads.append(pad)
        self._sampler.batches = batches
        for (images, labels, bad), pad in zip(from_workers(self._dataloader()), pads, strict=True):
            warn_once(self.skipped, bad)
            yield self.finish(images, torch.full_like(labels, PADDING) if pad else labels)

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate()

    def close(self) -> None:
        """End the worker processes (persistent ones live as long as the DataLoader does, which a
        reference cycle can make as long as the process); the next iterate() starts new ones."""
        if self._loader is not None:
            shut_down(self._loader)
            self._loader = None


Loader = ArrayLoader | FolderLoader | StreamLoader  # iterate(epoch, start), len, close


def make_loader(
    split: Split,
    batch_size: int,
    pre: Preprocessing,
    *,
    augment: BatchAugment | None = None,
    shuffle: bool = False,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    workers: int = 0,
    workers_chosen: bool = True,
    pin_memory: bool = False,
    prefetch: int = 2,
    buffer: int = 1000,
) -> Loader:
    """A training loader (augment given, shuffled) or an evaluation loader (plain preprocessing).
    `workers`, `pin_memory` and `prefetch` apply to streamed data (files, shards, HF rows),
    `buffer` (the shuffle buffer's size) to shards."""
    # an evaluation pass is one a call: its workers end with it
    options = LoaderOptions(
        workers, pin_memory, prefetch, persistent=augment is not None, chosen=workers_chosen
    )
    if augment is None:

        def evaluate_batch(images: Tensor, labels: Tensor) -> Batch:  # resized by per_image
            return pre.normalize(images), labels

        per_image, finish, mix = pre.resize, evaluate_batch, _unmixed
    else:
        per_image, finish, mix = augment.per_image_only, augment.finish, augment.mix_only
    if isinstance(split, ArraySplit):
        plan = BatchPlan(len(split), batch_size, shuffle, seed, rank, world)
        return ArrayLoader(split, plan, lambda im, lab: finish(per_image(im), lab))
    # streamed data: images decoded, transformed and normalised in the workers (the training
    # process, which also runs the model, is left the batch-level random erasing and mixing);
    # for a GPU the batches cross from the workers as uint8, a quarter of the bytes to pin and copy
    prepare, last = (_as_is, finish) if pin_memory else (pre.normalize, mix)
    options.say_if_many()
    if isinstance(split, ShardSplit):
        return StreamLoader(
            split, batch_size, per_image, prepare, last, in_chans=pre.in_chans,
            train=shuffle, seed=seed, rank=rank, world=world, buffer=buffer, options=options,
        )  # fmt: skip
    plan = BatchPlan(len(split), batch_size, shuffle, seed, rank, world)
    return FolderLoader(split, plan, per_image, prepare, last, pre.in_chans, options)


def _unmixed(images: Tensor, labels: Tensor) -> Batch:
    return images, labels
