"""Augmentation and preprocessing.

Shifts (a random crop of the zero-padded image), flips and random erasing run on whole batches
as tensor operations, each image with its own random draw from torchvision's distributions: a
tenth of what torchvision's transforms cost image by image (1.4 against 18 ms for 128 images of
28 x 28). Images are first resized to the model's size (unless a random resized crop makes
that size); random resized crops and RandAugment run per image, from torchvision.transforms.v2
(the shift and flip with them, in torchvision's order); then whole batches are scaled to [0, 1],
normalised, randomly erased and mixed (mixup / cutmix, with mixed soft labels)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vitlab.config import DataConfig
from vitlab.preprocessing import Preprocessing

if TYPE_CHECKING:
    from torchvision.transforms import v2

ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)  # torchvision's RandomErasing defaults
ERASE_ATTEMPTS = 10  # boxes drawn per image; the first that fits is erased (none fits: none)


def shift_images(
    x: Tensor, down: int | Tensor, right: int | Tensor, fill: Tensor | None = None
) -> Tensor:
    """(B, C, H, W) -> the same, each image moved `down` rows down and `right` columns right
    (negative: up, left), an int for every image or one per image ((B,) integers); the rows and
    columns moved in set to `fill` (C,) (None: 0), the ones moved out dropped."""
    b, c, h, w = x.shape
    down, right = (torch.as_tensor(s, device=x.device).expand(b) for s in (down, right))
    pad = int(torch.stack([down, right]).abs().max())
    canvas = x.new_zeros(b, c, h + 2 * pad, w + 2 * pad)
    if fill is not None:
        canvas[:] = fill.to(x).view(1, c, 1, 1)
    canvas[..., pad : pad + h, pad : pad + w] = x
    rows = (pad - down).view(b, 1, 1, 1) + torch.arange(h, device=x.device).view(1, 1, h, 1)
    cols = (pad - right).view(b, 1, 1, 1) + torch.arange(w, device=x.device).view(1, 1, 1, w)
    index = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    return canvas[index, torch.arange(c, device=x.device).view(1, c, 1, 1), rows, cols]


def random_shift(images: Tensor, padding: int) -> Tensor:
    """(B, C, H, W) -> the same, each image zero-padded by `padding` on every side and cropped
    back to H x W at its own uniformly drawn offset (torchvision's RandomCrop(size, padding)):
    moved by `padding` minus the offset."""
    b = images.shape[0]
    top = torch.randint(0, 2 * padding + 1, (b,))
    left = torch.randint(0, 2 * padding + 1, (b,))
    return shift_images(images, padding - top, padding - left)


def random_hflip(images: Tensor, p: float) -> Tensor:
    """(B, C, H, W) -> the same, each image mirrored left-right with probability p."""
    flip = torch.rand(images.shape[0]) < p
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


def random_erase(x: Tensor, p: float) -> Tensor:
    """(B, C, H, W) float -> the same, a box of each image set to 0 with probability p (the mean,
    after normalisation), torchvision's RandomErasing: area a uniform share in ERASE_SCALE of the
    image's, aspect ratio log-uniform in ERASE_RATIO, the first of ERASE_ATTEMPTS draws that fits,
    at a uniform position."""
    b, _, h, w = x.shape
    area = h * w * torch.empty(b, ERASE_ATTEMPTS).uniform_(*ERASE_SCALE)
    aspect = torch.empty(b, ERASE_ATTEMPTS).uniform_(*map(math.log, ERASE_RATIO)).exp()
    heights = (area * aspect).sqrt().round().long()  # (B, attempts); round half to even, as
    widths = (area / aspect).sqrt().round().long()  # Python's round() in torchvision
    fits = (heights < h) & (widths < w)
    first = fits.int().argmax(1, keepdim=True)  # (B, 1): the first attempt that fits
    eh, ew = heights.gather(1, first), widths.gather(1, first)  # (B, 1)
    top = (torch.rand(b, 1) * (h - eh + 1)).long()
    left = (torch.rand(b, 1) * (w - ew + 1)).long()
    rows, cols = torch.arange(h), torch.arange(w)
    in_rows = (rows >= top) & (rows < top + eh)  # (B, H)
    in_cols = (cols >= left) & (cols < left + ew)  # (B, W)
    erase = (torch.rand(b) < p) & fits.any(1)  # (B,)
    box = in_rows[:, :, None] & in_cols[:, None, :] & erase.view(b, 1, 1)  # (B, H, W)
    return x.masked_fill(box[:, None], 0.0)


def sample_transform(cfg: DataConfig, img_size: tuple[int, int]) -> v2.Compose | None:
    """The per-image random transforms named in cfg, for a random resized crop or RandAugment
    (None when neither is on: the batched ops do the rest)."""
    if not (cfg.random_resized_crop or cfg.randaugment_ops):
        return None
    from torchvision.transforms import v2  # here, not at import: `vitlab --help` needs none

    ops: list[v2.Transform] = []
    if cfg.random_resized_crop:
        ops.append(v2.RandomResizedCrop(list(img_size), scale=cfg.crop_scale, antialias=True))
    elif cfg.crop_padding:
        ops.append(v2.RandomCrop(list(img_size), padding=cfg.crop_padding))
    if cfg.hflip:
        ops.append(v2.RandomHorizontalFlip(cfg.hflip))
    if cfg.randaugment_ops:
        ops.append(v2.RandAugment(cfg.randaugment_ops, cfg.randaugment_magnitude))
    return v2.Compose(ops)


class BatchAugment:
    """Training-time batch pipeline: per-image or batched transforms, preprocessing, erasing,
    mixing."""

    def __init__(self, cfg: DataConfig, pre: Preprocessing, num_classes: int) -> None:
        self.pre, self.cfg = pre, cfg
        self.per_image = sample_transform(cfg, pre.img_size)
        self.crops_to_size = cfg.random_resized_crop  # else images are resized first
        self.mix = None
        if cfg.mixup or cfg.cutmix:
            from torchvision.transforms import v2

            mixers = [v2.MixUp(alpha=cfg.mixup, num_classes=num_classes)] if cfg.mixup else []
            if cfg.cutmix:
                mixers.append(v2.CutMix(alpha=cfg.cutmix, num_classes=num_classes))
            self.mix = v2.RandomChoice(mixers) if len(mixers) > 1 else mixers[0]

    def per_image_only(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> uint8 (B, C, h, w) with each image's own random transform."""
        if not self.crops_to_size:
            images = self.pre.resize(images)
        if self.per_image is not None:
            return torch.stack([self.per_image(img) for img in images])
        if self.cfg.crop_padding:
            images = random_shift(images, self.cfg.crop_padding)
        if self.cfg.hflip:
            images = random_hflip(images, self.cfg.hflip)
        return images

    def finish(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 images after per-image transforms -> (float input, labels: (B,) or soft (B, K))."""
        return self.mix_only(self.pre.batch(images), labels)

    def mix_only(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Normalised float images -> random erasing and mixing (the trainer's RNG draws)."""
        if self.cfg.random_erasing:
            x = random_erase(x, self.cfg.random_erasing)
        if self.mix is not None:
            x, labels = self.mix(x, labels)
        return x, labels
