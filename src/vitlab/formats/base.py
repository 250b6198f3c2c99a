"""What every format module shares: the files a checkpoint is read from (`Files`), what it is read
into (`Source`: tensors in vitlab's names plus what the format says about them), key renaming by
rules, safe readers and atomic writers.

Nothing is ever unpickled beyond tensors: safetensors, numpy without pickle,
torch.load(weights_only=True). Conventions of the key maps: Linear weights are (out, in) as in
PyTorch; a fused qkv weight is (3 D, D) with rows q, k, v.
"""

from __future__ import annotations

import functools
import json
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor, nn

from vitlab.preprocessing import Preprocessing
from vitlab.runtime import file_mode

if TYPE_CHECKING:  # annotations only: base.py stays free of model code
    from vitlab.models.cnn import CNNConfig
    from vitlab.models.swin import SwinConfig
    from vitlab.models.vit import ViTConfig

StateDict = dict[str, Tensor]
WEIGHTS = "model.safetensors"
TORCH_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")
READ_SUFFIXES = (".safetensors", ".npz", *TORCH_SUFFIXES)  # the weight files vitlab reads
SIDECARS = ("config.json", "preprocessor_config.json")  # what a folder's format reads beside them
INDEX = ".index.json"  # a sharded checkpoint's: model.safetensors.index.json


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, hostile, or does not fit the model."""


def pass_key(key: str) -> str:
    """How a value no tensor holds is given: in Python, or once for every command by convert."""
    return f"pass {key}=N (`vitlab convert SRC DST {key}=N` writes a checkpoint that states it)"


class FormatError(ValueError):
    """A tensor that has no place in the format being read or written."""


def fuse_qkv(parts: Mapping[str, Tensor], kind: str, where: str) -> Tensor:
    """Separate query, key and value {"q", "k", "v"} weights or biases (`kind`) of one attention
    layer (`where`) stacked as one qkv tensor; a FormatError naming what is missing or misshapen."""
    kinds = "biases" if kind == "bias" else f"{kind}s"
    if set(parts) != {"q", "k", "v"}:
        raise FormatError(f"{where} has {kinds} for {sorted(parts)} of query/key/value")
    try:
        return torch.cat([parts["q"], parts["k"], parts["v"]])
    except RuntimeError:  # shapes that do not stack
        shapes = [tuple(parts[n].shape) for n in "qkv"]
        raise FormatError(f"{where}: query/key/value {kinds} of shapes {shapes}") from None


@dataclass
class Files:
    """A checkpoint on disk: its weights file and, when it came in a folder, that folder (where
    config.json and preprocessor_config.json live), and the hub name it was fetched by. The
    tensors are read once, on first use."""

    weights: Path
    folder: Path | None = None
    hub_name: str | None = None
    _tensors: StateDict | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def suffix(self) -> str:
        """The weights file's suffix in lower case (`.NPZ` is a .npz); a sharded checkpoint's
        index (model.safetensors.index.json) has its shards' suffix."""
        return Path(self.weights.name.lower().removesuffix(INDEX)).suffix

    @property
    def where(self) -> str:
        """The hub name, folder or file, for messages."""
        return self.hub_name or str(self.folder or self.weights)

    def tensors(self) -> StateDict:
        """The flat state dict of a .safetensors or PyTorch file."""
        if self._tensors is None:
            read = load_weights if self.suffix == ".safetensors" else read_torch
            self._tensors = {k: v for shard in self.shards() for k, v in read(shard).items()}
            if self.index is not None and set(self.index) != set(self._tensors):  # every name
                lost = sorted(set(self.index) - set(self._tensors))
                extra = sorted(set(self._tensors) - set(self.index))
                raise CheckpointError(
                    f"{self.weights}: the shards do not hold what it names "
                    f"(missing {lost[:5]}, unlisted {extra[:5]})"
                )
        return self._tensors

    @functools.cached_property
    def index(self) -> dict[str, str] | None:
        """A sharded checkpoint's weight_map (tensor name -> shard file), read once; None for a
        weights file."""
        return _weight_map(self.weights) if self.weights.name.lower().endswith(INDEX) else None

    def shards(self) -> list[Path]:
        """The files the tensors are in: the weights file, or the shards its index names."""
        if self.index is None:
            return [self.weights]
        files = sorted(set(self.index.values()))
        missing = [f for f in files if not (self.weights.parent / f).is_file()]
        if missing:
            raise CheckpointError(f"{self.weights} names shards that are not beside it: {missing}")
        return [self.weights.parent / f for f in files]

    def names(self) -> set[str]:
        """The tensor names, for detection (none for a .npz, which is not a state dict)."""
        return set() if self.suffix == ".npz" else set(self.tensors())

    def metadata(self) -> dict[str, str]:
        """A .safetensors file's header metadata, its first shard's if sharded ({} for others)."""
        return safetensors_metadata(self.shards()[0]) if self.suffix == ".safetensors" else {}

    def json(self, name: str) -> dict[str, Any] | None:
        """The JSON file `name` in the folder, or None when there is none."""
        path = self.folder / name if self.folder else None
        if path is None or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            raise CheckpointError(f"{path} is not a readable JSON file: {e}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path} is not a JSON object")
        return data


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint index's weight_map: tensor name -> shard file name."""
    try:
        mapping = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a readable shard index: {e!r}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise CheckpointError(f"{index}: weight_map is not a mapping of names to shard files")
    if any(Path(v).name != v for v in mapping.values()):  # shards live beside their index
        raise CheckpointError(f"{index}: weight_map names files outside its folder")
    return mapping


