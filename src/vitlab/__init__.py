"""vitlab: build, train, fine-tune, convert, analyse and measure Vision Transformers in PyTorch.

The names below are imported on first use (PEP 562), so `import vitlab` (and the `vitlab`
command, before it parses its arguments) does not import PyTorch yet: a Ctrl-C in the command's
first seconds ends it with one line, not a traceback from inside `import torch`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from vitlab.models.checkpoint import load_checkpoint, load_pretrained, save_pretrained
    from vitlab.preprocessing import Preprocessing
    from vitlab.validation import ConfigError

__version__ = "0.1.0"

_HOMES = {
    "CheckpointError": "vitlab.formats.base",
    "ConfigError": "vitlab.validation",
    "UnknownModelError": "vitlab.models",
    "ViTConfig": "vitlab.models",
    "VisionTransformer": "vitlab.models",
    "create_model": "vitlab.models",
    "get_config": "vitlab.models",
    "list_models": "vitlab.models",
    "load_checkpoint": "vitlab.models.checkpoint",
    "load_pretrained": "vitlab.models.checkpoint",
    "Preprocessing": "vitlab.preprocessing",
    "resample_pos_embed": "vitlab.models",
    "save_pretrained": "vitlab.models.checkpoint",
}

__all__ = [  # written out for linters and type checkers; each but __version__ one of _HOMES
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


def __getattr__(name: str) -> Any:
    """`vitlab.create_model` and `from vitlab import create_model`: the name from its module,
    kept here after the first use; `vitlab.models` (after `import vitlab`): the submodule."""
    if name not in _HOMES:
        if not name.isidentifier() or name.startswith("__"):
            raise AttributeError(f"module 'vitlab' has no attribute {name!r}")
        if importlib.util.find_spec(f"vitlab.{name}") is None:
            raise AttributeError(f"module 'vitlab' has no attribute {name!r}")
        return importlib.import_module(f"vitlab.{name}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
