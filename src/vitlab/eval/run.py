"""Evaluating and using trained checkpoints: `vitlab eval` and `vitlab predict`."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import torch

from vitlab.analysis.page import out_folder
from vitlab.config import DataConfig, RunConfig, load_saved_config
from vitlab.data import ArraySplit, make_loader
from vitlab.data.classes import name_order, numbered
from vitlab.data.datasets import DatasetError, Split, check_data_dir, load_run_split, load_split
from vitlab.data.download import absolute_source
from vitlab.data.folders import decode_file, folder_root
from vitlab.data.hf import one_split
from vitlab.data.shards import is_pattern
from vitlab.eval.backends import backend_device, describe, prepare
from vitlab.eval.classification import (
    evaluate,
    format_confusion,
    save_confusion_png,
    top5_text,
)
from vitlab.formats.vitlab import resolve_checkpoint, vitlab_weights
from vitlab.models.checkpoint import load_checkpoint
from vitlab.models.indices import at_least
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import pick_device
from vitlab.validation import few

log = logging.getLogger(__name__)


def run_folder(weights: Path) -> Path | None:
    """The run folder a checkpoint belongs to (run/checkpoints/NAME/model.safetensors)."""
    run = weights.parent.parent.parent
    return run if (run / "config.yaml").is_file() else None


def run_config_of(weights: Path) -> RunConfig | None:
    """The config of the run a checkpoint belongs to, if it belongs to one."""
    run = run_folder(weights)
    if run is None:
        return None
    return load_saved_config(run / "config.yaml")


def data_config(run_cfg: RunConfig | None, data: str | None, data_dir: str | None) -> DataConfig:
    """The data a command evaluating a checkpoint reads: its run's (test source, columns, split
    seed and carve included) unless another dataset is named, then that one as it comes."""
    cfg = run_cfg.data if run_cfg else DataConfig(name="digits", split_seed=0)
    if data and not _same_source(data, cfg.name):  # restated (a link to its folder too): its own
        cfg = DataConfig(name=data, split_seed=cfg.split_seed, val_fraction=cfg.val_fraction)
    check_data_dir(data_dir)  # before a cache of its features is looked for
    return dataclasses.replace(cfg, dir=data_dir) if data_dir else cfg


def _same_source(data: str, own: str) -> bool:
    """Whether dataset name `data` names `own`: as written, or two image folders that are one
    (a link, a relative path)."""
    if absolute_source(data) == absolute_source(own):
        return True
    folders = [n.startswith("imagefolder:") and n.partition(":")[2].strip() for n in (data, own)]
    if not all(folders):
        return False
    return os.path.realpath(folder_root(data)) == os.path.realpath(folder_root(own))


def reads_whole(cfg: DataConfig, run_cfg: RunConfig | None) -> bool:
    """Whether the test split of `cfg` (data_config's, which keeps the run's own data however it
    is named) is all of it, where it is not the run's own data and has no data.test: an image
    folder without train/ or a Hugging Face dataset of one split (hf:NAME#SPLIT), whose test
    split would be a seeded fifth of it (the run's own folder keeps that fifth: the images its
    training left out), or shards named by a pattern (one split's, which has no test split of
    its own)."""
    if cfg.test or (run_cfg is not None and cfg.name == run_cfg.data.name):  # data_config
        return False  # compared the names
    if cfg.name.startswith("wds:"):
        return is_pattern(cfg.name.removeprefix("wds:"))
    if cfg.name.startswith("hf:"):
        return one_split(cfg.name.removeprefix("hf:"))
    return cfg.name.startswith("imagefolder:") and not (folder_root(cfg.name) / "train").is_dir()


def evaluation_split(
    cfg: DataConfig, split: str, classes: list[str] | None, pre: Preprocessing, whole: bool = False
) -> Split:
    """Split `split` ('val', 'test') of `cfg`'s data as vitlab eval and analyze read it: as the
    run's training read it (with data.test, labelled by the checkpoint's `classes`, so the
    training source is not read for its class names), its channels matched to the model's.
    `whole` (reads_whole): all of the source, its own classes (align_classes relabels them)."""
    if whole:
        keys = (cfg.image_key, cfg.label_key)
        part = load_split(cfg.name, "all", cfg.dir, cfg.split_seed, keys)
        if part.classes and classes and len(part.classes) < len(classes):  # lacking some
            if set(part.classes) <= set(classes):  # by name
                index = torch.tensor([classes.index(c) for c in part.classes], dtype=torch.long)
                part = dataclasses.replace(part, labels=index[part.labels], classes=list(classes))
            elif numbered(part.classes):  # by index, as data.test's folder is
                part = dataclasses.replace(part, classes=list(classes))
    else:
        part = load_run_split(cfg, split, classes or None)
    return match_channels(part, pre, cfg.name)  # e.g. grey images, an RGB model


def match_channels(split: Split, pre: Preprocessing, name: str) -> Split:
    """`split` with as many channels as the model takes (Preprocessing.match_channels: grey
    repeated to RGB, RGB converted to grey); image files are read in the model's mode anyway.
    Any other pair is a DatasetError naming both."""
    if not isinstance(split, ArraySplit) or split.images.shape[1] == pre.in_chans:
        return split
    if (images := pre.match_channels(split.images)) is None:
        raise DatasetError(
            f"{name} has {split.images.shape[1]}-channel images and the model's preprocessing "
            f"takes {pre.in_chans} channels: only grey -> any and RGB -> grey are converted"
        )
    return ArraySplit(images, split.labels, split.classes)


def align_classes(split: Split, classes: list[str], num_classes: int, name: str) -> Split:
    """`split` labelled in the order of the checkpoint's `classes` (data.classes.name_order): as it
    is, relabelled when the same names come in another order, by index with a warning when no
    name is shared; the counts must agree."""
    have = split.classes
    if len(have) != num_classes:
        raise DatasetError(
            f"{name} has {len(have)} classes, the checkpoint's model has {num_classes}"
        )
    if not classes:
        return split
    order, note = name_order(have, classes, f"{name} and the checkpoint")
    if note:
        log.warning("%s", note)
    if order is None:
        return split
    if not hasattr(split, "labels"):  # shards: labels are read with the images
        raise DatasetError(
            f"{name} names the checkpoint's classes in another order ({few(have, 5)}; the "
            f"checkpoint's: {few(classes, 5)}), and shards cannot be relabelled: evaluate their "
            "source (--data SOURCE: relabelled), or shards written in the checkpoint's order"
        )
    index = torch.tensor(order)
    return dataclasses.replace(split, labels=index[split.labels], classes=list(classes))


def _slug(name: str) -> str:
    """A dataset name as part of a file name (imagefolder:/data/x -> imagefolder-data-x)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def evaluate_checkpoint(
    checkpoint: str,
    data: str | None = None,
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int = 256,
    device: str = "auto",
    out: Path | None = None,
    backend: str = "torch",
    int8: bool = False,
    tta: str = "none",
    batch_threads: int = 1,
) -> dict:
    """Metrics of a checkpoint on a split, run by `backend` with test-time augmentation `tta`
    (vitlab.eval.backends); saves confusion_matrix.png. The dataset and its validation carve-out
    default to the checkpoint's run config."""
    if split not in ("test", "val"):  # others were evaluated as the test split, named as asked
        raise ValueError(f"split must be 'test' or 'val' (a run's validation carve-out), got "
                         f"{split!r}")  # fmt: skip
    batch_size = at_least(batch_size, 1, "batch_size")  # (torch's DataLoader: a Python int)
    if out is not None:  # a file there is refused now, not after the evaluation
        out_folder(Path(out))
    dev = _device(device, backend, int8)
    model, meta = load_checkpoint(checkpoint, device=dev)
    if meta.config.num_classes == 0:
        raise ValueError(
            f"{checkpoint} has no classifier (num_classes=0, e.g. masked-patch-prediction "
            f"pre-training): fine-tune it (vitlab train finetune.from=...), or measure its "
            f"features with vitlab fewshot / vitlab probe"
        )
    weights = vitlab_weights(checkpoint)  # a vitlab run's folder holds the data config
    run = run_folder(weights) if weights else None
    run_cfg = run_config_of(weights) if weights else None
    if split == "val" and run_cfg is None:
        raise DatasetError("--split val needs a run folder (its config defines the split)")
    cfg = data_config(run_cfg, data, data_dir)
    whole = split == "test" and reads_whole(cfg, run_cfg)  # a folder of test images: all
    name = cfg.name
    source = cfg.test if split == "test" and cfg.test else name  # where the images come from
    part = evaluation_split(
        cfg, "val" if split == "val" else "test", meta.classes, meta.preprocessing, whole
    )
    part = align_classes(part, meta.classes, meta.config.num_classes, name)
    loader = make_loader(part, batch_size, meta.preprocessing)
    runner = prepare(model, meta, backend, int8, tta=tta, batch_threads=batch_threads)
    metrics = evaluate(runner, loader, meta.config.num_classes, dev)
    if not metrics["num_images"]:  # an empty split, or every file unreadable: no 0% to report
        why = f"each of its {len(part)} skipped as unreadable" if len(part) else "it holds none"
        raise DatasetError(f"{source} ({split}): no image could be evaluated ({why})")
    target = Path(out) if out else (run or Path("."))
    augmented = tta != "none"
    other = run_cfg is None or name != run_cfg.data.name  # not the run's own split: not its PNG
    stem = f"confusion_matrix{f'_{_slug(name)}' if other else ''}_{split}"
    chosen = run is not None and weights != resolve_checkpoint(run)  # RUN/checkpoints/last:
    how = [f"_{weights.parent.name.strip('.').removesuffix('.old')}"] if chosen else []  # best's
    how += [f"_backend-{backend}"] * (backend != "torch") + ["_int8"] * int8
    how += [f"_tta-{tta}"] * augmented  # an int8 or onnxruntime matrix beside float32's
    png = target / f"{stem}{''.join(how)}.png"
    title = f"{source} {split}{f' (TTA {tta})' if augmented else ''}"
    try:  # the metrics stand where the picture cannot be written (a read-only run folder)
        target.mkdir(parents=True, exist_ok=True)
        save_confusion_png(
            metrics["confusion"], meta.classes, png, f"{title}: top-1 {100 * metrics['top1']:.2f}%"
        )
    except OSError as e:
        if isinstance(e, FileExistsError | NotADirectoryError):
            raise  # --out under or at a file: said as such (cli.main)
        log.warning("cannot write %s (%s): --out DIR writes it elsewhere", png, e)
        png = None
    return {
        "checkpoint": str(weights or checkpoint),
        "data": source,
        "split": split,
        "backend": describe(backend, int8),
        "tta": tta,
        **metrics,
        "classes": meta.classes,
        "confusion_png": png and str(png),
    }


