"""The model families (ViT, Swin, CNN baselines): configs, modules, building blocks and registry."""

from vitlab.models.cnn import CNN, CNNConfig, ResNet
from vitlab.models.intermediates import Intermediates
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
from vitlab.models.resnetv2 import BiTResNet
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.vit import VisionTransformer, ViTConfig

__all__ = [
    "BiTResNet",
    "CNN",
    "CNNConfig",
    "Intermediates",
    "ResNet",
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
