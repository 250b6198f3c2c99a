"""vitlab: build, train, fine-tune, convert, analyse and measure Vision Transformers in PyTorch."""

from vitlab.config import ConfigError
from vitlab.formats.base import CheckpointError
from vitlab.models import (
    UnknownModelError,
    VisionTransformer,
    ViTConfig,
    create_model,
    get_config,
    list_models,
    resample_pos_embed,
)
from vitlab.models.checkpoint import (
    load_checkpoint,
    load_pretrained,
    save_pretrained,
)
from vitlab.preprocessing import Preprocessing

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "UnknownModelError",
    "ViTConfig",
    "VisionTransformer",
    "__version__",
    "create_model",
    "get_config",
    "list_models",
    "load_checkpoint",
    "load_pretrained",
    "Preprocessing",
    "resample_pos_embed",
    "save_pretrained",
]
