"""What a hub folder's config.json states of the architecture, against its weights: vitlab reads
the architecture from the tensors, and a config.json that says otherwise (another depth, width,
patch or class count) describes another model than the weights are; timm and transformers refuse
to load such a folder, or build that other model. Checked where both say it; a ResNet's config,
whose stem and blocks the tensors tell, is not."""

from __future__ import annotations

from typing import Any

from vitlab.formats.base import CheckpointError, Source
from vitlab.formats.families import state_family

# the fields compared: vitlab's name -> (timm model_args' key, transformers' key)
_KEYS = {
    "depth": ("depth", "num_hidden_layers"),
    "depths": ("depths", "depths"),
    "embed_dim": ("embed_dim", "hidden_size"),
    "patch_size": ("patch_size", "patch_size"),
}


def stated(config: dict[str, Any], hf: bool) -> dict[str, Any]:
    """The architecture fields config.json states (transformers' when `hf`, else timm's)."""
    args = config if hf else dict(config.get("model_args") or {})
    out = {name: args[keys[hf]] for name, keys in _KEYS.items() if keys[hf] in args}
    if hf and "swin" in str(config.get("model_type")):  # a Swin's width is embed_dim
        out.pop("embed_dim", None)
        if "embed_dim" in config:
            out["embed_dim"] = config["embed_dim"]
    # timm's top-level num_classes is the weights' (model_args' says what to build, and may differ)
    classes = config.get("id2label") if hf else config.get("num_classes", args.get("num_classes"))
    if classes is not None:
        out["num_classes"] = len(classes) if isinstance(classes, dict) else classes
    return out


def in_weights(src: Source) -> dict[str, Any]:
    """The same fields as the tensors give them (a hybrid's patch is its stem's: not compared)."""
    s, family = src.state, state_family(src.state)
    out: dict[str, Any] = {}
    proj = s.get("patch_embed.proj.weight")
    if proj is not None and proj.ndim == 4:
        out["embed_dim"] = proj.shape[0]
        if not any(k.startswith("patch_embed.backbone.") for k in s):
            out["patch_size"] = proj.shape[-1]
    if family == "swin":
        stages = {int(k.split(".")[1]) for k in s if k.startswith("layers.") and ".blocks." in k}
        out["depths"] = [len({k.split(".")[3] for k in s if k.startswith(f"layers.{i}.blocks.")})
                         for i in sorted(stages)]  # fmt: skip
    else:
        out["depth"] = len({k.split(".")[1] for k in s if k.startswith("blocks.")})
    head = s.get("head.weight", s.get("head.fc.weight"))  # a ViT's, a Swin's
    if head is not None:
        out["num_classes"] = head.shape[0]
    return out


# a config's model name's start -> the family vitlab reads its weights as (a hybrid is a ViT)
_FAMILIES = (("swin", "swin"), ("resnet", "cnn"), ("vit", "vit"), ("deit", "vit"))


def named_family(config: dict[str, Any], hf: bool) -> tuple[str, str] | None:
    """(the model config.json names, its family), where its name tells one."""
    name = str(config.get("model_type" if hf else "architecture") or config.get("model_type") or "")
    family = next((f for start, f in _FAMILIES if name.lower().startswith(start)), None)
    return (name, family) if family else None


def check_family(config: dict[str, Any], src: Source, hf: bool) -> None:
    """A CheckpointError where config.json names a model of another family than the weights' (a
    Swin's config over a ViT's tensors), before its fields are read as hints."""
    named, family = named_family(config, hf), state_family(src.state)
    if named and named[1] != family:
        raise CheckpointError(f"{src.where}: config.json describes another model than its weights: "
                              f"{named[0]}, a {named[1]} (the weights: a {family})")  # fmt: skip


def check(config: dict[str, Any], src: Source, hf: bool) -> None:
    """A CheckpointError naming each field config.json states otherwise than the weights."""
    if state_family(src.state) == "cnn":
        return
    said, found = stated(config, hf), in_weights(src)
    wrong = [f"{k}={said[k]} (the weights: {found[k]})" for k in said
             if k in found and _plain(said[k]) != _plain(found[k])]  # fmt: skip
    if wrong:
        raise CheckpointError(f"{src.where}: config.json describes another model than its weights: "
                              f"{'; '.join(wrong)}")  # fmt: skip


def _plain(value: Any) -> Any:
    """A JSON value as compared: lists (and tuples) alike, a pair of equal sides as one side."""
    if isinstance(value, list | tuple):
        value = [_plain(v) for v in value]
        return value[0] if len(value) == 2 and value[0] == value[1] and value[0] != 0 else value
    return value
