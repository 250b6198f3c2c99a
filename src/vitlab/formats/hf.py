"""Hugging Face transformers' format: ViTModel or ViTForImageClassification weights (hub names,
with or without the `vit.` prefix, or transformers 5's in-memory names), and a distilled ViT's as
DeiTModel or DeiTForImageClassificationWithTeacher (`deit.`), in a folder with config.json and
preprocessor_config.json, as save_pretrained writes and from_pretrained loads. Query, key and
value are separate Linear layers there and fused here. SwinModel and
SwinForImageClassification likewise, their names, config and limits in formats.hf_swin."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from vitlab.formats import hf_swin
from vitlab.formats.base import (
    WEIGHTS,
    CheckpointError,
    Files,
    Source,
    StateDict,
    classes_of,
    convert,
    cpu_state,
    fuse_qkv,
    preprocessing_of,
    rename,
    unknown,
    write_json,
    write_safetensors,
)
from vitlab.formats.families import refuse_swin_v2, state_family, swin_layout, write_cnn_instead
from vitlab.models.registry import family_of
from vitlab.models.vit import ViTConfig
from vitlab.preprocessing import HALF, IMAGENET_MEAN, IMAGENET_STD, Preprocessing, crop_pct_for

_RULES = [  # (transformers' hub / save_pretrained name, vitlab name)
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.distillation_token", "dist_token"),
    (r"embeddings\.position_embeddings", "pos_embed.weight"),
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"encoder\.layer\.(\d+)\.layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"encoder\.layer\.(\d+)\.layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
    (r"pooler\.dense\.(weight|bias)", r"pre_logits.fc.\1"),
    (r"(?:cls_)?classifier\.(weight|bias)", r"head.\1"),
    (r"distillation_classifier\.(weight|bias)", r"head_dist.\1"),
]
_RULES_V5 = [  # transformers 5's in-memory names for the same modules
    (r"layers\.(\d+)\.layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"layers\.(\d+)\.attention\.o_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"layers\.(\d+)\.layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"layers\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.mlp.\2.\3"),
]
_QKV = re.compile(
    r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.(query|key|value)|(q|k|v)_proj)"
    r"\.(weight|bias)$"
)
_BLOCK_PARTS = {  # vitlab's block modules -> transformers' (attn.qkv is split)
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
_TOP = {  # vitlab's names outside the blocks -> transformers' (the classifier apart)
    "cls_token": "embeddings.cls_token",
    "dist_token": "embeddings.distillation_token",
    "pos_embed.weight": "embeddings.position_embeddings",
    "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias",
    "norm.weight": "layernorm.weight",
    "norm.bias": "layernorm.bias",
    "pre_logits.fc.weight": "pooler.dense.weight",
    "pre_logits.fc.bias": "pooler.dense.bias",
}
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes


def hf_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    rest = {}
    for key, value in state.items():
        key = key.removeprefix("vit.").removeprefix("deit.")
        m = _QKV.match(key)
        if m:
            layer, long, short, kind = m.groups()
            parts.setdefault((int(layer), kind), {})[(long or short)[0]] = value
        else:
            rest[key] = value
    out = rename(rest, _RULES + _RULES_V5, "Hugging Face ViT")
    for (layer, kind), qkv in parts.items():
        out[f"blocks.{layer}.attn.qkv.{kind}"] = fuse_qkv(qkv, kind, f"layer {layer}")
    return out


def vitlab_to_hf(state: Mapping[str, Tensor], with_classifier: bool) -> StateDict:
    """vitlab -> the hub names of ViTForImageClassification (`vit.` prefix, `classifier`), or of
    ViTModel when not `with_classifier`; a distilled ViT's as DeiTForImageClassificationWithTeacher
    (`deit.`, `cls_classifier`, `distillation_classifier`) or DeiTModel."""
    out, deit = {}, "dist_token" in state
    prefix = ("deit." if deit else "vit.") if with_classifier else ""
    heads = {
        "head": "cls_classifier" if deit else "classifier",
        "head_dist": "distillation_classifier",
    }
    for key, value in state.items():
        m = re.match(r"^blocks\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)$", key)
        if m:
            i, part, kind = m.groups()
            layer = f"{prefix}encoder.layer.{i}"
            if part == "attn.qkv":
                for name, chunk in zip(("query", "key", "value"), value.chunk(3)):
                    out[f"{layer}.attention.attention.{name}.{kind}"] = chunk.clone()
            elif part in _BLOCK_PARTS:
                out[f"{layer}.{_BLOCK_PARTS[part]}.{kind}"] = value
            else:
                raise unknown([key], "Hugging Face ViT")
        elif key in _TOP:
            out[prefix + _TOP[key]] = value
        elif key.split(".")[0] in heads and with_classifier:
            out[f"{heads[key.split('.')[0]]}.{key.split('.')[1]}"] = value
        else:
            raise unknown([key], "Hugging Face ViT")
    return out


def detect(files: Files) -> bool:
    return any("embeddings.patch_embeddings.projection" in k for k in files.names())


def read(files: Files) -> Source:
    tensors = files.tensors()
    if swin_layout(tensors) == "hf":  # Microsoft's Swins, trained on ImageNet's statistics
        refuse_swin_v2(tensors, files.where)
        src = Source(convert(files.where, hf_swin.hf_swin_to_vitlab, tensors), "hf", files.where)
        pre = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic", crop_pct=None)
        src.preprocessing = pre
        return src
    state = convert(files.where, hf_to_vitlab, tensors)
    src = Source(state, "hf", files.where, hints=dict(norm_eps=1e-12))
    src.preprocessing = dict(mean=HALF, std=HALF, crop_pct=None)
    # ViTEmbeddings.interpolate_pos_encoding: bicubic, no antialias (timm's has it)
    src.pos_resampling = dict(interpolation="bicubic", antialias=False)
    if "dist_token" in state and "head.weight" in state and "head_dist.weight" not in state:
        raise CheckpointError(
            f"{files.where}: DeiTForImageClassification's classifier reads the class token alone; "
            "vitlab's distilled ViT averages the class and distillation tokens' heads, as "
            "DeiTForImageClassificationWithTeacher does: read that model's weights, or DeiTModel's"
        )
    if "dist_token" in state and "pre_logits.fc.weight" in state:  # DeiTModel's
        del state["pre_logits.fc.weight"], state["pre_logits.fc.bias"]
        src.notes.append("DeiTModel's pooler ignored: a distilled ViT has no pre-logits layer")
    if "head.weight" in state and "pre_logits.fc.weight" in state:
        # ViTForImageClassification has no pooler: transformers ignores these, so do we
        del state["pre_logits.fc.weight"], state["pre_logits.fc.bias"]
        src.notes.append("pooler weights beside a classifier ignored, as transformers does")
    return src  # a folder's config.json and preprocessor_config.json: formats.read applies them


def is_config(cfg: dict[str, Any]) -> bool:
    """Whether a config.json is transformers' (not timm's)."""
    return cfg.get("model_type") in ("vit", "deit", "swin") or "hidden_size" in cfg


def read_processor(processor: dict[str, Any], src: Source) -> None:
    """Normalisation, resize and centre crop from transformers' preprocessor_config.json, as its
    (torchvision) image processors apply them: a mean or std given as one number is the same for
    every channel; rescale_factor and do_normalize fold into mean and std; a size of height and
    width (or one number) squashes the image, shortest_edge keeps its aspect ratio, and
    do_center_crop takes crop_size from that (DeiTImageProcessor); without a crop the whole
    image is resized to the model's size (ViTImageProcessor)."""
    stats = [processor.get(k) for k in ("image_mean", "image_std")]
    if stats != [None, None]:
        mean, std = (s if isinstance(s, list) else [s] for s in stats)
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in mean + std)
        if not (numbers and mean and len(mean) == len(std) and min(std) > 0):
            raise CheckpointError(
                f"{src.where}: preprocessor_config.json's image_mean {stats[0]!r} and image_std "
                f"{stats[1]!r} are not one positive std for each mean (lists of numbers)"
            )
        chans = _channels(src)
        if len(mean) == 1 and chans:
            mean, std = mean * chans, std * chans
        src.preprocessing.update(mean=mean, std=std)
    _read_scaling(processor, src)
    resample = processor.get("resample", 2)
    if resample not in _RESAMPLE:
        src.notes.append(
            f"preprocessor_config.json's resample {resample!r} (PIL's code) is not nearest, "
            "bilinear or bicubic: resized bilinear"
        )
    src.preprocessing.update(
        interpolation=_RESAMPLE.get(resample, "bilinear"),
        crop_pct=None,
        crop_mode="center",
        reference="transformers",
    )
    size = processor.get("size")
    if processor.get("do_center_crop"):
        _read_crop(processor, src)
    elif isinstance(size, dict) and "shortest_edge" in size:
        src.notes.append(
            f"preprocessor_config.json resizes the shorter side to {size['shortest_edge']} "
            "without a crop (a size per image's shape): the whole image resized instead"
        )


