"""torchvision's format: the state dict of torchvision.models.vit_* (`conv_proj`, `encoder.layers.
encoder_layer_N`, fused `in_proj` attention), read with the preprocessing of the weight enum it
comes from (weights_preprocessing); vitlab reads it and does not write it. And the state dict of
torchvision.models.resnet18 / 34 / 50 (conv1, bn1, layer1..4, fc: vitlab's CNN names, also timm's
ResNet names), read (BatchNorm counters older files lack filled in as 0, as PyTorch does) and
written: a plain state dict, DST.pth / .pt (torch.save) or DST.safetensors, that
torchvision.models.resnetNN().load_state_dict takes (a small stem needs its conv1 and maxpool
replaced as vitlab.models.cnn does)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

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
    rename,
    write_safetensors,
)
from vitlab.formats.families import is_resnet, write_cnn_instead
from vitlab.models.registry import family_of
from vitlab.preprocessing import IMAGENET_MEAN, IMAGENET_STD, crop_pct_for

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
    if "pos_embed.weight" not in src.state or "patch_embed.proj.weight" not in src.state:
        raise CheckpointError(f"{files.where}: a torchvision ViT without its position table or "
                              f"patch embedding (encoder.pos_embedding, conv_proj)")  # fmt: skip
    src.preprocessing = weights_preprocessing(src.state, src.notes)
    # vision_transformer.interpolate_embeddings: bicubic, align_corners=True, no antialias
    src.pos_resampling = dict(interpolation="bicubic", antialias=False, align_corners=True)
    return src


class Weights(NamedTuple):
    """One of torchvision's ViT weight enums and its transforms(): resize the shorter side to
    `resize`, centre-crop `size`."""

    arch: str
    name: str
    size: int
    resize: int
    interpolation: str

    @property
    def enum(self) -> str:
        return f"ViT_{self.arch.removeprefix('vit_').upper()}_Weights.{self.name}"

    @property
    def transform(self) -> str:
        return f"resize {self.resize}, crop {self.size}, {self.interpolation}"


# every ViT weight torchvision releases (tests check them against torchvision.models), V1 first
WEIGHTS_ENUMS = [
    Weights("vit_b_16", "IMAGENET1K_V1", 224, 256, "bilinear"),
    Weights("vit_b_32", "IMAGENET1K_V1", 224, 256, "bilinear"),
    Weights("vit_l_16", "IMAGENET1K_V1", 224, 242, "bilinear"),
    Weights("vit_l_32", "IMAGENET1K_V1", 224, 256, "bilinear"),
    Weights("vit_b_16", "IMAGENET1K_SWAG_E2E_V1", 384, 384, "bicubic"),
    Weights("vit_l_16", "IMAGENET1K_SWAG_E2E_V1", 512, 512, "bicubic"),
    Weights("vit_h_14", "IMAGENET1K_SWAG_E2E_V1", 518, 518, "bicubic"),
    Weights("vit_b_16", "IMAGENET1K_SWAG_LINEAR_V1", 224, 224, "bicubic"),
    Weights("vit_l_16", "IMAGENET1K_SWAG_LINEAR_V1", 224, 224, "bicubic"),
    Weights("vit_h_14", "IMAGENET1K_SWAG_LINEAR_V1", 224, 224, "bicubic"),
]
ARCHS = {  # (width, depth, patch) -> torchvision's model
    (768, 12, 16): "vit_b_16",
    (768, 12, 32): "vit_b_32",
    (1024, 24, 16): "vit_l_16",
    (1024, 24, 32): "vit_l_32",
    (1280, 32, 14): "vit_h_14",
}
_PATCH = {arch: patch for (_, _, patch), arch in ARCHS.items()}


def weights_preprocessing(state: Mapping[str, Tensor], notes: list[str]) -> dict[str, Any]:
    """The transform of the weight enum a ViT state dict (vitlab's names) comes from: its model
    from width, depth and patch, its image size from the position table. An unknown model is
    matched by patch and image size; where that leaves several enums (B/16 or L/16 at 224: V1
    or SWAG_LINEAR) V1's is taken, and said in `notes`, as where it leaves none."""
    kernel = state["patch_embed.proj.weight"]  # (D, C, P, P)
    width, patch = kernel.shape[0], kernel.shape[-1]
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    size = math.isqrt(state["pos_embed.weight"].shape[-2] - 1) * patch
    arch = ARCHS.get((width, depth, patch))
    fits = [
        w for w in WEIGHTS_ENUMS
        if w.size == size and (w.arch == arch if arch else _PATCH[w.arch] == patch)
    ]  # fmt: skip
    chosen = fits[0] if fits else WEIGHTS_ENUMS[0]
    said = f"torchvision ViT (width {width}, depth {depth}, patch {patch}) at {size} px"
    if not fits:
        share = f"crop {chosen.size} of {chosen.resize}, {chosen.interpolation}"
        notes.append(f"{said} is none of torchvision's weights: {chosen.enum}'s {share} assumed")
    elif len(fits) > 1:
        alike: dict[str, list[Weights]] = {}  # the other enums by their transform
        for w in fits[1:]:
            alike.setdefault(w.transform, []).append(w)
        others = "; ".join(
            f"for {' or '.join(w.enum for w in ws)} ({t}) set model.preprocessing = "
            f"dataclasses.replace(model.preprocessing, crop_pct="
            f"{crop_pct_for(ws[0].size, ws[0].resize)!r}, interpolation={ws[0].interpolation!r})"
            for t, ws in alike.items()
        )
        notes.append(f"{said}: {chosen.enum}'s {chosen.transform} assumed; {others}")
    elif not arch:
        notes.append(f"{said}: the only torchvision weights at that size, {chosen.enum}")
    return dict(
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        crop_pct=crop_pct_for(chosen.size, chosen.resize),
        interpolation=chosen.interpolation,
        crop_mode="center",
        reference="timm",  # torchvision's ImageClassification resizes PIL images as timm does
    )


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
