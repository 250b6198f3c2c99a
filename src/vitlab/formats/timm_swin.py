"""timm's Swin Transformer (`timm.models.swin_transformer.SwinTransformer`, v1), for formats.timm:
its names are vitlab's, so reading only leaves out the buffers older files kept (relative position
indices, shift masks) and moves the original Microsoft layout (patch merging at the end of stage
i, `head.weight`) to timm's (merging at the start of stage i + 1, `head.fc.weight`), as timm's
checkpoint_filter_fn does; config.json gives the image size and window; writing names the
architecture and its model_args."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from vitlab.formats.base import CheckpointError, Source, StateDict, rename
from vitlab.models.registry import UnknownModelError, get_config, list_models
from vitlab.models.swin import SwinConfig

_NAMES = (
    r"patch_embed\.(proj|norm)\.(weight|bias)|norm\.(weight|bias)|head\.fc\.(weight|bias)"
    r"|layers\.\d+\.downsample\.(norm\.(weight|bias)|reduction\.weight)"
    r"|layers\.\d+\.blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
    r"|layers\.\d+\.blocks\.\d+\.attn\.relative_position_bias_table"
)
_BUFFERS = ("relative_position_index", "attn_mask")  # derived from the config, never loaded

# the Swin (v1) entry points timm registers (tests check them against timm.list_models())
REGISTERED = frozenset(
    [f"swin_{s}_patch4_window7_224" for s in ("tiny", "small", "base", "large")]
    + [f"swin_{s}_patch4_window12_384" for s in ("base", "large")]
)


def timm_swin_to_vitlab(state: Mapping[str, Tensor], notes: list[str]) -> StateDict:
    """timm's (or the original Microsoft) Swin state dict in vitlab's names; what was moved is
    added to `notes`."""
    state = {k: v for k, v in state.items() if not k.endswith(_BUFFERS)}
    if "layers.0.downsample.reduction.weight" in state:  # merging at the end of each stage
        notes.append("original Swin layout: patch merging moved to the start of the next stage")
        state = {_timm_name(k): v for k, v in state.items()}
    return rename(state, [(f"({_NAMES})", r"\1")], "timm Swin")


def _timm_name(key: str) -> str:
    """A key of the original layout in timm's: layers.{i}.downsample -> layers.{i + 1}.downsample,
    head -> head.fc."""
    key = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) + 1}.downsample", key)
    return "head.fc." + key.removeprefix("head.") if key.startswith("head.") else key


def _size(value: Any) -> Any:
    """A JSON size: [h, w] as an int when square (as SwinConfig is usually given), else a tuple."""
    if isinstance(value, list):
        return value[0] if len(value) == 2 and value[0] == value[1] else tuple(value)
    return value


def read_hints(cfg: dict[str, Any], src: Source) -> None:
    """The image size and window from timm's config.json: the registered architecture's, the
    pretrained input size, then model_args."""
    arch = str(cfg.get("architecture", ""))
    if arch.startswith(("swinv2", "swin_s3")):
        raise CheckpointError(f"{src.where}: timm's {arch} is not the Swin (v1) vitlab builds")
    with contextlib.suppress(UnknownModelError):
        known = get_config(arch)
        if isinstance(known, SwinConfig):
            src.hints.update(img_size=known.img_size, window_size=known.window_size)
    pre = cfg.get("pretrained_cfg") or {}
    if len(pre.get("input_size") or []) == 3:
        src.hints["img_size"] = _size(list(pre["input_size"][1:]))
    args = dict(cfg.get("model_args") or {})
    for key in ("img_size", "window_size"):
        if key in args:
            src.hints[key] = _size(args[key])
    pool = args.get("global_pool", cfg.get("global_pool"))
    if pool not in (None, "avg"):
        raise CheckpointError(f"{src.where}: timm global_pool {pool!r} is not supported for Swin")


def _shape(cfg: SwinConfig) -> tuple[Any, ...]:
    """What a timm Swin name fixes: size (width, depths, heads), patch, window, resolution, MLP."""
    return (cfg.embed_dim, cfg.depths, cfg.num_heads, cfg.patch_size, cfg.window_hw, cfg.img_hw,
            cfg.mlp_ratio, cfg.qkv_bias)  # fmt: skip


def timm_arch(cfg: SwinConfig) -> str:
    """The timm name of `cfg`'s architecture when timm registers it (size, patch, window and
    resolution alike), else that of its size (width, depths, heads) when there is one, else
    Swin-T's. It only picks timm's entry point: model_args give every size."""
    same_size = []
    for name in sorted(REGISTERED & set(list_models(family="swin"))):
        known = get_config(name)
        if _shape(known) == _shape(cfg):
            return name
        if _shape(known)[:3] == _shape(cfg)[:3]:
            same_size.append(name)
    return (same_size or ["swin_tiny_patch4_window7_224"])[0]


def timm_swin_model_args(cfg: SwinConfig) -> tuple[str, dict[str, Any]]:
    """(timm architecture name, model_args) that build `cfg` with timm.create_model."""
    if cfg.norm_eps != 1e-5:
        raise CheckpointError(
            f"cannot write timm's format: norm_eps={cfg.norm_eps} (timm's Swin uses 1e-5)"
        )
    args: dict[str, Any] = dict(
        img_size=list(cfg.img_hw),
        patch_size=cfg.patch_size,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.embed_dim,
        depths=list(cfg.depths),
        num_heads=list(cfg.num_heads),
        window_size=cfg.window_hw[0] if len(set(cfg.window_hw)) == 1 else list(cfg.window_hw),
        mlp_ratio=cfg.mlp_ratio,
        qkv_bias=cfg.qkv_bias,
        global_pool="avg",
    )
    return timm_arch(cfg), args
