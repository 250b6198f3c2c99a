"""Weights in and out: vitlab's own checkpoint files, and the ViT checkpoints of timm, Hugging Face
transformers, torchvision and Google's .npz releases, from files, folders or the Hugging Face Hub.

    load_pretrained(source, **overrides) -> VisionTransformer      any format, detected
    load_checkpoint(source, ...)        -> (VisionTransformer, CheckpointMeta)
    save_weights / save_timm / save_hf                               vitlab, timm or HF layout

The architecture is read from the tensors (width, depth, MLP, patch, grid, prefix tokens,
pooling, pre-logits), from the config a format carries (heads, eps, activation, labels), and from
what the format implies (Google: tanh GELU, inputs in [-1, 1]). Every tensor must find its place
and every parameter must be filled: anything else is an error with names and shapes. Nothing is
ever unpickled beyond tensors: safetensors, numpy without pickle, torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

from vitlab.config import ConfigError, check_keys, from_dict, to_dict
from vitlab.models.formats import (
    LAYOUT_READERS,
    LayoutError,
    StateDict,
    npz_prefix,
    npz_to_vitlab,
    vitlab_to_hf,
    vitlab_to_timm,
)
from vitlab.models.vit import VisionTransformer, ViTConfig
from vitlab.preprocessing import HALF, IMAGENET_MEAN, IMAGENET_STD, Preprocessing

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
FORMATS = ("auto", "vitlab", "timm", "hf", "torchvision", "npz")
TORCH_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, hostile, or does not fit the model."""


@dataclass
class CheckpointMeta:
    """What a weights file holds besides the tensors."""

    config: ViTConfig
    preprocessing: Preprocessing
    classes: list[str]
    info: dict[str, Any] = field(default_factory=dict)  # epoch, step, metrics, source ...


# --- vitlab's own weights files ------------------------------------------------------------------


def fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_weights(path: Path, state: dict[str, Tensor], meta: CheckpointMeta) -> None:
    """Write model.safetensors-style weights with vitlab's metadata (config, preprocessing, class
    names, info), atomically: a temporary file, fsynced, renamed over `path`."""
    path = Path(path)
    metadata = {
        "format": "vitlab",
        "config": json.dumps(to_dict(meta.config)),
        "preprocessing": json.dumps(meta.preprocessing.to_dict()),
        "classes": json.dumps(meta.classes),
        "info": json.dumps(meta.info),
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    _write_safetensors(path, tensors, metadata)


def _write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)


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


