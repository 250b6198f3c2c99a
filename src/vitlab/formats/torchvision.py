"""torchvision's format: the state dict of torchvision.models.vit_* (`conv_proj`, `encoder.layers.
encoder_layer_N`, fused `in_proj` attention), read with the ImageNet preprocessing of its weight
enums (resize to 256, centre crop 224); vitlab reads it and does not write it. And the state dict of
torchvision.models.resnet18 / 34 / 50 (conv1, bn1, layer1..4, fc: vitlab's CNN names, also timm's
ResNet names), read (BatchNorm counters older files lack filled in as 0, as PyTorch does) and
written: a plain state dict, DST.pth / .pt (torch.save) or DST.safetensors, that
torchvision.models.resnetNN().load_state_dict takes (a small stem needs its conv1 and maxpool
replaced as vitlab.models.cnn does)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from vitlab.formats.base import (
    TORCH_SUFFIXES,
    WEIGHTS,
    CheckpointError,
    Files,
    Source,
    StateDict,
    convert,
    cpu_state,
    fsync,
    is_resnet,
    rename,
    write_cnn_instead,
    write_safetensors,
)
from vitlab.models.registry import family_of
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
    keys = files.names()
    return "conv_proj.weight" in keys or is_resnet(keys)


def read(files: Files) -> Source:
    tensors = files.tensors()
    if is_resnet(tensors):
        src = Source(with_batchnorm_counters(tensors), "torchvision", files.where)
        src.preprocessing = dict(
            mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=224 / 256, interpolation="bilinear"
        )
        return src
    src = Source(convert(files.where, torchvision_to_vitlab, tensors), "torchvision",
                 files.where)  # fmt: skip
    src.preprocessing = dict(  # ViT_*_Weights.IMAGENET1K_V1's ImageClassification: bilinear
        mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=224 / 256, interpolation="bilinear"
    )
    return src


def with_batchnorm_counters(state: Mapping[str, Tensor]) -> StateDict:
    """`state` with a zero `num_batches_tracked` for every BatchNorm that has running statistics
    but no counter (torchvision's older files), as BatchNorm's own loading adds it."""
    out = dict(state)
    for key in state:
        if key.endswith(".running_mean"):
            out.setdefault(key.removesuffix("running_mean") + "num_batches_tracked",
                           torch.tensor(0, dtype=torch.long))  # fmt: skip
    return out


def write(model: nn.Module, dst: Path) -> list[Path]:
    """A CNN's plain state dict in torchvision's names: DST.pth / .pt / .bin (torch.save),
    DST.safetensors, or DST/model.safetensors; no config or preprocessing travels with it."""
    if family_of(model.config) != "cnn":
        raise CheckpointError(
            "vitlab writes torchvision's format for CNNs (ResNets) only; write a ViT or a Swin "
            "as vitlab, timm or hf"
        )
    if model.config.bit:
        raise CheckpointError(
            f"{model.config.arch} is BiT's ResNet-v2 (GroupNorm, weight-standardised convs), "
            "which torchvision has no model for; " + write_cnn_instead(model.config)
        )
    state = cpu_state(model.state_dict())
    if dst.suffix in TORCH_SUFFIXES:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp")
        torch.save(state, tmp)
        fsync(tmp)
        tmp.replace(dst)
        return [dst]
    path = dst if dst.suffix == ".safetensors" else dst / WEIGHTS
    write_safetensors(path, state, {"format": "pt"})
    return [path]
