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
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitlab.data.datasets import ArraySplit, FolderSplit, Split, read_image
from vitlab.data.transforms import BatchAugment
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import derive_seed

Batch = tuple[Tensor, Tensor]
PADDING = -1  # the label of a padding sample: evaluated so ranks step together, never counted


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


class _FolderImages(Dataset):
    """Decodes image files to uint8 (C, H, W), with the per-image random transforms in workers.
    A DataLoader fetches whole batches, `(seed, indices)`, through __getitems__."""

    def __init__(self, files: list[Path], labels: Tensor, per_image: Callable, in_chans: int):
        self.files, self.labels, self.per_image, self.in_chans = files, labels, per_image, in_chans

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        from torchvision.transforms.v2 import functional as TF

        image = read_image(self.files[i], "L" if self.in_chans == 1 else "RGB")  # or DatasetError
        x = TF.pil_to_tensor(image)
        return self.per_image(x[None])[0], self.labels[i]

    def __getitems__(self, batch: tuple[int, list[int]]) -> list[tuple[Tensor, Tensor]]:
        """One batch, its random transforms drawn from its own seed (the process's RNG, in a worker
        or with workers=0 the trainer's, is left as it was)."""
        seed, indices = batch
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [self[i] for i in indices]


class FolderLoader:
    """Image files streamed through a DataLoader with workers."""

    def __init__(
        self,
        split: FolderSplit,
        plan: BatchPlan,
        per_image: Callable[[Tensor], Tensor],
        finish: Callable[..., Batch],
        in_chans: int,
        workers: int,
    ) -> None:
        self.plan, self.finish, self.workers = plan, finish, workers
        self.dataset = _FolderImages(split.files, split.labels, per_image, in_chans)

    def __len__(self) -> int:
        return len(self.plan)

    def iterate(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        plan, batches, pads = self.plan, [], []
        for b, index in enumerate(plan.batches(epoch, start), start=start):
            index, pad = _padded(index)
            batches.append((plan.batch_seed(epoch, b), index.tolist()))
            pads.append(pad)
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=self.workers,
            persistent_workers=False,
            # the workers' base seed (unused: each batch has its own), not from the global RNG
            generator=torch.Generator().manual_seed(plan.batch_seed(epoch, -1)),
        )
        for (images, labels), pad in zip(loader, pads, strict=True):
            yield self.finish(images, torch.full_like(labels, PADDING) if pad else labels)

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate()


Loader = ArrayLoader | FolderLoader


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
) -> Loader:
    """A training loader (augment given, shuffled) or an evaluation loader (plain preprocessing)."""
    plan = BatchPlan(len(split), batch_size, shuffle, seed, rank, world)
    if augment is None:

        def evaluate_batch(images: Tensor, labels: Tensor) -> Batch:  # resized by per_image
            return pre.normalize(images), labels

        per_image, finish = pre.resize, evaluate_batch
    else:
        per_image, finish = augment.per_image_only, augment.finish
    if isinstance(split, ArraySplit):
        return ArrayLoader(split, plan, lambda im, lab: finish(per_image(im), lab))
    return FolderLoader(split, plan, per_image, finish, pre.in_chans, workers)
