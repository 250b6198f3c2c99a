"""What a run is built from: its data splits, its model's config resolved against the data, and a
fine-tuning source's weights."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from vitlab.config import ConfigError, ModelSection, RunConfig, to_dict
from vitlab.data import dataset_info, label_subset, train_val_split
from vitlab.data.datasets import DatasetInfo, Split, load_run_split
from vitlab.data.decode import available_cores
from vitlab.formats.base import Source
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models.checkpoint import (
    as_stated,
    infer_config,
    load_checkpoint,
    load_state_strict,
    read_source,
    source_family,
)
from vitlab.models.mpp import PREFIX as MPP_PREFIX
from vitlab.models.registry import (
    ModelConfig,
    config_of,
    family_of,
    get_config,
    other_than_weights,
    shape_of,
    with_overrides,
)
from vitlab.runtime import Dist, first_rank, launched_processes, status_file
from vitlab.train import distill
from vitlab.validation import few

log = logging.getLogger(__name__)


def check_settings(cfg: RunConfig) -> None:
    """An unknown model name, key or type fails before anything is built, naming it. With
    finetune.from the keys apply to the source's architecture, checked once it is read (a Swin's
    window_size was refused as no ViTConfig key): here only the name. train.threads past this
    process's cores fails. Settings changed from their defaults that nothing reads are warned of
    (by rank 0 under torchrun)."""
    if not isinstance(cfg, RunConfig):  # a dict of sections: AttributeError deep inside, once
        raise TypeError(f"a run's settings are a vitlab.config.RunConfig (load_run_config(FILE, "
                        f"OVERRIDES), or RunConfig.from_tree(a dict of sections)), got "
                        f"{type(cfg).__name__}")  # fmt: skip
    if cfg.finetune.from_:
        get_config(cfg.model.name)
    else:
        config_of(cfg.model)
    o, data, t = cfg.optim, cfg.data, cfg.train
    cores = available_cores()
    if t.threads and t.threads > cores:  # 100,000 crashed in torch; 1,000 ran at 1% of the pace
        raise ConfigError(
            f"train.threads={t.threads} is more than the {cores} CPU cores this process may use: "
            f"at most {cores} (threads beyond the cores only wait on each other; 0 or unset "
            f"takes torch's default)"
        )
    default_o, default_d = type(o)(), type(data)()
    unused = [
        (t.strategy == "fsdp" and launched_processes() < 2, "train.strategy=fsdp",
         "more than one process (torchrun --nproc_per_node=N, N >= 2): one process trains the "
         "whole model"),
        (o.name != "sgd" and o.momentum != default_o.momentum, "optim.momentum", "optim.name=sgd"),
        (o.name != "adamw" and o.betas != default_o.betas, "optim.betas", "optim.name=adamw"),
        (not data.randaugment_ops and data.randaugment_magnitude != default_d.randaugment_magnitude,
         "data.randaugment_magnitude", "data.randaugment_ops > 0"),
        (not data.random_resized_crop and data.crop_scale != default_d.crop_scale,
         "data.crop_scale", "data.random_resized_crop=true"),
        (cfg.finetune.new_head and not cfg.finetune.from_, "finetune.new_head", "finetune.from"),
    ]  # fmt: skip
    if not first_rank():
        return
    for found, key, needs in unused:
        if found:
            log.warning("%s is set but not used: it applies with %s", key, needs)


def finetune_source(cfg: RunConfig) -> tuple[Source, ModelConfig]:
    """finetune.from, read once, and its architecture (inferred, and any guess warned, once). A
    ViT's model.num_heads is also the source's head count, which no tensor's shape tells (the
    loader's hint: it was applied after a refusal to guess, which asked to pass num_heads=)."""
    source = read_source(cfg.finetune.from_)
    heads = cfg.model.overrides.get("num_heads")
    if heads is not None and source_family(source) == "vit":
        source.hints.setdefault("num_heads", heads)
    source.config = infer_config(source)  # the tensors' own size, which loading resamples from
    return source, as_stated(source, source.config)  # the model as it loads (timm's size)


