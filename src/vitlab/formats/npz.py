"""Google's .npz format (the released vit_jax naming, or Flax linen / big_vision's, with blocks
numbered or stacked on a leading depth axis): Flax kernels are (in, out) and transposed here,
attention kernels are per head. Such weights use tanh GELU and inputs in [-1, 1]. A hybrid's
ResNet (R50+ViT-B_16.npz, the augreg R26 / R50 files) is `conv_root`, `gn_root` and
`block{i}/unit{j}/{conv1,gn1,conv2,gn2,conv3,gn3,conv_proj,gn_proj}` (numbered from 1), its 1x1
projection `embedding`; conv kernels are HWIO. vitlab reads it; it does not write it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from vitlab.formats.base import (
    CheckpointError,
    Files,
    FormatError,
    Source,
    StateDict,
    misnamed,
    unknown,
)
from vitlab.preprocessing import HALF

_PREFIXES = ("params/img/", "params/", "opt/target/", "")


def detect(files: Files) -> bool:
    return files.suffix == ".npz"


def read(files: Files) -> Source:
    path = files.weights
    arrays = read_arrays(path)
    if npz_prefix(arrays) is None:
        raise CheckpointError(f"{path} has no embedding/kernel: not a ViT .npz checkpoint")
    try:
        state, heads = npz_to_vitlab(arrays)
    except FormatError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (ValueError, IndexError) as e:  # transposes and slices of arrays of other ranks
        raise CheckpointError(f"{path}: arrays of shapes no ViT has ({e})") from None
    src = Source(state, "npz", files.where, hints={"num_heads": heads, "act": "gelu_tanh"})
    src.preprocessing = dict(mean=HALF, std=HALF, crop_pct=None)
    # vit_jax's and big_vision's resample_posemb: scipy.ndimage.zoom(order=1), which is bilinear
    # with the corners aligned
    src.pos_resampling = dict(interpolation="bilinear", antialias=False, align_corners=True)
    return src


def write(model: nn.Module, dst: Path) -> list[Path]:
    raise CheckpointError("vitlab does not write Google's .npz format (it writes vitlab, timm, hf)")


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise CheckpointError(f"no such file: {path}") from None
    # numpy never unpickles here (allow_pickle=False), and a damaged zip or .npy header fails in
    # many ways: BadZipFile, zlib.error, NotImplementedError (compression method), RuntimeError
    # (encrypted), SyntaxError / TokenError (header), MemoryError (shape), ...
    except Exception as e:  # numpy calls any file not a zip 'pickled data' and advises loading
        why = f"{path} is truncated or not a numpy .npz of arrays (pickled objects are refused)"
        text = "not a zip archive of .npy arrays" if "allow_pickle" in str(e) else str(e)
        raise CheckpointError(misnamed(path, "npz") or f"{why}: {text}") from None  # it unsafely
    for k, v in arrays.items():  # members not named .npy come back as raw bytes
        if not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
            raise CheckpointError(
                misnamed(path, "npz") or f"{path}: {k} is not an array of numbers"
            )
    return arrays


def npz_prefix(arrays: Mapping[str, np.ndarray]) -> str | None:
    """The key prefix under which an npz holds a ViT (None: no patch embedding found)."""
    for prefix in _PREFIXES:
        if f"{prefix}embedding/kernel" in arrays:
            return prefix
    return None


def _t(a: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).float()


def npz_to_vitlab(arrays: Mapping[str, np.ndarray]) -> tuple[StateDict, int]:
    """Google's arrays -> (vitlab state, number of heads)."""
    prefix = npz_prefix(arrays)
    if prefix is None:
        raise FormatError("no embedding/kernel: not a ViT .npz checkpoint")
    w = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    used: set[str] = set()

    def take(key: str, index: int | None = None) -> np.ndarray:
        if key not in w:
            raise FormatError(f"the .npz has no {prefix}{key}")
        used.add(key)
        return w[key] if index is None else w[key][index]

    out: StateDict = {}
    if "conv_root/kernel" in w:
        _resnet(w, take, out)
    out["patch_embed.proj.weight"] = _t(take("embedding/kernel").transpose(3, 2, 0, 1))
    out["patch_embed.proj.bias"] = _t(take("embedding/bias"))
    if "cls" in w:
        out["cls_token"] = _t(take("cls"))
    for pos_key in ("Transformer/posembed_input/pos_embedding", "pos_embedding"):
        if pos_key in w:
            pos = take(pos_key)
            out["pos_embed.weight"] = _t(pos if pos.ndim == 3 else pos[None])
            break
    heads = _blocks(w, take, out)
    out["norm.weight"] = _t(take("Transformer/encoder_norm/scale"))
    out["norm.bias"] = _t(take("Transformer/encoder_norm/bias"))
    for theirs, ours in (("pre_logits", "pre_logits.fc"), ("head", "head")):
        if f"{theirs}/kernel" in w:
            out[ours + ".weight"] = _t(take(f"{theirs}/kernel").T)
            out[ours + ".bias"] = _t(take(f"{theirs}/bias"))
    left = [prefix + k for k in w if k not in used]
    left += [k for k in arrays if not k.startswith(prefix)]
    if left:
        raise unknown(left, "Google .npz")
    return out, heads


