"""Augmentation and preprocessing, all from torchvision.transforms.v2.

Per-image random transforms (crops, flips, RandAugment) run on uint8 (C, H, W) tensors, each image
with its own random draw; then whole batches are resized, scaled to [0, 1], normalised, randomly
erased (per image) and mixed (mixup / cutmix, with mixed soft labels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vitlab.config import DataConfig
from vitlab.preprocessing import Preprocessing

if TYPE_CHECKING:
    from torchvision.transforms import v2


def sample_transform(cfg: DataConfig, img_size: tuple[int, int]) -> v2.Compose | None:
    """The per-image random transforms named in cfg (None when all are off)."""
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
    return v2.Compose(ops) if ops else None


class BatchAugment:
    """Training-time batch pipeline: per-image transforms, preprocessing, erasing, mixing."""

    def __init__(self, cfg: DataConfig, pre: Preprocessing, num_classes: int) -> None:
        self.pre = pre
        self.per_image = sample_transform(cfg, pre.img_size)
        self.crops_to_size = cfg.random_resized_crop  # else images are resized first
        from torchvision.transforms import v2

        self.erase = v2.RandomErasing(cfg.random_erasing) if cfg.random_erasing else None
        mixers = []
        if cfg.mixup:
            mixers.append(v2.MixUp(alpha=cfg.mixup, num_classes=num_classes))
        if cfg.cutmix:
            mixers.append(v2.CutMix(alpha=cfg.cutmix, num_classes=num_classes))
        self.mix = v2.RandomChoice(mixers) if len(mixers) > 1 else (mixers[0] if mixers else None)

    def per_image_only(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> uint8 (B, C, h, w) with each image's own random transform."""
        if not self.crops_to_size:
            images = self.pre.resize(images)
        if self.per_image is None:
            return images
        return torch.stack([self.per_image(img) for img in images])

    def finish(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 images after per-image transforms -> (float input, labels: (B,) or soft (B, K))."""
        return self.mix_only(self.pre.batch(images), labels)

    def mix_only(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Normalised float images -> random erasing and mixing (the trainer's RNG draws)."""
        if self.erase is not None:
            x = torch.stack([self.erase(img) for img in x])
        if self.mix is not None:
            x, labels = self.mix(x, labels)
        return x, labels