def resolve_model_config(
    cfg: RunConfig,
    info: DatasetInfo,
    base: ModelConfig | None = None,
    saved: CheckpointMeta | None = None,
) -> ModelConfig:
    """The registry's config (or `base`, a fine-tuning source's architecture) with the run's
    overrides; class count and channels follow the data unless set explicitly, or for a resumed
    run (`saved`: its last checkpoint's CheckpointMeta) its channels (a run trained on a grey
    folder before folders were read grey keeps its 3); no classifier for masked patch
    prediction. Fails before training when the data cannot fit the model."""
    auto = {}
    mpp = cfg.train.objective == "mpp"
    classes = 0 if mpp else len(info.classes)
    if not mpp and not info.classes:
        raise ConfigError(
            f"dataset {info.name} has no labels (an image folder without class sub-folders): "
            f"classification needs root/CLASS/* folders; train.objective=mpp trains without labels"
        )
    if not mpp and len(info.classes) == 1:  # every prediction right: nothing to learn or measure
        raise ConfigError(
            f"dataset {info.name} has one class ({info.classes[0]!r}): classification needs two "
            f"or more; train.objective=mpp trains without labels"
        )
    if "num_classes" not in cfg.model.overrides:
        auto["num_classes"] = classes
    if "in_chans" not in cfg.model.overrides:
        auto["in_chans"] = info.in_chans if saved is None else saved.config.in_chans
    if base is not None and family_of(base) == "cnn":  # the source's stem, at any new size
        base = base.replace(small_stem=base.uses_small_stem)
    said = saved is None and first_rank()  # once: not again on resume
    if base is not None and said and (cfg.model.named or cfg.model.name != ModelSection().name):
        named = get_config(cfg.model.name)  # said where it names another architecture
        rates = [k for k in RATES if k not in cfg.model.overrides
                 and getattr(named, k, None) != getattr(base, k, None)]  # fmt: skip
        if _architecture(named, cfg) != _architecture(base, cfg):
            log.warning("model.name=%s [%s] is not used: finetune.from's architecture [%s] is "
                        "trained (model.* keys apply to it)", cfg.model.name, shape_of(named),
                        shape_of(base))  # fmt: skip
        elif rates:  # the same shape: its regularisation is the source's too, which is said
            log.warning("model.name=%s's %s: not used, the run takes finetune.from's %s (set "
                        "model.KEY=VALUE for another)", cfg.model.name,
                        ", ".join(f"{k}={getattr(named, k)}" for k in rates),
                        ", ".join(f"{k}={getattr(base, k, None)}" for k in rates))  # fmt: skip
    if base is not None and (wrong := other_than_weights(base, cfg.model.overrides, "model")):
        raise ConfigError(f"finetune.from={cfg.finetune.from_}: model.{wrong}")
    mc = config_of(cfg.model) if base is None else with_overrides(base, cfg.model.overrides)
    mc = mc.replace(**auto)
    batchnorm = family_of(mc) == "cnn" and not mc.bit  # BiT's ResNet-v2 has GroupNorm
    if batchnorm and cfg.train.compile and cfg.train.grad_checkpointing:
        raise ConfigError(
            "train.compile with train.grad_checkpointing is not supported for a torchvision "
            "ResNet (its checkpointed blocks keep BatchNorm statistics to one update, which "
            "torch.compile cannot trace): choose one"
        )
    if cfg.train.channels_last and cfg.train.strategy == "fsdp":
        raise ConfigError(
            "train.channels_last with train.strategy=fsdp is not supported (FSDP2 shards only "
            "contiguous parameters): use train.strategy=ddp, or leave channels_last off"
        )
    if cfg.data.random_resized_crop and cfg.data.crop_padding:  # the padded crop was dropped
        raise ConfigError(
            "data.random_resized_crop and data.crop_padding are two crops of the training images: "
            "set one of them"
        )
    low, high = cfg.data.crop_scale  # shares of the image's area: a range within (0, 1]
    if cfg.data.random_resized_crop and not 0 < low <= high <= 1:
        raise ConfigError(f"data.crop_scale is a range of area shares, 0 < low <= high <= 1 (e.g. "
                          f"[0.08, 1.0]), got {list(cfg.data.crop_scale)}")  # fmt: skip
    if not 0 <= cfg.data.randaugment_magnitude <= 30:  # torchvision's 31 bins; 31+ fails later
        raise ConfigError(
            f"data.randaugment_magnitude is on torchvision's scale 0-30 (timm's / DeiT's m9 is "
            f"about 27 here), got {cfg.data.randaugment_magnitude}"
        )
    if cfg.train.batch_threads > 1:
        check_batch_threads(cfg, mc)
    if mc.num_classes != classes:
        why = "masked patch prediction trains no classifier" if mpp else f"dataset {info.name} has"
        raise ConfigError(f"model.num_classes={mc.num_classes} but {why} {classes}")
    files = info.image_size is None  # image files: decoded in the model's mode, grey or RGB
    if mc.in_chans != info.in_chans and not (files and mc.in_chans in (1, 3)):
        raise ConfigError(
            f"model.in_chans={mc.in_chans} but dataset {info.name} has {info.in_chans} "
            f"channel{'s' * (info.in_chans != 1)}"
        )
    return mc


