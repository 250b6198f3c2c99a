"""Loading and saving ViTs, Swins and CNNs in any checkpoint format vitlab speaks (see
vitlab.formats): resolve a source (a file, a folder, a vitlab run or a Hugging Face Hub name) to
its files, read them in their format, infer the architecture from the tensors and what the format
states, build the model, apply overrides and load the weights strictly.

    load_pretrained(source, **overrides) -> VisionTransformer | SwinTransformer | ResNet
    load_checkpoint(source, ...)        -> (model, CheckpointMeta)
    save_pretrained(model, dst, format)  vitlab's, timm's or Hugging Face's format

The family is the tensors' (Swin blocks are `layers.{i}.blocks.{j}`, a ResNet's `layer{i}.{j}`) or
the vitlab metadata's. A ViT's architecture is read from the tensors (width, depth, MLP, patch,
grid, prefix tokens, pooling, pre-logits; a hybrid's ResNet stem in models.hybrid_checkpoint), from
the config a format carries (heads, eps, activation, labels), and from what the format implies
(Google: tanh GELU, inputs in [-1, 1]), in models.vit_checkpoint; a Swin's in
models.swin_checkpoint, a ResNet's in models.cnn_checkpoint. Every tensor must find its place and
every parameter must be filled: anything else is an error with names and shapes.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vitlab import formats, hub
from vitlab.config import ConfigError, check_keys, validate
from vitlab.formats.base import (
    INDEX,
    READ_SUFFIXES,
    SIDECARS,
    TORCH_SUFFIXES,
    CheckpointError,
    Files,
    Source,
)
from vitlab.formats.families import state_family
from vitlab.formats.vitlab import CONFIGS, CheckpointMeta, resolve_checkpoint
from vitlab.models.cnn_checkpoint import infer_cnn_config
from vitlab.models.indices import whole_number
from vitlab.models.pos_embed import Grid, resample_pos_embed
from vitlab.models.registry import Model, ModelConfig, build_model, family_of, other_than_weights
from vitlab.models.swin_checkpoint import infer_swin_config
from vitlab.models.vit_checkpoint import infer_vit_config, read_stated_size
from vitlab.preprocessing import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from vitlab.validation import few

log = logging.getLogger(__name__)


# --- the files a source names --------------------------------------------------------------------

_FOLDER_WEIGHTS = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "open_clip_pytorch_model.bin",
)  # fmt: skip
_SHARD = re.compile(r"(.+)-\d+-of-\d+(\.safetensors|\.bin)$")  # model-00001-of-00004.safetensors


def _files_in(folder: Path, hub_name: str | None = None) -> Files:
    try:  # a vitlab run or checkpoint folder
        weights: Path | None = resolve_checkpoint(folder)
    except CheckpointError:
        weights = None
    if weights is not None:
        try:  # a damaged file is named, not passed over for the folder's other files
            if Files(weights).metadata().get("format") == "vitlab":
                return Files(weights, hub_name=hub_name)
        except CheckpointError as e:
            last = weights.parents[1] / "last" / weights.name
            if weights.parent.name == "best" and last.is_file():
                raise CheckpointError(f"{e}; the run's last checkpoint is {last.parent}") from None
            raise
    found = [folder / n for n in _FOLDER_WEIGHTS if (folder / n).is_file()]
    if not found:
        found = sorted(p for p in folder.iterdir() if p.suffix.lower() in READ_SUFFIXES)
    if not found:
        raise CheckpointError(
            f"{folder} holds no weights: expected model.safetensors, pytorch_model.bin, a .npz, "
            "or a vitlab run / checkpoint folder"
        )
    if len(found) > 1 and found[0].name not in _FOLDER_WEIGHTS:
        raise CheckpointError(f"{folder} holds several weight files: name one of {found}")
    return Files(found[0], folder, hub_name)


def _files(source: str | Path) -> Files:
    path = Path(source).expanduser()
    if path.is_dir():
        return _files_in(path)
    if path.is_file():
        sidecars = any((path.parent / n).is_file() for n in SIDECARS)
        if path.name in _FOLDER_WEIGHTS and sidecars:  # a hub folder's weights, named by file
            files = _files_in(path.parent)
            return files if files.weights == path else Files(path, path.parent)
        shard = _SHARD.match(path.name)
        index = path.with_name(f"{shard[1]}{shard[2]}{INDEX}") if shard else None
        if index is not None and index.is_file():  # one shard named: the whole checkpoint
            return Files(index, path.parent if sidecars else None)
        return Files(path)
    if hub.is_hub_name(str(source)):
        return _files_in(hub.download(str(source)), str(source))
    raise CheckpointError(f"no file or folder {source}, and it is not a hub name like org/model")


def read_source(source: str | Path, format: str = "auto") -> Source:
    """Read a checkpoint file, folder or hub name into a Source (tensors in vitlab's names)."""
    names = ("auto", *formats.FORMATS)  # read when called: a format registered later counts
    if format not in names:
        raise CheckpointError(f"format must be one of {', '.join(names)}, got {format!r}")
    files = _files(source)
    if format == "auto" and files.suffix not in READ_SUFFIXES:
        raise CheckpointError(
            f"{files.weights}: unknown checkpoint file type {files.suffix!r}; expected "
            f".safetensors, {', '.join(TORCH_SUFFIXES)}, .npz or a shard index (*{INDEX})"
            f"{formats.EXPORTED_NOTE * (files.suffix in ('.onnx', '.pt2'))}"  # (vitlab export's)
        )
    src = formats.read(files, formats.detect(files) if format == "auto" else format)
    bad = [k for k, t in src.state.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:  # a damaged file or a diverged run's weights: NaN outputs, evaluated without a word
        log.warning("%s: NaN or infinite values in %d of its %d tensors (%s): the weights are "
                    "damaged or come from a run that diverged, and the outputs will be NaN",
                    src.where, len(bad), len(src.state), few(bad))  # fmt: skip
    return src


# --- the architecture from the tensors -----------------------------------------------------------


def source_family(src: Source) -> str:
    """'vit', 'swin' or 'cnn': the family of the model `src` holds."""
    return family_of(src.config) if src.config is not None else state_family(src.state)


def infer_config(src: Source, img_size: int | tuple[int, int] | None = None) -> ModelConfig:
    """The ViTConfig, SwinConfig or CNNConfig that `src`'s tensors were trained with (at their own
    size and classes). `img_size`, the size the caller means, is taken as a Swin's or a ViT's
    trained size when the source states none and its tables fit it (a ViT's position table of
    that grid: a non-square one cannot be read from the table alone; no guess warned then), and
    as a CNN's when the source states none."""
    if src.config is not None:
        return src.config
    if source_family(src) == "swin":
        return infer_swin_config(src, img_size)
    if source_family(src) == "cnn":
        return infer_cnn_config(src, img_size)
    if src.format == "timm":  # a config.json's size that the table is not of: timm resamples
        read_stated_size(src)
    return infer_vit_config(src, img_size)


def as_stated(src: Source, cfg: ModelConfig) -> ModelConfig:
    """`cfg` (src's inferred config) at the image size its format states where the tables are
    another size's (Source.stated_size: timm builds the model at it, resampling the table)."""
    return cfg if src.stated_size is None else cfg.replace(img_size=src.stated_size)


_AFTER_LOADING = ("img_size", "window_size", "num_classes", "in_chans")
# the kernel that sees the image, by stem (a Swin's is patch_embed.proj); a ResNet's root is
# weight-standardised, so adapted kernels answer a grey image only up to a scale per channel
_FIRST_CONV = {
    "conv": "patch_embed.stem.0.weight",
    "resnet": "patch_embed.backbone.stem.conv.weight",
}


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


def _preprocessing(src: Source, cfg: ModelConfig) -> Preprocessing:
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
) -> tuple[Model, CheckpointMeta]:
    """A model (VisionTransformer, SwinTransformer or ResNet, as the weights are) with the weights
    of `source` (a file, a folder, a vitlab run or a hub name, in any format vitlab reads, or a
    Source read_source made) and its CheckpointMeta (config, preprocessing, class names, info).

    `overrides` are fields of the family's config (ViTConfig, SwinConfig or CNNConfig): img_size
    resamples the position embeddings (a Swin's relative position tables, its windows kept; a
    CNN's is only recorded), a Swin's window_size resamples its tables to the new window,
    num_classes replaces the head(s) with zero-initialised ones, in_chans adapts the patch
    kernels (a CNN's conv1); any other field (dropout, drop_path, num_heads, ...) is set before
    the weights are loaded, and one the weights cannot take (another width, patch size ...)
    fails naming it."""
    src = source if isinstance(source, Source) else read_source(source, format)
    check_keys(CONFIGS[source_family(src)], overrides.keys())
    for key in ("num_classes", "in_chans"):  # applied after loading, not by the config's check
        value = whole_number(overrides.get(key, 1))  # numpy's and 0-d tensors' integers too
        if value is None or value < (key == "in_chans"):
            raise ConfigError(f"{key} must be a whole number >= {int(key == 'in_chans')}, "
                              f"got {overrides[key]!r}")  # fmt: skip
        if key in overrides:
            overrides[key] = value
    overrides = validate(CONFIGS[source_family(src)], overrides)  # img_size="96" named here
    before = {k: v for k, v in overrides.items() if k not in _AFTER_LOADING}
    src.hints.update({k: v for k, v in before.items() if k != "patch_size"})  # e.g. num_heads,
    # which no tensor shape tells (the kernels tell the patch size: another is refused below)
    try:
        native = infer_config(src, overrides.get("img_size"))
    except CheckpointError as e:  # e.g. num_heads=3 at width 256: the override's fault
        raise CheckpointError(f"{e} (with the overrides {before})" if before else str(e)) from None
    if src.stated_size is not None:  # built at the table's size, then resized: as_stated's
        overrides.setdefault("img_size", src.stated_size)  # size, unless another is asked for
    if wrong := other_than_weights(native, before):
        raise CheckpointError(f"{src.where}: {wrong}")
    try:
        cfg = native.replace(**before)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{src.where}: overrides {before} do not fit: {e}") from None
    state = dict(src.state)
    if "in_chans" in overrides:
        chans = int(overrides["in_chans"])
        first = _FIRST_CONV.get(getattr(cfg, "stem", "patch"), "patch_embed.proj.weight")
        first = getattr(cfg, "first_conv", first)  # a CNN's conv1
        state[first] = _adapt_in_chans(state[first], chans, src.where)
        cfg = cfg.replace(in_chans=chans)
    model = build_model(cfg)
    load_state_strict(model, state, src.where)
    resize = {k: overrides[k] for k in ("img_size", "window_size") if k in overrides}
    if resize:  # to the model's own size, when only a Swin's window changes
        if getattr(cfg, "family", "") == "swin":  # its tables as the writing library does
            resize["table_resampling"] = src.table_resampling
        model.set_image_size(resize.pop("img_size", cfg.img_size), **resize)
        if src.pos_resampling:  # a ViT's, from a library that resamples its own way
            _resample_as_written(model, src, cfg.grid)
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


def _resample_as_written(model: Model, src: Source, grid: Grid) -> None:
    """A learned position table resampled from `grid` as the library that wrote it does
    (src.pos_resampling: transformers' and torchvision's ViTs), not timm's way, so that the
    outputs at the new size are that library's."""
    pos = getattr(model, "pos_embed", None)
    if not src.pos_resampling or getattr(pos, "kind", None) != "learned" or pos.grid == grid:
        return
    table = src.state["pos_embed.weight"].to(pos.weight.dtype)  # a bf16 file's: not rounded after
    new = resample_pos_embed(table, pos.grid, grid, pos.num_prefix_tokens, **src.pos_resampling)
    with torch.no_grad():
        pos.weight.copy_(new)


def load_pretrained(source: str | Path, format: str = "auto", **overrides: Any) -> Model:
    """A VisionTransformer, SwinTransformer or ResNet with the weights of `source`: a timm,
    Hugging Face, torchvision, Google .npz or vitlab checkpoint (file or folder), or a hub name as
    `timm/vit_base_patch16_224.augreg2_in21k_ft_in1k`, `google/vit-base-patch16-224` or
    `microsoft/swin-tiny-patch4-window7-224`. The format is detected (or named with `format=`);
    the architecture is read from the weights; overrides (num_classes, img_size, in_chans,
    dropout, ...) as in load_checkpoint. The model carries `.preprocessing` (what its inputs
    need) and `.classes`."""
    model, _ = load_checkpoint(source, format=format, **overrides)
    return model


def load_state_strict(model: torch.nn.Module, state: dict, where: str, load: bool = True) -> None:
    """Load `state` into `model` (`load`; else only check that it fits: a sharded model's whole
    state), or raise naming every missing, unexpected or misshapen tensor."""
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
    if load:
        model.load_state_dict(state)


def save_pretrained(
    model: Model, dst: str | Path, format: str = "vitlab", **deprecated: str
) -> list[Path]:
    """Write `model` (a ViT or a Swin) in vitlab's, timm's or Hugging Face's format
    (vitlab.formats) with its `.preprocessing` (inputs in [-1, 1] when it has none) and
    `.classes`. Returns the files written. Hugging Face's Swin is written only where the windows
    tile every stage's map (see formats.hf_swin). A CNN (ResNet) is written in vitlab's format or
    as torchvision's plain state dict (format="torchvision")."""
    if "layout" in deprecated:  # the name before formats had one name everywhere
        warnings.warn("save_pretrained(layout=) is now format=", DeprecationWarning, stacklevel=2)
        if format != "vitlab":
            raise TypeError("save_pretrained got both format= and layout= (its old name)")
        format = deprecated.pop("layout")
    if deprecated:
        raise TypeError(f"save_pretrained got unexpected arguments {sorted(deprecated)}")
    return formats.write(format, model, Path(dst))  # a DST named as another format's file: no
