"""The ViT model family: config, module, building blocks and registry."""

from vitlab.models.pos_embed import resample_pos_embed
from vitlab.models.registry import (
    UnknownModelError,
    create_model,
    get_config,
    list_models,
    register_alias,
    register_model,
)
from vitlab.models.vit import Intermediates, VisionTransformer, ViTConfig

__all__ = [
    "Intermediates",
    "UnknownModelError",
    "ViTConfig",
    "VisionTransformer",
    "create_model",
    "get_config",
    "list_models",
    "register_alias",
    "register_model",
    "resample_pos_embed",
]
