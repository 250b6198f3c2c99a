"""A whole training run: check the config against the data, build everything, train epoch by epoch
with validation, checkpoints and logs, then report the test split once at the end.

Run folder:
    config.yaml           the resolved config
    metrics.jsonl         one JSON line per epoch
    checkpoints/last/     model.safetensors + state.pt (resume from here)
    checkpoints/best/     the best validation accuracy so far (the EMA weights when train.ema)
    curves.png            loss and accuracy per epoch
    results.json          the test split's metrics for the best checkpoint
    tensorboard/          when tensorboard is installed
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from vitlab.config import ConfigError, RunConfig, load_run_config
from vitlab.data import (
    BatchAugment,
    Preprocessing,
    dataset_info,
    load_split,
    make_loader,
    train_val_split,
)
from vitlab.data.datasets import DatasetInfo, Split
from vitlab.eval.classification import evaluate
from vitlab.models.layers import resample_pos_embed
from vitlab.models.vit import VisionTransformer, ViTConfig
from vitlab.train import distributed
from vitlab.train.engine import NonFiniteLoss, Position, StepSettings, set_rng_state, train_epoch
from vitlab.train.optim import EMA, build_optimizer, learning_rate
from vitlab.train.state import (
    Checkpoint,
    CheckpointError,
    load_train_state,
    load_weights,
    read_metadata,
    resolve_checkpoint,
    save_checkpoint,
)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but no CUDA device is available")
    return device


def use_bf16(precision: str, model_cfg: ViTConfig, device: torch.device) -> bool:
    """`auto`: bf16 on GPUs that support it; on CPU only from width 192 up, because at small widths
    autocast's casts cost more than the bf16 matrix products save (BENCHMARKS.md: at D=64 training
    is 2.4x slower in bf16, at D=192 2x faster)."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return model_cfg.embed_dim >= 192


def resolve_model_config(cfg: RunConfig, info: DatasetInfo) -> ViTConfig:
    """The registry's config with the run's overrides; class count and channels follow the data
    unless set explicitly. Fails before training when the data cannot fit the model."""
    auto = {}
    if "num_classes" not in cfg.model.overrides:
        auto["num_classes"] = len(info.classes)
    if "in_chans" not in cfg.model.overrides:
        auto["in_chans"] = info.in_chans
    mc = cfg.model.vit_config().replace(**auto)
    if mc.num_classes != len(info.classes):
        raise ConfigError(
            f"model.num_classes={mc.num_classes} but dataset {info.name} has {len(info.classes)}"
        )
    if mc.in_chans != info.in_chans:
        raise ConfigError(
            f"model.in_chans={mc.in_chans} but dataset {info.name} has {info.in_chans} channels"
        )
    return mc


def finetune_weights(model: VisionTransformer, source: str) -> list[str]:
    """Load another checkpoint's weights into model: position embeddings resampled to the model's
    grid, the head left zero-initialised when the class count differs. Returns what was adapted."""
    weights = resolve_checkpoint(source)
    src_cfg = read_metadata(weights).config
    state = load_weights(weights)
    own = model.state_dict()
    notes = []
    key = "pos_embed.weight"
    if key in state and key in own and state[key].shape != own[key].shape:
        state[key] = resample_pos_embed(
            state[key], model.config.grid, src_cfg.grid, src_cfg.num_prefix_tokens
        )
        notes.append(f"position embeddings resampled {src_cfg.grid} -> {model.config.grid}")
    for k in ("head.weight", "head.bias"):
        if k in state and (k not in own or state[k].shape != own[k].shape):
            del state[k]
            if k == "head.weight":
                notes.append(f"new zero-initialised head for {model.config.num_classes} classes")
    for k, v in state.items():
        if k not in own:
            raise CheckpointError(f"{weights}: tensor {k} has no place in the model")
        if v.shape != own[k].shape:
            raise CheckpointError(
                f"{weights}: {k} has shape {tuple(v.shape)}, the model needs {tuple(own[k].shape)}"
            )
    model.load_state_dict(state, strict=False)
    return notes


@dataclass
class Data:
    info: DatasetInfo
    train: Split
    val: Split | None
    test: Split