@dataclass
class Source:
    """Tensors in vitlab's names plus everything known about them."""

    state: StateDict
    format: str
    where: str  # file, folder or hub name, for messages
    hints: dict[str, Any] = field(default_factory=dict)  # config fields the format states
    preprocessing: dict[str, Any] = field(default_factory=dict)  # Preprocessing fields
    classes: list[str] | None = None
    # the architecture once known (vitlab files carry theirs)
    config: ViTConfig | SwinConfig | CNNConfig | None = None
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # how the writing library resamples a ViT's position table to another size (keywords of
    # resample_pos_embed); empty: timm's way, the default
    pos_resampling: dict[str, Any] = field(default_factory=dict)
    table_resampling: str = "bicubic"  # a Swin's tables (resample_rel_pos_table's method)
    # the image size a format states where the tables are another size's (a timm config.json:
    # timm builds the model at it and resamples the table); loaded at the tables', then resized
    stated_size: int | tuple[int, int] | None = None


# --- key maps ------------------------------------------------------------------------------------

UNBUILT = {
    "patch_embed.backbone.conv.": "a hybrid of a ResNet stem without stages (timm's "
    "vit_*_r_s16_p8_*, R-Ti/16), which vitlab does not build",
    "reg_token": "register tokens (timm's reg_tokens), which vitlab's ViT does not have",
}


def unknown(keys: list[str], format: str) -> FormatError:
    shown = ", ".join(sorted(keys)[:8]) + (" ..." if len(keys) > 8 else "")
    why = "".join(f"; {w}" for k, w in UNBUILT.items() if any(x.startswith(k) for x in keys))
    return FormatError(
        f"{len(keys)} tensor(s) have no place in a vitlab model ({format}): {shown}{why}"
    )


def rename(state: Mapping[str, Tensor], rules: list[tuple[str, str]], format: str) -> StateDict:
    """Apply the first matching (regex, replacement) rule to every key; a key no rule matches is
    an error naming it (never silently dropped)."""
    out, left = {}, []
    compiled = [(re.compile(f"^{a}$"), b) for a, b in rules]
    for key, value in state.items():
        for pattern, repl in compiled:
            if pattern.match(key):
                out[pattern.sub(repl, key)] = value
                break
        else:
            left.append(key)
    if left:
        raise unknown(left, format)
    return out


def convert(where: str, fn: Any, *args: Any) -> Any:
    """fn(*args), a FormatError turned into a CheckpointError naming `where`."""
    try:
        return fn(*args)
    except FormatError as e:
        raise CheckpointError(f"{where}: {e}") from None


def cpu_state(state: Mapping[str, Tensor]) -> StateDict:
    """Detached, contiguous CPU copies (what safetensors writes)."""
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def preprocessing_of(model: nn.Module) -> Preprocessing:
    """The model's `.preprocessing`, or inputs in [-1, 1] when it has none."""
    pre = getattr(model, "preprocessing", None)
    if pre is not None:
        return pre
    cfg = model.config
    return Preprocessing(cfg.img_hw, cfg.in_chans, (0.5,) * cfg.in_chans, (0.5,) * cfg.in_chans)