def format_report(r: dict) -> str:
    lines = [
        f"{r['checkpoint']} on {r['data']} ({r['split']}, {r['num_images']:,} images), "
        f"backend {r.get('backend', 'torch')}"
        + (f", test-time augmentation {r['tta']}" if r.get("tta", "none") != "none" else ""),
        f"top-1 {100 * r['top1']:.2f}%{top5_text(len(r['classes']), r['top5'])}"
        f"   loss {r['loss']:.4f}",
    ]
    if "top1_cls" in r:  # a distilled model (DeiT): top-1 is its two heads' average
        lines.append(
            f"top-1 of the class head alone {100 * r['top1_cls']:.2f}%, of the distillation head "
            f"alone {100 * r['top1_dist']:.2f}%"
        )
    lines += ["", "per-class accuracy:"]
    lines += [
        f"  {c:<16} " + (f"{100 * a:6.2f}%" if a is not None else "   n/a (no images)")
        for c, a in zip(r["classes"], r["per_class"], strict=True)
    ]
    lines += ["", "confusion matrix (rows: true, columns: predicted):"]
    lines += [format_confusion(r["confusion"], r["classes"])]
    lines += ["", f"saved {r['confusion_png']}"] if r["confusion_png"] else []
    return "\n".join(lines)


def _device(device: str, backend: str, int8: bool) -> torch.device:
    """--device for a backend: `auto` is the CPU for onnxruntime and int8."""
    on_cpu = backend != "torch" or int8
    dev = pick_device("cpu" if on_cpu and device == "auto" else device, "--device")
    return backend_device(dev, backend, int8)


