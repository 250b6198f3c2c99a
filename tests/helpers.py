"""Small shared helpers for the tests."""

from __future__ import annotations

from torch import nn

from vitlab.models.vit import VisionTransformer, ViTConfig


def tiny_config(**overrides: object) -> ViTConfig:
    """A 16x16, patch-4 ViT small enough to run in milliseconds."""
    base: dict[str, object] = dict(
        img_size=16,
        patch_size=4,
        in_chans=3,
        num_classes=7,
        embed_dim=32,
        depth=2,
        num_heads=4,
        mlp_dim=64,
    )
    base.update(overrides)
    return ViTConfig(**base)


def randomize_head(model: VisionTransformer) -> None:
    """The head is zero-initialised, which would stop every gradient before it."""
    nn.init.normal_(model.head.weight, std=0.1)