def load_data(cfg: RunConfig) -> Data:
    train_full = load_split(cfg.data.name, "train", cfg.data.dir, cfg.data.split_seed)
    test = load_split(cfg.data.name, "test", cfg.data.dir, cfg.data.split_seed)
    train, val = train_val_split(train_full, cfg.data.val_fraction, cfg.data.split_seed)
    return Data(dataset_info(cfg.data.name, train_full), train, val, test)


class StopFlag:
    """First Ctrl-C (SIGINT) or SIGTERM: finish the step, save, exit. Second Ctrl-C: stop now."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # ValueError: not the main thread
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstop requested: saving a checkpoint after this step ...", file=sys.stderr)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class TrainingStopped(RuntimeError):
    """The run was stopped on request after saving a checkpoint."""


def train(cfg: RunConfig, out: Path | None = None, resume: Path | None = None) -> Path:
    """Run cfg; returns the run folder. With `resume` (a run folder, whose saved config cfg must
    be, see resume_config) training continues exactly where it stopped."""
    if resume is not None:
        out = Path(resume)
    device = pick_device(cfg.train.device)
    d = distributed.init(device)
    if device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    try:
        return _train(cfg, out, resume, device, d)
    finally:
        distributed.shutdown(d)


RESUMABLE_KEYS = ("train.epochs", "train.stop_at_epoch")


def resume_config(run: Path, overrides: list[str]) -> RunConfig:
    """The saved config of run folder `run`; the overrides may change only the run's length
    (train.epochs, train.stop_at_epoch)."""
    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"cannot resume {run}: it has no config.yaml (not a vitlab run)")
    for item in overrides:
        if item.partition("=")[0] not in RESUMABLE_KEYS:
            raise ConfigError(
                f"cannot change {item.partition('=')[0]} when resuming (only {RESUMABLE_KEYS})"
            )
    return load_run_config(str(path), overrides)


def _train(
    cfg: RunConfig, out: Path | None, resume: Path | None, device: torch.device, d: distributed.Dist
) -> Path:
    data = load_data(cfg)
    model_cfg = resolve_model_config(cfg, data.info)
    if cfg.train.batch_size % d.world:
        raise ConfigError(
            f"train.batch_size {cfg.train.batch_size} is not divisible by {d.world} processes"
        )
    if cfg.train.ema is not None and cfg.train.strategy == "fsdp" and d.enabled:
        raise ConfigError("train.ema is not supported with train.strategy=fsdp")
    out = Path(out or Path("runs") / time.strftime(f"{cfg.data.name.split(':')[0]}-%Y%m%d-%H%M%S"))
    pre = Preprocessing(model_cfg.img_hw, model_cfg.in_chans, data.info.mean, data.info.std)
    if not cfg.data.normalize:
        pre = Preprocessing(
            pre.img_size, pre.in_chans, (0.0,) * pre.in_chans, (1.0,) * pre.in_chans
        )

    torch.manual_seed(cfg.train.seed)
    model = VisionTransformer(model_cfg)
    notes = []
    if cfg.finetune.from_ and resume is None:
        notes = finetune_weights(model, cfg.finetune.from_)
    model.set_grad_checkpointing(cfg.train.grad_checkpointing)
    model.to(device)
    bf16 = use_bf16(cfg.train.precision, model_cfg, device)

    def autocast():
        return torch.autocast(device.type, torch.bfloat16) if bf16 else nullcontext()

    augment = BatchAugment(cfg.data, pre, len(data.info.classes))
    loader = make_loader(
        data.train,
        cfg.train.batch_size,
        pre,
        augment=augment,
        shuffle=True,
        seed=cfg.train.seed,
        rank=d.rank,
        world=d.world,
        workers=cfg.data.workers,
    )
    eval_batch = max(cfg.train.batch_size, 256)

    def eval_loader(split: Split):
        return make_loader(
            split, eval_batch, pre, rank=d.rank, world=d.world, workers=cfg.data.workers
        )

    steps_per_epoch = len(loader) // cfg.train.accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"{len(data.train)} training images give no full step of batch_size "
            f"{cfg.train.batch_size} x accum_steps {cfg.train.accum_steps}"
        )
    total_steps = steps_per_epoch * cfg.train.epochs
    warmup = int(round(cfg.optim.warmup_epochs * steps_per_epoch))
    settings = StepSettings(
        accum_steps=cfg.train.accum_steps,
        clip_grad=cfg.optim.clip_grad,
        label_smoothing=cfg.optim.label_smoothing,
        lr_at=lambda s: learning_rate(cfg.optim, s, total_steps, warmup),
        autocast=autocast,
    )
    optimizer = build_optimizer(model, cfg.optim)
    ema = EMA(model, cfg.train.ema) if cfg.train.ema else None
    pos, best = Position(), float("-inf")
    if resume is not None:
        pos, best = _restore(resume, model, optimizer, ema, device)
    train_model = distributed.wrap(model, d, cfg.train.strategy, device)
    if cfg.train.compile:
        train_model = torch.compile(train_model)

    meta = Checkpoint(model_cfg, pre, data.info.classes, {})
    log = RunLog(out, cfg, d.is_main, resume is not None)
    if d.is_main:
        print(
            f"vitlab train: {cfg.model.name} ({sum(p.numel() for p in model.parameters()):,} "
            f"params, {'bf16' if bf16 else 'fp32'}, {device}, {d.world} process"
            f"{'es' if d.world > 1 else ''}) on {cfg.data.name}: {len(data.train):,} train / "
            f"{len(data.val) if data.val is not None else 0:,} val / {len(data.test):,} test; "
            f"run folder {out}",
            file=sys.stderr,
        )
        for note in notes:
            print(f"fine-tune: {note}", file=sys.stderr)

    def save(folder: str, with_state: bool, weights: dict | None = None, info: dict | None = None):
        if not d.is_main:
            return
        state = None
        if with_state:
            state = {
                "optimizer": optimizer.state_dict(),
                "epoch": pos.epoch,
                "batch": pos.batch,
                "step": pos.step,
                "rng": pos.rng,
                "best": best,
                "ema": ema.state_dict() if ema else None,
            }
        meta.info = {"epoch": pos.epoch, "step": pos.step, **(info or {})}
        save_checkpoint(out / "checkpoints" / folder, weights or model.state_dict(), meta, state)

    with StopFlag() as stop:
        while pos.epoch < cfg.train.epochs:
            bar = log.bar(pos.epoch, cfg.train.epochs, len(loader), pos.batch, cfg.train.batch_size)
            try:
                stats, stopped = train_epoch(
                    train_model,
                    loader,
                    optimizer,
                    settings,
                    pos,
                    device,
                    d,
                    ema=ema,
                    stop_requested=lambda: stop.requested,
                    progress=bar.update,
                )
            except NonFiniteLoss as e:
                bar.close()
                last = out / "checkpoints" / "last"
                kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint"
                raise NonFiniteLoss(
                    f"{e}; stopped, {kept} (weights after this step not saved)"
                ) from None
            bar.close()
            if stopped:
                save("last", with_state=True)
                raise TrainingStopped(
                    f"stopped at epoch {pos.epoch + 1}, batch {pos.batch}; checkpoint saved: "
                    f"continue with `vitlab train --resume {out}`"
                )
            raw = ema.apply_to(model) if ema else None  # validate (and keep) the EMA weights
            val = None
            if data.val is not None:
                val_batches = eval_loader(data.val)
                val = evaluate(model, val_batches, model_cfg.num_classes, device, autocast(), d)
            evaluated = None
            if raw is not None:
                evaluated = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.load_state_dict(raw)
            pos.epoch, pos.batch = pos.epoch + 1, 0
            lr = optimizer.param_groups[0]["lr"]
            record = log.epoch(pos.epoch, stats, val, lr)
            score = val["top1"] if val else -stats["loss"]
            if score > best:
                best = score
                save("best", with_state=False, weights=evaluated, info=record)
            save("last", with_state=True, info=record)
            distributed.barrier(d)
            if cfg.train.stop_at_epoch == pos.epoch and pos.epoch < cfg.train.epochs:
                if d.is_main:
                    log.finish()
                    print(
                        f"stopped after epoch {pos.epoch} (train.stop_at_epoch); continue with "
                        f"`vitlab train --resume {out}`",
                        file=sys.stderr,
                    )
                return out

    if d.is_main:
        log.finish()
    # the test split, once, for the best checkpoint
    best_weights = out / "checkpoints" / "best"
    distributed.barrier(d)
    model.load_state_dict(load_weights(resolve_checkpoint(best_weights)))
    test = evaluate(model, eval_loader(data.test), model_cfg.num_classes, device, autocast(), d)
    if d.is_main:
        log.results(test, data.info.classes)
    return out


def _restore(run: Path, model, optimizer, ema, device) -> tuple[Position, float]:
    folder = run / "checkpoints" / "last"
    weights = resolve_checkpoint(folder)
    state = load_train_state(weights.parent)
    model.load_state_dict(load_weights(weights))
    optimizer.load_state_dict(state["optimizer"])
    if ema is not None and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])
    pos = Position(state["epoch"], state["batch"], state["step"], state["rng"])
    set_rng_state(pos.rng, device)
    return pos, float(state["best"])


class RunLog:
    """Progress bar, metrics.jsonl, TensorBoard, curves.png, results.json (rank 0 only)."""

    def __init__(self, out: Path, cfg: RunConfig, active: bool, resumed: bool) -> None:
        self.out, self.active = out, active
        self.tb = None
        if not active:
            return
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "config.yaml", "w") as f:
            yaml.safe_dump(cfg.to_tree(), f, sort_keys=False)
        self.metrics = out / "metrics.jsonl"
        if not resumed:
            self.metrics.write_text("")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            self.tb = None

    def bar(self, epoch: int, epochs: int, batches: int, start: int, batch_size: int):
        return _Bar(self.active, epoch, epochs, batches, start, batch_size)

    def epoch(self, epoch: int, stats: dict, val: dict | None, lr: float) -> dict:
        record = {
            "epoch": epoch,
            "train_loss": round(stats["loss"], 6),
            "train_acc": round(stats["acc"], 6),
            "val_loss": round(val["loss"], 6) if val else None,
            "val_acc": round(val["top1"], 6) if val else None,
            "lr": lr,
            "images_per_s": round(stats["images_per_s"], 1),
            "seconds": round(stats["seconds"], 2),
        }
        if not self.active:
            return record
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "epoch" and v is not None:
                    self.tb.add_scalar(k, v, epoch)
        val_text = f" val loss {val['loss']:.4f} acc {100 * val['top1']:.2f}%" if val else ""
        print(
            f"epoch {epoch}: train loss {stats['loss']:.4f} acc {100 * stats['acc']:.2f}%"
            f"{val_text} lr {lr:.2e} {stats['images_per_s']:.0f} img/s {stats['seconds']:.1f}s",
            file=sys.stderr,
        )
        return record

    def finish(self) -> None:
        if self.tb is not None:
            self.tb.close()
        records = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
        if records:
            save_curves(records, self.out / "curves.png")

    def results(self, test: dict, classes: list[str]) -> None:
        summary = {k: v for k, v in test.items() if k != "confusion"}
        summary["classes"] = classes
        (self.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"test: top-1 {100 * test['top1']:.2f}%  top-5 {100 * test['top5']:.2f}%  loss "
            f"{test['loss']:.4f} on {test['num_images']:,} images; run folder {self.out}",
            file=sys.stderr,
        )


class _Bar:
    def __init__(self, active: bool, epoch: int, epochs: int, total: int, start: int, bs: int):
        from tqdm import tqdm

        self.bs, self.start = bs, start
        self.tqdm = tqdm(
            total=total,
            initial=start,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="batch",
            disable=not active,
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,  # keep logs short
            file=sys.stderr,
        )
        self.t0 = time.perf_counter()

    def update(self, stats: dict) -> None:
        self.tqdm.n = stats["batch"]
        rate = (stats["batch"] - self.start) * self.bs / max(time.perf_counter() - self.t0, 1e-9)
        self.tqdm.set_postfix(
            loss=f"{stats['loss']:.3f}", acc=f"{100 * stats['acc']:.1f}%", img_s=f"{rate:.0f}"
        )

    def close(self) -> None:
        self.tqdm.close()


def save_curves(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [r["train_loss"] for r in records], "o-", label="train")
    ax2.plot(epochs, [100 * r["train_acc"] for r in records], "o-", label="train")
    if records[0]["val_loss"] is not None:
        ax1.plot(epochs, [r["val_loss"] for r in records], "s-", label="validation")
        ax2.plot(epochs, [100 * r["val_acc"] for r in records], "s-", label="validation")
    ax1.set(xlabel="epoch", ylabel="loss", title="loss")
    ax2.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
