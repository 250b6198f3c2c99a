"""Registered model names and aliases -> a model config (ViTConfig, SwinConfig or CNNConfig); the
config's type picks the model class. A new size is an entry, never a new class."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Sequence

from vitlab.config import ConfigError, ModelSection, check_keys, validate
from vitlab.models.cnn import CNN, CNNConfig, ResNet
from vitlab.models.resnetv2 import BiTResNet
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.vit import VisionTransformer, ViTConfig

ModelConfig = ViTConfig | SwinConfig | CNNConfig
Model = VisionTransformer | SwinTransformer | CNN  # a CNN: ResNet or BiTResNet

# (width D, depth L, MLP M, heads): paper Table 1, Ti and S from DeiT
_SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (192, 12, 768, 3),
    "small": (384, 12, 1536, 6),
    "base": (768, 12, 3072, 12),
    "large": (1024, 24, 4096, 16),
    "huge": (1280, 32, 5120, 16),
}
_PAPER_VARIANTS = [
    ("tiny", 16),
    ("small", 16),
    ("small", 32),
    ("base", 8),
    ("base", 16),
    ("base", 32),
    ("large", 16),
    ("large", 32),
    ("huge", 14),
]
_SHORT = {"tiny": "Ti", "small": "S", "base": "B", "large": "L", "huge": "H"}

_MODELS: dict[str, ModelConfig] = {}
_ALIASES: dict[str, str] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register_model(name: str, config: ModelConfig, description: str = "") -> None:
    """Register `config` (a ViTConfig, SwinConfig or CNNConfig) under `name` (a name already taken
    is an error)."""
    if not isinstance(config, (ViTConfig, SwinConfig, CNNConfig)):
        raise TypeError(
            f"expected a ViTConfig, SwinConfig or CNNConfig, got {type(config).__name__}"
        )
    if name in _MODELS or name in _ALIASES:
        raise ValueError(f"model name {name!r} is already registered")
    _MODELS[name] = config
    _DESCRIPTIONS[name] = description


def register_alias(alias: str, name: str) -> None:
    if name not in _MODELS:
        raise ValueError(f"cannot alias {alias!r} to unregistered model {name!r}")
    if alias in _MODELS or alias in _ALIASES:
        raise ValueError(f"alias {alias!r} is already registered")
    _ALIASES[alias] = name


for _size, _patch in _PAPER_VARIANTS:
    _dim, _depth, _mlp, _heads = _SIZES[_size]
    # H/14 does not tile 384; the paper fine-tunes it at 518 (Table 2)
    for _res in (224, 518) if _patch == 14 else (224, 384):
        _name = f"vit_{_size}_patch{_patch}_{_res}"
        register_model(
            _name,
            ViTConfig(
                img_size=_res,
                patch_size=_patch,
                embed_dim=_dim,
                depth=_depth,
                mlp_dim=_mlp,
                num_heads=_heads,
            ),
            f"ViT-{_SHORT[_size]}/{_patch} at {_res}, ImageNet-1k head",
        )
    register_alias(f"{_SHORT[_size]}/{_patch}", f"vit_{_size}_patch{_patch}_224")

# DeiT's (Touvron et al. 2021) names, timm's: the Ti / S / B shapes above, trained by its recipe;
# `distilled` adds the distillation token and head (their weights, timm's or Facebook's, load)
for _size, _res in (("tiny", 224), ("small", 224), ("base", 224), ("base", 384)):
    for _kind in ("", "_distilled"):
        _plain = _MODELS[f"vit_{_size}_patch16_{_res}"]
        register_model(f"deit_{_size}{_kind}_patch16_{_res}", _plain.replace(distilled=bool(_kind)),
                       f"DeiT-{_SHORT[_size]}/16 at {_res}{_kind.replace('_', ', ')}, ImageNet-1k "
                       f"head")  # fmt: skip

# Small presets sized for training on a CPU: 28x28 grey (MNIST, Fashion-MNIST) and
# 32x32 colour (CIFAR), patch 4 (a 7x7 or 8x8 grid), 10 classes.
for _res, _chans, _data in ((28, 1, "28x28 greyscale"), (32, 3, "32x32 colour")):
    register_model(
        f"vit_nano_patch4_{_res}",
        ViTConfig(
            img_size=_res,
            patch_size=4,
            in_chans=_chans,
            num_classes=10,
            embed_dim=64,
            depth=4,
            num_heads=4,
            mlp_dim=128,
        ),
        f"D=64, 4 layers, for {_data} images, 10 classes",
    )
    register_model(
        f"vit_micro_patch4_{_res}",
        ViTConfig(
            img_size=_res,
            patch_size=4,
            in_chans=_chans,
            num_classes=10,
            embed_dim=128,
            depth=6,
            num_heads=4,
            mlp_dim=256,
        ),
        f"D=128, 6 layers, for {_data} images, 10 classes",
    )


# The paper's hybrids (§3.1), timm's names and shapes: a BiT ResNet-v2 stem of width 64 (R50 with
# stage 4 removed and stage 3 extended to 9 units: stride 16; R26, or the full R50: stride 32), then
# a ViT on its 1x1-projected feature map. patch_size is the ResNet's stride.
_HYBRIDS = [
    ("base", "r50", (3, 4, 9)),
    ("small", "r26", (2, 2, 2, 2)),
    ("large", "r50", (3, 4, 6, 3)),
]
for _size, _resnet, _depths in _HYBRIDS:
    _dim, _depth, _mlp, _heads = _SIZES[_size]
    _stride = 4 * 2 ** (len(_depths) - 1)
    _short = f"{_resnet.upper()}+{_SHORT[_size]}/{_stride}"
    for _res in (224, 384):
        register_model(
            f"vit_{_size}_{_resnet}_s{_stride}_{_res}",
            ViTConfig(
                img_size=_res,
                patch_size=_stride,
                embed_dim=_dim,
                depth=_depth,
                mlp_dim=_mlp,
                num_heads=_heads,
                stem="resnet",
                stem_width=64,
                stem_depths=_depths,
            ),
            f"{_short} hybrid at {_res}: ResNet units {_depths}, ImageNet-1k head",
        )
    register_alias(_short, f"vit_{_size}_{_resnet}_s{_stride}_224")

# Small hybrids for CPU training: a ResNet stem of width 32 with one stage of two units (stride
# 4, 128 channels; the same 7x7 / 8x8 token grid as the patch-4 presets), then the nano ViT.
for _res, _chans, _data in ((28, 1, "28x28 greyscale"), (32, 3, "32x32 colour")):
    register_model(
        f"vit_nano_r_s4_{_res}",
        _MODELS[f"vit_nano_patch4_{_res}"].replace(stem="resnet", stem_width=32, stem_depths=(2,)),
        f"ResNet stem (width 32, units (2,), stride 4) + D=64, 4 layers, for {_data} images, "
        "10 classes",
    )
    # its smaller sibling, 1.9x its training pace on CPU: the quick preset's (more steps in 3 min)
    register_model(
        f"vit_pico_r_s4_{_res}",
        _MODELS[f"vit_nano_r_s4_{_res}"].replace(depth=2, stem_depths=(1,)),
        f"ResNet stem (width 32, units (1,), stride 4) + D=64, 2 layers, for {_data} images, "
        "10 classes",
    )

# Swin (Liu et al. 2021), timm's names and shapes: (alias, C, depths, heads) per size; window 7
# at 224, 12 at 384; drop_path keeps timm's default 0.1 (the paper trains T / S / B with 0.2 / 0.3
# / 0.5).
_SWIN_SIZES: dict[str, tuple[str, int, tuple[int, ...], tuple[int, ...]]] = {
    "tiny": ("T", 96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": ("S", 96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": ("B", 128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "large": ("L", 192, (2, 2, 18, 2), (6, 12, 24, 48)),
}
for _size, _window, _res in (
    ("tiny", 7, 224),
    ("small", 7, 224),
    ("base", 7, 224),
    ("base", 12, 384),
    ("large", 7, 224),
):
    _short, _dim, _depths, _heads = _SWIN_SIZES[_size]
    _name = f"swin_{_size}_patch4_window{_window}_{_res}"
    register_model(
        _name,
        SwinConfig(
            img_size=_res, window_size=_window, embed_dim=_dim, depths=_depths, num_heads=_heads
        ),
        f"Swin-{_short} at {_res}, window {_window}, ImageNet-1k head",
    )
    if _res == 224:
        register_alias(f"Swin-{_short}", _name)

# Small Swin presets for CPU training, 10 classes: 28x28 grey, patch 2 (14x14 map), window 7, two
# stages (14x14 in 4 windows, then 7x7 in one); 32x32 colour, patch 2 (16x16), window 4, three
# stages (16, 4 and 1 windows). Head width 16 everywhere.
register_model(
    "swin_nano_patch2_window7_28",
    SwinConfig(
        img_size=28,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        embed_dim=48,
        depths=(2, 2),
        num_heads=(3, 6),
        window_size=7,
    ),
    "C=48, depths (2, 2), window 7, for 28x28 greyscale images, 10 classes",
)
register_model(
    "swin_nano_patch2_window4_32",
    SwinConfig(
        img_size=32,
        patch_size=2,
        num_classes=10,
        embed_dim=32,
        depths=(2, 2, 2),
        num_heads=(2, 4, 8),
        window_size=4,
    ),
    "C=32, depths (2, 2, 2), window 4, for 32x32 colour images, 10 classes",
)


# CNN baselines: torchvision's ResNets at 224 for ImageNet (the parameter counts of its builders),
# and 10-class presets for CPU training with the small stem (3x3 stride-1 conv1, no max-pool).
for _arch, _short in (("resnet18", "18"), ("resnet34", "34"), ("resnet50", "50")):
    register_model(
        _arch, CNNConfig(arch=_arch), f"ResNet-{_short} (torchvision) at 224, ImageNet-1k head"
    )
for _res, _chans, _data in ((28, 1, "28x28 greyscale"), (32, 3, "32x32 colour")):
    register_model(
        f"resnet18_{_res}",
        CNNConfig(arch="resnet18", img_size=_res, in_chans=_chans, num_classes=10),
        f"ResNet-18 with the small stem, for {_data} images, 10 classes",
    )
# BiT's ResNet-v2-50 as the R50 hybrids build it (models.resnetv2: GroupNorm, weight-standardised
# convs, not pre-activation, timm's names; not timm's registered resnetv2_50), likewise
register_model(
    "resnetv2_50",
    CNNConfig(arch="resnetv2_50"),
    "BiT ResNet-v2-50 (GroupNorm, StdConv, the R50 hybrid's units) at 224, ImageNet-1k head",
)
for _res, _chans, _data in ((28, 1, "28x28 greyscale"), (32, 3, "32x32 colour")):
    register_model(
        f"resnetv2_50_{_res}",
        CNNConfig(arch="resnetv2_50", img_size=_res, in_chans=_chans, num_classes=10),
        f"BiT ResNet-v2-50 with the small stem, for {_data} images, 10 classes",
    )


def resolve_name(name: str) -> str:
    """The registered name for `name` or its alias; unknown names raise with the closest names."""
    if not isinstance(name, str):
        built = " (create_model(config) builds a config)" * isinstance(name, ModelConfig)
        raise UnknownModelError(f"a model name is a string like 'B/16', got {name!r}{built}")
    if name in _MODELS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    known = list(_MODELS) + list(_ALIASES)
    lowered = {k.lower(): k for k in known}
    if name.lower() in lowered:
        return resolve_name(lowered[name.lower()])
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.4)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise UnknownModelError(f"unknown model {name!r}{hint} (`vitlab models` lists all)")


class UnknownModelError(KeyError, ValueError):
    """A model name that is neither registered nor an alias."""

    def __str__(self) -> str:
        return str(self.args[0])


def get_config(name: str, **overrides: object) -> ModelConfig:
    """The config registered under `name` (or alias) with `overrides` applied and validated."""
    return _MODELS[resolve_name(name)].replace(**overrides)


def named_config(
    model: str | ModelConfig, label: str | None = None, **overrides: object
) -> tuple[str, ModelConfig]:
    """A report's name for `model` and its config with `overrides` applied: `label` where given
    (e.g. the path a config was read from), else a registered name or alias's registered name,
    a config's shape_of line."""
    if isinstance(model, str):
        return label or resolve_name(model), get_config(model, **overrides)
    cfg = model.replace(**overrides)
    return label or shape_of(cfg), cfg


