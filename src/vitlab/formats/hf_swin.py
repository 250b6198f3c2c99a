"""Hugging Face transformers' Swin (`SwinModel`, `SwinForImageClassification`, config.json
`model_type: swin`), for formats.hf: names, config and limits.

Names: the hub's (`swin.encoder.layers.{i}.blocks.{j}.attention.self.query`, ...; no `swin.` prefix
in a bare SwinModel) and transformers 5's in-memory ones (`attention.q_proj`, `mlp.fc1`, ...).
Query, key and value are separate there and fused into timm's `attn.qkv` here; transformers merges
patches at the END of stage i (`encoder.layers.{i}.downsample`), timm and vitlab at the START of
stage i + 1 (`layers.{i + 1}.downsample`).

Limits: transformers pads a map the window does not tile BEFORE the cyclic shift (timm and vitlab
after it), shifts along both axes or neither (timm per axis), and keeps a full (2M - 1)^2 bias
table where the window is clamped to a smaller map (timm shrinks it, and transformers' forward
cannot use it there). The same weights give the same outputs only where the window M tiles every
stage's map: each map a multiple of M on both sides, and equal to M on both sides or on neither.
vitlab writes this format only for such models (tiling_problems), and notes it when reading one
that is not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from vitlab.formats.base import (
    CheckpointError,
    Source,
    StateDict,
    fuse_qkv,
    rename,
    unknown,
)
from vitlab.models.swin import SwinConfig

_B = r"encoder\.layers\.(\d+)\.blocks\.(\d+)\."  # a block in transformers' names
_V = r"layers.\1.blocks.\2."  # the same block in vitlab's
_RULES = [  # (transformers' name without `swin.`, hub or in-memory; vitlab's)
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"embeddings\.norm\.(weight|bias)", r"patch_embed.norm.\1"),
    (rf"{_B}layernorm_before\.(weight|bias)", rf"{_V}norm1.\3"),
    (rf"{_B}attention\.(?:output\.dense|o_proj)\.(weight|bias)", rf"{_V}attn.proj.\3"),
    (
        rf"{_B}attention\.(?:self|relative_position_bias)\.relative_position_bias_table",
        rf"{_V}attn.relative_position_bias_table",
    ),
    (rf"{_B}layernorm_after\.(weight|bias)", rf"{_V}norm2.\3"),
    (rf"{_B}(?:intermediate\.dense|mlp\.fc1)\.(weight|bias)", rf"{_V}mlp.fc1.\3"),
    (rf"{_B}(?:output\.dense|mlp\.fc2)\.(weight|bias)", rf"{_V}mlp.fc2.\3"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
    (r"classifier\.(weight|bias)", r"head.fc.\1"),
    (r"(layers\.\d+\.downsample\.(?:norm\.(?:weight|bias)|reduction\.weight))", r"\1"),  # moved
]
_QKV = re.compile(rf"^{_B}attention\.(?:self\.(query|key|value)|(q|k|v)_proj)\.(weight|bias)$")
_MERGE = re.compile(r"^encoder\.layers\.(\d+)\.downsample\.(.+)$")
_BLOCK_PARTS = {  # vitlab's block modules -> the hub's (attn.qkv is split)
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
_TOP = {  # vitlab's names outside the stages -> the hub's (the classifier apart)
    "patch_embed.proj": "embeddings.patch_embeddings.projection",
    "patch_embed.norm": "embeddings.norm",
    "norm": "layernorm",
}


def hf_swin_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    """transformers' Swin state dict (hub or in-memory names) in vitlab's (timm's) names."""
    parts: dict[tuple[int, int, str], dict[str, Tensor]] = {}
    rest = {}
    for key, value in state.items():
        key = key.removeprefix("swin.")
        if key.endswith("relative_position_index"):  # a buffer older files kept
            continue
        m, merge = _QKV.match(key), _MERGE.match(key)
        if m:
            stage, block, long, short, kind = m.groups()
            parts.setdefault((int(stage), int(block), kind), {})[(long or short)[0]] = value
        elif merge:  # end of stage i -> start of stage i + 1
            rest[f"layers.{int(merge[1]) + 1}.downsample.{merge[2]}"] = value
        else:
            rest[key] = value
    out = rename(rest, _RULES, "Hugging Face Swin")
    for (stage, block, kind), qkv in parts.items():
        fused = fuse_qkv(qkv, kind, f"stage {stage} block {block}")
        out[f"layers.{stage}.blocks.{block}.attn.qkv.{kind}"] = fused
    return out


def vitlab_to_hf_swin(state: Mapping[str, Tensor], with_classifier: bool) -> StateDict:
    """vitlab's Swin -> the hub names of SwinForImageClassification (`swin.` prefix,
    `classifier`), or of SwinModel when not `with_classifier`."""
    out = {}
    prefix = "swin." if with_classifier else ""
    for key, value in state.items():
        block = re.match(r"^layers\.(\d+)\.blocks\.(\d+)\.(.+)$", key)
        merge = re.match(r"^layers\.(\d+)\.downsample\.(.+)$", key)
        module, _, kind = key.rpartition(".")
        if block:
            stage, j, rest = block.groups()
            base = f"{prefix}encoder.layers.{stage}.blocks.{j}"
            part, _, kind = rest.rpartition(".")
            if rest == "attn.relative_position_bias_table":
                out[f"{base}.attention.self.relative_position_bias_table"] = value
            elif part == "attn.qkv":
                for name, chunk in zip(("query", "key", "value"), value.chunk(3)):
                    out[f"{base}.attention.self.{name}.{kind}"] = chunk.clone()
            elif part in _BLOCK_PARTS:
                out[f"{base}.{_BLOCK_PARTS[part]}.{kind}"] = value
            else:
                raise unknown([key], "Hugging Face Swin")
        elif merge:
            out[f"{prefix}encoder.layers.{int(merge[1]) - 1}.downsample.{merge[2]}"] = value
        elif module in _TOP:
            out[f"{prefix}{_TOP[module]}.{kind}"] = value
        elif module == "head.fc" and with_classifier:
            out[f"classifier.{kind}"] = value
        else:
            raise unknown([key], "Hugging Face Swin")
    return out


def tiling_problems(
    img_hw: tuple[int, int], patch: int, window: tuple[int, int], stages: int
) -> list[str]:
    """Why transformers' Swin would not compute what timm's and vitlab's do with the same weights
    (see the module's docstring); [] when it does."""
    if window[0] != window[1]:
        return [f"a {window[0]}x{window[1]} window (transformers' Swin has square ones)"]
    m, why = window[0], []
    for i in range(stages):
        h, w = (-(-side // (patch * 2**i)) for side in img_hw)
        if h % m or w % m:
            why.append(f"windows of {m} do not tile stage {i}'s {h}x{w} map")
        elif (h == m) != (w == m):
            why.append(
                f"stage {i}'s {h}x{w} map is one window of {m} along one side only (timm and "
                "vitlab shift along the other side, transformers along neither)"
            )
    return why


def read_hints(cfg: dict[str, Any], src: Source) -> None:
    """Hints from transformers' SwinConfig (config.json); a note when its windows do not tile its
    maps, where transformers' outputs and vitlab's differ."""
    if cfg.get("use_absolute_embeddings"):
        raise CheckpointError(
            f"{src.where}: absolute position embeddings (use_absolute_embeddings) are not part of "
            "vitlab's Swin"
        )
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointError(f"{src.where}: hidden_act {act!r}: vitlab's Swin uses exact GELU")
    size = cfg.get("image_size", 224)
    src.hints.update(
        img_size=tuple(size) if isinstance(size, list) else size,
        window_size=cfg.get("window_size", 7),
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        dropout=cfg.get("hidden_dropout_prob", 0.0),
        attn_dropout=cfg.get("attention_probs_dropout_prob", 0.0),
        drop_path=cfg.get("drop_path_rate", 0.1),
    )
    if cfg.get("layer_norm_eps", 1e-5) != 1e-5:
        src.notes.append(
            f"layer_norm_eps={cfg['layer_norm_eps']}: transformers uses it in the blocks' and the "
            "final LayerNorm but 1e-5 in the patch embedding's and patch merging's, vitlab one eps "
            "for all: outputs differ slightly"
        )
    h, w = (size, size) if isinstance(size, int) else size
    window, patch = cfg.get("window_size", 7), cfg.get("patch_size", 4)
    problems = tiling_problems((h, w), patch, (window, window), len(cfg.get("depths", [])))
    if problems:
        src.notes.append(
            f"{'; '.join(problems)}: transformers' outputs differ from vitlab's (and timm's) at "
            "this size (see vitlab.formats.hf_swin)"
        )


def hf_swin_config(cfg: SwinConfig, classes: list[str]) -> tuple[dict[str, Any], bool]:
    """(transformers SwinConfig dict, whether the model has a classifier) for `cfg`; an error for a
    model transformers would not compute alike (tiling_problems)."""
    why = tiling_problems(cfg.img_hw, cfg.patch_size, cfg.window_hw, cfg.num_stages)
    if cfg.norm_eps != 1e-5:
        why.append(
            f"norm_eps={cfg.norm_eps}: transformers applies layer_norm_eps to the blocks' and the "
            "final LayerNorm only (1e-5 in the patch embedding and patch merging)"
        )
    if why:
        raise CheckpointError(
            f"cannot write Hugging Face Swin's format: {'; '.join(why)}. transformers pads such a "
            "map before the cyclic shift (vitlab, as timm, after it), shifts along both sides or "
            "neither, and keeps full-size bias tables where a window is clamped, so its outputs "
            "would differ: write timm's format, or pick an img_size whose stage maps are "
            "multiples of the window"
        )
    with_classifier = cfg.num_classes > 0
    h, w = cfg.img_hw
    out = {
        "architectures": ["SwinForImageClassification" if with_classifier else "SwinModel"],
        "model_type": "swin",
        "image_size": h if h == w else [h, w],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans,
        "embed_dim": cfg.embed_dim,
        "depths": list(cfg.depths),
        "num_heads": list(cfg.num_heads),
        "window_size": cfg.window_hw[0],
        "mlp_ratio": cfg.mlp_ratio,
        "qkv_bias": cfg.qkv_bias,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "drop_path_rate": cfg.drop_path,
        "use_absolute_embeddings": False,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.norm_eps,
        "encoder_stride": cfg.patch_size * 2 ** (cfg.num_stages - 1),
    }
    if with_classifier:
        out["id2label"] = {str(i): n for i, n in enumerate(classes)}
        out["label2id"] = {n: i for i, n in enumerate(classes)}
    return out, with_classifier
