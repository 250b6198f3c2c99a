"""The CNNConfig a ResNet state dict (torchvision's names, which are vitlab's and timm's) was
trained with, read from its tensors and the hints its format states; models.checkpoint dispatches
here for CNNs.

From the tensors: the blocks per stage (layer{i}.{j}) and their kind (a conv3 means bottlenecks),
which name the architecture (resnet18 / 34 / 50); the stem (conv1 3x3: the small stem, 7x7: the
standard one) and the channels (conv1, (64, in_chans, k, k)); the classes (fc). The image size is
in no tensor: a CNN takes any. It comes from the format's config (timm's config.json, vitlab's
metadata), from the size the caller asks for, or is taken as 224 for the standard stem
(torchvision's weights) and 32 for the small one (a note says so).
"""

from __future__ import annotations

import re

from vitlab.config import ConfigError
from vitlab.formats.base import CheckpointError, Source
from vitlab.models.cnn import ARCHS, SMALL_SIDE, STEM_WIDTH, CNNConfig

_BLOCK = re.compile(r"^layer(\d+)\.(\d+)\.")
_STEMS = {3: True, 7: False}  # conv1's kernel side -> small stem


def infer_cnn_config(src: Source, img_size: int | tuple[int, int] | None = None) -> CNNConfig:
    """The CNNConfig of `src`'s ResNet tensors; `img_size` is taken as the trained size when the
    source states none."""
    s, hints, where = src.state, dict(src.hints), src.where
    stem = s.get("conv1.weight")
    if stem is None or stem.ndim != 4 or stem.shape[2] != stem.shape[3]:
        shape = None if stem is None else tuple(stem.shape)
        raise CheckpointError(f"{where}: conv1.weight {shape} is not a ResNet stem (64, C, k, k)")
    width, chans, side, _ = stem.shape
    if side not in _STEMS or width != STEM_WIDTH:
        raise CheckpointError(
            f"{where}: conv1 is {width} kernels of {side}x{side}; vitlab's ResNets have "
            f"{STEM_WIDTH} of 7x7 (standard stem) or 3x3 (small stem)"
        )
    small = _STEMS[side]
    blocks: dict[int, set[int]] = {}
    for key in s:
        m = _BLOCK.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    depths = tuple(len(blocks.get(i, ())) for i in range(1, max(blocks, default=0) + 1))
    bottleneck = "layer1.0.conv3.weight" in s
    archs = [a for a, (d, b) in ARCHS.items() if d == depths and b == bottleneck]
    if not archs:
        kind = "bottleneck" if bottleneck else "basic"
        raise CheckpointError(
            f"{where}: {kind} blocks {'-'.join(map(str, depths)) or 'none'} per stage are none of "
            f"the ResNets vitlab builds ({', '.join(ARCHS)})"
        )
    first = s.get("layer1.0.conv2.weight")
    if first is None or tuple(first.shape[:2]) != (STEM_WIDTH, STEM_WIDTH):
        raise CheckpointError(
            f"{where}: layer1.0.conv2 is not 64 -> 64 channels (a wide ResNet or a ResNeXt?): "
            f"vitlab builds torchvision's {', '.join(ARCHS)}"
        )
    asked = hints.pop("small_stem", None)
    if asked is not None and asked != small:
        raise CheckpointError(
            f"{where}: conv1 is {side}x{side}, the {'small' if small else 'standard'} stem; "
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
        num_classes=s["fc.weight"].shape[0] if "fc.weight" in s else 0,
        small_stem=small,
    )
    fields.update({k: v for k, v in hints.items() if v is not None})
    try:
        return CNNConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{where}: the tensors describe no valid ResNet: {e}") from None
