"""The run's configuration (`vitlab train`): its sections as typed dataclasses, read from YAML and
dotted key=value overrides. Every config object in vitlab (models' configs, these sections) is a
dataclass checked by vitlab.validation (re-exported here): a wrong type or an unknown key is a
`ConfigError` naming field, expected and given."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitlab.duration import parse_duration
from vitlab.overrides import apply_overrides, given_twice, parse_value, yaml_loader
from vitlab.validation import ConfigError, check_keys, from_dict, pair, shown, to_dict, validate

log = logging.getLogger(__name__)
SEEDS = 1 << 43  # |seed| < 2^43: vitlab's derived 64-bit seeds (seed * 1,000,003 + ...) hold

__all__ = [  # the validation helpers too: every config module imports them from here
    "ConfigError", "DataConfig", "DistillConfig", "FinetuneConfig", "MPPConfig", "ModelSection",
    "OptimConfig", "RunConfig", "TrainConfig", "apply_overrides", "check_keys", "from_dict",
    "given_twice", "load_run_config", "load_saved_config", "pair", "parse_value",
    "read_config_file", "to_dict", "validate",
]  # fmt: skip

# --- run configuration (vitlab train): YAML file + dotted key=value overrides --------------------


@dataclass
class ModelSection:
    """`model.name` (a registered name or alias) plus any ViTConfig field as an override; the
    registry turns it into a ViTConfig (vitlab.models.registry.config_of), this module knows no
    model."""

    name: str = "vit_nano_patch4_28"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    named: bool = dataclasses.field(default=False, compare=False)  # given (may name the default)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.overrides}

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> ModelSection:
        """A config tree's model section (none: the default model), its keys checked to be names."""
        model_tree = dict(tree.get("model") or {})
        name = model_tree.pop("name", cls.name)
        if not isinstance(name, str):
            raise ConfigError(f"model.name: expected a model name, got {shown(name)}")
        if bad := [key for key in model_tree if not isinstance(key, str)]:
            raise ConfigError(f"keys of section 'model' are names, got {bad[0]!r}")
        return cls(name, model_tree, "name" in (tree.get("model") or {}))


def check_rules(section: object, name: str, rules: list[tuple[bool, str, str]]) -> None:
    """A ConfigError listing every (holds, key, rule) of `section` that fails, with its value."""
    broken = [f"{name}.{k} must be {rule}, got {shown(getattr(section, k))}"
              for ok, k, rule in rules if not ok]  # fmt: skip
    if broken:
        raise ConfigError("; ".join(broken))


def at_least(section: object, lows: dict[str, int], unset: tuple = ()) -> list:
    """check_rules' rules that each field in `lows` is None or at least its value (for the keys
    in `unset`, 0 is unset too, which the rule says)."""
    said = {k: " (0: unset)" for k in unset}
    return [((v := getattr(section, k)) is None or v >= low, k, f">= {low}{said.get(k, '')}")
            for k, low in lows.items()]  # fmt: skip


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
        lows = {"mixup": 0, "cutmix": 0, "crop_padding": 0, "workers": 0, "randaugment_ops": 0}
        seed = [(-SEEDS <= self.split_seed < SEEDS, "split_seed", "in -2^43 .. 2^43 - 1")]
        check_rules(
            self, "data", at_least(self, {**lows, "prefetch": 1, "shuffle_buffer": 1}) + seed
        )


