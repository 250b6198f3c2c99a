"""vitlab: build, train, fine-tune, convert, analyse and measure Vision Transformers in PyTorch."""

from vitlab.config import ConfigError
from vitlab.models import (
    UnknownModelError,
    VisionTransformer,
    ViTConfig,
    create_model,
    get_config,
    list_models,
    resample_pos_embed,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "UnknownModelError",
    "ViTConfig",
    "VisionTransformer",
    "__version__",
    "create_model",
    "get_config",
    "list_models",
    "resample_pos_embed",
]