def _read_scaling(processor: dict[str, Any], src: Source) -> None:
    """do_rescale / rescale_factor and do_normalize folded into mean and std: vitlab computes
    (x / 255 - mean) / std of a uint8 x, transformers (x * rescale_factor - mean) / std."""
    factor = processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1
    if not (isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 0):
        raise CheckpointError(
            f"{src.where}: preprocessor_config.json's rescale_factor {factor!r} is no positive "
            "number"
        )
    mean, std = src.preprocessing.get("mean", HALF), src.preprocessing.get("std", HALF)
    if not processor.get("do_normalize", True):
        mean, std = [0.0] * len(mean), [1.0] * len(std)
    scale = 255 * factor
    if abs(scale - 1) > 1e-9:
        mean, std = [m / scale for m in mean], [s / scale for s in std]
    src.preprocessing.update(mean=mean, std=std)


def _size_hw(size: Any) -> tuple[int, int] | None:
    """(height, width) of a processor's size or crop_size: one number (both sides, as the ViT
    and DeiT processors take it) or a dict with height and width; None for anything else."""
    if isinstance(size, dict) and set(size) >= {"height", "width"}:
        size = (size["height"], size["width"])
    elif isinstance(size, int):
        size = (size, size)
    ints = isinstance(size, tuple) and all(isinstance(v, int) and v > 0 for v in size)
    return size if ints else None


