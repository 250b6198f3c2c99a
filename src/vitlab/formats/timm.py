"""timm's format: a VisionTransformer or SwinTransformer state dict, alone or in a folder with
timm's config.json (architecture, model_args, pretrained_cfg), as the hub serves `timm/...` names
and timm.create_model loads `local-dir:DST`. vitlab's names are timm's except a ViT's learned
position table, which is a module here (`pos_embed.weight`); a hybrid's ResNet stem has timm's
names (`patch_embed.backbone.*`) and is written under the timm entry point that builds its ResNet
(vit_base_r50_s16_*, vit_small_r26_s32_*, vit_large_r50_s32_*); the Swin specifics are in
formats.timm_swin.

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
from vitlab.models.cnn import CNNConfig
from vitlab.models.registry import UnknownModelError, family_of, get_config
from vitlab.models.vit import ViTConfig
from vitlab.preprocessing import CROP_MODES, IMAGENET_MEAN, IMAGENET_STD

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


# (width, heads) -> timm's family name, and the entry points timm registers for the paper's sizes
# (tests check each against timm.list_models()). The name only picks timm's entry point: every
# size, the image size included, is in model_args, so any other shape is built from
# vit_base_patch16_224 (or deit_base_distilled_patch16_224).
_FAMILIES = {
    (192, 3): "vit_tiny",
    (384, 6): "vit_small",
    (768, 12): "vit_base",
    (1024, 16): "vit_large",
    (1280, 16): "vit_huge",
}
# the head counts of timm's DeiT and DeiT III entry points (deit_tiny_patch16_224,
# deit_small_distilled_patch16_224, deit3_medium_patch16_224 ...), by the name's family
DEIT_HEADS = {"deit_tiny": 3, "deit_small": 6, "deit_base": 12, "deit3_small": 6,
              "deit3_medium": 8, "deit3_base": 12, "deit3_large": 16, "deit3_huge": 16}  # fmt: skip
REGISTERED_DEIT = frozenset(
    [f"deit_{s}_distilled_patch16_224" for s in ("tiny", "small", "base")]
    + ["deit_base_distilled_patch16_384"]
)
REGISTERED = frozenset(
    ["vit_tiny_patch16_224", "vit_tiny_patch16_384", "vit_small_patch8_224"]
    + [f"vit_{s}_patch{p}_{r}" for s in ("small", "base", "large") for p in (16, 32)
       for r in (224, 384)]
    + ["vit_base_patch8_224", "vit_large_patch14_224", "vit_huge_patch14_224"]
)  # fmt: skip


# the hybrids timm builds: its entry points fix the ResNet (width 64, units per stage), so the name
# picks the backbone; the ViT's sizes are in model_args as for any ViT
HYBRID_ARCHS = {
    (3, 4, 9): "vit_base_r50_s16",
    (2, 2, 2, 2): "vit_small_r26_s32",
    (3, 4, 6, 3): "vit_large_r50_s32",
}
REGISTERED_HYBRIDS = frozenset(f"{a}_{r}" for a in HYBRID_ARCHS.values() for r in (224, 384))
_FIRST_CONV = {"resnet": "patch_embed.backbone.stem.conv"}


def timm_resnetv2_args(cfg: CNNConfig) -> tuple[str, dict[str, Any]]:
    """(timm entry point, model_args) for BiT's ResNet-v2-50: what JSON can say of timm's
    ResNetV2(preact=False, stem_type="same", conv_layer=partial(StdConv2dSame, eps=1e-8)). The
    conv layer is a note timm cannot call: the caller passes the layer itself (module
    docstring)."""
    return "resnetv2_50", dict(
        layers=list(cfg.depths),
        preact=False,
        stem_type="same",
        conv_layer=CONV_LAYER_NOTE,
        norm_layer="groupnorm",  # timm's GroupNormAct: 32 groups, eps 1e-5
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        global_pool="avg",
    )


CONV_LAYER_NOTE = (
    "not JSON: pass conv_layer=functools.partial(timm.layers.StdConv2dSame, eps=1e-8) to "
    "timm.create_model"
)


def timm_hybrid_arch(cfg: ViTConfig) -> str | None:
    """The timm entry point that builds `cfg`'s ResNet stem (at cfg's resolution when timm has
    that name), or None when timm builds no such ResNet."""
    base = HYBRID_ARCHS.get(cfg.stem_depths) if cfg.stem_width == 64 else None
    if base is None:
        return None
    h, w = cfg.img_hw
    return f"{base}_{h}" if h == w and f"{base}_{h}" in REGISTERED_HYBRIDS else f"{base}_224"


def timm_arch(cfg: ViTConfig) -> str:
    """The registered timm name closest to `cfg`: its family, patch and resolution when timm has
    that entry point, else the family's at 224, else vit_base_patch16_224."""
    family = _FAMILIES.get((cfg.embed_dim, cfg.num_heads))
    h, w = cfg.img_hw
    for name in (f"{family}_patch{cfg.patch_size}_{h}", f"{family}_patch{cfg.patch_size}_224"):
        if family and h == w and name in REGISTERED:
            return name
    return "vit_base_patch16_224"


