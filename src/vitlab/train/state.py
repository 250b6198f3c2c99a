"""Checkpoints: a folder with the weights (model.safetensors, the model config, preprocessing and
class names in its metadata) and the training state beside them (state.pt: optimizer, EMA, RNG,
step; loaded with weights_only=True, so it can never run code).

Writes are atomic: the new checkpoint is written and fsynced in a temporary folder, the old one is
renamed aside, the new one renamed into place, the old one removed. A kill at any point leaves a
loadable checkpoint: the old one, the new one, or (mid-swap) the old one under its aside name, which
`resolve_checkpoint` finds."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from vitlab.config import from_dict, to_dict
from vitlab.data.transforms import Preprocessing
from vitlab.models.vit import VisionTransformer, ViTConfig

WEIGHTS, STATE = "model.safetensors", "state.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or not vitlab's."""


@dataclass
class Checkpoint:
    """What a weights file holds besides the tensors."""

    config: ViTConfig
    preprocessing: Preprocessing
    classes: list[str]
    info: dict[str, Any]  # epoch, step, metrics ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    folder: Path,
    model_state: dict[str, torch.Tensor],
    meta: Checkpoint,
    train_state: dict[str, Any] | None = None,
) -> None:
    """Atomically (re)write checkpoint `folder` (e.g. run/checkpoints/last)."""
    folder = Path(folder)
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp, aside = parent / f".{folder.name}.tmp", parent / f".{folder.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    metadata = {
        "format": "vitlab",
        "config": json.dumps(to_dict(meta.config)),
        "preprocessing": json.dumps(meta.preprocessing.to_dict()),
        "classes": json.dumps(meta.classes),
        "info": json.dumps(meta.info),
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(tensors, tmp / WEIGHTS, metadata=metadata)
    _fsync_file(tmp / WEIGHTS)
    if train_state is not None:
        torch.save(train_state, tmp / STATE)
        _fsync_file(tmp / STATE)
    _fsync_dir(tmp)
    if folder.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, aside)
    os.replace(tmp, folder)
    _fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """The weights file for a run folder (its best, else last checkpoint), a checkpoint folder, or a
    .safetensors file."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    candidates = [
        p / "checkpoints" / "best" / WEIGHTS,
        p / "checkpoints" / "last" / WEIGHTS,
        p / WEIGHTS,
        # a save killed mid-swap leaves the previous checkpoint under its aside name
        p / "checkpoints" / ".best.old" / WEIGHTS,
        p / "checkpoints" / ".last.old" / WEIGHTS,
        p.parent / f".{p.name}.old" / WEIGHTS,
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise CheckpointError(
        f"no checkpoint at {p}: expected a run folder (with checkpoints/best or checkpoints/last), "
        f"a checkpoint folder holding {WEIGHTS}, or a .safetensors file"
    )


def read_metadata(weights: Path) -> Checkpoint:
    try:
        with safe_open(str(weights), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {e}") from None
    if meta.get("format") != "vitlab":
        raise CheckpointError(f"{weights} has no vitlab metadata (model config, preprocessing)")
    try:
        config = from_dict(ViTConfig, json.loads(meta["config"]), where=f"config in {weights}")
        pre = Preprocessing.from_dict(json.loads(meta["preprocessing"]))
        return Checkpoint(config, pre, json.loads(meta["classes"]), json.loads(meta["info"]))
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{weights}: damaged vitlab metadata ({e})") from None


def load_weights(weights: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is truncated or not a safetensors file: {e}") from None


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[VisionTransformer, Checkpoint]:
    """A model with its weights, plus the checkpoint's metadata, from a run, folder or file."""
    weights = resolve_checkpoint(path)
    meta = read_metadata(weights)
    model = VisionTransformer(meta.config)
    state = load_weights(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not fit its own config: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device).eval(), meta


def load_train_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no training state ({STATE}) to resume from") from None
    except Exception as e:
        raise CheckpointError(f"{path} is truncated or not a vitlab training state: {e}") from None