def _safetensors_metadata(weights: Path) -> dict[str, str]:
    try:
        with safe_open(str(weights), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {e}") from None


def vitlab_weights(source: str | Path) -> Path | None:
    """The vitlab weights file `source` names (a run, checkpoint folder or file), else None."""
    try:
        weights = resolve_checkpoint(source)
    except CheckpointError:
        return None
    if weights.suffix != ".safetensors":
        return None
    try:
        return weights if _safetensors_metadata(weights).get("format") == "vitlab" else None
    except CheckpointError:
        return None


def read_metadata(weights: Path) -> CheckpointMeta:
    meta = _safetensors_metadata(weights)
    if meta.get("format") != "vitlab":
        raise CheckpointError(f"{weights} has no vitlab metadata (model config, preprocessing)")
    try:
        config = from_dict(ViTConfig, json.loads(meta["config"]), where=f"config in {weights}")
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


def load_weights(weights: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is truncated or not a safetensors file: {e}") from None


def load_state_strict(model: VisionTransformer, state: dict[str, Tensor], where: str) -> None:
    """Load `state` into `model`, or raise naming every missing, unexpected or misshapen tensor."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shapes differ: " + "; ".join(shapes[:6]))
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"no place in the model: {', '.join(unexpected[:8])}")
        raise CheckpointError(f"{where} does not fit the model: " + " | ".join(parts))
    model.load_state_dict(state)


# --- reading other formats -----------------------------------------------------------------------


@dataclass
class Source:
    """Tensors in vitlab's names plus everything known about them."""

    state: StateDict
    format: str
    where: str  # file, folder or hub name, for messages
    hints: dict[str, Any] = field(default_factory=dict)  # ViTConfig fields the format states
    preprocessing: dict[str, Any] = field(default_factory=dict)  # Preprocessing fields
    classes: list[str] | None = None
    config: ViTConfig | None = None  # the architecture once known (vitlab files carry theirs)
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _read_torch(path: Path) -> dict[str, Any]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no such file: {path}") from None
    except Exception as e:  # UnpicklingError for code, RuntimeError / EOFError when truncated
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text:
            raise CheckpointError(
                f"{path} holds Python objects beyond tensors, which vitlab refuses to unpickle "
                "(it could run code); save the state dict alone, or as safetensors"
            ) from None
        raise CheckpointError(
            f"{path} is truncated or not a PyTorch checkpoint: {text[:200]}"
        ) from None
    return _unwrap(obj, path)


def _unwrap(obj: Any, path: Path | str) -> dict[str, Tensor]:
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
        raise CheckpointError(
            f"{path}: entries that are not tensors: {', '.join(map(str, bad[:5]))}"
        )
    if all(k.startswith("module.") for k in obj):
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise CheckpointError(f"no such file: {path}") from None
    # numpy never unpickles here (allow_pickle=False), and a damaged zip or .npy header fails in
    # many ways: BadZipFile, zlib.error, NotImplementedError (compression method), RuntimeError
    # (encrypted), SyntaxError / TokenError (header), MemoryError (shape), ...
    except Exception as e:
        raise CheckpointError(
            f"{path} is truncated or not a numpy .npz of arrays (pickled objects are refused): {e}"
        ) from None
    for k, v in arrays.items():  # members not named .npy come back as raw bytes
        if not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
            raise CheckpointError(f"{path}: {k} is not an array of numbers")
    return arrays


def detect_layout(keys: list[str] | set[str] | Any) -> str:
    keys = set(keys)
    if "patch_embed.proj.weight" in keys:
        return "vitlab" if "pos_embed.weight" in keys or "pos_embed" not in keys else "timm"
    if any("embeddings.patch_embeddings.projection" in k for k in keys):
        return "hf"
    if "conv_proj.weight" in keys:
        return "torchvision"
    shown = ", ".join(sorted(keys)[:6])
    raise CheckpointError(
        f"not a ViT checkpoint in a layout vitlab knows (timm, Hugging Face, torchvision, npz, "
        f"vitlab); first keys: {shown}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable JSON file: {e}") from None


def _hints_from_config(cfg: dict[str, Any], src: Source) -> None:
    """Fill a Source's hints, preprocessing and classes from a timm or HF config.json."""
    if cfg.get("model_type") == "vit" or "hidden_size" in cfg:  # transformers' ViTConfig
        size = cfg.get("image_size")
        src.hints.update(
            num_heads=cfg.get("num_attention_heads"),
            norm_eps=cfg.get("layer_norm_eps", 1e-12),
            act="gelu" if cfg.get("hidden_act", "gelu") == "gelu" else "gelu_tanh",
            img_size=tuple(size) if isinstance(size, list) else size,
            qkv_bias=cfg.get("qkv_bias", True),
        )
        if cfg.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{src.where}: hidden_act {cfg['hidden_act']!r} is not a GELU")
        labels = cfg.get("id2label")
        if labels:
            src.classes = [labels[str(i)] for i in range(len(labels))]
        return
    args = dict(cfg.get("model_args") or {})  # timm's config.json
    arch = cfg.get("architecture", "")
    from vitlab.models.registry import _MODELS

    if arch in _MODELS:
        src.hints["num_heads"] = _MODELS[arch].num_heads
    if "num_heads" in args:
        src.hints["num_heads"] = args["num_heads"]
    pool = args.get("global_pool", cfg.get("global_pool"))
    if pool in ("avg", "token"):
        src.hints["pool"] = "gap" if pool == "avg" else "token"
    elif pool not in (None, ""):
        raise CheckpointError(f"{src.where}: timm global_pool {pool!r} is not supported")
    if args.get("act_layer") in ("gelu_tanh",):
        src.hints["act"] = "gelu_tanh"
    if "img_size" in args:
        size = args["img_size"]
        src.hints["img_size"] = tuple(size) if isinstance(size, list) else size
    pre = cfg.get("pretrained_cfg") or {}
    for ours, theirs in (("mean", "mean"), ("std", "std"), ("interpolation", "interpolation")):
        if theirs in pre:
            src.preprocessing[ours] = pre[theirs]
    if "crop_pct" in pre:  # timm's `squash` resizes the whole image, as crop_pct None does
        squash = pre.get("crop_mode") == "squash"
        src.preprocessing["crop_pct"] = None if squash else pre["crop_pct"]
    names = cfg.get("label_names") or pre.get("label_names")
    if names:
        src.classes = list(names)


def _read_hf_preprocessor(path: Path, src: Source) -> None:
    if not path.is_file():
        return
    p = _read_json(path)
    if "image_mean" in p:
        src.preprocessing.update(mean=p["image_mean"], std=p["image_std"])
    src.preprocessing["interpolation"] = {0: "nearest", 2: "bilinear", 3: "bicubic"}.get(
        p.get("resample", 2), "bilinear"
    )
    src.preprocessing["crop_pct"] = None


def _from_state(raw: dict[str, Tensor], fmt: str, where: str) -> Source:
    layout = detect_layout(raw.keys()) if fmt == "auto" else fmt
    if layout == "vitlab":
        return Source(dict(raw), "vitlab", where)
    if layout not in LAYOUT_READERS:
        raise CheckpointError(f"{where}: format {fmt!r} cannot be read from a state dict")
    try:
        state = LAYOUT_READERS[layout](raw)
    except LayoutError as e:
        raise CheckpointError(f"{where}: {e}") from None
    src = Source(state, layout, where)
    if layout == "torchvision":
        src.preprocessing = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=224 / 256)
    elif layout == "timm":
        src.preprocessing = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=0.9)
        src.preprocessing["interpolation"] = "bicubic"
    elif layout == "hf":
        src.hints.update(norm_eps=1e-12)
        src.preprocessing = dict(mean=HALF, std=HALF, crop_pct=None)
        if "head.weight" in state and "pre_logits.fc.weight" in state:
            # ViTForImageClassification has no pooler: transformers ignores these, so do we
            del state["pre_logits.fc.weight"], state["pre_logits.fc.bias"]
            src.notes.append("pooler weights beside a classifier ignored, as transformers does")
    return src


