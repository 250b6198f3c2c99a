"""What a run shows and leaves behind: the progress bar, metrics.jsonl, TensorBoard, curves.png
and results.json (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from vitlab.config import RunConfig
from vitlab.data.download import absolute_source
from vitlab.eval.classification import top5_text
from vitlab.formats.base import write_text
from vitlab.overrides import yaml_dumper
from vitlab.runtime import quiet, status_file
from vitlab.validation import json_text

log = logging.getLogger(__name__)

# what a run writes into its folder (a folder holding any of these holds a run)
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "checkpoints",
    "curves.png",
    "results.json",
    "tensorboard",
    "features",  # vitlab fewshot / probe caches
    "time_budget.json",  # train.time_budget's plan (vitlab.train.budget.PLAN_FILE)
)


def saved_tree(cfg: RunConfig) -> dict:
    """cfg as a run's config.yaml holds it: local paths absolute (the datasets: imagefolder:, hf:
    on disk, local wds: shards, data.test, data.dir; a teacher or fine-tuning source on disk), so
    that eval, fewshot, probe, analyze and --resume read the same files from any working folder."""
    tree = cfg.to_tree()
    data = tree["data"]
    data.update(name=absolute_source(data["name"]), test=absolute_source(data.get("test")))
    if data.get("dir"):
        data["dir"] = os.path.abspath(os.path.expanduser(data["dir"]))
    for section, key in (("distill", "teacher"), ("finetune", "from")):
        source = tree[section].get(key)
        if source and os.path.exists(os.path.expanduser(source)):  # not a hub name
            tree[section][key] = os.path.abspath(os.path.expanduser(source))
    return tree


class RunLog:
    """Progress bar, metrics.jsonl, TensorBoard, curves.png, results.json (rank 0 only).
    `resumed_at`: the epochs the resumed checkpoint holds (None: a new run); lines of later
    epochs (logged before a kill that came ahead of their checkpoint) are dropped, since those
    epochs are trained again."""

    def __init__(
        self,
        out: Path,
        cfg: RunConfig,
        active: bool,
        resumed_at: int | None = None,
    ) -> None:
        self.out, self.active = out, active
        self.tb = None
        if not active:
            return
        out.mkdir(parents=True, exist_ok=True)
        tree = yaml.dump(saved_tree(cfg), Dumper=yaml_dumper(), sort_keys=False)  # as read back
        write_text(out / "config.yaml", tree)
        self.metrics = out / "metrics.jsonl"
        if resumed_at is None or not self.metrics.exists():
            self.metrics.write_text("")
        else:  # the epochs the checkpoint holds; a torn line (a kill mid-write) is said
            lines = self.metrics.read_text(errors="replace").splitlines()
            epochs = [_epoch_of(x) if x.strip() else None for x in lines]  # None: blank
            kept = [x for x, e in zip(lines, epochs) if e is not None and e <= resumed_at]
            torn = [i + 1 for i, e in enumerate(epochs) if e is not None and e == _TORN]
            if torn:
                log.warning("%s: line %s is not an epoch's record (cut short?): left out; an "
                            "epoch the checkpoint holds loses its figures, a later one is "
                            "trained and logged again", self.metrics,
                            ", ".join(map(str, torn)))  # fmt: skip
            if len(kept) != len(lines):
                write_text(self.metrics, "".join(x + "\n" for x in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            # events of epochs after the checkpoint are hidden: those epochs are trained again
            purge = None if resumed_at is None else resumed_at + 1
            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=purge)
        except ImportError:
            self.tb = None

    def bar(self, epoch: int, epochs: Callable[[], str], batches: int, start: int, batch_size: int):
        """The progress bar of epoch `epoch` (0-based); `epochs()` gives the count it shows."""
        return _Bar(self.active, epoch, epochs, batches, start, batch_size)

    def epoch(self, epoch: int, stats: dict, val: dict | None, lr: float) -> dict:
        record = {
            "epoch": epoch,
            "train_loss": round(stats["loss"], 6),
            "train_acc": _round(stats["acc"]),
            "val_loss": round(val["loss"], 6) if val else None,
            "val_acc": _round(val["top1"]) if val else None,
            "lr": lr,
            "images_per_s": round(stats["images_per_s"], 1),
            "seconds": round(stats["seconds"], 2),
        }
        if not self.active:
            return record
        with open(self.metrics, "a") as f:
            f.write(json_text(record, indent=None) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "epoch" and v is not None:
                    self.tb.add_scalar(k, v, epoch)
        val_text = f" val loss {val['loss']:.4f}{_acc(val['top1'])}" if val else ""
        print(
            f"epoch {epoch}: train loss {stats['loss']:.4f}{_acc(stats['acc'])}"
            f"{val_text} lr {lr:.2e} {stats['images_per_s']:.0f} img/s {stats['seconds']:.1f}s",
            file=status_file(),
        )
        return record

    def finish(self) -> None:
        if self.tb is not None:
            self.tb.close()
        records = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
        if records:
            save_curves(records, self.out / "curves.png")

    def results(self, test: dict, classes: list[str]) -> None:
        """results.json; `test` holds classification metrics, or masked-patch-prediction ones
        (`num_patches`: the corrupted patches scored). A test of no image (each unreadable,
        named as it was skipped) has no accuracy: its metrics become None, in `test` too (it
        said top-1 0.00% and loss 0 on 0 images)."""
        if not test["num_images"]:
            test.update({k: None for k in ("loss", "top1", "top5", "top1_cls", "top1_dist")
                         if k in test})  # fmt: skip
        summary = {k: v for k, v in test.items() if k != "confusion"}
        summary["classes"] = classes
        write_text(self.out / "results.json", json_text(summary) + "\n")
        if not test["num_images"]:
            what = ("no image could be evaluated (each skipped as unreadable, or the split is "
                    "empty): results.json holds no accuracy")  # fmt: skip
        elif "num_patches" in test:
            what = f"masked patch prediction:{_acc(test['top1'])} loss {test['loss']:.4f} on "
            what += f"{test['num_patches']:,} corrupted patches of {test['num_images']:,} images"
        else:
            what = f"top-1 {100 * test['top1']:.2f}%{_heads(test)}"
            what += f"{top5_text(len(classes), test['top5'], '  ')}  loss {test['loss']:.4f} on "
            what += f"{test['num_images']:,} images"
        print(f"test: {what}; run folder {self.out}", file=status_file())


def _heads(metrics: dict) -> str:
    """' (class head 12.34%, distillation head 12.34%)' for a distilled model, else nothing."""
    if "top1_cls" not in metrics:
        return ""
    cls, dist = 100 * metrics["top1_cls"], 100 * metrics["top1_dist"]
    return f" (class head {cls:.2f}%, distillation head {dist:.2f}%)"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _acc(value: float | None) -> str:
    """' acc 12.34%', or nothing for an objective without accuracy."""
    return "" if value is None else f" acc {100 * value:.2f}%"


_TORN = 1 << 30  # the epoch of a line that is no epoch's record


def _epoch_of(line: str) -> int:
    try:
        return int(json.loads(line)["epoch"])
    except (ValueError, KeyError, TypeError):
        return _TORN  # a torn or foreign line: dropped


class _Bar:
    """An epoch's progress bar. `epochs` is read at every redraw: a time budget's plan (made in
    the first epoch, and again as the pace changes) moves the epoch count, "?" before it."""

    def __init__(
        self, active: bool, epoch: int, epochs: Callable[[], str], total: int, start: int, bs: int
    ):
        from tqdm import tqdm

        self.bs, self.start, self.epoch, self.epochs = bs, start, epoch, epochs
        self.desc = self._desc()
        self.tqdm = tqdm(
            total=total,
            initial=start,
            desc=self.desc,
            unit="batch",
            # -q (vitlab's loggers at ERROR) hides it, as fewshot's and probe's; epoch lines stay
            disable=not active or quiet(),
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 30.0,  # keep logs short
            file=sys.stderr,
        )
        self.t0 = time.perf_counter()

    def _desc(self) -> str:
        return f"epoch {self.epoch + 1}/{self.epochs()}"

    def update(self, stats: dict) -> None:
        rate = (stats["batch"] - self.start) * self.bs / max(time.perf_counter() - self.t0, 1e-9)
        shown = {"loss": f"{stats['loss']:.3f}"}
        if stats["acc"] is not None:
            shown["acc"] = f"{100 * stats['acc']:.1f}%"
        shown["img_s"] = f"{rate:.0f}"
        desc = self._desc()
        if desc != self.desc:
            self.desc = desc
            self.tqdm.set_description_str(desc, refresh=False)
        self.tqdm.set_postfix(shown, refresh=False)  # update() redraws, every mininterval
        self.tqdm.update(stats["batch"] - self.tqdm.n)

    def close(self) -> None:
        self.tqdm.close()


def save_curves(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str, scale: float = 1.0) -> list[float] | None:
        """The epochs' values of `key`, a null one (NaN: JSON has none; no validation split) a
        gap; None when every epoch's is null."""
        values = [r[key] for r in records]
        if all(v is None for v in values):
            return None
        return [math.nan if v is None else scale * v for v in values]

    epochs = [r["epoch"] for r in records]
    accuracy = series("train_acc", 100) is not None  # a regression objective (patch_l2) has none
    fig, axes = plt.subplots(1, 1 + accuracy, figsize=(5 + 5 * accuracy, 4), squeeze=False)
    ax1, ax2 = axes[0][0], axes[0][-1]
    for ax, key, scale in ((ax1, "loss", 1.0), (ax2, "acc", 100.0))[: 1 + accuracy]:
        for split, marker, label in (("train", "o-", "train"), ("val", "s-", "validation")):
            values = series(f"{split}_{key}", scale)
            if values is not None:
                ax.plot(epochs, values, marker, label=label)
    ax1.set(xlabel="epoch", ylabel="loss", title="loss")
    if accuracy:
        ax2.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
