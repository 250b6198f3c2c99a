"""The checkpoint formats vitlab speaks, one module each, listed in one registry (a library's Swin
specifics in a module beside it: timm_swin, hf_swin). Every module has the same interface:

    detect(files: Files) -> bool        do these files hold this format?
    read(files: Files) -> Source        tensors in vitlab's names, architecture hints,
                                        preprocessing, class names
    write(model, dst: Path) -> list[Path]   the model (with its .preprocessing and .classes) in
                                        this format; the files written

A new format is one new module and one line in FORMATS. Detection tries the formats in FORMATS'
order, so a format whose keys are a superset of another's comes first."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from vitlab.formats import hf, npz, stated, timm, torchvision
from vitlab.formats import vitlab as native
from vitlab.formats.base import TORCH_SUFFIXES, CheckpointError, Files, Source

FORMATS: dict[str, ModuleType] = {
    "vitlab": native,
    "npz": npz,
    "timm": timm,
    "hf": hf,
    "torchvision": torchvision,
}
WRITABLE = ("vitlab", "timm", "hf", "torchvision")
# the files each format writes as DST itself (any other DST is a folder)
FILE_SUFFIXES = {"vitlab": (".safetensors",), "timm": (".safetensors",), "hf": (),
                 "torchvision": (".safetensors", *TORCH_SUFFIXES)}  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".onnx", ".pt2", ".json", *TORCH_SUFFIXES)
EXPORTED_NOTE = ": an exported model is no checkpoint (give the run or checkpoint it came from)"

__all__ = ["FORMATS", "WRITABLE", "CheckpointError", "Files", "Source", "detect", "get", "read",
           "write"]  # fmt: skip


def write(name: str, model: object, dst: Path, option: str = "format=") -> list[Path]:
    """Write `model` in format `name` at dst (a file or a folder, as the format writes it); a
    ValueError for a format that writes none, or a dst named as a file of weights the format does
    not write (it would become a folder of that name: `option` names the choice in the message,
    "--to " for `vitlab convert`)."""
    if name not in WRITABLE:
        raise ValueError(f"format must be one of {', '.join(WRITABLE)}, got {name!r}")
    check_suffix(dst, name, option)
    return FORMATS[name].write(model, dst)


def check_suffix(dst: Path, name: str, option: str = "format=") -> None:
    """A ValueError for a dst named as a file of weights format `name` does not write."""
    if dst.suffix.lower() in WEIGHT_SUFFIXES and dst.suffix not in FILE_SUFFIXES[name]:
        files = " or ".join(f"DST{s}" for s in FILE_SUFFIXES[name])
        case = " (in lower case)" * (dst.suffix.lower() in FILE_SUFFIXES[name])
        raise ValueError(f"{option}{name} writes {files + ' or ' if files else ''}a folder DST"
                         f"{case}; {dst} names a {dst.suffix} file")  # fmt: skip


def get(name: str) -> ModuleType:
    """The format module called `name`."""
    if name not in FORMATS:
        raise CheckpointError(f"format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def read(files: Files, name: str) -> Source:
    """`files` read in format `name`, with what a hub folder's config files state applied to
    whatever format its weights are in: config.json (transformers' or timm's) and
    preprocessor_config.json."""
    src = get(name).read(files)
    if timm.CONFIG_KEY in files.metadata():  # the file states its own
        return src
    config = files.json("config.json") if files.folder is not None else None
    if config is not None:
        transformers = hf.is_config(config)  # else timm's
        stated.check_family(config, src, transformers)
        (hf.read_config if transformers else timm.read_config)(config, src)
        stated.check(config, src, transformers)
    processor = files.json("preprocessor_config.json") if files.folder is not None else None
    if processor is not None:
        hf.read_processor(processor, src)
    elif name == "timm" and config is None:  # nothing states the preprocessing
        timm.note_assumed_preprocessing(src)
    return src


def detect(files: Files) -> str:
    """The name of the format `files` hold."""
    for name, module in FORMATS.items():
        if module.detect(files):
            return name
    shown = ", ".join(sorted(files.names())[:6])
    raise CheckpointError(
        f"{files.where}: not a ViT checkpoint (nor a Swin or ResNet one) in a format vitlab knows "
        f"({', '.join(FORMATS)}); first keys: {shown}"
    )
