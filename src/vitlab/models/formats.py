"""Key layouts of the ViT checkpoints people bring (VIT_REFERENCE.md §10), mapped to and from
vitlab's own names. Each `*_to_vitlab` takes a flat {name: tensor} dict in that library's layout
and returns one in vitlab's names (timm's, with `pos_embed.weight`); each `vitlab_to_*` is the
inverse. Nothing here guesses an architecture: that is `checkpoint.infer_config`'s job.

Conventions: Linear weights are (out, in) as in PyTorch; Flax kernels are (in, out) and are
transposed here; a fused qkv weight is (3 D, D) with rows q, k, v.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

StateDict = dict[str, Tensor]


class LayoutError(ValueError):
    """A tensor that has no place in the layout being read or written."""


def _unknown(keys: list[str], layout: str) -> LayoutError:
    shown = ", ".join(sorted(keys)[:8]) + (" ..." if len(keys) > 8 else "")
    return LayoutError(f"{len(keys)} tensor(s) have no place in a vitlab ViT ({layout}): {shown}")


def _rename(state: Mapping[str, Tensor], rules: list[tuple[str, str]], layout: str) -> StateDict:
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
        raise _unknown(left, layout)
    return out


# --- timm ----------------------------------------------------------------------------------------

# vitlab's names are timm's, except the learned position table, which is a module here
_TIMM_SAME = (
    r"patch_embed\.proj\.(weight|bias)|cls_token|dist_token|norm\.(weight|bias)"
    r"|fc_norm\.(weight|bias)|head\.(weight|bias)|head_dist\.(weight|bias)"
    r"|pre_logits\.fc\.(weight|bias)"
    r"|blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
    r"|blocks\.\d+\.ls[12]\.gamma"
)


def timm_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    return _rename(state, [("pos_embed", "pos_embed.weight"), (f"({_TIMM_SAME})", r"\1")], "timm")


def vitlab_to_timm(state: Mapping[str, Tensor]) -> StateDict:
    return _rename(state, [(r"pos_embed\.weight", "pos_embed"), (f"({_TIMM_SAME})", r"\1")], "timm")


# --- Hugging Face transformers -------------------------------------------------------------------

_HF_RULES = [  # (transformers' hub / save_pretrained name, vitlab name)
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.position_embeddings", "pos_embed.weight"),
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"encoder\.layer\.(\d+)\.layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"encoder\.layer\.(\d+)\.layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
    (r"pooler\.dense\.(weight|bias)", r"pre_logits.fc.\1"),
    (r"classifier\.(weight|bias)", r"head.\1"),
]
_HF5_RULES = [  # transformers 5's in-memory names for the same modules
    (r"layers\.(\d+)\.layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"layers\.(\d+)\.attention\.o_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"layers\.(\d+)\.layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"layers\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.mlp.\2.\3"),
]
_HF_QKV = re.compile(
    r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.(query|key|value)|(q|k|v)_proj)"
    r"\.(weight|bias)$"
)


def hf_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    """ViTModel or ViTForImageClassification weights (with or without the `vit.` prefix, in the
    hub names or transformers 5's in-memory names) -> vitlab; query/key/value are fused."""
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    rest = {}
    for key, value in state.items():
        key = key.removeprefix("vit.")
        m = _HF_QKV.match(key)
        if m:
            layer, long, short, kind = m.groups()
            parts.setdefault((int(layer), kind), {})[(long or short)[0]] = value
        else:
            rest[key] = value
    out = _rename(rest, _HF_RULES + _HF5_RULES, "Hugging Face ViT")
    for (layer, kind), qkv in parts.items():
        if set(qkv) != {"q", "k", "v"}:
            raise LayoutError(f"layer {layer} has {kind}s for {sorted(qkv)} of query/key/value")
        out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    return out


def vitlab_to_hf(state: Mapping[str, Tensor], with_classifier: bool) -> StateDict:
    """vitlab -> the hub layout of ViTForImageClassification (`vit.` prefix, `classifier`), or of
    ViTModel when not `with_classifier`."""
    out = {}
    prefix = "vit." if with_classifier else ""
    for key, value in state.items():
        m = re.match(r"^blocks\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)$", key)
        if m:
            i, part, kind = m.groups()
            layer = f"{prefix}encoder.layer.{i}"
            if part == "attn.qkv":
                for name, chunk in zip(("query", "key", "value"), value.chunk(3)):
                    out[f"{layer}.attention.attention.{name}.{kind}"] = chunk.clone()
                continue
            names = {
                "norm1": "layernorm_before",
                "attn.proj": "attention.output.dense",
                "norm2": "layernorm_after",
                "mlp.fc1": "intermediate.dense",
                "mlp.fc2": "output.dense",
            }
            if part not in names:
                raise _unknown([key], "Hugging Face ViT")
            out[f"{layer}.{names[part]}.{kind}"] = value
            continue
        simple = {
            "cls_token": "embeddings.cls_token",
            "pos_embed.weight": "embeddings.position_embeddings",
            "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
            "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias",
            "norm.weight": "layernorm.weight",
            "norm.bias": "layernorm.bias",
            "pre_logits.fc.weight": "pooler.dense.weight",
            "pre_logits.fc.bias": "pooler.dense.bias",
        }
        if key in simple:
            out[prefix + simple[key]] = value
        elif key in ("head.weight", "head.bias") and with_classifier:
            out["classifier." + key.split(".")[1]] = value
        else:
            raise _unknown([key], "Hugging Face ViT")
    return out


# --- torchvision ---------------------------------------------------------------------------------

_TV_RULES = [
    (r"conv_proj\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"class_token", "cls_token"),
    (r"encoder\.pos_embedding", "pos_embed.weight"),
    (r"encoder\.layers\.encoder_layer_(\d+)\.ln_1\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (
        r"encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_(weight|bias)",
        r"blocks.\1.attn.qkv.\2",
    ),
    (
        r"encoder\.layers\.encoder_layer_(\d+)\.self_attention\.out_proj\.(weight|bias)",
        r"blocks.\1.attn.proj.\2",
    ),
    (r"encoder\.layers\.encoder_layer_(\d+)\.ln_2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (
        r"encoder\.layers\.encoder_layer_(\d+)\.mlp\.(?:0|linear_1)\.(weight|bias)",
        r"blocks.\1.mlp.fc1.\2",
    ),
    (
        r"encoder\.layers\.encoder_layer_(\d+)\.mlp\.(?:3|linear_2)\.(weight|bias)",
        r"blocks.\1.mlp.fc2.\2",
    ),
    (r"encoder\.ln\.(weight|bias)", r"norm.\1"),
    (r"heads\.pre_logits\.(weight|bias)", r"pre_logits.fc.\1"),
    (r"heads\.head\.(weight|bias)", r"head.\1"),
]


def torchvision_to_vitlab(state: Mapping[str, Tensor]) -> StateDict:
    return _rename(state, _TV_RULES, "torchvision vit_*")


# --- Google .npz ---------------------------------------------------------------------------------

_NPZ_PREFIXES = ("params/img/", "params/", "opt/target/", "")


def npz_prefix(arrays: Mapping[str, np.ndarray]) -> str | None:
    """The key prefix under which an npz holds a ViT (None: no patch embedding found)."""
    for prefix in _NPZ_PREFIXES:
        if f"{prefix}embedding/kernel" in arrays:
            return prefix
    return None


def npz_to_vitlab(arrays: Mapping[str, np.ndarray]) -> tuple[StateDict, int]:
    """Google's .npz (the released naming, or Flax linen / big_vision's, with blocks numbered or
    stacked on a leading depth axis) -> (vitlab state, number of heads)."""
    prefix = npz_prefix(arrays)
    if prefix is None:
        raise LayoutError("no embedding/kernel: not a ViT .npz checkpoint")
    w = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    outside = [k for k in arrays if not k.startswith(prefix)]
    used: set[str] = set()

    def take(key: str, index: int | None = None) -> np.ndarray:
        if key not in w:
            raise LayoutError(f"the .npz has no {prefix}{key}")
        used.add(key)
        value = w[key]
        return value if index is None else value[index]

    def t(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).float()

    out: StateDict = {}
    out["patch_embed.proj.weight"] = t(take("embedding/kernel").transpose(3, 2, 0, 1))
    out["patch_embed.proj.bias"] = t(take("embedding/bias"))
    if "cls" in w:
        out["cls_token"] = t(take("cls"))
    for pos_key in ("Transformer/posembed_input/pos_embedding", "pos_embedding"):
        if pos_key in w:
            pos = take(pos_key)
            out["pos_embed.weight"] = t(pos if pos.ndim == 3 else pos[None])
            break

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
        base, idx = (
            ("Transformer/encoderblock/", i)
            if stacked
            else (f"Transformer/encoderblock_{i}/", None)
        )
        b = f"blocks.{i}."

        def get(name: str, base: str = base, idx: int | None = idx) -> np.ndarray:
            return take(base + name, idx)

        for ours, theirs in (("norm1", ln1), ("norm2", ln2)):
            out[b + ours + ".weight"] = t(get(f"{theirs}/scale"))
            out[b + ours + ".bias"] = t(get(f"{theirs}/bias"))
        q, k, v = (get(f"{mha}/{n}/kernel") for n in ("query", "key", "value"))  # (D, H, d)
        heads = q.shape[1]
        out[b + "attn.qkv.weight"] = t(
            np.concatenate([a.reshape(a.shape[0], -1).T for a in (q, k, v)])
        )
        out[b + "attn.qkv.bias"] = t(
            np.concatenate([get(f"{mha}/{n}/bias").reshape(-1) for n in ("query", "key", "value")])
        )
        o = get(f"{mha}/out/kernel")  # (H, d, D)
        out[b + "attn.proj.weight"] = t(o.reshape(-1, o.shape[-1]).T)
        out[b + "attn.proj.bias"] = t(get(f"{mha}/out/bias"))
        for r in (0, 1):
            out[b + f"mlp.fc{r + 1}.weight"] = t(get(f"{mlp}/Dense_{r}/kernel").T)
            out[b + f"mlp.fc{r + 1}.bias"] = t(get(f"{mlp}/Dense_{r}/bias"))

    out["norm.weight"] = t(take("Transformer/encoder_norm/scale"))
    out["norm.bias"] = t(take("Transformer/encoder_norm/bias"))
    for theirs, ours in (("pre_logits", "pre_logits.fc"), ("head", "head")):
        if f"{theirs}/kernel" in w:
            out[ours + ".weight"] = t(take(f"{theirs}/kernel").T)
            out[ours + ".bias"] = t(take(f"{theirs}/bias"))
    left = [prefix + k for k in w if k not in used] + outside
    if left:
        raise _unknown(left, "Google .npz")
    return out, heads


LAYOUT_READERS: dict[str, Callable[[Mapping[str, Tensor]], StateDict]] = {
    "timm": timm_to_vitlab,
    "hf": hf_to_vitlab,
    "torchvision": torchvision_to_vitlab,
}
