"""torchvision's format: the state dict of torchvision.models.vit_* (`conv_proj`, `encoder.layers.
encoder_layer_N`, fused `in_proj` attention), read with the ImageNet preprocessing of its weight
enums (resize to 256, centre crop 224). vitlab reads it; it does not write it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import Tensor, nn

from vitlab.formats.base import CheckpointError, Files, Source, StateDict, convert, rename
from vitlab.preprocessing import IMAGENET_MEAN, IMAGENET_STD

_LAYER = r"encoder\.layers\.encoder_layer_(\d+)"
_RULES = [
    (r"conv_proj\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"class_token", "cls_token"),
    (r"encoder\.pos_embedding", "pos_embed.weight"),
    (rf"{_LAYER}\.ln_1\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (rf"{_LAYER}\.self_attention\.in_proj_(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (rf"{_LAYER}\.self_attention\.out_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (rf"{_LAYER}\.ln_2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (rf"{_LAYER}\.mlp\.(?:0|linear_1)\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (rf"{_LAYER}\.mlp\.(?:3|linear_2)\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"encoder\.ln\.(weight|bias)", r"norm.\1"),
    (r"heads\.pre_logits\.(weight|bias)", r"pre_logits.fc.\1"),
    (r"heads\.head\.(weight|bias)", r"head.\1"),
]


def torchvision_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    return rename(state, _RULES, "torchvision vit_*")


def detect(files: Files) -> bool:
    return "conv_proj.weight" in files.names()


def read(files: Files) -> Source:
    src = Source(convert(files.where, torchvision_to_vitlab, files.tensors()), "torchvision",
                 files.where)  # fmt: skip
    src.preprocessing = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=224 / 256)
    return src


def write(model: nn.Module, dst: Path) -> list[Path]:
    raise CheckpointError("vitlab does not write torchvision's format (it writes vitlab, timm, hf)")
