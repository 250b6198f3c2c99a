"""timm's format: a VisionTransformer or SwinTransformer state dict, alone or in a folder with
timm's config.json (architecture, model_args, pretrained_cfg), as the hub serves `timm/...` names
and timm.create_model loads `local-dir:DST`. vitlab's names are timm's except a ViT's learned
position table, which is a module here (`pos_embed.weight`); a hybrid's ResNet stem has timm's
names (`patch_embed.backbone.*`) and is written under the timm entry point that builds its ResNet
(vit_base_r50_s16_*, vit_small_r26_s32_*, vit_large_r50_s32_*); the names and model_args written
for a config are in formats.timm_names, the Swin specifics in formats.timm_swin.

BiT's ResNet-v2-50 (models.resnetv2) has the names of timm's ResNetV2(preact=False,
stem_type="same", conv_layer=partial(StdConv2dSame, eps=1e-8)). Its folder's config.json names
timm's `resnetv2_50` entry point with model_args for that network, but a conv layer is no JSON
value: the file says so in `conv_layer`, and timm builds it only when given the layer,
`timm.create_model("local-dir:DST", pretrained=True, conv_layer=partial(StdConv2dSame,
eps=1e-8))` (without it, construction fails rather than giving plain convs the weights). timm's
stem is the standard one: a small-stem model is written as a state dict only (its 3x3 stem.conv
does not load into timm's). Reading, a config.json whose model_args describe another ResNetV2
(pre-activation, another stem padding or conv layer) is refused.

A bare DST.safetensors (timm's state dict, as timm's load_state_dict takes it) carries what its
folder's config.json would hold in its header metadata (`timm_config`, which timm ignores), so
that vitlab reads back the model it wrote (heads, image size, activation, pooling, classes)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from vitlab.formats import timm_swin
from vitlab.formats.base import (
    WEIGHTS,
    CheckpointError,
    Files,
    Source,
    StateDict,
    classes_of,
    convert,
    cpu_state,
    pass_key,
    preprocessing_of,
    rename,
    write_json,
    write_safetensors,
)
from vitlab.formats.families import (
    is_resnetv2,
    refuse_swin_v2,
    state_family,
    swin_layout,
    write_cnn_instead,
)
from vitlab.formats.timm_names import (
    CONV_LAYER_NOTE,
    DEIT_HEADS,
    timm_model_args,
    timm_resnetv2_args,
)
from vitlab.models.registry import UnknownModelError, family_of, get_config
from vitlab.preprocessing import CROP_MODES, IMAGENET_MEAN, IMAGENET_STD

_FIRST_CONV = {"resnet": "patch_embed.backbone.stem.conv"}  # the pretrained_cfg first_conv
CONFIG_KEY = "timm_config"  # a bare DST.safetensors's header: the config.json a folder would hold

# timm's ResNetV2 without pre-activation (models/stems.py has timm's names)
_RESNETV2 = (
    r"stem\.(?:conv\.weight|norm\.(?:weight|bias))|stages\.\d+\.blocks\.\d+\."
    r"(?:conv[123]\.weight|norm[123]\.(?:weight|bias)|downsample\.(?:conv\.weight|norm\.(?:weight|bias)))"
)
_SAME = (
    r"patch_embed\.proj\.(weight|bias)|cls_token|dist_token|norm\.(weight|bias)"
    r"|fc_norm\.(weight|bias)|head\.(weight|bias)|head_dist\.(weight|bias)"
    r"|pre_logits\.fc\.(weight|bias)"
    r"|blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
    r"|blocks\.\d+\.ls[12]\.gamma"
    rf"|patch_embed\.backbone\.(?:{_RESNETV2})"  # a hybrid's ResNet stem
)


def timm_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    return rename(state, [("pos_embed", "pos_embed.weight"), (f"({_SAME})", r"\1")], "timm")


def vitlab_to_timm(state: Mapping[str, Tensor]) -> StateDict:
    return rename(state, [(r"pos_embed\.weight", "pos_embed"), (f"({_SAME})", r"\1")], "timm")


def resnetv2_names(state: Mapping[str, Tensor]) -> StateDict:
    """A BiT ResNet-v2 classifier's tensors, whose names are timm's: checked, not renamed."""
    return rename(state, [(rf"({_RESNETV2}|head\.fc\.(?:weight|bias))", r"\1")], "timm ResNetV2")


def refuse_other_resnetv2(keys: Iterable[str], where: str) -> None:
    """A CheckpointError naming what vitlab's resnetv2_50 is not: timm's pre-activation ResNetV2
    (its registered resnetv2_50, BiT's resnetv2_50x1_bit: a final `norm`, no stem.norm) or one
    with BatchNorm (running statistics)."""
    keys = list(keys)
    ours = "vitlab's resnetv2_50 is the R50 hybrid's ResNet-v2 (GroupNorm after each conv)"
    if any(k.endswith("running_mean") for k in keys):
        raise CheckpointError(
            f"{where}: a ResNet-v2 with BatchNorm (timm's registered resnetv2_50 ...): {ours}"
        )
    if "norm.weight" in keys or "stem.norm.weight" not in keys:
        raise CheckpointError(
            f"{where}: a pre-activation ResNet-v2 (timm's resnetv2_50x1_bit, BiT's released "
            f"weights): {ours}, timm's ResNetV2(preact=False, stem_type='same')"
        )


def detect(files: Files) -> bool:
    keys = files.names()
    vit = "patch_embed.proj.weight" in keys and "pos_embed" in keys
    return vit or swin_layout(keys) == "timm" or is_resnetv2(keys)


def read(files: Files) -> Source:
    tensors = files.tensors()
    if is_resnetv2(tensors):
        refuse_other_resnetv2(tensors, files.where)
        src = Source(convert(files.where, resnetv2_names, tensors), "timm", files.where)
    elif swin_layout(tensors) == "timm":
        refuse_swin_v2(tensors, files.where)
        src = Source({}, "timm", files.where)
        src.state = convert(files.where, timm_swin.timm_swin_to_vitlab, tensors, src.notes)
        if "layers.0.downsample.reduction.weight" not in tensors:  # the original layout: its
            src.table_resampling = "timm"  # code's bicubic; timm's names: timm's loader's way
    else:
        src = Source(convert(files.where, timm_to_vitlab, tensors), "timm", files.where)
    src.preprocessing = dict(
        mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=0.9, interpolation="bicubic"
    )
    header = files.metadata().get(CONFIG_KEY)  # a bare file vitlab wrote: its config.json
    if header is not None:  # it, not a config.json that may lie beside it (formats.read)
        try:
            config = json.loads(header)
        except ValueError as e:
            where = f"{files.where}: its {CONFIG_KEY} header"
            raise CheckpointError(f"{where} is damaged: {e}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{files.where}: its {CONFIG_KEY} header is no JSON object")
        read_config(config, src)
    return src  # a folder's config.json: formats.read applies it


def note_assumed_preprocessing(src: Source) -> None:
    """What read assumes of a timm ViT's (or ResNetV2's) preprocessing nothing states, as a note
    (a Swin's is every timm Swin's, ImageNet's with crop 0.9: none)."""
    if state_family(src.state) != "swin":
        src.notes.append(
            "timm weights without timm's config.json: ImageNet mean and std, crop 0.9, bicubic "
            "assumed (timm's augreg ViTs take mean = std = 0.5, DeiT crop 0.9 at 224); a folder of "
            "the weights as model.safetensors and the hub's config.json gives the model's own"
        )


def read_config(cfg: dict[str, Any], src: Source) -> None:
    """Hints, preprocessing and class names from timm's config.json."""
    family = state_family(src.state)
    if family == "swin":
        timm_swin.read_hints(cfg, src)
    elif family == "cnn":  # a timm ResNet (torchvision's names) or ResNetV2: its input size
        if is_resnetv2(src.state):
            _refuse_other_resnetv2_args(cfg.get("model_args") or {}, src.where)
        size = (cfg.get("pretrained_cfg") or {}).get("input_size")
        if isinstance(size, list) and len(size) == 3:
            src.hints["img_size"] = tuple(size[1:])
    else:
        _read_vit_hints(cfg, src)
    pre = cfg.get("pretrained_cfg") or {}
    for key in ("mean", "std", "interpolation"):
        if key in pre:
            src.preprocessing[key] = pre[key]
    if "crop_pct" in pre or "crop_mode" in pre:
        _read_crop(pre, src)
    names = cfg.get("label_names") or pre.get("label_names")
    if names:
        src.classes = list(names)


def _read_crop(pre: dict[str, Any], src: Source) -> None:
    """crop_pct and crop_mode from a pretrained_cfg, as timm's eval transform applies them: a
    squash of 1.0 resizes the whole image (crop_pct None, by PIL as timm does); a crop_mode
    other than squash or border is timm's default, center."""
    mode = pre.get("crop_mode") or "center"
    if mode not in CROP_MODES:
        src.notes.append(f"pretrained_cfg's crop_mode {mode!r} is none of timm's: centre crop")
        mode = "center"
    pct = pre.get("crop_pct", src.preprocessing.get("crop_pct"))
    whole = mode == "squash" and pct is not None and pct >= 1.0
    src.preprocessing.update(crop_pct=None if whole else pct, crop_mode=mode, reference="timm")


def _refuse_other_resnetv2_args(args: dict[str, Any], where: str) -> None:
    """A CheckpointError when config.json's model_args describe a ResNetV2 with the names of
    vitlab's resnetv2_50 but another function: pre-activation units, another stem padding
    (stem_type "" or "fixed": symmetric), or another conv layer than StdConv2dSame (plain
    convs, StdConv2d with another eps). Tensors alone cannot tell these apart."""
    why = []
    if args.get("preact", False):
        why.append("preact=True (pre-activation units)")
    if args.get("stem_type", "same") != "same":
        why.append(f"stem_type={args['stem_type']!r} (vitlab's pads TF-'same')")
    if args.get("conv_layer", CONV_LAYER_NOTE) != CONV_LAYER_NOTE:
        why.append(f"conv_layer={args['conv_layer']!r} (vitlab's is StdConv2dSame, eps 1e-8)")
    if why:
        raise CheckpointError(
            f"{where}: config.json's model_args describe a ResNetV2 vitlab's resnetv2_50 is not: "
            + "; ".join(why)
        )


def _read_vit_hints(cfg: dict[str, Any], src: Source) -> None:
    args = dict(cfg.get("model_args") or {})
    arch = str(cfg.get("architecture", ""))
    with contextlib.suppress(UnknownModelError):  # a name vitlab registers tells the heads
        src.hints["num_heads"] = get_config(arch).num_heads
    deit = arch.split("_patch")[0].removesuffix("_distilled")  # deit_tiny_distilled_patch16_224
    if deit in DEIT_HEADS:  # DeiT III's entry points (unregistered) and DeiT's at any size
        src.hints["num_heads"] = DEIT_HEADS[deit]
    if "num_heads" in args:
        src.hints["num_heads"] = args["num_heads"]
    elif arch and "num_heads" not in src.hints:  # e.g. vit_base_patch16_gap_224: 16 at 768
        src.notes.append(
            f"architecture {arch!r} is not one vitlab registers and model_args name no "
            f"num_heads: the head count is guessed from the width; if timm builds it otherwise, "
            f"{pass_key('num_heads')}"
        )
    pool = args.get("global_pool", cfg.get("global_pool"))
    if pool in ("avg", "token"):
        src.hints["pool"] = "gap" if pool == "avg" else "token"
    elif pool not in (None, ""):
        raise CheckpointError(f"{src.where}: timm global_pool {pool!r} is not supported")
    act = args.get("act_layer")
    if act == "gelu_tanh":
        src.hints["act"] = "gelu_tanh"
    elif act not in (None, "gelu"):  # quick_gelu, relu, silu, ...
        raise CheckpointError(
            f"{src.where}: timm act_layer {act!r} is not supported (vitlab's ViT has GELU, exact "
            f"or tanh: 'gelu' or 'gelu_tanh')"
        )
    if "img_size" in args:
        size = args["img_size"]
        src.hints["img_size"] = tuple(size) if isinstance(size, list) else size


def write(model: nn.Module, dst: Path) -> list[Path]:
    """DST.safetensors alone, or a folder with model.safetensors and timm's config.json. Its
    pretrained_cfg has the preprocessing's crop_pct and crop_mode (the whole image resized:
    squash at 1.0); timm resizes with PIL, preprocessing that follows transformers' pixels within
    a grey level, shifted a pixel where the margin to crop is odd."""
    cfg = model.config
    if family_of(cfg) == "cnn" and not cfg.bit:
        raise CheckpointError(
            "vitlab writes timm's format for ViTs, Swins and BiT's ResNet-v2; "
            + write_cnn_instead(cfg)
        )
    state = cpu_state(model.state_dict())
    first_conv = _FIRST_CONV.get(getattr(cfg, "stem", "patch"), "patch_embed.proj")
    if family_of(cfg) == "swin":  # the same names
        (arch, args), classifier = timm_swin.timm_swin_model_args(cfg), "head.fc"
    elif family_of(cfg) == "cnn":  # the same names
        if cfg.uses_small_stem and dst.suffix != ".safetensors":
            raise CheckpointError(
                "timm's ResNetV2 has no small stem (3x3 stride 1, no max-pool), so timm cannot "
                "build this model from a folder: write DST.safetensors (the state dict, timm's "
                "names) or --to vitlab"
            )
        (arch, args), classifier = timm_resnetv2_args(cfg), "head.fc"
        first_conv = "stem.conv"
    else:
        (arch, args), state = timm_model_args(cfg), vitlab_to_timm(state)
        classifier = ["head", "head_dist"] if cfg.distilled else "head"
    pre = preprocessing_of(model)
    pretrained_cfg = {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in pre.timm_data_config().items()},
        "input_size": [cfg.in_chans, *cfg.img_hw],
        "num_classes": cfg.num_classes,
        "first_conv": first_conv,
        "classifier": classifier,
    }
    config = {
        "architecture": arch,
        "num_classes": cfg.num_classes,
        "num_features": model.num_features,
        "global_pool": args.get("global_pool", "token"),
        "model_args": args,
        "pretrained_cfg": pretrained_cfg,
    }
    if cfg.num_classes:
        config["label_names"] = classes_of(model)
    if dst.suffix == ".safetensors":  # timm's bare state dict; its config.json in the header
        write_safetensors(dst, state, {"format": "pt", CONFIG_KEY: json.dumps(config)})
        return [dst]
    write_safetensors(dst / WEIGHTS, state, {"format": "pt"})
    write_json(dst / "config.json", config)
    stale = dst / "preprocessor_config.json"  # an earlier Hugging Face write's: it would apply
    stale.unlink(missing_ok=True)
    return [dst / WEIGHTS, dst / "config.json"]