def predict_files(
    checkpoint: str,
    images: list[str],
    topk: int = 5,
    device: str = "auto",
    backend: str = "torch",
    int8: bool = False,
    tta: str = "none",
    batch_size: int | None = None,
) -> list:
    """Top-k classes with probabilities for each image file, run by `backend` with test-time
    augmentation `tta` (vitlab.eval.backends): {"image", "top"} for each, in order; a file that
    cannot be read gives {"image", "error"} and the others are still classified. The images go
    through the model `batch_size` at a time (default 32; 1 with `int8`, whose activations are
    quantised per batch: so each image's scores are its own)."""
    batch_size = None if batch_size is None else at_least(batch_size, 1, "batch_size")
    topk = at_least(topk, 1, "topk")
    dev = _device(device, backend, int8)
    model, meta = load_checkpoint(checkpoint, device=dev)
    if meta.config.num_classes == 0:
        raise ValueError(f"{checkpoint} has no classifier (num_classes=0): nothing to predict")
    from torchvision.transforms.v2 import functional as TF

    model = prepare(model, meta, backend, int8, tta=tta)
    k, pre = min(topk, meta.config.num_classes), meta.preprocessing
    batch = batch_size or (1 if int8 else 32)
    results: list[dict] = []
    waiting: list[tuple[dict, torch.Tensor]] = []  # (its result, its input), run together

    def classify() -> None:
        with torch.no_grad():
            probs = model(torch.stack([x for _, x in waiting]).to(dev)).float().softmax(dim=1)
        top = probs.topk(k)
        for (result, _), ps, ids in zip(
            waiting, top.values.tolist(), top.indices.tolist(), strict=True
        ):
            result["top"] = [
                {"class": meta.classes[i], "index": i, "probability": p}
                for p, i in zip(ps, ids, strict=True)
            ]
        waiting.clear()

    for path in images:
        results.append({"image": path})
        try:
            x = pre.pil(TF.to_pil_image(decode_file(path, pre.in_chans)))  # as trained
        except DatasetError as e:
            results[-1]["error"] = str(e)
            continue
        waiting.append((results[-1], x))
        if len(waiting) == batch:
            classify()
    if waiting:
        classify()
    return results