def _resnet(w: Mapping[str, np.ndarray], take: Callable[..., np.ndarray], out: StateDict) -> None:
    """A hybrid's ResNet stem into `out` (timm's names): HWIO kernels to OIHW, GroupNorm scale
    and bias flattened (BiT's files store them (1, 1, 1, C))."""
    b = "patch_embed.backbone."

    def conv(ours: str, theirs: str) -> None:
        out[f"{b}{ours}.weight"] = _t(take(f"{theirs}/kernel").transpose(3, 2, 0, 1))

    def norm(ours: str, theirs: str) -> None:
        for param, name in (("weight", "scale"), ("bias", "bias")):
            out[f"{b}{ours}.{param}"] = _t(take(f"{theirs}/{name}").reshape(-1))

    conv("stem.conv", "conv_root")
    norm("stem.norm", "gn_root")
    units = [re.fullmatch(r"block(\d+)/unit(\d+)/conv1/kernel", k) for k in w]
    for i, j in sorted((int(m[1]), int(m[2])) for m in units if m):
        theirs, ours = f"block{i}/unit{j}/", f"stages.{i - 1}.blocks.{j - 1}."
        for r in (1, 2, 3):
            conv(f"{ours}conv{r}", f"{theirs}conv{r}")
            norm(f"{ours}norm{r}", f"{theirs}gn{r}")
        if f"{theirs}conv_proj/kernel" in w:
            conv(f"{ours}downsample.conv", f"{theirs}conv_proj")
            norm(f"{ours}downsample.norm", f"{theirs}gn_proj")


def _blocks(w: Mapping[str, np.ndarray], take: Callable[..., np.ndarray], out: StateDict) -> int:
    """The encoder blocks into `out`; returns the number of heads (0 for no blocks)."""
    stacked = "Transformer/encoderblock/LayerNorm_0/scale" in w
    linen = stacked or "Transformer/encoderblock_0/MultiHeadDotProductAttention_0/out/bias" in w
    ln1, mha, ln2, mlp = (
        ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
        if linen
        else ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    )
    if stacked:
        depth = w["Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
    else:
        depth = sum(
            1 for k in w if re.fullmatch(r"Transformer/encoderblock_\d+/LayerNorm_0/scale", k)
        )
    heads = 0
    for i in range(depth):
        base, idx = ("Transformer/encoderblock/", i) if stacked else (
            f"Transformer/encoderblock_{i}/", None)  # fmt: skip

        def get(name: str, base: str = base, idx: int | None = idx) -> np.ndarray:
            return take(base + name, idx)

        b = f"blocks.{i}."
        for ours, theirs in (("norm1", ln1), ("norm2", ln2)):
            out[b + ours + ".weight"] = _t(get(f"{theirs}/scale"))
            out[b + ours + ".bias"] = _t(get(f"{theirs}/bias"))
        q, k, v = (get(f"{mha}/{n}/kernel") for n in ("query", "key", "value"))  # (D, H, d)
        heads = q.shape[1]
        out[b + "attn.qkv.weight"] = _t(
            np.concatenate([a.reshape(a.shape[0], -1).T for a in (q, k, v)])
        )
        out[b + "attn.qkv.bias"] = _t(
            np.concatenate([get(f"{mha}/{n}/bias").reshape(-1) for n in ("query", "key", "value")])
        )
        o = get(f"{mha}/out/kernel")  # (H, d, D)
        out[b + "attn.proj.weight"] = _t(o.reshape(-1, o.shape[-1]).T)
        out[b + "attn.proj.bias"] = _t(get(f"{mha}/out/bias"))
        for r in (0, 1):
            out[b + f"mlp.fc{r + 1}.weight"] = _t(get(f"{mlp}/Dense_{r}/kernel").T)
            out[b + f"mlp.fc{r + 1}.bias"] = _t(get(f"{mlp}/Dense_{r}/bias"))
    return heads
