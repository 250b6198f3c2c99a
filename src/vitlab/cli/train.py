"""`vitlab train`: parse the config and overrides, then call vitlab.train.run.train."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from vitlab.config import (
    ConfigError,
    ModelSection,
    RunConfig,
    apply_overrides,
    given_twice,
    read_config_file,
)
from vitlab.runtime import first_rank

log = logging.getLogger("vitlab.cli.train")


class Once(argparse.Action):
    """An option given at most once: a second --config was taken in place of the first, whose
    settings went without a word (files are not merged)."""

    def __call__(self, parser, namespace, value, option=None) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option} is given twice ({getattr(namespace, self.dest)}, {value}): "
                         f"name one file (the other's settings as key=value)")  # fmt: skip
        setattr(namespace, self.dest, value)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train or fine-tune a ViT, Swin or ResNet on a dataset",
        description="Train a ViT, Swin or ResNet from scratch or fine-tune one. Settings come from "
        "the defaults (digits, vit_nano_patch4_28), then --config FILE.yaml, then key=value "
        "overrides with dotted keys: model.* (name and any field of its config: ViTConfig, "
        "SwinConfig or CNNConfig; another model.name than the file's keeps the file's model keys, "
        "warned), "
        "data.* (name: digits | fashion-mnist | cifar10 | cifar100 | imagefolder:PATH | "
        "wds:SHARDS (a `vitlab data shard` folder or a brace pattern of tar shards) | hf:NAME (a "
        "save_to_disk folder, parquet file or hub name; hf:NAME#SPLIT: that split alone), test "
        "(the test split's source for a one-split source, labelled by the training split's "
        "classes; the training source is then read whole), image_key, label_key, workers, "
        "prefetch, shuffle_buffer, dir, val_fraction, split_seed, label_fraction, test_fraction, "
        "crop_padding, random_resized_crop, crop_scale, hflip, randaugment_ops, "
        "randaugment_magnitude, random_erasing, mixup, cutmix, normalize), "
        "optim.* (name adamw | sgd, lr, weight_decay, betas (adamw), momentum (sgd), "
        "schedule cosine | linear | constant, warmup_epochs, min_lr, clip_grad, label_smoothing), "
        "train.* (time_budget=DURATION such as 90s, 3m, 1h30m: the whole command then fits it, "
        "the steps planned from measured throughput and the schedule spanning them; epochs, "
        "max_steps, batch_size, accum_steps, seed, ema, precision auto | fp32 | bf16 (auto: "
        "bf16 autocast where the GPU or CPU computes in bf16, else fp32), compile, "
        "grad_checkpointing, channels_last (NHWC convolutions: faster conv stems and CNNs on "
        "CPU), batch_threads=N (each batch in N parts, their forward and backward on N threads "
        "of one process: time it first, off by default; BatchNorm per part, no dropout), "
        "strategy ddp | fsdp, device, threads, stop_at_epoch, objective classify | mpp), mpp.* "
        "(masked patch prediction without labels: target mean_color | patch_l2, corrupt, mask, "
        "random, bits), distill.* (DeiT, for model.distilled=true: teacher=RUN_OR_CKPT, type "
        "hard | soft, alpha, tau), finetune.from=RUN_OR_CKPT (a vitlab run or checkpoint, or "
        "any timm / HF / torchvision / .npz file, folder or hub name: the architecture is then the "
        "checkpoint's, model.* overrides apply on top, positions are resampled and a new head "
        "made as needed), finetune.new_head (a new head at the source's class count too). "
        "Unknown keys and wrong types are errors. Under torchrun "
        "(`torchrun --nproc_per_node=N -m vitlab train ...`) it trains with DDP or FSDP.",
        epilog="Presets: configs/*.yaml. Example: vitlab train --config configs/fashion-mnist-quick"
        ".yaml train.time_budget=5m optim.lr=0.002 (a preset with a time budget plans its steps "
        "from it; train.time_budget=null trains train.epochs)",
    )
    p.add_argument("--config", metavar="FILE.yaml", action=Once,
                   help="YAML file with model/data/optim/train (one)")  # fmt: skip
    p.add_argument("--out", type=Path, help="run folder (default: runs/DATASET-DATE-TIME)")
    p.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the run in DIR exactly where it stopped; train.stop_at_epoch may change, "
        "train.epochs only with --extend, and the CPU it takes (train.threads, data.workers)",
    )
    p.add_argument(
        "--extend",
        action="store_true",
        help="with --resume and a new train.epochs: train to that length, the learning-rate "
        "schedule recomputed as if the run had started with it (so the rate at the current step "
        "changes, e.g. rises again when a finished cosine run is extended; the log states old "
        "and new); without it a different train.epochs is refused",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --out name a folder that already holds a run, replacing that run's files "
        "once the new run is built (data, finetune.from, the teacher loaded: a start that fails "
        "keeps them); without it such a folder is refused, so no metrics or checkpoints are lost",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. optim.lr=0.001")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.train.distributed import RankLost
    from vitlab.train.engine import NonFiniteLoss
    from vitlab.train.folder import resume_config
    from vitlab.train.run import TrainingStopped, train

    if args.resume is not None:
        if args.config or args.out or args.overwrite:
            raise ValueError(
                "--resume continues the run in its folder with its config; drop "
                "--config/--out/--overwrite"
            )
        cfg = resume_config(args.resume, args.overrides)
    else:
        if args.extend:
            raise ValueError("--extend lengthens a resumed run: use it with --resume")
        tree = read_config_file(args.config) if args.config else {}  # read once
        cfg = RunConfig.from_tree(apply_overrides(tree, args.overrides))
    main_rank = first_rank()  # under torchrun: rank 0 speaks for all
    for said in given_twice(args.overrides) if main_rank else ():
        log.warning(said)
    if args.config and not args.resume and not cfg.finetune.from_ and main_rank:
        say_kept_model_keys(args.config, tree, cfg, args.overrides)
    epochs = [o for o in args.overrides if o.startswith("train.epochs=")]
    if epochs and cfg.train.time_budget is not None and not args.resume and main_rank:
        log.warning("%s is not used: train.time_budget=%s plans the steps (train.time_budget=null "
                    "trains train.epochs)", epochs[-1], cfg.train.time_budget)  # fmt: skip
    try:
        out = train(cfg, out=args.out, resume=args.resume, extend=args.extend,
                    overwrite=args.overwrite, budget_from_process_start=True)  # fmt: skip
    except TrainingStopped as e:
        if main_rank:
            print(f"vitlab train: {e}", file=sys.stderr)
        return 128 + e.signum  # 130 for Ctrl-C, 143 for SIGTERM
    except NonFiniteLoss as e:  # each rank its own loss: the one that went bad says so
        print(f"vitlab train: error: {e}", file=sys.stderr)
        return 3
    except RankLost as e:  # under torchrun: a peer process died or hung; each survivor says
        print(f"vitlab train: error: {e}", file=sys.stderr)
        return 4
    if main_rank:  # one line, for `RUN=$(torchrun ... vitlab train ...)`
        print(out)
    return 0


def say_kept_model_keys(path: str, tree: dict, cfg: RunConfig, overrides: list[str]) -> None:
    """Warn when the overrides name another model than the config file's, whose model keys (a
    preset's patch size, stem ...) then still apply to it: digits.yaml's patch_size=7 made S/16
    a 1,024-token model, and a ResNet refused it ("unknown key 'patch_size'") without saying
    where the key came from. Names are compared as registered (aliases, any case)."""
    import json

    from vitlab.models.registry import UnknownModelError, resolve_name

    try:
        file = ModelSection.from_tree(tree)  # the file's own, before the overrides
    except ConfigError:  # a name that is none, which the command line replaces
        model = dict(tree.get("model") or {})
        file = ModelSection(repr(model.pop("name", None)), model)
    given = {o.partition("=")[0].removeprefix("model.") for o in overrides}
    kept = {k: v for k, v in file.overrides.items() if k not in given}
    try:
        mine = resolve_name(cfg.model.name)
    except UnknownModelError:  # said when the model is built
        return
    same = False  # a file's unknown name: another model than the command line's
    with contextlib.suppress(UnknownModelError):
        same = mine == resolve_name(file.name)
    if kept and not same:
        log.warning(
            "model.name=%s replaces %s's %s, whose model keys still apply to it: %s (restate one "
            "as model.KEY=VALUE to change it; a model without such a key needs a config file "
            "without it)", cfg.model.name, path, file.name,
            ", ".join(f"{k}={json.dumps(v)}" for k, v in kept.items()),
        )  # fmt: skip
