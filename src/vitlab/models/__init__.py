"""The model families (ViT, Swin): configs, modules, building blocks and registry."""

from vitlab.models.pos_embed import resample_pos_embed
from vitlab.models.registry import (
    UnknownModelError,
    build_model,
    create_model,
    get_config,
    list_models,
    register_alias,
    register_model,
)
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.vit import Intermediates, VisionTransformer, ViTConfig

__all__ = [
    "Intermediates",
    "SwinConfig",
    "SwinTransformer",
    "UnknownModelError",
    "ViTConfig",
    "VisionTransformer",
    "build_model",
    "create_model",
    "get_config",
    "list_models",
    "register_alias",
    "register_model",
    "resample_pos_embed",
]
