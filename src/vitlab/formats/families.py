"""Which model family a checkpoint's tensors belong to, told by their names (a ViT, a Swin in
timm's or transformers' names, a torchvision ResNet or timm's ResNet-v2), and what a format says
of a family it cannot hold."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from vitlab.formats.base import CheckpointError

# a Swin block in timm's (and vitlab's) names, `layers.{stage}.blocks.{block}.`, or in
# transformers' (`[swin.]encoder.layers.{stage}.blocks.{block}.`); a ViT's are `blocks.{i}.` or
# `[encoder.]layer[s].{i}.`
_SWIN_BLOCK = {
    "timm": re.compile(r"^layers\.\d+\.blocks\.\d+\."),
    "hf": re.compile(r"^(?:swin\.)?encoder\.layers\.\d+\.blocks\.\d+\."),
}


def swin_layout(keys: Iterable[str]) -> str | None:
    """'timm' or 'hf' when `keys` name a Swin Transformer's blocks in that library's names (vitlab's
    are timm's), else None."""
    keys = list(keys)
    for layout, pattern in _SWIN_BLOCK.items():
        if any(pattern.match(k) for k in keys):
            return layout
    return None


# a ResNet's residual blocks in torchvision's (and timm's, and vitlab's) names
_RESNET_BLOCK = re.compile(r"^layer[1-4]\.\d+\.(?:conv|bn)\d\.")


def is_resnet(keys: Iterable[str]) -> bool:
    """Whether `keys` name a ResNet in torchvision's names: conv1 and layer{1-4}.{j} blocks."""
    keys = list(keys)
    return "conv1.weight" in keys and any(_RESNET_BLOCK.match(k) for k in keys)


# a ResNet-v2's units in timm's names, at the top level (a hybrid's are under patch_embed.backbone)
_RESNETV2_BLOCK = re.compile(r"^stages\.\d+\.blocks\.\d+\.conv\d\.weight$")


def is_resnetv2(keys: Iterable[str]) -> bool:
    """Whether `keys` name a classifier ResNet-v2 in timm's names (BiT's, models.resnetv2):
    stem.conv and stages.{i}.blocks.{j} units."""
    keys = list(keys)
    return "stem.conv.weight" in keys and any(_RESNETV2_BLOCK.match(k) for k in keys)


def state_family(keys: Iterable[str]) -> str:
    """'swin' when `keys` are a Swin Transformer's (timm's or transformers' names), 'cnn' when a
    torchvision ResNet's or a timm ResNet-v2's, else 'vit'."""
    keys = list(keys)
    if is_resnet(keys) or is_resnetv2(keys):
        return "cnn"
    return "vit" if swin_layout(keys) is None else "swin"


def write_cnn_instead(config: Any) -> str:
    """Where a CNN is written, for a format that refuses it: torchvision's ResNets as torchvision's
    state dict, BiT's ResNet-v2 (a CNNConfig with `bit`) as timm's."""
    if getattr(config, "bit", False):
        return "write BiT's ResNet-v2 (timm's ResNetV2 names) with --to timm or --to vitlab"
    return (
        "write a ResNet with --to torchvision (a plain state dict in torchvision's names, "
        "which are timm's resnet18/34/50's too) or --to vitlab"
    )


def refuse_swin_v2(keys: Iterable[str], where: str) -> None:
    """A CheckpointError naming Swin V2 (its continuous position bias and attention scale) or
    absolute position embeddings, which vitlab's Swin (v1) has no place for."""
    keys = list(keys)
    if any(k.endswith(("cpb_mlp.0.weight", "logit_scale")) for k in keys):
        raise CheckpointError(
            f"{where}: a Swin V2 checkpoint (continuous position bias, cosine attention): "
            "vitlab builds the Swin (v1) of Liu et al. 2021"
        )
    if any(k.endswith(("absolute_pos_embed", "embeddings.position_embeddings")) for k in keys):
        raise CheckpointError(
            f"{where}: absolute position embeddings (ape / use_absolute_embeddings) are not "
            "part of vitlab's Swin"
        )
