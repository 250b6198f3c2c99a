"""The CNNConfig a ResNet state dict was trained with, read from its tensors and the hints its
format states; models.checkpoint dispatches here for CNNs. Two layouts: torchvision's names (which
are vitlab's ResNet's and timm's resnet18/34/50's) and timm's ResNetV2 names (vitlab's
BiTResNet's, arch resnetv2_50).

From the tensors: the blocks per stage (layer{i}.{j}, or stages.{i}.blocks.{j}) and their kind (a
conv3 means bottlenecks), which with the layout name the architecture (resnet18 / 34 / 50,
resnetv2_50); the stem (conv1 or stem.conv: 3x3 the small stem, 7x7 the standard one) and the
channels ((64, in_chans, k, k)); the classes (fc, or head.fc). The image size is in no tensor: a
CNN takes any. It comes from the format's config (timm's config.json, vitlab's metadata), from the
size the caller asks for, or is taken as 224 for the standard stem (torchvision's weights) and 32
for the small one (a note says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vitlab.config import ConfigError
from vitlab.formats.base import CheckpointError, Source
from vitlab.formats.families import is_resnetv2
from vitlab.models.cnn import ARCHS, BIT_ARCHS, SMALL_SIDE, STEM_WIDTH, CNNConfig

_STEMS = {3: True, 7: False}  # the stem conv's kernel side -> small stem


@dataclass(frozen=True)
class _Layout:
    """Where a layout keeps what the config is read from."""

    stem: str  # the stem conv's weight
    block: re.Pattern[str]  # a residual block's keys: (stage, block) groups
    first: int  # the first stage's number
    unit: str  # the first block's prefix
    classifier: str  # the classifier's weight
    archs: tuple[str, ...]  # the architectures vitlab builds in these names


_TORCHVISION = _Layout(
    "conv1.weight",
    re.compile(r"^layer(\d+)\.(\d+)\."),
    1,
    "layer1.0.",
    "fc.weight",
    tuple(a for a in ARCHS if a not in BIT_ARCHS),
)
_TIMM_RESNETV2 = _Layout(
    "stem.conv.weight",
    re.compile(r"^stages\.(\d+)\.blocks\.(\d+)\."),
    0,
    "stages.0.blocks.0.",
    "head.fc.weight",
    BIT_ARCHS,
)


def infer_cnn_config(src: Source, img_size: int | tuple[int, int] | None = None) -> CNNConfig:
    """The CNNConfig of `src`'s ResNet tensors; `img_size` is taken as the trained size when the
    source states none."""
    s, hints, where = src.state, dict(src.hints), src.where
    names = _TIMM_RESNETV2 if is_resnetv2(s) else _TORCHVISION
    conv = names.stem.removesuffix(".weight")
    stem = s.get(names.stem)
    if stem is None or stem.ndim != 4 or stem.shape[2] != stem.shape[3]:
        shape = None if stem is None else tuple(stem.shape)
        raise CheckpointError(f"{where}: {names.stem} {shape} is not a ResNet stem (64, C, k, k)")
    width, chans, side, _ = stem.shape
    if side not in _STEMS or width != STEM_WIDTH:
        raise CheckpointError(
            f"{where}: {conv} is {width} kernels of {side}x{side}; vitlab's ResNets have "
            f"{STEM_WIDTH} of 7x7 (standard stem) or 3x3 (small stem)"
        )
    small = _STEMS[side]
    blocks: dict[int, set[int]] = {}
    for key in s:
        m = names.block.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    stages = range(names.first, max(blocks, default=names.first - 1) + 1)
    depths = tuple(len(blocks.get(i, ())) for i in stages)
    unit = names.unit  # the first block, e.g. "layer1.0."
    bottleneck = f"{unit}conv3.weight" in s
    archs = [a for a in names.archs if ARCHS[a] == (depths, bottleneck)]
    if not archs:
        kind = "bottleneck" if bottleneck else "basic"
        raise CheckpointError(
            f"{where}: {kind} blocks {'-'.join(map(str, depths)) or 'none'} per stage are none of "
            f"the ResNets vitlab builds in these names ({', '.join(names.archs)})"
        )
    first = s.get(f"{unit}conv2.weight")
    if first is None or tuple(first.shape[:2]) != (STEM_WIDTH, STEM_WIDTH):
        raise CheckpointError(
            f"{where}: {unit}conv2 is not 64 -> 64 channels (a wide ResNet or a ResNeXt?): "
            f"vitlab builds {', '.join(names.archs)}"
        )
    asked = hints.pop("small_stem", None)
    if asked is not None and asked != small:
        raise CheckpointError(
            f"{where}: {conv} is {side}x{side}, the {'small' if small else 'standard'} stem; "
            f"small_stem={asked} does not fit these weights"
        )
    size = hints.pop("img_size", None) or img_size
    if size is None:
        size = SMALL_SIDE if small else 224
        if small:
            src.notes.append(
                f"the image size is in no tensor: assumed {size} for the small stem (pass "
                f"img_size= for another)"
            )
    fields = dict(
        arch=archs[0],
        img_size=size,
        in_chans=chans,
        num_classes=s[names.classifier].shape[0] if names.classifier in s else 0,
        small_stem=small,
    )
    fields.update({k: v for k, v in hints.items() if v is not None})
    try:
        return CNNConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{where}: the tensors describe no valid ResNet: {e}") from None