def timm_deit_arch(cfg: ViTConfig) -> str:
    """The registered timm DeiT (distilled) name closest to `cfg`, as timm_arch for a ViT."""
    family = _FAMILIES.get((cfg.embed_dim, cfg.num_heads), "").replace("vit_", "deit_")
    h, w = cfg.img_hw
    for name in (f"{family}_distilled_patch16_{h}", f"{family}_distilled_patch16_224"):
        if family and h == w and name in REGISTERED_DEIT:
            return name
    return "deit_base_distilled_patch16_224"


def timm_mlp_ratio(dim: int, mlp_dim: int) -> float:
    """An mlp_ratio from which timm builds exactly `mlp_dim` hidden units: timm takes
    int(dim * mlp_ratio), and mlp_dim / dim can land just below mlp_dim (448 * (488 / 448) is
    487.99...), so the ratio of mlp_dim + 0.5 is taken then."""
    for ratio in (mlp_dim / dim, (mlp_dim + 0.5) / dim):
        if int(dim * ratio) == mlp_dim:
            return ratio
    raise CheckpointError(f"no mlp_ratio gives timm an MLP of {mlp_dim} at width {dim}")


def timm_model_args(cfg: ViTConfig) -> tuple[str, dict[str, Any]]:
    """(timm architecture name, model_args) that build `cfg` with timm.create_model."""
    why = []
    hybrid = cfg.stem == "resnet"
    if cfg.stem == "conv":
        why.append(f"stem={cfg.stem!r} (timm's ViT patchifies with one conv)")
    if hybrid and timm_hybrid_arch(cfg) is None:
        why.append(
            f"a ResNet stem of width {cfg.stem_width} and units {cfg.stem_depths} (timm builds "
            f"width 64 with units {', '.join(map(str, HYBRID_ARCHS))})"
        )
    if hybrid and cfg.distilled:
        why.append("a distilled hybrid (timm has no such entry point)")
    if cfg.pos_embed not in ("learned", "none"):
        why.append(f"pos_embed={cfg.pos_embed!r} (timm's ViT has learned tables or none)")
    if cfg.representation_size:
        why.append("a pre-logits layer (timm's ViT has none)")
    if cfg.norm_eps != 1e-6:
        why.append(f"norm_eps={cfg.norm_eps} (timm's ViT uses 1e-6)")
    if why:
        raise CheckpointError("cannot write timm's format: " + "; ".join(why))
    h, w = cfg.img_hw
    args: dict[str, Any] = dict(
        img_size=[h, w],
        patch_size=1 if hybrid else cfg.patch_size,  # a hybrid's patches are on the feature map
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.embed_dim,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=timm_mlp_ratio(cfg.embed_dim, cfg.mlp_dim),
        qkv_bias=cfg.qkv_bias,
    )
    if cfg.layer_scale is not None:
        args["init_values"] = cfg.layer_scale
    if cfg.act == "gelu_tanh":
        args["act_layer"] = "gelu_tanh"
    if cfg.pos_embed == "none":
        args["pos_embed"] = "none"
    if cfg.distilled:  # a DeiT: the class and distillation tokens, token pooling
        return timm_deit_arch(cfg), args
    args.update(
        class_token=cfg.class_token,
        global_pool="avg" if cfg.pool == "gap" else "token",
        fc_norm=cfg.fc_norm,
        no_embed_class=cfg.no_embed_class,
    )
    return (timm_hybrid_arch(cfg) if hybrid else None) or timm_arch(cfg), args