def config_of(section: ModelSection) -> ModelConfig:
    """The config a run config's `model` section names: the registered config (or alias) with the
    section's overrides applied and validated against that config's type (an unknown key named
    with the section's, model.name among the keys suggested)."""
    named = get_config(section.name)
    check_keys(
        type(named), section.overrides, f"section 'model' ({type(named).__name__})", ("name",)
    )
    return with_overrides(named, section.overrides)


def with_overrides(config: ModelConfig, overrides: dict) -> ModelConfig:
    """`config` with a run config's model.* overrides, a wrong type named as written
    (model.depth, not ViTConfig.depth); an unknown key is replace's to name."""
    known = {f.name for f in dataclasses.fields(config)}
    validate(type(config), {k: v for k, v in overrides.items() if k in known}, "model")
    return config.replace(**overrides)


def family_of(config: ModelConfig) -> str:
    """'vit', 'swin' or 'cnn': the model family a config builds."""
    return getattr(config, "family", "vit")


def other_than_weights(weights: ModelConfig, asked: dict, section: str | None = None) -> str | None:
    """What is wrong with a patch_size (a ViT's, a Swin's) or small_stem (a CNN's) in `asked`
    other than the weights' config's (their patch kernels, a hybrid's ResNet stride; a CNN's
    conv1), which loading and fine-tuning keep; None where `asked` keeps them. `section`: how a
    wrong type names the key (validate's)."""
    if hasattr(weights, "uses_small_stem") and asked.get("small_stem") is not None:
        stem = validate(type(weights), {"small_stem": asked["small_stem"]}, section)["small_stem"]
        if stem == weights.uses_small_stem:
            return None
        kind = "small (3x3 stride-1 conv1, no max-pool)" if weights.uses_small_stem else (
            "ImageNet (7x7 stride-2 conv1, max-pool)")  # fmt: skip
        return (f"small_stem={stem}: the weights' stem is the {kind} one, which loading and "
                f"fine-tuning keep (a new image size keeps it too)")  # fmt: skip
    if not hasattr(weights, "patch_size") or "patch_size" not in asked:  # a CNN's: unknown key
        return None
    p = validate(type(weights), {"patch_size": asked["patch_size"]}, section)["patch_size"]
    if p == weights.patch_size:
        return None
    return (f"patch_size={p}: the weights' patch size is {weights.patch_size}, which loading "
            f"keeps (img_size changes the grid of patches)")  # fmt: skip


