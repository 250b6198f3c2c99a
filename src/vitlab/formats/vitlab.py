"""vitlab's own format: model.safetensors whose metadata holds the model family ('vit', 'swin' or
'cnn'; 'vit' when absent, as in files written before Swin), its config, preprocessing, class
names and training info, alone (DST.safetensors) or in a checkpoint folder; a run keeps its
checkpoints under run/checkpoints/{best,last}. A plain ViT state dict in vitlab's names (timm's,
with the learned position table as `pos_embed.weight`) is read too, without that metadata; a
plain Swin state dict is timm's (the same names), so the timm format reads it, and a plain CNN's
is torchvision's."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from vitlab.config import from_dict, to_dict
from vitlab.formats.base import (
    WEIGHTS,
    CheckpointError,
    Files,
    Source,
    classes_of,
    cpu_state,
    preprocessing_of,
    safetensors_metadata,
    write_safetensors,
)
from vitlab.formats.families import state_family
from vitlab.models.cnn import CNNConfig
from vitlab.models.mpp import PREFIX as MPP_PREFIX
from vitlab.models.registry import ModelConfig, family_of
from vitlab.models.swin import SwinConfig
from vitlab.models.vit import ViTConfig
from vitlab.preprocessing import Preprocessing

log = logging.getLogger(__name__)

CONFIGS: dict[str, type[ViTConfig] | type[SwinConfig] | type[CNNConfig]] = {
    "vit": ViTConfig,
    "swin": SwinConfig,
    "cnn": CNNConfig,
}


@dataclass
class CheckpointMeta:
    """What a weights file holds besides the tensors."""

    config: ModelConfig  # a ViTConfig, a SwinConfig or a CNNConfig
    preprocessing: Preprocessing
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)  # epoch, step, metrics, source ...


def detect(files: Files) -> bool:
    if files.metadata().get("format") == "vitlab":
        return True
    keys = files.names()
    return (
        "patch_embed.proj.weight" in keys
        and ("pos_embed.weight" in keys or "pos_embed" not in keys)
        and state_family(keys) == "vit"
    )


def read(files: Files) -> Source:
    if files.metadata().get("format") != "vitlab":  # a plain state dict in vitlab's names
        return Source(dict(files.tensors()), "vitlab", files.where)
    meta = read_metadata(files.weights)
    where = files.hub_name or str(files.weights)
    state = files.tensors()
    pretraining = [k for k in state if k.startswith(MPP_PREFIX)]
    if pretraining:  # a masked-patch-prediction run's head and [mask] embedding: not the ViT's
        log.info("%s: masked-patch-prediction head left out (%s)", where, ", ".join(pretraining))
        state = {k: v for k, v in state.items() if not k.startswith(MPP_PREFIX)}
    src = Source(state, "vitlab", where, config=meta.config)
    src.info, src.classes = meta.info, meta.classes
    src.preprocessing = meta.preprocessing.to_dict()
    return src


def write(model: nn.Module, dst: Path, info: dict[str, Any] | None = None) -> list[Path]:
    """DST.safetensors, or DST/model.safetensors (a checkpoint folder); `info` (training state,
    where a converted checkpoint came from) is kept in the metadata."""
    path = dst if dst.suffix == ".safetensors" else dst / WEIGHTS
    meta = CheckpointMeta(model.config, preprocessing_of(model), classes_of(model), info or {})
    write_weights(path, model.state_dict(), meta)
    return [path]


def write_weights(path: Path, state: dict[str, Tensor], meta: CheckpointMeta) -> None:
    """Weights with vitlab's metadata (config, preprocessing, class names, info), atomically."""
    metadata = {
        "format": "vitlab",
        "family": family_of(meta.config),
        "config": json.dumps(to_dict(meta.config)),
        "preprocessing": json.dumps(meta.preprocessing.to_dict()),
        "classes": json.dumps(meta.classes),
        "info": json.dumps(meta.info),
    }
    write_safetensors(Path(path), cpu_state(state), metadata)


def read_metadata(weights: Path) -> CheckpointMeta:
    """What a vitlab weights file holds besides the tensors; its config is the dataclass its
    `family` names (ViTConfig when there is none)."""
    meta = safetensors_metadata(weights)
    if meta.get("format") != "vitlab":
        raise CheckpointError(f"{weights} has no vitlab metadata (model config, preprocessing)")
    family = meta.get("family", "vit")  # files from before Swin have no family: ViTs
    if family not in CONFIGS:
        raise CheckpointError(
            f"{weights}: model family {family!r} is not one vitlab builds ({', '.join(CONFIGS)})"
        )
    try:
        where = f"config in {weights}"
        config = from_dict(CONFIGS[family], json.loads(meta["config"]), where=where)
        pre = Preprocessing.from_dict(json.loads(meta["preprocessing"]))
        classes, info = json.loads(meta["classes"]), json.loads(meta["info"])
    # AttributeError: JSON of the wrong shape (a list for a mapping); RecursionError: deep nesting
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{weights}: damaged vitlab metadata ({e})") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise CheckpointError(f"{weights}: damaged vitlab metadata (classes are not names)")
    if not isinstance(info, dict):
        raise CheckpointError(f"{weights}: damaged vitlab metadata (info is not a mapping)")
    return CheckpointMeta(config, pre, classes, info)


def resolve_checkpoint(path: str | Path) -> Path:
    """The weights file for a run folder (its best, else last checkpoint), a checkpoint folder, or a
    .safetensors file."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    # a save killed mid-swap leaves the previous checkpoint under its aside name: a run's best
    # there still comes before its last
    candidates = [
        p / "checkpoints" / "best" / WEIGHTS,
        p / "checkpoints" / ".best.old" / WEIGHTS,
        p / "checkpoints" / "last" / WEIGHTS,
        p / "checkpoints" / ".last.old" / WEIGHTS,
        p / WEIGHTS,
        p.parent / f".{p.name}.old" / WEIGHTS,
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise CheckpointError(
        f"no checkpoint at {p}: expected a run folder (with checkpoints/best or checkpoints/last), "
        f"a checkpoint folder holding {WEIGHTS}, or a .safetensors file"
    )


def vitlab_weights(source: str | Path) -> Path | None:
    """The vitlab weights file `source` names (a run, checkpoint folder or file), else None."""
    try:
        weights = resolve_checkpoint(source)
        if weights.suffix == ".safetensors":
            return weights if safetensors_metadata(weights).get("format") == "vitlab" else None
    except CheckpointError:
        pass
    return None
