"""The ResNet stem of a hybrid ViT state dict (timm's names, which are vitlab's), read from its
tensors; models.checkpoint asks here before reading the rest of a ViT.

From the tensors: the root width and input channels (patch_embed.backbone.stem.conv, (W, C, 7,
7)), the stages and their units (patch_embed.backbone.stages.{i}.blocks.{j}), hence the stride,
which is the config's patch_size. The projection must be 1x1 (timm's hybrids with larger patches
on the feature map, and its stem-only `vit_tiny_r_s16_p8`, have no vitlab counterpart).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from vitlab.formats.base import CheckpointError
from vitlab.models.stems import resnet_stride

PREFIX = "patch_embed.backbone."
_UNIT = re.compile(r"^patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.")


def infer_resnet_stem(state: Mapping[str, Tensor], where: str) -> dict[str, object] | None:
    """ViTConfig fields of the ResNet stem in `state` (stem, stem_width, stem_depths, patch_size,
    in_chans), or None when its patch embedding is no ResNet."""
    if not any(k.startswith(PREFIX) for k in state):
        return None
    root = state.get(PREFIX + "stem.conv.weight")
    if root is None or root.ndim != 4:
        raise CheckpointError(
            f"{where}: a hybrid whose CNN is not a ResNet stem with stages (no "
            f"{PREFIX}stem.conv.weight): vitlab builds the BiT ResNet hybrids (R50, R26 ...)"
        )
    units: dict[int, set[int]] = {}
    for key in state:
        m = _UNIT.match(key)
        if m:
            units.setdefault(int(m[1]), set()).add(int(m[2]))
    if not units or sorted(units) != list(range(len(units))):
        raise CheckpointError(f"{where}: ResNet stages numbered {sorted(units)}, not 0, 1, ...")
    depths = tuple(len(units[i]) for i in range(len(units)))
    for i, blocks in units.items():
        if sorted(blocks) != list(range(len(blocks))):
            raise CheckpointError(f"{where}: ResNet stage {i} has units {sorted(blocks)}")
    proj = state.get("patch_embed.proj.weight")
    if proj is not None and tuple(proj.shape[2:]) != (1, 1):
        raise CheckpointError(
            f"{where}: a hybrid with {tuple(proj.shape[2:])} patches on the feature map; vitlab's "
            "projects each position (1x1)"
        )
    return dict(
        stem="resnet",
        stem_width=int(root.shape[0]),
        stem_depths=depths,
        patch_size=resnet_stride(depths),
        in_chans=int(root.shape[1]),
    )