def shape_of(config: ModelConfig) -> str:
    """One line: 'D=64, 4 layers, patch 4, 28x28', 'Swin C=96, depths 2-2-6-2, window 7,
    patch 4, 224x224' or 'ResNet-18, small stem, 28x28'."""
    h, w = config.img_hw
    if isinstance(config, CNNConfig):
        stem = "small stem" if config.uses_small_stem else "standard stem"
        return f"{config.title}, {stem}, {h}x{w}"
    if isinstance(config, SwinConfig):
        depths = "-".join(map(str, config.depths))
        shape = f"Swin C={config.embed_dim}, depths {depths}, window {config.window_size}"
    else:
        shape = f"D={config.embed_dim}, {config.depth} layer{'s' * (config.depth != 1)}"
    return f"{shape}, patch {config.patch_size}, {h}x{w}"


def build_model(config: ModelConfig) -> Model:
    """The model a config describes: a VisionTransformer, a SwinTransformer, or a CNN (a ResNet,
    or a BiTResNet for arch "resnetv2_50")."""
    if isinstance(config, CNNConfig):
        return BiTResNet(config) if config.bit else ResNet(config)
    if isinstance(config, SwinConfig):
        return SwinTransformer(config)
    if isinstance(config, ViTConfig):
        return VisionTransformer(config)
    raise TypeError(f"expected a ViTConfig, SwinConfig or CNNConfig, got {type(config).__name__}")