def _read_crop(processor: dict[str, Any], src: Source) -> None:
    """crop_pct and crop_mode for do_center_crop: crop_size of a size of height and width
    (squash), or of the shorter side at shortest_edge (center)."""
    size, crop = processor.get("size"), _size_hw(processor.get("crop_size"))
    if isinstance(size, dict) and "shortest_edge" in size:
        mode, resize = "center", _size_hw(size["shortest_edge"])
    else:
        mode, resize = "squash", _size_hw(size)
    said = f"preprocessor_config.json's size {size!r} and crop_size {processor.get('crop_size')!r}"
    if not processor.get("do_resize", True) or crop is None or resize is None:
        why = "without do_resize" if resize and crop else "are not sizes vitlab reads"
        src.notes.append(f"{said} {why}: no crop, the whole image resized")
        return
    if crop[0] > resize[0] or crop[1] > resize[1]:
        src.notes.append(f"{said}: a crop larger than the image, the whole image resized")
        return
    pct = crop_pct_for(crop[0], resize[0])
    if math.floor(crop[1] / pct) != resize[1] or (mode == "center" and crop[0] != crop[1]):
        src.notes.append(f"{said}: not one crop share for both sides, {pct:.4f} of the height")
    src.preprocessing.update(crop_pct=pct, crop_mode=mode)


def _channels(src: Source) -> int | None:
    """The input channels of the weights' patch embedding (a ViT's or a Swin's), if there."""
    weight = src.state.get("patch_embed.proj.weight")
    return int(weight.shape[1]) if weight is not None and weight.ndim == 4 else None


def read_config(cfg: dict[str, Any], src: Source) -> None:
    """Hints and class names from transformers' ViTConfig or SwinConfig (config.json)."""
    family = state_family(src.state)  # config.json's model_type: checked (stated.check_family)
    if family == "swin":
        hf_swin.read_hints(cfg, src)
    else:
        _read_vit_hints(cfg, src)
    labels = cfg.get("id2label")
    if labels:
        try:
            src.classes = [str(labels[str(i)]) for i in range(len(labels))]
        except (KeyError, TypeError):
            raise CheckpointError(f"{src.where}: id2label does not number classes 0..n-1") from None


def _read_vit_hints(cfg: dict[str, Any], src: Source) -> None:
    act = cfg.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{src.where}: hidden_act {act!r} is not a GELU")
    pooler_act = cfg.get("pooler_act", "tanh")
    if "pre_logits.fc.weight" in src.state and pooler_act != "tanh":  # the pooler is used
        raise CheckpointError(
            f"{src.where}: pooler_act {pooler_act!r} is not supported (vitlab's pre-logits "
            f"layer is tanh, transformers' default)"
        )
    size = cfg.get("image_size")
    src.hints.update(
        num_heads=cfg.get("num_attention_heads"),
        norm_eps=cfg.get("layer_norm_eps", 1e-12),
        act="gelu" if act == "gelu" else "gelu_tanh",
        img_size=tuple(size) if isinstance(size, list) else size,
        qkv_bias=cfg.get("qkv_bias", True),
    )


