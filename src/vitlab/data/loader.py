"""Batches for training and evaluation.

Each epoch's order is a fresh permutation seeded by (seed, epoch), the epoch passed explicitly by
the caller on every pass: a resumed run sees the same batches, and no two epochs share an order.
Under torchrun each global batch is cut into equal per-rank slices: N ranks see exactly the samples
one process would see with the same global batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitlab.data.datasets import ArraySplit, FolderSplit, Split
from vitlab.data.transforms import BatchAugment, Preprocessing

Batch = tuple[Tensor, Tensor]


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
        return -(-self.n // self.batch_size)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Tensor]:
        """Epoch `epoch`'s batches (0-based) from batch `start` on."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.n, generator=gen)
            per_rank = self.batch_size // self.world
            for b in range(start, len(self)):
                chunk = order[b * self.batch_size : (b + 1) * self.batch_size]
                yield chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
        else:  # evaluation: every sample exactly once across ranks
            mine = torch.arange(self.rank, self.n, self.world)
            yield from mine.split(self.batch_size)[start:]


class ArrayLoader:
    """In-memory uint8 images, augmented a batch at a time in the training process."""

    def __init__(self, split: ArraySplit, plan: BatchPlan, transform: Callable[..., Batch]) -> None:
        self.split, self.plan, self.transform = split, plan, transform

    def __len__(self) -> int:
        return len(self.plan)

    def iterate(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for index in self.plan.batches(epoch, start):
            yield self.transform(self.split.images[index], self.split.labels[index])

    def __iter__(self) -> Iterator[Batch]:
        return self.iterate()


class _FolderImages(Dataset):
    """Decodes image files to uint8 (C, H, W), with the per-image random transforms in workers."""

    def __init__(self, files: list[Path], labels: Tensor, per_image: Callable, in_chans: int):
        self.files, self.labels, self.per_image, self.in_chans = files, labels, per_image, in_chans

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        from PIL import Image
        from torchvision.transforms.v2 import functional as TF

        with Image.open(self.files[i]) as im:
            x = TF.pil_to_tensor(im.convert("L" if self.in_chans == 1 else "RGB"))
        return self.per_image(x[None])[0], self.labels[i]


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
        batches = [b.tolist() for b in self.plan.batches(epoch, start)]
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=self.workers,
            persistent_workers=False,
        )
        for images, labels in loader:
            yield self.finish(images, labels)

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

        def evaluate_batch(images: Tensor, labels: Tensor) -> Batch:
            return pre.batch(images), labels

        per_image, finish = pre.resize, evaluate_batch
    else:
        per_image, finish = augment.per_image_only, augment.finish
    if isinstance(split, ArraySplit):
        return ArrayLoader(split, plan, lambda im, lab: finish(per_image(im), lab))
    return FolderLoader(split, plan, per_image, finish, pre.in_chans, workers)
