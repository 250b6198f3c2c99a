"""Strict, typed configuration: dataclasses whose fields are checked against their annotations.

Every config object in vitlab (models' configs, the run's sections) is a dataclass validated by
`validate`: a wrong type or an unknown key is a `ConfigError` naming field, expected and given."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from vitlab.duration import parse_duration

T = TypeVar("T")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.IGNORECASE | re.ASCII)


class ConfigError(ValueError):
    """A configuration value or key that cannot be used."""


def pair(size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of a size given as one side or as a pair (img_size, window_size)."""
    return (size, size) if isinstance(size, int) else (size[0], size[1])


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(_type_name(a) for a in args) + "]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted to `tp`), converting only losslessly (int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin is typing.Literal:
        return value in typing.get_args(tp), value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:  # a string of digits too: YAML 1.1 reads 1e-3 as text; NaN, inf no setting
        if isinstance(value, str) and _NUMBER.fullmatch(value):
            value = float(value)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False, value
        args = typing.get_args(tp)
        elem_types = [args[0]] * len(value) if args[1:] == (Ellipsis,) else list(args)
        if len(elem_types) != len(value):
            return False, value
        out = []
        for v, t in zip(value, elem_types):
            ok, c = _coerce(v, t)
            if not ok:
                return False, value
            out.append(c)
        return True, tuple(out)
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def validate(obj: Any, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check every field of dataclass `obj` against its type hint, converting losslessly; with
    `values` (some fields' values, `obj` its class), check and return those converted instead."""
    in_place, cls = values is None, obj if values is not None else type(obj)
    if in_place:
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    hints, out = typing.get_type_hints(cls), {}
    for name, value in values.items():
        ok, out[name] = _coerce(value, hints[name])
        if not ok:
            raise ConfigError(f"{cls.__name__}.{name}: expected {_type_name(hints[name])}, "
                              f"got {value!r} ({type(value).__name__})")  # fmt: skip
        if in_place and out[name] is not value:
            object.__setattr__(obj, name, out[name])
    return out


def check_keys(cls: type, keys: typing.Iterable[str], where: str | None = None) -> None:
    """Raise ConfigError naming any key that is not a field of dataclass `cls`."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if not isinstance(key, str):
            raise ConfigError(f"keys of {where or cls.__name__} are names, got {key!r}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown key {key!r} for {where or cls.__name__}{hint} "
                f"(valid keys: {', '.join(names)})"
            )


def from_dict(cls: type[T], data: Mapping[str, Any], where: str | None = None) -> T:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
    check_keys(cls, data.keys(), where)
    return cls(**data)


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (tuples as lists), ready for JSON or YAML."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


# --- run configuration (vitlab train): YAML file + dotted key=value overrides --------------------


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it ('0.1', 'true', '[1, 2]', 'null'), else the text."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, dict) and not text.lstrip().startswith("{"):  # imagefolder: (a name)
        return text
    if isinstance(value, str):  # YAML 1.1 reads '1e-3' as a string
        with contextlib.suppress(ValueError):
            return float(value)
    return value


def apply_overrides(tree: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply 'section.key=value' strings to a nested dict (a copy); a malformed item is an error."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in tree.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected an override like optim.lr=0.001, got {item!r}")
        section, dot, field = key.partition(".")
        if not dot or not field or "." in field:
            raise ConfigError(f"override keys are section.key (e.g. train.epochs), got {key!r}")
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {node!r}")
        node[field] = parse_value(value)
    return out


@dataclass
class ModelSection:
    """`model.name` (a registered name or alias) plus any ViTConfig field as an override; the
    registry turns it into a ViTConfig (vitlab.models.registry.config_of), this module knows no
    model."""

    name: str = "vit_nano_patch4_28"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.overrides}


@dataclass
class DataConfig:
    """Dataset and augmentation. Every augmentation is off at 0 / False."""

    # digits | fashion-mnist | cifar10 | cifar100 | imagefolder:PATH | wds:SHARDS | hf:NAME
    name: str = "digits"
    dir: str | None = None  # where the files are (searched first)
    val_fraction: float = 0.1  # carved from train, seeded by split_seed
    split_seed: int = 0
    crop_padding: int = 0  # random crop with this zero padding
    random_resized_crop: bool = False
    crop_scale: tuple[float, float] = (0.08, 1.0)  # random resized crop's area range
    hflip: float = 0.0  # probability of a horizontal flip
    randaugment_ops: int = 0  # RandAugment: ops per image (0: off)
    randaugment_magnitude: int = 9
    random_erasing: float = 0.0  # probability per image
    mixup: float = 0.0  # mixup alpha (0: off)
    cutmix: float = 0.0  # cutmix alpha (0: off)
    normalize: bool = True  # subtract the dataset's mean, divide by its std
    # DataLoader workers for streamed data (files, shards, HF rows); null: this process's share
    # of the cores it may use
    workers: int | None = None
    prefetch: int = 2  # batches each worker prepares ahead
    shuffle_buffer: int = 1000  # wds: samples a shard stream shuffles among
    test: str | None = None  # the test split's dataset, for a source of one split (wds, hf)
    image_key: str | None = None  # hf / wds: the image column or file extension (default: found)
    label_key: str | None = None  # hf / wds: the label column or file extension (default: found)
    # train on this fraction of the training split only (after the validation carve-out; the
    # same share of every class, seeded by split_seed): the labelled part of a few-label run
    label_fraction: float = 1.0
    # the run's own test evaluation on this seeded share of every class of the test split (quick
    # experiments: vitlab reproduce's short budgets); vitlab eval always takes the whole split
    test_fraction: float = 1.0

    def __post_init__(self) -> None:
        validate(self)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        for name in ("label_fraction", "test_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"data.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("hflip", "random_erasing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"data.{name} is a probability, got {getattr(self, name)}")
        counts = (self.mixup, self.cutmix, self.crop_padding, self.randaugment_ops, self.workers)
        if min(c for c in counts if c is not None) < 0:
            raise ConfigError("data.mixup, cutmix, crop_padding, randaugment_ops, workers are >= 0")
        if self.prefetch < 1 or self.shuffle_buffer < 1:
            raise ConfigError("data.prefetch and data.shuffle_buffer are >= 1")


@dataclass
class OptimConfig:
    """Optimiser, schedule and loss."""

    name: typing.Literal["adamw", "sgd"] = "adamw"
    lr: float = 2e-3  # peak learning rate, reached after warm-up
    weight_decay: float = 0.05  # decoupled; never on biases, norms, positions, class token
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9  # sgd
    schedule: typing.Literal["cosine", "linear", "constant"] = "cosine"
    warmup_epochs: float = 2.0
    min_lr: float = 0.0
    clip_grad: float | None = 1.0  # global gradient norm; null: no clipping
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        validate(self)
        clip = self.clip_grad is None or self.clip_grad >= 0  # below 0: gradients reversed
        if not (self.lr > 0 and self.lr >= self.min_lr >= 0 and clip and 0 <= self.momentum < 1
                and min(self.weight_decay, self.warmup_epochs) >= 0
                and 0 <= self.label_smoothing < 1):  # fmt: skip
            raise ConfigError(f"optim: lr must be > 0, min_lr in [0, lr], clip_grad >= 0 (0, "
                              f"null: none), momentum and label_smoothing in [0, 1), weight_decay "
                              f"and warmup_epochs >= 0; got {self}")  # fmt: skip


@dataclass
class TrainConfig:
    """The loop: length, batch, precision, devices."""

    epochs: int = 40
    batch_size: int = 64  # global batch (split across ranks), before accumulation
    accum_steps: int = 1  # gradient accumulation: optimizer step every N batches
    seed: int = 0
    ema: float | None = None  # decay of an exponential moving average of the weights
    # auto: bf16 autocast on GPUs with bf16 and on CPUs that compute in it (AVX512-BF16 / AMX)
    precision: typing.Literal["auto", "fp32", "bf16"] = "auto"
    compile: bool = False  # torch.compile the model
    grad_checkpointing: bool = False
    # conv weights and images in channels-last (NHWC) memory: faster conv stems and CNNs on CPU
    channels_last: bool = False
    batch_threads: int = 1  # each batch's parts' forward and backward on N threads (CPU)
    strategy: typing.Literal["ddp", "fsdp"] = "ddp"  # under torchrun
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # CPU threads (default: torch's)
    stop_at_epoch: int | None = None  # stop resumably after this epoch (split a run into jobs)
    # end after exactly this many optimizer steps, the schedule spanning them (epochs: the most)
    max_steps: int | None = None
    # classify: labels and cross-entropy; mpp: masked patch prediction, no labels (section mpp)
    objective: typing.Literal["classify", "mpp"] = "classify"
    # a duration (3m, 90s, 1h30m, seconds) the whole command fits in (vitlab.train.budget)
    time_budget: str | float | None = None

    def __post_init__(self) -> None:
        validate(self)
        if self.time_budget is not None:
            if self.max_steps is not None:
                raise ConfigError("train.time_budget plans the steps: leave train.max_steps unset")
            try:
                parse_duration(self.time_budget, "train.time_budget")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        counts = (self.epochs, self.batch_size, self.accum_steps, self.batch_threads)
        unset = min(self.threads or 0, self.stop_at_epoch or 0)  # 0: unset (threads: torch's)
        if min(*counts, 1 if self.max_steps is None else self.max_steps) < 1 or unset < 0:
            names = "batch_threads and max_steps must be >= 1; threads, stop_at_epoch >= 0"
            raise ConfigError(f"train.epochs, batch_size, accum_steps, {names} (0: unset)")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise ConfigError(f"train.ema is a decay in (0, 1), got {self.ema}")


@dataclass
class MPPConfig:
    """Masked patch prediction (paper §4.6, appendix B.1.2), for train.objective=mpp: `corrupt` of
    each image's patch embeddings are corrupted, of those `mask` replaced by a learned [mask]
    embedding, `random` by the embedding of another patch of the batch, the rest left as they are;
    a linear head on each corrupted patch's output token predicts its target."""

    # mean_color: each channel's mean over the patch (in [0, 1] pixel values) quantised to `bits`
    # bits, one class of 2^(bits*channels), cross-entropy; patch_l2: the patch's pixels as the
    # model sees them (normalised by the dataset's mean and std), mean squared error
    target: typing.Literal["mean_color", "patch_l2"] = "mean_color"
    corrupt: float = 0.5  # share of patches corrupted (rounded to whole patches per image)
    mask: float = 0.8  # of the corrupted: replaced by the [mask] embedding
    random: float = 0.1  # of the corrupted: replaced by another patch's embedding
    bits: int = 3

    def __post_init__(self) -> None:
        validate(self)
        if not 0.0 < self.corrupt <= 1.0:
            raise ConfigError(f"mpp.corrupt must be in (0, 1], got {self.corrupt}")
        if min(self.mask, self.random) < 0 or self.mask + self.random > 1.0:
            raise ConfigError(
                f"mpp.mask and mpp.random are shares of the corrupted patches, >= 0 and at most 1 "
                f"together; got {self.mask} and {self.random}"
            )
        if not 1 <= self.bits <= 8:
            raise ConfigError(f"mpp.bits must be in 1..8, got {self.bits}")


@dataclass
class DistillConfig:
    """DeiT's distillation (Touvron et al. 2021) for a student with a distillation token
    (model.distilled=true): its class head learns the labels, its distillation head the teacher's
    predictions on the same (augmented, mixed) batch. A distilled student without a teacher trains
    both heads on the labels (DeiT's "no distillation" control)."""

    teacher: str | None = None  # a vitlab run or checkpoint, or any file / folder / hub name
    # hard: cross-entropy against the teacher's argmax; soft: tau^2 KL to its softened outputs
    type: typing.Literal["hard", "soft"] = "hard"
    alpha: float = 0.5  # loss = (1 - alpha) class head's + alpha distillation head's
    tau: float = 1.0  # soft only: the temperature of both softmaxes

    def __post_init__(self) -> None:
        validate(self)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"distill.alpha must be in [0, 1], got {self.alpha}")
        if not self.tau > 0:
            raise ConfigError(f"distill.tau must be > 0, got {self.tau}")
        if self.type == "soft" and self.teacher is None:
            raise ConfigError("distill.type=soft softens a teacher's outputs: set distill.teacher")
        if self.type == "hard" and self.tau != 1.0:  # hard distillation takes the argmax
            raise ConfigError(f"distill.tau={self.tau} applies to distill.type=soft only")


@dataclass
class FinetuneConfig:
    """Start from another run's or checkpoint's weights (`finetune.from=RUN_OR_CKPT`)."""

    from_: str | None = None


@dataclass
class RunConfig:
    """Everything a training run needs. The defaults are the digits recipe that plain
    `vitlab train` runs (its results are in BENCHMARKS.md)."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    mpp: MPPConfig = dataclasses.field(default_factory=MPPConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

    SECTIONS: typing.ClassVar[dict[str, type]] = {
        "data": DataConfig, "optim": OptimConfig, "train": TrainConfig, "finetune": FinetuneConfig,
        "mpp": MPPConfig, "distill": DistillConfig,
    }  # fmt: skip

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> RunConfig:
        """Build from nested dicts (YAML), refusing unknown sections, keys and wrong types. The
        model section is only checked to be a name plus named overrides: the registry checks the
        rest when it builds the ViTConfig (`vitlab train` does so before loading any data)."""
        known = ["model", *cls.SECTIONS]
        for section, body in tree.items():
            if not isinstance(section, str):
                raise ConfigError(f"config sections are names ({known}), got {section!r}")
            if section not in known:
                close = difflib.get_close_matches(section, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown config section {section!r}{hint} (sections: {known})")
            if body is not None and not isinstance(body, Mapping):
                raise ConfigError(f"config section {section!r} must be a mapping, got {body!r}")
        model_tree = dict(tree.get("model") or {})
        name = model_tree.pop("name", ModelSection.name)
        if not isinstance(name, str):
            raise ConfigError(f"model.name: expected a model name, got {name!r}")
        if bad := [key for key in model_tree if not isinstance(key, str)]:
            raise ConfigError(f"keys of section 'model' are names, got {bad[0]!r}")
        kwargs: dict[str, Any] = {"model": ModelSection(name, model_tree)}
        for section, klass in cls.SECTIONS.items():
            body = {
                (k + "_" if k == "from" else k): v for k, v in (tree.get(section) or {}).items()
            }
            check_keys(klass, body.keys(), where=f"section {section!r}")
            kwargs[section] = klass(**body)
        return cls(**kwargs)

    def to_tree(self) -> dict[str, Any]:
        """Nested plain dicts, as written to config.yaml (round-trips through from_tree)."""
        tree: dict[str, Any] = {"model": self.model.to_dict()}
        for section in self.SECTIONS:
            body = to_dict(getattr(self, section))
            tree[section] = {k.rstrip("_"): v for k, v in body.items()}
        return tree


def load_run_config(path: str | None = None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """A RunConfig from an optional YAML file plus 'section.key=value' overrides."""
    import yaml

    tree: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                # libyaml's where built: Python's scanner is quadratic in nesting (libyaml: 1,000)
                tree = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from None
        # values YAML parses and Python cannot hold (huge integers, a 13th month); deep nesting
        except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    return RunConfig.from_tree(apply_overrides(tree, overrides))