def create_model(name: str | ModelConfig, **overrides: object) -> Model:
    """Build a registered model, e.g. create_model("B/16", num_classes=10, img_size=384),
    create_model("Swin-T", num_classes=10) or create_model("resnet18", num_classes=10); or one
    of a config (get_config's, a checkpoint's), with any overrides. timm's keywords of the
    same settings are taken: pretrained=False, drop_path_rate, attn_drop_rate, global_pool
    ('avg': pool='gap'; for a name, fc_norm follows it unless given, as timm builds it; a
    config's fc_norm stands)."""
    config = name if isinstance(name, ModelConfig) else get_config(name)
    overrides = _from_timm(name, config, overrides)
    return build_model(config.replace(**overrides) if overrides else config)


# timm's create_model keywords that mean one of vitlab's config fields exactly (timm's drop_rate,
# a ViT's head dropout, has no vitlab field: refused as an unknown key)
_TIMM_NAMES = {
    "drop_path_rate": "drop_path", "attn_drop_rate": "attn_dropout", "global_pool": "pool",
}  # fmt: skip


def _from_timm(name: object, config: ModelConfig, overrides: dict) -> dict:
    """`overrides` with timm's keywords under vitlab's names where `config` has that field (else
    refused under the name given); pretrained=True refused."""
    overrides = dict(overrides)
    if overrides.pop("pretrained", False):
        raise ConfigError(
            f"create_model({name!r}, pretrained=True): create_model builds a model with new "
            "weights; for trained ones, vitlab.load_pretrained(SOURCE, ...) reads a timm, Hugging "
            "Face, torchvision, .npz or vitlab checkpoint, or a hub name (e.g. "
            "'timm/vit_base_patch16_224.augreg2_in21k_ft_in1k')"
        )
    for theirs, ours in _TIMM_NAMES.items():
        if theirs in overrides and ours in {f.name for f in dataclasses.fields(config)}:
            if ours in overrides:
                raise ConfigError(f"{theirs} (timm's name) and {ours} both given: give one")
            value = overrides.pop(theirs)
            overrides[ours] = "gap" if theirs == "global_pool" and value == "avg" else value
            if theirs == "global_pool" and isinstance(name, str):  # timm's fc_norm=None rule
                overrides.setdefault("fc_norm", overrides[ours] == "gap")  # (a config's stands)
    return overrides


def list_models(pattern: str | Sequence[str] | None = None, family: str | None = None) -> list[str]:
    """Registered names (aliases excluded), optionally filtered by a glob pattern on names and
    aliases (or a list of them, as timm's: any one), in any case as names are resolved ('B/*'
    and 'b/*' list B/16's name too) and a model family ('vit', 'swin', 'cnn'; None: all)."""
    if family not in (None, "vit", "swin", "cnn"):
        raise ValueError(f"family must be 'vit', 'swin' or 'cnn' (or None: all), got {family!r}")
    try:
        patterns = [pattern] if isinstance(pattern, str) else list(pattern or ["*"])
    except TypeError:  # list_models(5)
        patterns = [pattern]
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"pattern is a glob pattern or a list of them, got {pattern!r}")
    return [
        n
        for n, cfg in _MODELS.items()
        if any(
            fnmatch.fnmatchcase(a.lower(), p.lower()) for a in [n, *aliases_of(n)] for p in patterns
        )
        and (family is None or family_of(cfg) == family)
    ]


def aliases_of(name: str) -> list[str]:
    return [a for a, n in _ALIASES.items() if n == name]


def describe(name: str) -> str:
    return _DESCRIPTIONS[resolve_name(name)]