def _read_file(path: Path, fmt: str) -> Source:
    suffix = path.suffix.lower()
    if fmt == "npz" or (fmt == "auto" and suffix == ".npz"):
        arrays = _read_npz(path)
        if npz_prefix(arrays) is None:
            raise CheckpointError(f"{path} has no embedding/kernel: not a ViT .npz checkpoint")
        try:
            state, heads = npz_to_vitlab(arrays)
        except LayoutError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except (ValueError, IndexError) as e:  # transposes and slices of arrays of other ranks
            raise CheckpointError(f"{path}: arrays of shapes no ViT has ({e})") from None
        src = Source(state, "npz", str(path), hints={"num_heads": heads, "act": "gelu_tanh"})
        src.preprocessing = dict(mean=HALF, std=HALF, crop_pct=None)
        return src
    if suffix == ".safetensors":
        meta = _safetensors_metadata(path)
        if meta.get("format") == "vitlab" and fmt in ("auto", "vitlab"):
            ckpt = read_metadata(path)
            src = Source(load_weights(path), "vitlab", str(path), config=ckpt.config)
            src.info = ckpt.info
            src.preprocessing, src.classes = ckpt.preprocessing.to_dict(), ckpt.classes
            return src
        return _from_state(load_weights(path), fmt, str(path))
    if suffix in TORCH_SUFFIXES or fmt != "auto":
        return _from_state(_read_torch(path), fmt, str(path))
    raise CheckpointError(
        f"{path}: unknown checkpoint file type {suffix!r}; expected .safetensors, "
        f"{', '.join(TORCH_SUFFIXES)} or .npz"
    )


