"""timm's names for what vitlab writes: the entry point (`architecture`) timm registers for a
ViT's width, heads, patch and size (DeiT's for a distilled one, the ResNet hybrids' by their
backbone), the `model_args` that make timm build exactly the config, and a BiT ResNet-v2's."""

from __future__ import annotations

from typing import Any

from vitlab.formats.base import CheckpointError
from vitlab.models.cnn import CNNConfig
from vitlab.models.vit import ViTConfig

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
