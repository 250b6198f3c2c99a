"""`vitlab convert`: read a ViT, Swin or ResNet checkpoint in any known format, write it in
vitlab's, timm's or Hugging Face's (a torchvision ResNet: vitlab's or torchvision's; BiT's
ResNet-v2: vitlab's or timm's)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from vitlab import formats
from vitlab.runtime import folder_refusal

if TYPE_CHECKING:
    from vitlab.models.swin import SwinConfig
    from vitlab.models.vit import ViTConfig

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert ViT, Swin and ResNet checkpoints between vitlab, timm, Hugging Face, "
        "torchvision and .npz",
        description="Read SRC (a file, a folder, a vitlab run, or a Hugging Face Hub name such "
        "as timm/vit_base_patch16_224.augreg2_in21k_ft_in1k or google/vit-base-patch16-224) and "
        "write DST as safetensors. --to vitlab: DST.safetensors or DST/model.safetensors with the "
        "config, preprocessing and class names in its metadata (eval, predict, analyze and "
        "finetune.from take it). --to timm: DST.safetensors, or a folder with a timm config.json "
        "(timm.create_model('local-dir:DST', pretrained=True)). --to hf: a folder with "
        "config.json and preprocessor_config.json (ViTForImageClassification or "
        "SwinForImageClassification.from_pretrained; a Swin only where its windows tile every "
        "stage's map). --to torchvision (ResNets only): a plain state dict, DST.pth or "
        "DST.safetensors, that torchvision.models.resnet18/34/50 load; those ResNets are not "
        "written as timm or hf. BiT's resnetv2_50 is written --to timm (timm's ResNetV2 names; "
        "timm builds it given conv_layer=partial(StdConv2dSame, eps=1e-8)), never --to "
        "torchvision or hf. KEY=VALUE overrides change the model on the way: num_classes (new zero "
        "head), img_size (positions resampled), in_chans, num_heads when the weights cannot "
        "tell; a Swin's window_size.",
    )
    p.add_argument("source", metavar="SRC")
    p.add_argument("dest", metavar="DST", type=Path)
    p.add_argument(
        "--from",
        dest="src_format",
        default="auto",
        choices=["auto", *formats.FORMATS],
        help="format of SRC (default: detected)",
    )
    p.add_argument("--to", default="vitlab", choices=formats.WRITABLE, help="format of DST")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing DST file, or the checkpoint in an existing DST folder (its "
        "other weight and config files are removed, so that it holds one model)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="ViTConfig, SwinConfig or CNNConfig fields",
    )
    p.set_defaults(run=run)


def parse_overrides(items: list[str]) -> dict:
    from vitlab.config import ConfigError, given_twice, parse_value

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected an override like num_classes=10, got {item!r}")
        out[key] = parse_value(value, key)
    for said in given_twice(items):  # (after the malformed ones are refused)
        log.warning(said)
    return out


def check_dest(dest: Path, to: str, source: str | None = None, overwrite: bool = False) -> None:
    """A ValueError for a DST named as a file the format does not write (it would become a
    folder of that name), a DST folder where a file is (or a folder above it is one), a DST
    inside a vitlab run's checkpoints (train, eval and --resume read them in vitlab's format), a
    DST that is the local `source`, a file in it (a folder) or the folder holding it (a file;
    a new sub-folder, or a file beside a file, is fine): the conversion would write where it
    reads (an HF folder kept its config.json beside vitlab-named weights); or, unless
    `overwrite`, a DST file that exists or a DST folder that holds files (a model converted
    there before, or another one, was replaced without a word)."""
    formats.check_suffix(dest, to, "--to ")
    file = dest.suffix in formats.FILE_SUFFIXES[to]  # else a folder
    place, what = (dest.parent, dest.name) if file else (dest, "the converted checkpoint")
    if refusal := folder_refusal(place, what):
        raise ValueError(refusal)
    at = dest.resolve()  # as the writers take it (no ~)
    if not file and _is_run(at):  # its checkpoints/best is what reads as the folder's model
        raise ValueError(
            f"{dest} is a vitlab run, which eval, predict and convert read as its checkpoints "
            f"(best, else last, once it has them): a checkpoint written there would not be the "
            f"one read; name another DST"
        )
    for folder in (p for p in (at, *at.parents) if p.name == "checkpoints"):
        if _is_run(folder.parent):
            raise ValueError(
                f"{dest} is inside the checkpoints of the run {folder.parent}, which vitlab "
                f"train, eval and --resume read: write the converted checkpoint elsewhere"
            )
    src = Path(source).expanduser() if source else None
    src = src.resolve() if src is not None and src.exists() else None
    home = None if src is None else src if src.is_dir() else src.parent  # SRC's files' folder
    if src is not None and (at in (src, home) or (file and at.parent == src)):
        raise ValueError(f"{dest} is the source {source}, a file in it or its folder: "
                         f"the conversion would write where it reads (a folder's config beside "
                         f"other weights); name another DST")  # fmt: skip
    held = sorted(p.name for p in dest.iterdir()) if dest.is_dir() and not file else []
    if not overwrite and (held or (file and dest.exists())):
        what = f"holds {', '.join(held[:5])}{' ...' * (len(held) > 5)}" if held else "exists"
        raise ValueError(f"{dest} {what}: pass --overwrite to replace it, or name another DST")


def clear_replaced(dest: Path, written: list[Path]) -> list[Path]:
    """Remove the files of DST folder that a reader takes as (part of) a checkpoint, weights or
    config, and that this conversion did not write: they were the replaced model's (a
    pytorch_model.bin beside new model.safetensors is a second model). Other files stay."""
    from vitlab.formats.base import INDEX, READ_SUFFIXES, SIDECARS

    kept = {Path(p).resolve() for p in written}

    def read(p: Path) -> bool:  # by a reader, as weights or their config or shard index
        name = p.name.lower()
        return p.suffix.lower() in READ_SUFFIXES or name in SIDECARS or name.endswith(INDEX)

    stale = [p for p in sorted(dest.iterdir()) if p.is_file() and read(p)]
    stale = [p for p in stale if p.resolve() not in kept]
    for path in stale:
        path.unlink()
    return stale


def _is_run(folder: Path) -> bool:
    """Whether `folder` holds a vitlab run: a config.yaml vitlab reads as a run config (another
    project's checkpoints/ beside its own config.yaml is not one)."""
    import yaml

    from vitlab.config import ConfigError, load_run_config

    if not (folder / "config.yaml").is_file():
        return False
    try:  # empty or comments only: anyone's notes (a run's states every section), not a run
        if not yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8")):
            return False
        load_run_config(str(folder / "config.yaml"))
    except (ConfigError, ValueError, OSError, yaml.YAMLError):
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from vitlab.models.checkpoint import load_checkpoint
    from vitlab.models.cnn import CNNConfig
    from vitlab.models.registry import shape_of
    from vitlab.models.swin import SwinConfig

    check_dest(args.dest, args.to, args.source, args.overwrite)
    model, meta = load_checkpoint(args.source, args.src_format, **parse_overrides(args.overrides))
    try:
        if args.to == "vitlab":  # keeps where the weights came from in the metadata
            written = formats.get("vitlab").write(model, args.dest, meta.info)
        else:
            written = formats.get(args.to).write(model, args.dest)
    except OSError as e:  # a file where the folder goes, no permission, a full disk
        raise formats.CheckpointError(f"cannot write {args.dest}: {e}") from None
    cfg = model.config
    if isinstance(cfg, CNNConfig):
        shape = f"{shape_of(cfg)}, {cfg.in_chans}-channel images, {cfg.num_classes} classes"
    else:
        shape = _transformer_shape(cfg, isinstance(cfg, SwinConfig))
    read_as = meta.info.get("source_format", "vitlab")
    if meta.info.get("source") != str(args.source) and read_as != "vitlab":  # converted before
        read_as = f"vitlab, converted from {read_as}"
    print(f"read {args.source} ({read_as}): {shape}")
    for path in written:
        print(f"wrote {path}")
    if args.overwrite and args.dest.is_dir():
        for path in clear_replaced(args.dest, written):
            print(f"removed {path} (the replaced checkpoint's)")
    return 0


def _transformer_shape(cfg: ViTConfig | SwinConfig, swin: bool) -> str:
    """A ViT's or Swin's architecture in one line."""
    size = f"patch {cfg.patch_size}, {cfg.img_hw[0]}x{cfg.img_hw[1]}, {cfg.num_classes} classes"
    if swin:
        return (
            f"Swin, blocks {list(cfg.depths)}, width {cfg.embed_dim}, heads "
            f"{list(cfg.num_heads)}, window {'x'.join(map(str, cfg.window_hw))}, {size}"
        )
    return (
        f"{cfg.depth} block{'s' * (cfg.depth != 1)}, width {cfg.embed_dim}, {cfg.num_heads} "
        f"head{'s' * (cfg.num_heads != 1)}, {size}, pool {cfg.pool}"
    )