def _read_folder(folder: Path, fmt: str) -> Source:
    try:  # a vitlab run or checkpoint folder
        weights = resolve_checkpoint(folder)
        if _safetensors_metadata(weights).get("format") == "vitlab":
            return _read_file(weights, fmt)
    except CheckpointError:
        pass
    names = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")
    files = [folder / n for n in names if (folder / n).is_file()]
    if not files:
        files = sorted(
            p for p in folder.iterdir() if p.suffix in (".safetensors", ".npz", *TORCH_SUFFIXES)
        )
    if not files:
        raise CheckpointError(
            f"{folder} holds no weights: expected model.safetensors, pytorch_model.bin, a .npz, "
            "or a vitlab run / checkpoint folder"
        )
    if len(files) > 1 and files[0].name not in names:
        raise CheckpointError(f"{folder} holds several weight files: name one of {files}")
    src = _read_file(files[0], fmt)
    if (folder / "config.json").is_file():
        _hints_from_config(_read_json(folder / "config.json"), src)
    _read_hf_preprocessor(folder / "preprocessor_config.json", src)
    src.where = str(folder)
    return src


_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


def _download(repo: str, revision: str | None) -> Path:
    """A hub repo's snapshot folder in the local Hugging Face cache with config.json,
    preprocessor_config.json and the weights (model.safetensors, else pytorch_model.bin):
    downloaded when online, the cached copy when offline."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{repo} looks like a Hugging Face Hub name, but huggingface_hub is not installed "
            "(pip install huggingface_hub)"
        ) from None

    errors: list[str] = []
    for weights in ("model.safetensors", "pytorch_model.bin"):
        patterns = ["config.json", "preprocessor_config.json", weights]
        for local_only in (False, True):
            try:
                folder = Path(
                    snapshot_download(
                        repo, revision=revision, allow_patterns=patterns,
                        local_files_only=local_only,
                    )
                )  # fmt: skip
            except Exception as e:  # offline, not cached, no such repo or revision
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            if (folder / weights).is_file():
                return folder
            errors.append(f"no {weights} in {folder}")
            break
    from huggingface_hub.constants import HF_HUB_CACHE

    raise CheckpointError(
        f"cannot get {repo} from the Hugging Face Hub (offline, or no such repo; nor is it a "
        f"local file or folder) and it is not in the local cache ({HF_HUB_CACHE}). Download it "
        f"where there is internet (it lands in that cache), or pass a local file or folder. "
        f"Last error: {errors[-1]}"
    )


def read_source(source: str | Path, fmt: str = "auto") -> Source:
    """Read a checkpoint file, folder or hub name into a Source (tensors in vitlab's names)."""
    src = _read_any(source, fmt)
    params = sum(t.numel() for t in src.state.values())
    log.debug("%s: %s format, %d tensors, %d values", src.where, src.format, len(src.state), params)
    return src


def _read_any(source: str | Path, fmt: str) -> Source:
    if fmt not in FORMATS:
        raise CheckpointError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_folder(path, fmt)
    if path.is_file():
        src = _read_file(path, fmt)
        return src
    text = str(source)
    if _HUB_NAME.match(text) and not text.startswith((".", "/")):
        repo, _, revision = text.partition("@")
        src = _read_folder(_download(repo, revision or None), fmt)
        src.where = text
        return src
    raise CheckpointError(f"no file or folder {source}, and it is not a hub name like org/model")


# --- the architecture from the tensors -----------------------------------------------------------


# heads of the paper's widths (Ti, S, B, L, H): every released checkpoint of these widths uses them
_PAPER_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}


