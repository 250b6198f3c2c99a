"""Registered model names and aliases -> ViTConfig. A new size is an entry, never a new class."""

from __future__ import annotations

import difflib
import fnmatch

from vitlab.config import ModelSection
from vitlab.models.vit import VisionTransformer, ViTConfig

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

_MODELS: dict[str, ViTConfig] = {}
_ALIASES: dict[str, str] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register_model(name: str, config: ViTConfig, description: str = "") -> None:
    """Register `config` under `name` (a name already taken is an error)."""
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


def resolve_name(name: str) -> str:
    """The registered name for `name` or its alias; unknown names raise with the closest names."""
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


def get_config(name: str, **overrides: object) -> ViTConfig:
    """The config registered under `name` (or alias) with `overrides` applied and validated."""
    return _MODELS[resolve_name(name)].replace(**overrides)


def config_of(section: ModelSection) -> ViTConfig:
    """The ViTConfig a run config's `model` section names: the registered config (or alias) with
    the section's overrides applied and validated."""
    return get_config(section.name, **section.overrides)


def create_model(name: str, **overrides: object) -> VisionTransformer:
    """Build a registered model, e.g. create_model("B/16", num_classes=10, img_size=384)."""
    return VisionTransformer(get_config(name, **overrides))


def list_models(pattern: str | None = None) -> list[str]:
    """Registered names (aliases excluded), optionally filtered by a glob pattern."""
    names = list(_MODELS)
    return [n for n in names if pattern is None or fnmatch.fnmatch(n, pattern)]


def aliases_of(name: str) -> list[str]:
    return [a for a, n in _ALIASES.items() if n == name]


def describe(name: str) -> str:
    return _DESCRIPTIONS[resolve_name(name)]