def classes_of(model: nn.Module) -> list[str]:
    """The model's `.classes`, or the class indices as names (also when `.classes` names another
    count: a head replaced by hand)."""
    names, count = getattr(model, "classes", None), model.config.num_classes
    return list(names) if names and len(names) == count else [str(i) for i in range(count)]


# --- reading -------------------------------------------------------------------------------------


# what a file holds, told by its first bytes; readers are chosen by suffix (or format=), so a file
# named for another format gets the name that reads it: (what it is, the suffix that reads it)
_HOLDS = {
    "safetensors": ("a safetensors file", "*.safetensors"),
    "torch": ("a PyTorch file (torch.save's zip)", "*.pt (or .pth, .bin)"),
    "pickle": ("a Python pickle, such as torch.save's legacy format", "*.pt (or .pth, .bin)"),
    "npz": ("a numpy .npz (a zip of .npy arrays)", "*.npz"),
}


def holds(path: Path) -> str | None:
    """What a file holds by its first bytes: 'safetensors' (an 8-byte header length, then its JSON
    header), 'pickle', or for a zip 'torch' (a data.pkl inside) or 'npz' (.npy files only); None
    for anything else, or a file that cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            if head[:4] == b"PK\x03\x04":
                f.seek(0)
                names = zipfile.ZipFile(f).namelist()
                if any(n.endswith("data.pkl") for n in names):
                    return "torch"
                return "npz" if names and all(n.endswith(".npy") for n in names) else None
    except Exception:  # a damaged zip raises what zipfile meets (UnicodeDecodeError, ...): unknown
        return None
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "pickle" if head[:1] == b"\x80" else None


def misnamed(path: Path, reading: str) -> str | None:
    """The error for a file read as `reading` ('safetensors', 'torch' or 'npz') that holds another
    format, with the name that reads it; None when it holds what is read, or something unknown."""
    kind = holds(path)
    if kind in (None, reading) or (kind, reading) == ("pickle", "torch"):
        return None
    (what, suffix), (expected, _) = _HOLDS[kind], _HOLDS[reading]
    return f"{path} is not {expected}: it is {what}; name it {suffix}, which format='auto' reads"


def safetensors_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        why = misnamed(path, "safetensors") or f"{path} is not a readable safetensors file: {e}"
        raise CheckpointError(why) from None


def load_weights(path: Path) -> StateDict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        why = misnamed(path, "safetensors") or f"{path} is truncated or not a safetensors file: {e}"
        raise CheckpointError(why) from None


def read_torch(path: Path, state_dict: bool = True) -> StateDict | Any:
    """The state dict (else whatever it holds) in a PyTorch file, loaded with weights_only=True."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no such file: {path}") from None
    except Exception as e:  # UnpicklingError for code, RuntimeError / EOFError when truncated
        other = misnamed(path, "torch")
        if other:
            raise CheckpointError(other) from None
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text:
            # an opcode weights_only does not read: damage, or a pickle beyond a state dict's
            what = "is damaged, or " if "Unsupported operand" in text else ""
            raise CheckpointError(
                f"{path} {what}holds Python objects beyond tensors, which vitlab refuses to "
                "unpickle (it could run code); save the state dict alone, or as safetensors"
            ) from None
        why = text.partition(". ")[0][:200] or type(e).__name__  # torch's first sentence
        why = why if path.stat().st_size else "an empty file, 0 bytes"  # (EOFError's text: '')
        raise CheckpointError(f"{path} is truncated or not a PyTorch file ({why})") from None
    return unwrap(obj, path) if state_dict else obj


def unwrap(obj: Any, path: Path | str) -> StateDict:
    """The state dict inside a training checkpoint ({'model': ...}, {'state_dict': ...}), without
    DDP's `module.` prefix."""
    for key in ("model", "state_dict", "model_state", "model_state_dict", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path} holds no state dict (a mapping of names to tensors)")
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        names = ", ".join(map(str, bad[:5]))
        raise CheckpointError(f"{path}: entries that are not tensors: {names}")
    if all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


# --- writing, atomically -------------------------------------------------------------------------


def fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: StateDict, metadata: dict[str, str]) -> None:
    """A safetensors file written to a temporary name, fsynced, renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, file_mode())  # safetensors writes 0600, unlike its JSON neighbours
        fsync(tmp)
    except BaseException:  # a full disk, a tensor it cannot save, Ctrl-C: no half file left
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync(path.parent)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a kill at any moment leaves the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync(path.parent)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A JSON file written atomically (write_text), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2) + "\n")