def infer_config(src: Source) -> ViTConfig:
    """The ViTConfig that `src`'s tensors were trained with (at their own size and classes)."""
    if src.config is not None:
        return src.config
    s, hints = src.state, dict(src.hints)
    where = src.where

    def need(key: str) -> Tensor:
        if key not in s:
            raise CheckpointError(f"{where}: no {key} tensor, so not a complete ViT checkpoint")
        return s[key]

    d, chans, p, _ = need("patch_embed.proj.weight").shape
    depth = len({k.split(".")[1] for k in s if k.startswith("blocks.")})
    for i in range(depth):
        need(f"blocks.{i}.norm1.weight")
    mlp = need("blocks.0.mlp.fc1.weight").shape[0] if depth else 4 * d
    class_token, distilled = "cls_token" in s, "dist_token" in s
    prefix = int(class_token) + int(distilled)
    fc_norm = "fc_norm.weight" in s
    if not fc_norm:
        need("norm.weight")
    heads = hints.pop("num_heads", None) or _PAPER_HEADS.get(d)
    if heads is None:
        if d % 64:
            raise CheckpointError(
                f"{where}: cannot tell the number of heads of width {d}: pass num_heads="
            )
        heads = d // 64
        log.warning(
            "%s: assuming num_heads=%d (head width 64); pass num_heads= if not", where, heads
        )
    no_embed_class, pos_kind = False, "learned"
    img = hints.pop("img_size", None)
    if "pos_embed.weight" in s:
        rows = s["pos_embed.weight"].shape[1]
        if img is not None:
            h, w = (img, img) if isinstance(img, int) else img
            n = (h // p) * (w // p)
            if rows not in (n, n + prefix):
                raise CheckpointError(
                    f"{where}: position table has {rows} rows; a {h}x{w} image in patches of "
                    f"{p} has {n} (+{prefix} prefix)"
                )
            no_embed_class = rows == n and prefix > 0
        else:
            side = math.isqrt(rows - prefix) if rows > prefix else 0
            if prefix and side * side == rows - prefix:
                n = rows - prefix
            elif math.isqrt(rows) ** 2 == rows:
                n, no_embed_class = rows, prefix > 0
            else:
                raise CheckpointError(
                    f"{where}: position table of {rows} rows fits no square grid: pass img_size="
                )
            img = math.isqrt(n) * p
    else:
        pos_kind = "none"
        if img is None:
            raise CheckpointError(f"{where}: no position table to read the image size from")
    rep = s["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in s else None
    num_classes = s["head.weight"].shape[0] if "head.weight" in s else 0
    pool = hints.pop("pool", None) or ("gap" if fc_norm or not class_token else "token")
    fields = dict(
        img_size=img,
        patch_size=p,
        in_chans=chans,
        num_classes=num_classes,
        embed_dim=d,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp,
        class_token=class_token,
        pool=pool,
        pos_embed=pos_kind,
        representation_size=rep,
        no_embed_class=no_embed_class,
        fc_norm=fc_norm,
        distilled=distilled,
        layer_scale=1e-5 if "blocks.0.ls1.gamma" in s else None,
        qkv_bias="blocks.0.attn.qkv.bias" in s or depth == 0,
    )
    fields.update({k: v for k, v in hints.items() if v is not None})
    try:
        return ViTConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{where}: the tensors describe no valid ViT: {e}") from None


# --- building a model ----------------------------------------------------------------------------

_AFTER_LOADING = ("img_size", "num_classes", "in_chans")


def _adapt_in_chans(weight: Tensor, chans: int, where: str) -> Tensor:
    """Patch kernels (D, C, P, P) for another channel count: RGB -> grey sums the colours; grey ->
    C repeats it, scaled by 1/C (timm's adapt_input_conv)."""
    have = weight.shape[1]
    if chans == have:
        return weight
    if chans == 1:
        return weight.sum(dim=1, keepdim=True)
    if have == 1:
        return weight.repeat(1, chans, 1, 1) / chans
    raise CheckpointError(f"{where}: cannot adapt {have}-channel patch kernels to {chans} channels")


def _preprocessing(src: Source, cfg: ViTConfig) -> Preprocessing:
    pre = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic", crop_pct=0.9)
    pre.update(src.preprocessing)
    pre.pop("img_size", None), pre.pop("in_chans", None)
    mean, std = tuple(pre.pop("mean")), tuple(pre.pop("std"))
    if len(mean) != cfg.in_chans:  # channels adapted: one statistic per channel
        mean = (sum(mean) / len(mean),) * cfg.in_chans
        std = (sum(std) / len(std),) * cfg.in_chans
    return Preprocessing(cfg.img_hw, cfg.in_chans, mean, std, **pre)


def load_checkpoint(
    source: str | Path | Source,
    format: str = "auto",
    device: str | torch.device = "cpu",
    **overrides: Any,
) -> tuple[VisionTransformer, CheckpointMeta]:
    """A model with the weights of `source` (a file, a folder, a vitlab run or a hub name, in any
    format vitlab reads, or a Source read_source made) and its CheckpointMeta (config,
    preprocessing, class names, info).

    `overrides` are ViTConfig fields: img_size resamples the position embeddings, num_classes
    replaces the head(s) with zero-initialised ones, in_chans adapts the patch kernels; any other
    field (dropout, drop_path, num_heads, ...) is set before the weights are loaded, and a field
    the weights cannot take (another width ...) fails naming the tensors."""
    src = source if isinstance(source, Source) else read_source(source, format)
    check_keys(ViTConfig, overrides.keys())
    before = {k: v for k, v in overrides.items() if k not in _AFTER_LOADING}
    src.hints.update(before)  # e.g. num_heads, which no tensor shape tells
    native = infer_config(src)
    try:
        cfg = native.replace(**before)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{src.where}: overrides {before} do not fit: {e}") from None
    state = dict(src.state)
    if "in_chans" in overrides:
        chans = int(overrides["in_chans"])
        first = "patch_embed.stem.0.weight" if cfg.stem == "conv" else "patch_embed.proj.weight"
        state[first] = _adapt_in_chans(state[first], chans, src.where)
        cfg = cfg.replace(in_chans=chans)
    model = VisionTransformer(cfg)
    load_state_strict(model, state, src.where)
    if "img_size" in overrides:
        model.set_image_size(overrides["img_size"])
    classes = src.classes if src.classes and len(src.classes) == cfg.num_classes else None
    classes = classes or [str(i) for i in range(cfg.num_classes)]
    if "num_classes" in overrides and overrides["num_classes"] != cfg.num_classes:
        model.reset_classifier(int(overrides["num_classes"]))
        classes = [str(i) for i in range(model.config.num_classes)]
    pre = _preprocessing(src, model.config)
    model.preprocessing = pre
    model.classes = classes
    for note in src.notes:
        log.warning("%s: %s", src.where, note)
    info = dict(src.info)  # a vitlab checkpoint keeps its training info
    if src.format != "vitlab":
        name = src.where if isinstance(source, Source) else str(source)
        info.update(source=name, source_format=src.format, notes=src.notes)
    return model.to(device).eval(), CheckpointMeta(model.config, pre, classes, info)


def load_pretrained(
    source: str | Path, format: str = "auto", **overrides: Any
) -> VisionTransformer:
    """A VisionTransformer with the weights of `source`: a timm, Hugging Face, torchvision, Google
    .npz or vitlab checkpoint (file or folder), or a hub name such as
    `timm/vit_base_patch16_224.augreg2_in21k_ft_in1k` or `google/vit-base-patch16-224`. The format
    is detected (or named with `format=`); the architecture is read from the weights; overrides
    (num_classes, img_size, in_chans, dropout, ...) as in load_checkpoint. The model carries
    `.preprocessing` (what its inputs need) and `.classes`."""
    model, _ = load_checkpoint(source, format=format, **overrides)
    return model


# --- writing other layouts -----------------------------------------------------------------------

# (width, heads) -> timm's family name, and the entry points timm registers for the paper's sizes
# (tests check each against timm.list_models()). The name only picks timm's entry point: every
# size, the image size included, is in model_args, so any other shape is built from
# vit_base_patch16_224 (or the DeiT distilled one).
_TIMM_FAMILIES = {
    (192, 3): "vit_tiny",
    (384, 6): "vit_small",
    (768, 12): "vit_base",
    (1024, 16): "vit_large",
    (1280, 16): "vit_huge",
}
_TIMM_REGISTERED = frozenset(
    ["vit_tiny_patch16_224", "vit_tiny_patch16_384", "vit_small_patch8_224"]
    + [f"vit_{s}_patch{p}_{r}" for s in ("small", "base", "large") for p in (16, 32)
       for r in (224, 384)]
    + ["vit_base_patch8_224", "vit_large_patch14_224", "vit_huge_patch14_224"]
)  # fmt: skip


def timm_arch(cfg: ViTConfig) -> str:
    """The registered timm name closest to `cfg`: its family, patch and resolution when timm has
    that entry point, else the family's at 224, else vit_base_patch16_224."""
    family = _TIMM_FAMILIES.get((cfg.embed_dim, cfg.num_heads))
    h, w = cfg.img_hw
    for name in (f"{family}_patch{cfg.patch_size}_{h}", f"{family}_patch{cfg.patch_size}_224"):
        if family and h == w and name in _TIMM_REGISTERED:
            return name
    return "vit_base_patch16_224"


def timm_mlp_ratio(dim: int, mlp_dim: int) -> float:
    """An mlp_ratio from which timm builds exactly `mlp_dim` hidden units: timm takes
    int(dim * mlp_ratio), and mlp_dim / dim can land just below mlp_dim (448 * (488 / 448) is
    487.99...), so the ratio of mlp_dim + 0.5 is taken then."""
    for ratio in (mlp_dim / dim, (mlp_dim + 0.5) / dim):
        if int(dim * ratio) == mlp_dim:
            return ratio
    raise CheckpointError(f"no mlp_ratio gives timm an MLP of {mlp_dim} at width {dim}")


def timm_model_args(cfg: ViTConfig) -> tuple[str, dict[str, Any]]:
    """(timm architecture name, model_args) that build `cfg` with timm.create_model."""
    why = []
    if cfg.stem != "patch":
        why.append(f"stem={cfg.stem!r} (timm's ViT patchifies with one conv)")
    if cfg.pos_embed != "learned":
        why.append(f"pos_embed={cfg.pos_embed!r} (timm's ViT has learned tables only)")
    if cfg.representation_size:
        why.append("a pre-logits layer (timm's ViT has none)")
    if cfg.norm_eps != 1e-6:
        why.append(f"norm_eps={cfg.norm_eps} (timm's ViT uses 1e-6)")
    if why:
        raise CheckpointError("cannot write timm's layout: " + "; ".join(why))
    h, w = cfg.img_hw
    args: dict[str, Any] = dict(
        img_size=[h, w],
        patch_size=cfg.patch_size,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.embed_dim,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=timm_mlp_ratio(cfg.embed_dim, cfg.mlp_dim),
        qkv_bias=cfg.qkv_bias,
    )
    if cfg.distilled:
        return "deit_base_distilled_patch16_224", args
    args.update(
        class_token=cfg.class_token,
        global_pool="avg" if cfg.pool == "gap" else "token",
        fc_norm=cfg.fc_norm,
        no_embed_class=cfg.no_embed_class,
    )
    if cfg.layer_scale is not None:
        args["init_values"] = cfg.layer_scale
    if cfg.act == "gelu_tanh":
        args["act_layer"] = "gelu_tanh"
    return timm_arch(cfg), args


def save_timm(model: VisionTransformer, dst: Path, classes: list[str] | None = None) -> list[Path]:
    """timm's layout: DST.safetensors alone, or a folder with model.safetensors and a timm
    config.json (architecture, model_args, pretrained_cfg), which timm.create_model loads as
    `local-dir:DST`, and which the hub serves for `timm/...` names."""
    arch, args = timm_model_args(model.config)
    state = vitlab_to_timm(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    )
    dst = Path(dst)
    if dst.suffix == ".safetensors":
        _write_safetensors(dst, state, {"format": "pt"})
        return [dst]
    pre = model.preprocessing or _default_pre(model.config)
    cfg = model.config
    pretrained_cfg = {
        "input_size": [cfg.in_chans, *cfg.img_hw],
        "interpolation": pre.interpolation,
        "crop_pct": pre.crop_pct if pre.crop_pct is not None else 1.0,
        "crop_mode": "center" if pre.crop_pct is not None else "squash",
        "mean": list(pre.mean),
        "std": list(pre.std),
        "num_classes": cfg.num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": ["head", "head_dist"] if cfg.distilled else "head",
    }
    config = {
        "architecture": arch,
        "num_classes": cfg.num_classes,
        "num_features": cfg.embed_dim,
        "global_pool": args.get("global_pool", "token"),
        "model_args": args,
        "pretrained_cfg": pretrained_cfg,
    }
    if classes:
        config["label_names"] = list(classes)
    _write_safetensors(dst / WEIGHTS, state, {"format": "pt"})
    _write_text(dst / "config.json", json.dumps(config, indent=2))
    return [dst / WEIGHTS, dst / "config.json"]


def hf_config(cfg: ViTConfig, classes: list[str] | None) -> tuple[dict[str, Any], bool]:
    """(transformers ViTConfig dict, whether the model has a classifier) for `cfg`."""
    why = []
    for bad, text in (
        (not cfg.class_token or cfg.pool != "token", "pooling other than the class token"),
        (cfg.pos_embed != "learned" or cfg.no_embed_class, "position tables other than learned"),
        (cfg.fc_norm, "fc_norm"),
        (cfg.stem != "patch", "a conv stem"),
        (cfg.distilled, "a distillation token (transformers has DeiT models for that)"),
        (cfg.layer_scale is not None, "layer scale"),
        (
            cfg.representation_size not in (None, cfg.embed_dim)
            or (cfg.representation_size and cfg.num_classes),
            "a pre-logits layer beside a classifier (ViTForImageClassification has no pooler)",
        ),
    ):
        if bad:
            why.append(text)
    if why:
        raise CheckpointError("cannot write Hugging Face ViT's layout: " + "; ".join(why))
    with_classifier = cfg.num_classes > 0
    h, w = cfg.img_hw
    names = classes or [str(i) for i in range(cfg.num_classes)]
    out = {
        "architectures": ["ViTForImageClassification" if with_classifier else "ViTModel"],
        "model_type": "vit",
        "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu" if cfg.act == "gelu" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": cfg.norm_eps,
        "image_size": h if h == w else [h, w],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans,
        "qkv_bias": cfg.qkv_bias,
        "encoder_stride": cfg.patch_size,
        "pooler_output_size": cfg.embed_dim,
        "pooler_act": "tanh",
    }
    if with_classifier:
        out["id2label"] = {str(i): n for i, n in enumerate(names)}
        out["label2id"] = {n: i for i, n in enumerate(names)}
    return out, with_classifier


def save_hf(model: VisionTransformer, dst: Path, classes: list[str] | None = None) -> list[Path]:
    """transformers' layout in folder DST: model.safetensors (hub names), config.json and
    preprocessor_config.json, which ViTForImageClassification.from_pretrained (or ViTModel,
    for a model without classifier) loads."""
    config, with_classifier = hf_config(model.config, classes)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    state = vitlab_to_hf(state, with_classifier)
    pre = model.preprocessing or _default_pre(model.config)
    h, w = model.config.img_hw
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": h, "width": w},
        "resample": {"nearest": 0, "bilinear": 2, "bicubic": 3}[pre.interpolation],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(pre.mean),
        "image_std": list(pre.std),
    }
    dst = Path(dst)
    _write_safetensors(dst / WEIGHTS, state, {"format": "pt"})
    _write_text(dst / "config.json", json.dumps(config, indent=2))
    _write_text(dst / "preprocessor_config.json", json.dumps(processor, indent=2))
    return [dst / WEIGHTS, dst / "config.json", dst / "preprocessor_config.json"]


def save_vitlab(model: VisionTransformer, dst: Path, meta: CheckpointMeta) -> list[Path]:
    """vitlab's layout: DST.safetensors, or DST/model.safetensors (a checkpoint folder)."""
    dst = Path(dst)
    path = dst if dst.suffix == ".safetensors" else dst / WEIGHTS
    write_weights(path, model.state_dict(), meta)
    return [path]


def save_pretrained(
    model: VisionTransformer, dst: str | Path, layout: str = "vitlab"
) -> list[Path]:
    """Write `model` in vitlab's, timm's or Hugging Face's layout (see save_vitlab, save_timm,
    save_hf) with its `.preprocessing` (inputs in [-1, 1] when it has none) and `.classes`.
    Returns the files written."""
    cfg = model.config
    pre = model.preprocessing or _default_pre(cfg)
    classes = model.classes or [str(i) for i in range(cfg.num_classes)]
    if layout == "vitlab":
        return save_vitlab(model, Path(dst), CheckpointMeta(cfg, pre, classes))
    if layout == "timm":
        return save_timm(model, Path(dst), classes)
    if layout == "hf":
        return save_hf(model, Path(dst), classes)
    raise ValueError(f"layout must be vitlab, timm or hf, got {layout!r}")


def _default_pre(cfg: ViTConfig) -> Preprocessing:
    return Preprocessing(cfg.img_hw, cfg.in_chans, (0.5,) * cfg.in_chans, (0.5,) * cfg.in_chans)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    fsync(tmp)
    os.replace(tmp, path)