def normalization(cfg: RunConfig, info: DatasetInfo, in_chans: int) -> tuple[tuple, tuple]:
    """(mean, std) per channel: the data's (one value for every channel when it has one), or
    none (0, 1) when data.normalize is off; a ConfigError when they fit neither."""
    mean, std = (info.mean, info.std) if cfg.data.normalize else ((0.0,), (1.0,))
    if in_chans == 1 and len(mean) == 3 and info.image_size is None:  # colour files read grey
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)  # (ImageNet's: GREY_STATS)
    if len(mean) not in (1, in_chans) or len(std) != len(mean):
        raise ConfigError(f"dataset {info.name}'s statistics have {len(mean)} channels, the model "
                          f"{in_chans}")  # fmt: skip
    return tuple(mean) * (in_chans // len(mean)), tuple(std) * (in_chans // len(std))


def finetune_weights(
    model: nn.Module, source: Source, classes: list[str] | None = None, new_head: bool = False
) -> list[str]:
    """Load another checkpoint's weights (read by read_source, any format vitlab reads) into
    model: the source is moved to the model's resolution (learned and relative position tables
    resampled, a fixed sin-cos table computed for the new grid; a Swin's relative position
    tables, also to a new window; a CNN's size only recorded) and channels (patch kernels, a
    CNN's conv1, adapted), and gets a zero-initialised head when the class count differs or
    `new_head` (finetune.new_head), or when the model has no
    pre-logits layer where the source has one (model.representation_size=null: the paper's
    fine-tuning head, one linear layer). A head kept whose class names (the source's) are not
    the data's (`classes`) is warned of. Returns what was adapted."""
    cfg = model.config
    src_cfg = infer_config(source)
    notes = []
    swin, cnn = family_of(cfg) == "swin", family_of(cfg) == "cnn"
    where = "relative position tables" if swin else "position embeddings"
    if src_cfg.img_hw != cfg.img_hw and cnn:  # a CNN's weights take any size
        notes.append(f"image size {src_cfg.img_hw} -> {cfg.img_hw} (a CNN's weights are kept)")
    elif src_cfg.img_hw != cfg.img_hw and swin:  # its tables span a window: kept at the same one
        notes.append(f"token grid {src_cfg.grid} -> {cfg.grid}")
    elif src_cfg.img_hw != cfg.img_hw:  # as the ViT's kind of position embedding is
        what = {
            "relative": "relative position tables resampled to",
            "sincos2d": "the fixed 2-D sin-cos table (no weights) computed for",
            "none": "no position embeddings;",
        }
        notes.append(f"{what.get(cfg.pos_embed, f'{where} resampled to')} the token grid "
                     f"{src_cfg.grid} -> {cfg.grid}")  # fmt: skip
    moves = {"img_size": cfg.img_size}
    if swin:
        moves["window_size"] = cfg.window_size
        if src_cfg.window_size != cfg.window_size:
            notes.append(f"{where} resampled to the window {src_cfg.window_size} -> "
                         f"{cfg.window_size}")  # fmt: skip
    if src_cfg.in_chans != cfg.in_chans:
        kernels = f"{cfg.first_conv.removesuffix('.weight')} kernels" if cnn else "patch kernels"
        note = f"{kernels} adapted {src_cfg.in_chans} -> {cfg.in_chans} channels"
        if cfg.in_chans < src_cfg.in_chans and _standardised_root(cfg):
            note += (" (approximate: the summed kernels of a weight-standardised conv are "
                     "standardised anew, which rescales each channel's response)")  # fmt: skip
        notes.append(note)
    if src_cfg.num_classes != cfg.num_classes and cfg.num_classes:
        notes.append(f"new zero-initialised head for {cfg.num_classes} classes")
    elif src_cfg.num_classes != cfg.num_classes:  # masked patch prediction: no classifier
        notes.append(f"the classifier of {src_cfg.num_classes} classes left out")
    had = getattr(src_cfg, "representation_size", None)  # a pre-logits layer: the source's,
    wants = getattr(cfg, "representation_size", None)  # the run's
    if wants and not had:
        raise ConfigError(f"model.representation_size={cfg.representation_size} adds a pre-logits "
                          f"layer {source.where} has no weights for: drop it (the paper fine-tunes "
                          f"with one linear head)")  # fmt: skip
    src, _ = load_checkpoint(source, in_chans=cfg.in_chans, num_classes=cfg.num_classes, **moves)
    state = src.state_dict()
    new_layer = had and not wants  # the paper's fine-tuning head: one new linear layer
    if new_layer:
        state = {k: v for k, v in state.items() if not k.startswith(("pre_logits.", "head."))}
        state.update({k: torch.zeros_like(v) for k, v in model.state_dict().items()
                      if k.startswith("head.")})  # fmt: skip
        now = "replaced by one zero-initialised linear layer" if cfg.num_classes else "left out"
        notes.append(f"the pre-training head (pre-logits layer and classifier) {now}")
    fresh = {k: v for k, v in model.state_dict().items() if k.startswith(MPP_PREFIX)}
    if fresh:  # pre-training goes on from an encoder: its head and [mask] start new
        notes.append("new masked-patch-prediction head and [mask] embedding")
    load_state_strict(model, {**fresh, **state}, source.where)
    same = src_cfg.num_classes == cfg.num_classes and cfg.num_classes and not new_layer
    if same and new_head:
        model.reset_classifier(cfg.num_classes)
        notes.append(f"new zero-initialised head for {cfg.num_classes} classes (finetune.new_head)")
    elif same and source.classes and classes and source.classes != classes and first_rank():
        log.warning("the head is kept: %s's %d classes (%s) are taken for the data's (%s); "
                    "finetune.new_head=true starts a new one", source.where, cfg.num_classes,
                    few(source.classes), few(classes))  # fmt: skip
    return notes


@dataclass
class Data:
    info: DatasetInfo
    train: Split
    val: Split | None
    test: Split

    @cached_property
    def digest(self) -> str:
        """A hash of the splits as listed: their sizes and labels, and an image folder's file
        names, shards and their counts, a Hugging Face split's rows (not the images' bytes): what
        a resumed run's data is checked against."""
        h = hashlib.sha256()
        for split in (self.train, self.val, self.test):
            h.update(f"|{type(split).__name__} {0 if split is None else len(split)}|".encode())
            for field in ("files", "urls", "counts", "rows", "labels"):
                items = getattr(split, field, None)
                if isinstance(items, torch.Tensor):
                    h.update(items.numpy().tobytes())
                elif items is not None:
                    for i in range(0, len(items), 1 << 16):  # a million names: no huge string
                        h.update("\n".join(map(str, items[i : i + (1 << 16)])).encode())
        return h.hexdigest()

    def check_same(self, saved: str | None) -> None:
        """Warn when a resumed run's data is not what it trained on (`saved`, the digest in its
        training state; None in states before 2026-12-05)."""
        if saved is not None and saved != self.digest:
            log.warning("data %s is not what the run trained on (files, shards or labels added, "
                        "removed, renamed or moved): the continuation is not exact, and where the "
                        "test split is drawn by seed (an image folder without train/), images may "
                        "have moved between the training and the test split",
                        self.info.name)  # fmt: skip


def load_data(cfg: RunConfig) -> Data:
    train_full = load_run_split(cfg.data, "train")
    test = load_run_split(cfg.data, "test", train_full.classes)
    train, val = train_val_split(train_full, cfg.data.val_fraction, cfg.data.split_seed)
    train = label_subset(train, cfg.data.label_fraction, cfg.data.split_seed)
    test = label_subset(test, cfg.data.test_fraction, cfg.data.split_seed, "data.test_fraction")
    return Data(dataset_info(cfg.data.name, train_full), train, val, test)


def _standardised_root(cfg: ModelConfig) -> bool:
    """Whether the kernel that sees the image is a weight-standardised conv (StdConv2d): BiT's
    ResNet-v2 and the hybrids' ResNet stem."""
    return getattr(cfg, "bit", False) or getattr(cfg, "stem", None) == "resnet"


RATES = ("dropout", "attn_dropout", "drop_path", "head_dropout")  # a config's regularisation


def _architecture(mc: ModelConfig, cfg: RunConfig) -> tuple[str, dict]:
    """What a fine-tuning run takes from its source and no model.* key changes: the family and
    the config's fields but the size, classes and channels (which follow the data or the keys)
    and the dropout rates (training settings no tensor tells: another library's file has none)."""
    kept = {"img_size", "num_classes", "in_chans", "small_stem", *RATES, *cfg.model.overrides}
    return family_of(mc), {k: v for k, v in to_dict(mc).items() if k not in kept}


def model_label(cfg: RunConfig, mc: ModelConfig) -> str:
    """What is trained: the registered name with its overrides, or the fine-tuning source's
    architecture, and the shape either way."""
    shape = shape_of(mc)
    if cfg.finetune.from_:
        return f"the architecture of {cfg.finetune.from_} [{shape}]"
    changes = ", ".join(f"{k}={v}" for k, v in cfg.model.overrides.items())
    return f"{cfg.model.name}{f' with {changes}' if changes else ''} [{shape}]"


def check_objective(cfg: RunConfig, mc: ModelConfig) -> bool:
    """Whether the run pre-trains by masked patch prediction (a ViT's, without mixed labels)."""
    if cfg.train.objective != "mpp":
        return False
    if family_of(mc) != "vit":
        raise ConfigError(
            f"train.objective=mpp pre-trains a ViT (patch tokens in, one per patch out); "
            f"{model_label(cfg, mc)} is a {family_of(mc)} model"
        )
    if cfg.data.mixup or cfg.data.cutmix:
        raise ConfigError(
            "train.objective=mpp uses no labels, and data.mixup / data.cutmix mix labels: "
            "set them to 0"
        )
    return True


def batch_split(batch: int, world: int, resumed: bool) -> str:
    """What to do about a global batch of `batch` that `world` processes cannot share: another
    batch, or for a resumed run (whose batch is fixed) another number of processes."""
    said = f"train.batch_size {batch} is not divisible by {world} processes"
    if not resumed:
        near = [n for n in (batch // world * world, (batch // world + 1) * world) if n]
        return f"{said}: give a multiple of {world} (e.g. {' or '.join(map(str, near))})"
    fits = [n for n in range(1, batch + 1) if batch % n == 0][:8]
    return (f"{said}: a resumed run keeps its global batch, so resume it on a number of "
            f"processes that divides {batch} ({', '.join(map(str, fits))})")  # fmt: skip


def check_processes(cfg: RunConfig, d: Dist, device: torch.device) -> None:
    """What the run's processes and device rule out."""
    if cfg.train.ema is not None and cfg.train.strategy == "fsdp" and d.enabled:
        raise ConfigError("train.ema is not supported with train.strategy=fsdp")
    if cfg.train.batch_threads > 1 and (d.enabled or device.type != "cpu"):
        raise ConfigError(
            f"train.batch_threads > 1 shares a batch among one process's CPU threads; this run "
            f"has {d.world} process(es) on {device}: use train.batch_threads=1"
        )


def check_batch_threads(cfg: RunConfig, mc: object) -> None:
    """train.batch_threads > 1 trains eagerly, and the model draws only from the parts' own random
    streams (vitlab.train.threads): dropout layers draw from PyTorch's default stream, which the
    threads would share in an order that differs from run to run, and gradient checkpointing
    recomputes with the default stream's state."""
    if cfg.train.compile:
        raise ConfigError("train.batch_threads > 1 runs the model eagerly: leave train.compile off")
    if cfg.train.grad_checkpointing:  # its recomputation restores the default stream, not a part's
        raise ConfigError(
            "train.batch_threads > 1 with train.grad_checkpointing is not supported (the "
            "recomputed forward would draw other DropPath masks than the parts' streams did): "
            "choose one"
        )
    fields = ("dropout", "attn_dropout", "head_dropout")
    used = [f"model.{f}={getattr(mc, f)}" for f in fields if getattr(mc, f, 0.0)]
    if used:
        raise ConfigError(
            f"train.batch_threads > 1 with {', '.join(used)}: dropout draws from PyTorch's one "
            f"random stream, which the threads would share in a different order every run; use "
            f"model.drop_path (stochastic depth, drawn per thread) or train.batch_threads=1"
        )


def announce(run) -> None:  # a train.run.Run (which imports this module)
    """The run's first line on stderr: model, precision, device, processes, data, run folder."""
    data, d, cfg = run.data, run.d, run.cfg
    params = sum(p.numel() for p in run.model.parameters())
    print(
        f"vitlab train: {model_label(cfg, run.model_cfg)} ({params:,} params, "
        f"{'bf16' if run.bf16 else 'fp32'}, {run.device}, {d.world} process"
        f"{'es' if d.world > 1 else ''}) on {cfg.data.name}: {len(data.train):,} train / "
        f"{len(data.val) if data.val is not None else 0:,} val / {len(data.test):,} test; "
        f"run folder {run.out}",
        file=status_file(),
    )
    for note in run.notes:  # notes go through logging: -q hides them
        log.info("fine-tune: %s", note)
    if cfg.data.label_fraction < 1 and data.val is not None:
        said = (cfg.data.label_fraction, f"{len(data.train):,}", f"{len(data.val):,}")
        if cfg.train.objective == "mpp":
            log.info("data.label_fraction=%s keeps %s training images (masked patch prediction "
                     "reads no labels); the validation split keeps all %s", *said)  # fmt: skip
        else:
            log.info("data.label_fraction=%s labels %s training images, and the validation split "
                     "keeps all %s of its labels to choose the best checkpoint with; "
                     "data.val_fraction=0 keeps the run to its labels", *said)  # fmt: skip
    if run.two_heads:
        distill.announce(run.teacher, cfg.distill)
