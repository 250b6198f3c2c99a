"""A whole training run: check the config against the data, build everything, train epoch by epoch
with validation, checkpoints and logs, then report the test split once at the end.

Run folder:
    config.yaml           the resolved config
    metrics.jsonl         one JSON line per epoch
    checkpoints/last/     model.safetensors + state.pt (resume from here)
    checkpoints/best/     best validation top-1 (no split: lowest train loss); EMA's if train.ema
    curves.png            loss and accuracy per epoch
    results.json          the test split's metrics for the best checkpoint
    tensorboard/          when tensorboard is installed
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from math import inf
from pathlib import Path

import torch

from vitlab.config import ConfigError, RunConfig, to_dict
from vitlab.data import BatchAugment, Preprocessing, loader_options, make_loader
from vitlab.data.datasets import Split
from vitlab.data.loader import Loader
from vitlab.eval.classification import evaluate
from vitlab.eval.mpp import evaluate_mpp
from vitlab.models.mpp import MaskedPatchViT
from vitlab.models.registry import build_model
from vitlab.runtime import Dist, pick_device, rng_state, set_rng_state, status_file, use_bf16
from vitlab.train import budget, build, clock, distill, distributed, engine, folder, resuming
from vitlab.train.build import finetune_weights, load_data, normalization, resolve_model_config
from vitlab.train.engine import NonFiniteLoss, Position, StepSettings, train_epoch
from vitlab.train.folder import check_resume_length, claim_run_folder, default_run_folder
from vitlab.train.log import RunLog
from vitlab.train.optim import EMA, build_optimizer, learning_rate, warn_schedule
from vitlab.train.state import (
    CheckpointMeta,
    load_weights,
    read_metadata,
    resolve_checkpoint,
    save_checkpoint,
)
from vitlab.train.stop import StopFlag, TrainingStopped, failed_on_stop


def train(
    cfg: RunConfig,
    out: Path | None = None,
    resume: Path | None = None,
    *,
    extend: bool = False,
    overwrite: bool = False,
    budget_from_process_start: bool = False,
) -> Path:
    """Run cfg; returns the run folder. With `resume` (a run folder, whose saved config cfg must be,
    see vitlab.train.folder.resume_config) training continues exactly where it stopped; a different
    train.epochs is refused unless `extend` (the schedule is recomputed for it, see
    vitlab.train.resuming.extend). An `out` that already holds a run is refused unless `overwrite`
    (its files removed once the new run is built). train.time_budget counts from this call, or
    from the process's start with `budget_from_process_start` (`vitlab train`: Python's start-up
    is in the budget too). A full disk or quota raises folder.OutOfSpace (a ValueError) from the
    OSError, saying how to go on. train.threads sets PyTorch's thread count for the run; the
    caller's is restored on return, as is the state of torch's random-number generators."""
    before = 0.0 if budget_from_process_start else clock.process_age()
    out = Path(resume) if resume is not None else out
    build.check_settings(cfg)  # an unknown model, key or type fails now, naming it
    try:
        device = pick_device(cfg.train.device, "train.device")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    d = distributed.init(device)
    if device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(device)
    failed, run, threads, rng = False, None, torch.get_num_threads(), rng_state(device)
    torch.set_num_threads(cfg.train.threads or threads)
    try:
        if resume is None and out is None:  # rank 0 names it, every rank uses that name
            out = distributed.broadcast(default_run_folder(cfg) if d.is_main else None, d)
        claim = d.is_main and claim_run_folder(Path(resume or out), overwrite, bool(resume), d)
        if distributed.any_rank(bool(claim), d, device):  # rank 0 writes the folder: it decides
            raise ConfigError(claim or f"rank 0 refused the run folder {resume or out}")
        run = Run(cfg, out, resume, device, d, extend, before, overwrite)
        if run.fit():  # else stopped as planned (train.stop_at_epoch)
            run.test()
        return run.out
    except TrainingStopped as e:  # every rank agreed to stop: leave the process group together
        raise e.with_traceback(None) from None  # its frames' locals would keep the model
    except BaseException as e:
        failed = True
        if d.enabled and isinstance(e, Exception):
            distributed.raise_if_rank_lost(d, e, out)
        ours = resume is not None or run is not None  # else --out may hold an earlier run
        folder.raise_if_out_of_space(e, out, d, ours)  # a full disk: said with how the run goes on
        raise
    finally:
        if run is not None:  # its loaders' workers would outlive it (Run is in a cycle)
            run.close()
        run = None  # its model holds the process group, which shutdown frees
        folder.release_run_folders()  # the lock claim_run_folder took, for the next run
        distributed.shutdown(d, device, failed)
        torch.set_num_threads(threads)  # a notebook's next cell gets its count back, and its
        set_rng_state(rng, device)  # random stream (the run seeds torch's with train.seed)


class Run:
    """One training run's objects and its three phases: build (__init__), fit, test."""

    def __init__(
        self,
        cfg: RunConfig,
        out: Path | None,
        resume: Path | None,
        device: torch.device,
        d: Dist,
        extend: bool = False,
        before: float = 0.0,
        overwrite: bool = False,
    ) -> None:
        self.cfg, self.device, self.d, self.strategy = cfg, device, d, cfg.train.strategy
        planned = None  # the resumed run's train.epochs, before this command's overrides
        if resume is not None:
            if extend and (cfg.train.time_budget is not None or cfg.train.max_steps is not None):
                raise ConfigError(
                    "--extend sets train.epochs, which the schedule of a train.time_budget or "
                    "train.max_steps run does not span"
                )
            planned = check_resume_length(Path(resume), cfg, extend, said=d.is_main)
        self.data = load_data(cfg)
        # resumed: the channels and statistics `last` keeps (the model is config.yaml's, which
        # the weights must fit); fine-tuning: the source's architecture, the source read once
        saved = resume and read_metadata(resolve_checkpoint(Path(resume) / "checkpoints" / "last"))
        base = saved.config if saved and cfg.finetune.from_ else None
        source = None
        if cfg.finetune.from_ and not saved:
            source, base = build.finetune_source(cfg)
        mc = self.model_cfg = resolve_model_config(cfg, self.data.info, base, saved)
        if cfg.train.batch_size % d.world:
            raise ConfigError(build.batch_split(cfg.train.batch_size, d.world, bool(resume)))
        build.check_processes(cfg, d, device)
        self.mpp = build.check_objective(cfg, mc)
        self.out = Path(out or default_run_folder(cfg))
        info = self.data.info
        kept = saved and (saved.preprocessing.mean, saved.preprocessing.std)
        mean, std = kept or normalization(cfg, info, mc.in_chans)
        self.pre = Preprocessing(mc.img_hw, mc.in_chans, mean, std)
        # the teacher is loaded before the seed: a student starts the same with or without one
        sharded = d.enabled and self.strategy == "fsdp"
        self.two_heads, self.teacher = distill.prepare(
            cfg, mc, info.classes, self.pre, device, sharded
        )

        torch.manual_seed(cfg.train.seed)
        self.model = MaskedPatchViT(mc, cfg.mpp, mean, std) if self.mpp else build_model(mc)
        self.notes = []
        if source is not None:
            self.notes = finetune_weights(self.model, source, info.classes, cfg.finetune.new_head)
            del source
        if d.rank:  # the same model on every rank; then each rank draws its own dropout and
            torch.manual_seed(distributed.rank_seed(cfg.train.seed, d.rank))  # augmentation
        self.model.set_grad_checkpointing(cfg.train.grad_checkpointing)
        self.layout = torch.channels_last if cfg.train.channels_last else torch.preserve_format
        self.model.to(device, memory_format=self.layout)  # images follow (StepSettings)
        self.bf16 = use_bf16(cfg.train.precision, device)
        self.loader = make_loader(
            self.data.train,
            cfg.train.batch_size,
            self.pre,
            augment=BatchAugment(cfg.data, self.pre, mc.num_classes),
            shuffle=True,
            seed=cfg.train.seed,
            rank=d.rank,
            world=d.world,
            **loader_options(cfg.data, device),
        )
        # built now, so that what makes them fail does so before training
        self.val_loader = self.eval_loader(self.data.val) if self.data.val is not None else None
        self.test_loader = self.eval_loader(self.data.test)
        self.settings = self._step_settings()
        # FSDP shards self.model in place; the optimizer must be built after, to see the shards
        student = distill.TwoHeads(self.model) if self.two_heads else self.model
        self.train_model = distributed.wrap(student, d, self.strategy, device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.ema = EMA(self.model, cfg.train.ema) if cfg.train.ema else None
        self.pos, self.best = Position(), float("-inf")
        self.best_state: dict | None = None  # this rank's best weights (sharded under FSDP)
        if resume is not None:
            resuming.restore(self, Path(resume))
            if planned is not None and planned != cfg.train.epochs:
                resuming.extend(self, planned)
        batches, resumed = len(self.loader), resume is not None
        self.budget = budget.attach(
            cfg, self.settings, batches, self.data, self.out, d, self.bf16, resumed, before
        )
        if cfg.train.compile:
            self.train_model = torch.compile(self.train_model)
        self.meta = CheckpointMeta(mc, self.pre, [] if self.mpp else info.classes, {})
        folder.replace_run(self.out, d, device, overwrite and resume is None)  # built: replace
        self.log = RunLog(self.out, cfg, d.is_main, self.pos.epoch if resume is not None else None)
        if d.is_main:
            build.announce(self)

    # --- building --------------------------------------------------------------------------------

    def autocast(self):
        return torch.autocast(self.device.type, torch.bfloat16) if self.bf16 else nullcontext()

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps an epoch: the loader's batches in whole accumulation windows."""
        return len(self.loader) // self.cfg.train.accum_steps

    def _step_settings(self) -> StepSettings:
        cfg = self.cfg
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{len(self.data.train)} training images give no full step of batch_size "
                f"{cfg.train.batch_size} x accum_steps {cfg.train.accum_steps}"
            )
        total, warmup = self.total_steps(), self.warmup_steps()
        warn_schedule(cfg, total, warmup, said=self.d.is_main)  # rank 0 says it
        return StepSettings(
            accum_steps=cfg.train.accum_steps,
            clip_grad=cfg.optim.clip_grad,
            lr_at=lambda step: learning_rate(cfg.optim, step, total, warmup),
            autocast=self.autocast,
            objective=self._objective(),
            max_steps=cfg.train.max_steps,
            memory_format=self.layout,
            batch_threads=cfg.train.batch_threads,
            seed=cfg.train.seed,
        )

    def _objective(self) -> engine.Objective:
        smoothing = self.cfg.optim.label_smoothing
        if self.mpp:
            return engine.masked_patch_prediction(self.cfg.mpp.target)
        if self.two_heads:
            return engine.distillation(self.cfg.distill, self.teacher, smoothing)
        return engine.classification(smoothing)

    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.cfg.train.epochs
        return min(total, self.cfg.train.max_steps or total)

    def warmup_steps(self) -> int:
        return int(round(self.cfg.optim.warmup_epochs * self.steps_per_epoch))

    # --- phases ----------------------------------------------------------------------------------

    def eval_loader(self, split: Split) -> Loader:
        """An evaluation loader of `split` (its workers end with each pass)."""
        size, d = max(self.cfg.train.batch_size, 256), self.d
        options = loader_options(self.cfg.data, self.device)
        return make_loader(split, size, self.pre, rank=d.rank, world=d.world, **options)

    def evaluate(self, data: Split | Loader, fp32: bool = False) -> dict:
        """Metrics on a split (or its loader), under the run's precision, or in float32 (as
        `vitlab eval`)."""
        batches = self.eval_loader(data) if isinstance(data, Split) else data
        precision = nullcontext() if fp32 else self.autocast()
        try:
            if self.mpp:  # the same corruption draws at every evaluation of a split
                return evaluate_mpp(self.model, batches, self.device, precision, self.d, seed=0)
            return evaluate(
                self.model, batches, self.model_cfg.num_classes, self.device, precision, self.d
            )
        finally:
            batches.close()

    def close(self) -> None:
        """End every loader's worker processes."""
        for loader in (self.loader, self.val_loader, self.test_loader):
            if loader is not None:
                loader.close()

    def save(self, folder: str, with_state: bool, weights: dict | None = None, info=None) -> None:
        """Write checkpoint `folder`; gathering sharded (FSDP) state is collective, so every rank
        takes part and rank 0 writes."""
        d, model = self.d, self.model
        if weights is None:
            weights = distributed.full_model_state(model, d, self.strategy)
        optim = None
        rngs = None  # every rank's random stream, to resume each exactly
        if with_state:
            optim = distributed.full_optimizer_state(model, self.optimizer, d, self.strategy)
            rngs = distributed.gather(self.pos.rng, d)
        if not d.is_main:
            return
        state = resuming.train_state(self, optim, rngs) if with_state else None
        self.meta.info = {"epoch": self.pos.epoch, "step": self.pos.step, **(info or {})}
        if self.mpp:
            self.meta.info.update(objective="mpp", mpp=to_dict(self.cfg.mpp))
        save_checkpoint(self.out / "checkpoints" / folder, weights, self.meta, state)

    def fit(self) -> bool:
        """Train to the last epoch (True), or to train.stop_at_epoch (False)."""
        cfg, pos, trained = self.cfg, self.pos, False
        with StopFlag(self.d.enabled) as stop:
            while pos.epoch < cfg.train.epochs and pos.step < (cfg.train.max_steps or inf):
                trained, stats = True, self._epoch(stop)
                self._end_of_epoch(stats)
                if distributed.any_rank(stop.requested, self.d, self.device):  # during the save
                    where = f"stopped after epoch {pos.epoch}; checkpoint saved"
                    again = distributed.resume_command(self.out, self.d)
                    raise TrainingStopped(where, again, stop.signum)
                if cfg.train.stop_at_epoch == pos.epoch and pos.epoch < cfg.train.epochs:
                    if self.d.is_main:
                        self.log.finish()
                        again = distributed.resume_command(self.out, self.d)
                        print(
                            f"stopped after epoch {pos.epoch} (train.stop_at_epoch); continue "
                            f"with {again}",
                            file=status_file(),
                        )
                    return False
        if self.d.is_main and not trained and pos.step:  # --resume of a run that had finished
            folder.note_finished(pos.epoch, pos.step, cfg)
        if self.d.is_main:
            self.log.finish()
        return True

    def _epoch(self, stop: StopFlag) -> dict:
        cfg, pos = self.cfg, self.pos
        shown = partial(budget.epochs_shown, self.budget, cfg, self.steps_per_epoch)  # "?": no plan

        bar = self.log.bar(pos.epoch, shown, len(self.loader), pos.batch, cfg.train.batch_size)
        try:
            stats, stopped = train_epoch(
                self.train_model,
                self.loader,
                self.optimizer,
                self.settings,
                pos,
                self.device,
                self.d,
                ema=self.ema,
                stop_requested=lambda: stop.requested,
                progress=bar.update,
            )
        except NonFiniteLoss as e:
            last = self.out / "checkpoints" / "last"
            kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint"
            rate = pos.step and self.settings.lr_at(pos.step - 1)  # the weights' last update's
            why = f"after an update at learning rate {rate:.3g}" if pos.step else "before an update"
            raise NonFiniteLoss(
                f"{e}, {why} (optim.lr={cfg.optim.lr:g}); "
                f"stopped, {kept} (weights after this step not saved)"
            ) from None
        except Exception as e:  # a stop signal the step's helper processes got too
            if not stop.requested or self.d.enabled:
                raise
            again = distributed.resume_command(self.out, self.d)
            raise failed_on_stop(e, pos.epoch + 1, self.out, again, stop.signum) from None
        finally:
            bar.close()
        if stopped:
            self.save("last", with_state=True)
            raise TrainingStopped(
                f"stopped at epoch {pos.epoch + 1}, batch {pos.batch}; checkpoint saved",
                distributed.resume_command(self.out, self.d),
                stop.signum,
            )
        return stats

    def _end_of_epoch(self, stats: dict) -> None:
        """Validate (the EMA weights when train.ema), log, keep the best, save the last."""
        model, pos = self.model, self.pos
        distributed.sync_buffers(model, self.d, self.ema.shadow.values() if self.ema else ())
        raw = self.ema.apply_to(model) if self.ema else None
        val = self.evaluate(self.val_loader) if self.val_loader is not None else None
        evaluated = None
        if raw is not None:
            evaluated = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(raw)
        pos.epoch, pos.batch = pos.epoch + 1, 0
        record = self.log.epoch(pos.epoch, stats, val, self.optimizer.param_groups[0]["lr"])
        # no validation split, or no accuracy (patch_l2): the (validation) loss decides
        score = val["top1"] if val and val["top1"] is not None else -(val or stats)["loss"]
        if score > self.best:
            self.best = score
            self.best_state = evaluated or {
                k: v.detach().clone() for k, v in model.state_dict().items()
            }
            self.save("best", with_state=False, weights=evaluated, info=record)
        self.save("last", with_state=True, info=record)
        distributed.barrier(self.d)

    def test(self) -> dict:
        """The test split, once, with the best weights (from disk when they predate a resume), in
        float32 as `vitlab eval` computes it (validation runs under the training precision)."""
        distributed.barrier(self.d)
        if self.best_state is None:
            state = load_weights(resolve_checkpoint(self.out / "checkpoints" / "best"))
            distributed.load_full_state(self.model, None, state, None, self.d, self.strategy)
        else:
            self.model.load_state_dict(self.best_state)
        result = self.evaluate(self.test_loader, fp32=True)
        if self.d.is_main:
            self.log.results(result, self.meta.classes)
        return result