def write(model: nn.Module, dst: Path) -> list[Path]:
    """Folder DST with model.safetensors (hub names), config.json and preprocessor_config.json,
    which ViTForImageClassification.from_pretrained (ViTModel without a classifier) loads, a
    distilled ViT's DeiTForImageClassificationWithTeacher (DeiTModel), or
    SwinForImageClassification's (SwinModel) for a Swin whose windows tile its maps."""
    if family_of(model.config) == "cnn":
        raise CheckpointError(
            "vitlab writes Hugging Face's format for ViTs and Swins; "
            + write_cnn_instead(model.config)
        )
    state = cpu_state(model.state_dict())
    if family_of(model.config) == "swin":
        config, with_classifier = hf_swin.hf_swin_config(model.config, classes_of(model))
        state = hf_swin.vitlab_to_hf_swin(state, with_classifier)
    else:
        config, with_classifier = hf_config(model.config, classes_of(model))
        state = vitlab_to_hf(state, with_classifier)
    processor = processor_config(preprocessing_of(model), model.config.img_hw)
    write_safetensors(dst / WEIGHTS, state, {"format": "pt"})
    write_json(dst / "config.json", config)
    write_json(dst / "preprocessor_config.json", processor)
    return [dst / WEIGHTS, dst / "config.json", dst / "preprocessor_config.json"]


def processor_config(pre: Preprocessing, img_hw: tuple[int, int]) -> dict[str, Any]:
    """preprocessor_config.json for `pre`: ViTImageProcessor's whole-image resize, or with a
    crop_pct DeiTImageProcessor's resize (squash: height and width; center: shortest_edge) and
    centre crop. transformers resizes uint8 tensors: preprocessing that follows timm's pixels
    (PIL) comes out within a grey level, shifted a pixel where the margin to crop is odd (the
    offset rounded down, not to nearest); a non-square centre crop keeping the aspect ratio
    (timm's ResizeKeepRatio) has no processor and is approximated by the shortest edge that
    covers the crop; timm's border mode (padding) is refused."""
    h, w = img_hw
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": h, "width": w},
        "resample": {v: k for k, v in _RESAMPLE.items()}[pre.interpolation],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(pre.mean),
        "image_std": list(pre.std),
    }
    if pre.crop_pct is None:
        return processor
    if pre.crop_mode == "border":
        raise CheckpointError(
            "transformers' image processors cannot pad an image to fit (timm's crop_mode "
            "'border'): write the weights as timm or vitlab"
        )
    sh, sw = math.floor(h / pre.crop_pct), math.floor(w / pre.crop_pct)
    squash = pre.crop_mode == "squash"
    processor.update(
        image_processor_type="DeiTImageProcessor",
        size={"height": sh, "width": sw} if squash else {"shortest_edge": max(sh, sw)},
        do_center_crop=True,
        crop_size={"height": h, "width": w},
    )
    return processor


def hf_config(cfg: ViTConfig, classes: list[str]) -> tuple[dict[str, Any], bool]:
    """(transformers ViTConfig dict, or DeiTConfig's for a distilled ViT, whether the model has a
    classifier) for `cfg`."""
    why = [
        text
        for bad, text in (
            (not cfg.class_token or cfg.pool != "token", "pooling other than the class token"),
            (cfg.pos_embed != "learned", "position tables other than learned"),
            (cfg.no_embed_class, "positions for the patches only (no_embed_class, DeiT-3)"),
            (cfg.fc_norm, "fc_norm"),
            (
                cfg.stem != "patch",
                "a ResNet stem (a hybrid)" if cfg.stem == "resnet" else "a conv stem",
            ),
            (cfg.layer_scale is not None, "layer scale"),
            (
                bool(cfg.representation_size and cfg.num_classes),
                "a pre-logits layer beside a classifier (ViTForImageClassification has no pooler)",
            ),
        )
        if bad
    ]
    if why:
        reasons = "; ".join(why)
        raise CheckpointError(f"cannot write Hugging Face ViT's format: {reasons} (--to vitlab "
                              "writes every vitlab model)")  # fmt: skip
    with_classifier = cfg.num_classes > 0
    h, w = cfg.img_hw
    kind, head = "DeiT" if cfg.distilled else "ViT", "ForImageClassification"
    head += "WithTeacher" if cfg.distilled else ""  # DeiT's classifier averages both heads
    out = {
        "architectures": [kind + (head if with_classifier else "Model")],
        "model_type": kind.lower(),
        "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu" if cfg.act == "gelu" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.norm_eps,
        "image_size": h if h == w else [h, w],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans,
        "qkv_bias": cfg.qkv_bias,
        "encoder_stride": cfg.patch_size,
        "pooler_output_size": cfg.representation_size or cfg.embed_dim,
        "pooler_act": "tanh",
    }
    if with_classifier:
        out["id2label"] = {str(i): n for i, n in enumerate(classes)}
        out["label2id"] = {n: i for i, n in enumerate(classes)}
    return out, with_classifier