@dataclass
class OptimConfig:
    """Optimiser, schedule and loss."""

    name: typing.Literal["adamw", "sgd"] = "adamw"
    lr: float = 2e-3  # peak learning rate, reached after warm-up
    weight_decay: float = 0.05  # adamw: decoupled; sgd: L2 in the gradient; never on biases,
    # norms, positions, class tokens
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
        rules = [
            (self.lr > 0, "lr", "> 0"),
            (self.min_lr >= 0 and (self.lr <= 0 or self.min_lr <= self.lr), "min_lr", "in [0, lr]"),
            (clip, "clip_grad", ">= 0 (0, null: none)"),
            (0 <= self.momentum < 1, "momentum", "in [0, 1)"),
            (all(0 <= b < 1 for b in self.betas), "betas", "in [0, 1) each"),
            (0 <= self.label_smoothing < 1, "label_smoothing", "in [0, 1)"),
            (self.weight_decay >= 0, "weight_decay", ">= 0"),
            (self.warmup_epochs >= 0, "warmup_epochs", ">= 0"),
        ]
        check_rules(self, "optim", rules)


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
        off = self.time_budget  # off, no, false (YAML's booleans), None, none: meant as "no budget"
        if isinstance(off, bool) or isinstance(off, str) and off.strip().lower() in ("none", "off"):
            said = f" (YAML reads {'on, yes, true' if off else 'off, no, false'} as {off})"
            said = said if isinstance(off, bool) else ""
            raise ConfigError(f"train.time_budget is a duration such as 90s, 3m or 1h30m (null "
                              f"or ~: no budget), got {off!r}{said}")  # fmt: skip
        validate(self)
        if self.time_budget is not None:
            if self.max_steps is not None:
                raise ConfigError("train.time_budget plans the steps: leave train.max_steps "
                                  "unset, or turn the budget off (a preset's too) with "
                                  "train.time_budget=null")  # fmt: skip
            try:
                parse_duration(self.time_budget, "train.time_budget")
            except ValueError as e:
                raise ConfigError(f"{e} (null turns the budget off)") from None
        ones = ("epochs", "batch_size", "accum_steps", "max_steps", "batch_threads")
        zeros = ("threads", "stop_at_epoch")  # 0: torch's threads, no stop
        lows = {**dict.fromkeys(ones, 1), **dict.fromkeys(zeros, 0)}
        seed = [(-SEEDS <= self.seed < SEEDS, "seed", "in -2^43 .. 2^43 - 1")]
        check_rules(self, "train", at_least(self, lows, zeros) + seed)
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
    both heads on the labels (the DeiT paper's check of a second class token on the labels)."""

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
            raise ConfigError(
                "distill.type=soft softens a teacher's outputs: set distill.teacher "
                "(and model.distilled=true: DeiT's distillation token)"
            )
        if self.type == "hard" and self.tau != 1.0:  # hard distillation takes the argmax
            raise ConfigError(f"distill.tau={self.tau} applies to distill.type=soft only")


@dataclass
class FinetuneConfig:
    """Start from another run's or checkpoint's weights (`finetune.from=RUN_OR_CKPT`)."""

    from_: str | None = None
    new_head: bool = False  # a zero-initialised head even where the class count is the source's

    def __post_init__(self) -> None:
        validate(self)  # finetune.new_head=3 was taken (as true), finetune.from=5 as a path


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
                raise ConfigError(
                    f"config section {section!r} must be a mapping, got {shown(body)}"
                )
        kwargs: dict[str, Any] = {"model": ModelSection.from_tree(tree)}
        for section, klass in cls.SECTIONS.items():
            body = {
                (k + "_" if k == "from" else k): v for k, v in (tree.get(section) or {}).items()
            }
            try:
                check_keys(klass, body.keys(), where=f"section {section!r}")
            except ConfigError as e:  # train.lr: said to be optim.lr
                key = next(k for k in body if k not in _fields(klass))
                other = [
                    f"{s}.{key.rstrip('_')}" for s, k in cls.SECTIONS.items() if key in _fields(k)
                ]
                raise ConfigError(f"{e}{'; another section has it: ' * bool(other)}"
                                  f"{' / '.join(other)}") from None  # fmt: skip
            kwargs[section] = klass(**body)
        return cls(**kwargs)

    def to_tree(self) -> dict[str, Any]:
        """Nested plain dicts, as written to config.yaml (round-trips through from_tree)."""
        tree: dict[str, Any] = {"model": self.model.to_dict()}
        for section in self.SECTIONS:
            body = to_dict(getattr(self, section))
            tree[section] = {k.rstrip("_"): v for k, v in body.items()}
        return tree


for _name, _section in RunConfig.SECTIONS.items():  # how validate names a section's keys:
    _section.config_section = _name  # data.hflip, as the user wrote it


def _fields(klass: type) -> set[str]:
    return {f.name for f in dataclasses.fields(klass)}


def _strict_loader() -> type:
    """YAML's safe loader (libyaml's where built: Python's scanner is quadratic in nesting,
    libyaml's takes 1,000 levels; numbers as YAML 1.2 reads them, overrides.yaml_loader) that
    refuses a key given twice in one mapping, where YAML keeps the last (`train: {epochs: 3,
    epochs: 4}` trained 4 epochs without a word)."""
    import yaml

    class Strict(yaml_loader()):  # type: ignore[misc]
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged, may be
                    continue  # overridden by a key of this mapping
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, str):  # other keys: refused by name, as before
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark, f"{key!r} is given twice",
                        key_node.start_mark,
                    )  # fmt: skip
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Strict


def one_line(e: BaseException) -> str:
    """A YAML error on one line: PyYAML's text spans several (context, marks, problem, each with
    the file's name, which the caller's message already gives)."""
    import yaml

    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{e.problem}{where}" + (f" ({e.context})" if e.context else "")
    return " ".join(str(e).split())


def load_run_config(path: str | None = None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """A RunConfig from an optional YAML file plus 'section.key=value' overrides."""
    return RunConfig.from_tree(apply_overrides(read_config_file(path) if path else {}, overrides))


def read_config_file(path: str) -> dict[str, Any]:
    """A config file's tree of sections, as YAML gives it (the sections checked when it becomes a
    RunConfig): a ConfigError naming the file where it cannot be read, is not YAML or is not a
    mapping; an empty one (or comments only) is warned of and sets nothing."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.load(f, Loader=_strict_loader())
    except OSError as e:
        preset = Path(__file__).resolve().parents[2] / "configs" / f"{Path(path).stem}.yaml"
        missing = not Path(path).is_file() and preset.is_file()  # (a wheel install has none)
        hint = f" (the preset {Path(path).stem!r} is {preset})" if missing else ""
        raise ConfigError(f"cannot read config file {path}: {e.strerror}{hint}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from None
    # values YAML parses and Python cannot hold (huge integers, a 13th month); deep nesting
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
        raise ConfigError(f"config file {path} is not valid YAML: {one_line(e)}") from None
    if tree is None:
        log.warning("config file %s sets nothing: the defaults are used", path)
        return {}
    if not isinstance(tree, dict):  # [] or 0
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return tree


def load_saved_config(path: str | Path) -> RunConfig:
    """A run folder's config.yaml, the settings `vitlab train` wrote for it: a ConfigError naming
    the file where it is damaged (not YAML, empty, not a mapping, not a run's settings), which
    defaults must not stand in for (an empty one read as the defaults: digits)."""
    import yaml

    try:
        tree = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=yaml_loader())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError, OverflowError,
            RecursionError) as e:  # fmt: skip
        raise ConfigError(f"{path}, the run's settings, cannot be read: {one_line(e)}") from None
    if not isinstance(tree, dict) or not tree:
        what = "empty" if not tree else f"a {type(tree).__name__}, not a mapping of sections"
        raise ConfigError(f"{path}, the run's settings, is damaged: {what}")
    try:
        return RunConfig.from_tree(tree)
    except ConfigError as e:  # or written by another version of vitlab
        raise ConfigError(f"{path}, the run's settings, is damaged or another version's: "
                          f"{e}") from None  # fmt: skip
