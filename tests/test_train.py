"""Training end to end on digits: it learns, resumes exactly, survives crashes and bad losses,
runs under torchrun, and its checkpoints work with eval and predict."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import (
    TINY_MODEL,
    VITLAB,
    resume,
    torchrun_train,
    weights_of,
)
from vitlab import create_model, load_checkpoint, runtime
from vitlab.cli.main import main
from vitlab.config import ConfigError, load_run_config
from vitlab.data import load_split
from vitlab.data.datasets import DatasetError
from vitlab.formats import base as formats_base
from vitlab.models import checkpoint as checkpoint_mod
from vitlab.runtime import use_bf16
from vitlab.train import build as build_mod
from vitlab.train import state as state_mod
from vitlab.train.engine import NonFiniteLoss
from vitlab.train.folder import LOCK, claim_run_folder, holding, resume_config
from vitlab.train.run import train
from vitlab.train.state import load_weights, resolve_checkpoint

FAST = [*TINY_MODEL, "train.batch_size=64"]


def cfg(*overrides: str):
    return load_run_config(None, [*FAST, *overrides])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The default recipe (vit_nano_patch4_28 on digits), shortened."""
    out = tmp_path_factory.mktemp("runs") / "digits"
    assert main(["train", "--out", str(out), "train.epochs=15"]) == 0
    return out


def test_a_short_run_learns_and_writes_its_folder(trained_run: Path) -> None:
    records = [json.loads(x) for x in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 15
    assert records[-1]["train_loss"] < 0.5 * records[0]["train_loss"]
    assert set(records[0]) >= {
        "epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "images_per_s", "seconds"
    }  # fmt: skip
    results = json.loads((trained_run / "results.json").read_text())
    assert results["top1"] > 0.90, results["top1"]
    for name in ("config.yaml", "curves.png", "checkpoints/best/model.safetensors",
                 "checkpoints/last/model.safetensors", "checkpoints/last/state.pt"):  # fmt: skip
        assert (trained_run / name).is_file(), name
    saved = load_run_config(str(trained_run / "config.yaml"))
    assert saved.train.epochs == 15 and saved.model.name == "vit_nano_patch4_28"
    model, meta = load_checkpoint(trained_run)
    assert meta.config.in_chans == 1 and meta.config.num_classes == 10
    assert meta.preprocessing.img_size == (28, 28) and meta.classes[3] == "3"


def test_eval_cli_reports_all_metrics_and_saves_the_confusion_png(trained_run, capsys) -> None:
    assert main(["eval", str(trained_run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"top1", "top5", "loss", "per_class", "num_images", "confusion"} <= set(report)
    results = json.loads((trained_run / "results.json").read_text())
    assert report["top1"] == pytest.approx(results["top1"])
    assert report["num_images"] == 359 and len(report["per_class"]) == 10
    assert Path(report["confusion_png"]).is_file()
    assert main(["eval", str(trained_run), "--split", "val"]) == 0
    text = capsys.readouterr().out
    assert "top-1" in text and "confusion matrix" in text and "per-class" in text


def test_predict_cli_on_image_files(trained_run: Path, tmp_path: Path, capsys) -> None:
    test = load_split("digits", "test")
    paths = []
    for i in range(3):
        grey = test.images[i, 0].numpy()
        path = tmp_path / f"digit{i}.png"
        # any size and mode: saved as a large RGB picture
        Image.fromarray(np.stack([grey] * 3, axis=-1)).resize((64, 64)).save(path)
        paths.append(str(path))
    assert main(["predict", str(trained_run), *paths, "--topk", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["image"] for r in results] == paths
    for r in results:
        probs = [p["probability"] for p in r["top"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1.0001
    hits = sum(r["top"][0]["index"] == y for r, y in zip(results, test.labels[:3].tolist()))
    assert hits >= 2
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    # an unreadable file among readable ones: named, exit code 2, and the others still classified
    assert (
        main(["predict", str(trained_run), paths[0], str(bad), paths[1], "--topk", "3", "--json"])
        == 2
    )
    out, err = capsys.readouterr()
    assert f"cannot read image {bad}" in err and "1 of 3 images skipped; the other 2 are" in err
    again = json.loads(out)
    assert [r["image"] for r in again] == [paths[0], str(bad), paths[1]]
    assert again[0] == results[0] and again[2] == results[1] and "cannot read" in again[1]["error"]
    assert main(["predict", str(trained_run), paths[0], str(bad)]) == 2
    assert "1 of 2 images skipped; the other 1 is classified" in capsys.readouterr().err
    (tmp_path / "empty.png").write_bytes(b"")  # said as what they are, not PIL's words
    assert main(["predict", str(trained_run), str(tmp_path), str(tmp_path / "empty.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: it is a folder (name its images: {tmp_path / '*'})" in err, err
    assert "empty.png: an empty file" in err, err
    assert main(["predict", str(trained_run), str(bad), paths[0]]) == 2
    out, err = capsys.readouterr()
    assert "cannot read image" in err and out.startswith(paths[0]) and str(bad) not in out


def test_predict_runs_the_images_in_batches_each_as_its_own_forward_gives(
    trained_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """predict ran the model on one image at a time (1.4x a timm script's time per image); the
    images now go `--batch-size` at a time (32 by default), an unreadable one among them, with
    each image's probabilities those of the model on it alone, in the given order."""
    from vitlab import load_checkpoint
    from vitlab.data.folders import read_image
    from vitlab.eval.run import predict_files
    from vitlab.models.vit import VisionTransformer

    test = load_split("digits", "test")
    paths = []
    for i in range(7):
        path = tmp_path / f"d{i}.png"
        Image.fromarray(test.images[i, 0].numpy()).resize((40, 40)).save(path)
        paths.append(str(path))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    files = [*paths[:3], str(bad), *paths[3:]]
    batches, forward = [], VisionTransformer.forward

    def counted(self, x, *args, **kwargs):  # the forward passes' batch sizes
        batches.append(len(x))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(VisionTransformer, "forward", counted)
    assert main(["predict", str(trained_run), *files, "--batch-size", "3", "--json"]) == 2
    assert batches == [3, 3, 1]
    results = json.loads(capsys.readouterr().out)
    assert [r["image"] for r in results] == files and "error" in results[3]
    model, meta = load_checkpoint(trained_run)
    for r, path in zip([*results[:3], *results[4:]], paths, strict=True):
        with torch.no_grad():  # the image alone, preprocessed as its checkpoint says
            alone = model(meta.preprocessing.pil(read_image(path, "L"))[None]).softmax(dim=1)[0]
        top = alone.topk(5)
        assert [p["index"] for p in r["top"]] == top.indices.tolist()
        np.testing.assert_allclose([p["probability"] for p in r["top"]], top.values, atol=1e-6)
    batches.clear()
    assert main(["predict", str(trained_run), *paths, "--json"]) == 0
    assert batches == [7]  # the default batch holds them all
    batches.clear()  # int8 quantises activations per batch: each image alone, so its own scores
    assert main(["predict", str(trained_run), *paths, "--int8", "--json"]) == 0
    assert len(batches) == 7 and set(batches) == {1}
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        predict_files(str(trained_run), paths, batch_size=0)


def test_resume_is_exact(tmp_path: Path) -> None:
    """4 epochs straight == 2 epochs, stop, resume to 4 (augmentation, mixup, dropout, EMA on)."""
    extra = [
        "data.crop_padding=1",
        "data.hflip=0.5",
        "data.mixup=0.5",
        "model.dropout=0.1",
        "model.drop_path=0.1",
        "train.ema=0.9",
        "optim.label_smoothing=0.1",
    ]
    straight = train(cfg(*extra, "train.epochs=4"), out=tmp_path / "straight")
    half = train(cfg(*extra, "train.epochs=4", "train.stop_at_epoch=2"), out=tmp_path / "half")
    assert len((half / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (half / "results.json").exists()
    resumed = resume(half)
    a, b = weights_of(straight), weights_of(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    best_a, best_b = weights_of(straight, "best"), weights_of(resumed, "best")
    assert torch.equal(best_a["head.weight"], best_b["head.weight"])
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2, 3, 4]


def test_every_epoch_is_a_fresh_shuffle(tmp_path: Path, monkeypatch) -> None:
    """Each epoch draws its own permutation: epochs 1 and 2 see different batch orders, and each
    epoch sees every sample at most once (the plan once repeated epoch 1's order forever)."""
    from vitlab.data import loader as loader_mod

    seen: list[list[int]] = []
    original = loader_mod.BatchPlan.batches

    def recording(self, *args, **kwargs):
        order: list[int] = []
        if self.shuffle:
            seen.append(order)
        for chunk in original(self, *args, **kwargs):
            order.extend(chunk.tolist())
            yield chunk

    monkeypatch.setattr(loader_mod.BatchPlan, "batches", recording)
    train(cfg("train.epochs=3", "data.val_fraction=0"), out=tmp_path / "r")
    assert len(seen) == 3
    for order in seen:
        assert len(order) == len(set(order)) == (len(order) // 64) * 64
    assert seen[0] != seen[1] and seen[1] != seen[2] and seen[0] != seen[2]
    assert set(seen[0]) != set(seen[1])  # the dropped remainder differs too


def test_resume_may_only_change_the_length(tmp_path: Path, capsys) -> None:
    run = train(cfg("train.epochs=1"), out=tmp_path / "r")
    assert main(["train", "--resume", str(run), "optim.lr=0.1"]) == 2
    assert "cannot change optim.lr when resuming" in capsys.readouterr().err
    saved = load_run_config(str(run / "config.yaml"))
    same = [f"optim.lr={saved.optim.lr}", f"train.seed={saved.train.seed}"]  # restated: no change
    assert resume_config(run, same) == saved
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "nothing: no such folder" in capsys.readouterr().err
    assert main(["train", "--resume", str(run / "config.yaml")]) == 2
    assert "config.yaml: not a folder (expected a run folder)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "data.val_fraction=0.5"]) == 2  # a raw tuple
    err = capsys.readouterr().err  # once
    assert (
        "(only the run's length: train.epochs, train.stop_at_epoch; and the CPU it takes: "
        "train.threads, data.workers)" in err
    ), err
    machine = resume_config(run, ["train.threads=1", "data.workers=0"])  # another machine's
    assert (machine.train.threads, machine.data.workers) == (1, 0)
    assert main(["train", "--resume", str(run), "--extend"]) == 0  # finished: nothing to do
    assert "the run's train.epochs is 1 already, so it keeps its length" in capsys.readouterr().err


def test_a_checkpoint_of_another_model_or_process_count_is_said_on_resume(
    tmp_path: Path, capsys, caplog
) -> None:
    """Weights of another model in a run's checkpoint (copied over by hand) stopped --resume with
    PyTorch's traceback (exit 1); a checkpoint saved by two processes resumed on one went on
    without a word, though not as the run would have (each process's random stream)."""
    run = train(cfg("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "r")
    other = train(cfg("train.epochs=1", "model.depth=1"), out=tmp_path / "other")
    weights = Path("checkpoints", "last", "model.safetensors")
    shutil.copytree(run, tmp_path / "swapped")
    shutil.copy(other / weights, tmp_path / "swapped" / weights)
    assert main(["train", "--resume", str(tmp_path / "swapped")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'swapped' / weights} (the model is the run's config.yaml's)" in err, err
    assert "does not fit the model" in err and "missing from the checkpoint: blocks.1." in err
    state = torch.load(run / "checkpoints" / "last" / "state.pt", weights_only=True)
    other = torch.get_num_threads() + 1  # and on another number of threads than saved it
    two = {**state, "rng_ranks": [state["rng_ranks"][0], state["rng_ranks"][0]], "threads": other}
    torch.save(two, run / "checkpoints" / "last" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        rng = state_mod.saved_rng(two, runtime.Dist(), 0, torch.device("cpu"))
        assert torch.equal(rng["torch"], state["rng_ranks"][0]["torch"])  # rank 0's stream
        state_mod.saved_rng(state, runtime.Dist(), 0, torch.device("cpu"))  # 1 and 1: nothing
        resume(run)
    said = [r.getMessage() for r in caplog.records if "is resumed on" in r.getMessage()]
    assert (
        said
        == [
            "the checkpoint was saved by 2 processes and is resumed on 1 process: "
            "training goes on reproducibly, but not exactly as the run would have (each "
            "process has its own random stream); resume on 2 processes for that"
        ]
        * 2
    )
    assert "float sums run in another order" not in caplog.text  # the process count says it
    caplog.clear()
    again = train(cfg("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "threads")
    saved = torch.load(again / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert saved["threads"] == torch.get_num_threads()  # the count that summed its floats
    torch.save({**saved, "threads": other}, again / "checkpoints" / "last" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        resume(again)
        older = {k: v for k, v in saved.items() if k != "threads"}  # saved before the count
        state_mod.check_threads(older, runtime.Dist(), torch.device("cpu"))  # was kept: quiet
    threads = [r.getMessage() for r in caplog.records if "float sums run" in r.getMessage()]
    assert len(threads) == 1 and f"saved by a run on {other} threads and goes on with" in threads[0]


def test_the_command_that_continues_a_run_is_the_one_it_ran_under(monkeypatch) -> None:
    """Under torchrun a stop said `vitlab train --resume RUN`: one process, which goes on but not
    exactly (the same number of processes continues exactly)."""
    from vitlab.train.distributed import resume_command

    assert resume_command("r", runtime.Dist()) == "`vitlab train --resume r`"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = runtime.Dist(rank=1, world=2)
    assert resume_command("r", two) == "`torchrun --nproc_per_node=2 -m vitlab train --resume r`"
    four = runtime.Dist(rank=0, world=4)  # two nodes of two
    assert resume_command("r", four) == (
        "`torchrun --nnodes=2 (and your rendezvous options) --nproc_per_node=2 -m vitlab train "
        "--resume r`"
    )


def test_a_relative_data_path_is_saved_absolute(tmp_path: Path, monkeypatch, capsys) -> None:
    """data.name=imagefolder:RELATIVE was saved as typed, so eval / fewshot / probe of the run
    from any other folder said "image folder ... does not exist"; a restated relative path on
    --resume is the same data."""
    work = tmp_path / "work"
    digits = load_split("digits", "test")
    for i, (image, label) in enumerate(zip(digits.images[:150], digits.labels.tolist())):
        folder = work / "pics" / ("train" if i < 120 else "test") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy().astype(np.uint8)).save(folder / f"{i}.png")
    monkeypatch.chdir(work)
    data = ["data.name=imagefolder:pics/train", "data.test=imagefolder:pics/test"]
    run = train(cfg("train.epochs=1", "data.val_fraction=0.0", *data), out=tmp_path / "r")
    saved = load_run_config(str(run / "config.yaml"))
    assert saved.data.name == f"imagefolder:{work / 'pics' / 'train'}"
    assert saved.data.test == f"imagefolder:{work / 'pics' / 'test'}"
    resume_config(run, data)  # restated relative: the same data, accepted
    restated = main(["eval", str(run), "--data", "imagefolder:pics/train", "--json"])
    assert restated == 0  # the run's own data: its data.test's 30 images, not a carve of train
    assert json.loads(capsys.readouterr().out)["num_images"] == 30
    from vitlab.train.log import saved_tree  # a teacher on disk too (a hub name stays a name)

    teacher = cfg("distill.teacher=pics", "finetune.from=org/model")
    assert saved_tree(teacher)["distill"]["teacher"] == str(work / "pics")
    assert saved_tree(teacher)["finetune"]["from"] == "org/model"
    monkeypatch.chdir(tmp_path)  # elsewhere: the run still names its data
    assert main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_images"] > 0


def test_the_progress_bar_counts_the_epochs_max_steps_covers() -> None:
    """train.max_steps=30 ends a 40-epoch run of 22 steps an epoch in its second epoch; the bar
    said `epoch 1/40`."""
    from vitlab.train.budget import epochs_shown

    assert epochs_shown(None, cfg("train.epochs=40", "train.max_steps=30"), 22) == "2"
    assert epochs_shown(None, cfg("train.epochs=40", "train.max_steps=44"), 22) == "2"
    assert epochs_shown(None, cfg("train.epochs=40"), 22) == "40"
    assert epochs_shown(None, cfg("train.epochs=1", "train.max_steps=30"), 22) == "1"


def test_a_warm_up_as_long_as_the_run_is_warned(tmp_path: Path, caplog) -> None:
    """train.max_steps=3 with a warm-up of one epoch (many more steps): the rate only rose, to
    lr * 3 / warm-up steps, and the run ended there without a word. Now a warning says so (by
    hand: the last step's rate); a run with steps left to decay, or a time budget, is not warned."""
    from vitlab.train.optim import warn_warmup

    schedule = ["optim.lr=0.001", "optim.warmup_epochs=1", "optim.schedule=cosine"]
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        run = train(cfg(*schedule, "train.max_steps=3"), out=tmp_path / "steps")
    said = [r.getMessage() for r in caplog.records if "spans the whole run" in r.getMessage()]
    assert len(said) == 1, said
    steps_per_epoch = int(re.search(r"\((\d+) steps\) spans the whole run \(3 steps\)", said[0])[1])
    assert steps_per_epoch == len(load_split("digits", "train")) * 9 // 10 // 64  # val 10%
    assert f"to {0.001 * 3 / steps_per_epoch:.3g} at the last step" in said[0], said
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["lr"] == pytest.approx(0.001 * 3 / steps_per_epoch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        warn_warmup(load_run_config(None, schedule), 100, 40)  # decays over 60 steps
        warn_warmup(load_run_config(None, [*schedule, "train.time_budget=1m"]), 30, 40)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        warn_warmup(load_run_config(None, schedule), 1, 1)  # one step: no "1 steps"
    assert "(1 step) spans the whole run (1 step):" in caplog.records[0].getMessage(), caplog.text


def test_a_length_the_run_cannot_reach_is_warned(tmp_path: Path, caplog) -> None:
    """train.max_steps=100 with train.epochs=1 trained one epoch's 20 steps without a word (a
    timm user expects 100: epochs bound it, README says), and train.stop_at_epoch past the
    epochs was taken silently: both are warned, with the step the run ends at (as trained)."""
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        run = train(cfg("train.epochs=1", "train.max_steps=100", "train.stop_at_epoch=3",
                        "optim.warmup_epochs=0"), out=tmp_path / "r")  # fmt: skip
    per_epoch = len(load_split("digits", "train")) * 9 // 10 // 64  # val 10%
    assert torch.load(run / "checkpoints" / "last" / "state.pt", weights_only=True)["step"] == (
        per_epoch
    )
    text = caplog.text
    assert f"train.max_steps=100 is more than train.epochs=1 take ({per_epoch} steps)" in text
    assert "train.stop_at_epoch=3 is past train.epochs=1" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        train(cfg("train.epochs=2", "train.max_steps=3", "optim.warmup_epochs=0"),
              out=tmp_path / "s")  # fmt: skip
    assert "max_steps" not in caplog.text and "stop_at_epoch" not in caplog.text


def test_settings_nothing_reads_are_warned(tmp_path: Path, capsys) -> None:
    """optim.momentum under adamw, optim.betas under sgd, a RandAugment magnitude without its
    ops and a crop scale without the random resized crop were taken silently (a QA run set
    each, expecting an effect); each is warned, and one that applies is not."""
    base = ["train", *FAST, "train.epochs=1", "optim.warmup_epochs=0"]
    unused = ["optim.momentum=0.5", "data.randaugment_magnitude=20", "data.crop_scale=[0.5,1.0]",
              "finetune.new_head=true"]  # fmt: skip
    assert main([*base, *unused, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "finetune.new_head is set but not used: it applies with finetune.from" in err
    assert "optim.momentum is set but not used: it applies with optim.name=sgd" in err
    assert "data.randaugment_magnitude is set but not used: it applies with" in err
    assert "data.crop_scale is set but not used: it applies with data.random_resized_crop" in err
    used = ["optim.name=sgd", "optim.momentum=0.5", "optim.betas=[0.8,0.9]"]
    assert main([*base, *used, "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "optim.betas is set but not used: it applies with optim.name=adamw" in err
    assert "momentum" not in err


def test_a_new_length_on_resume_is_refused_unless_extended(tmp_path: Path, capsys) -> None:
    """train.epochs on --resume used to reshape the cosine schedule silently. Now it is refused;
    with --extend the schedule spans the new length from the current step on, and says so."""
    import math

    schedule = ["optim.lr=0.001", "optim.warmup_epochs=1", "optim.schedule=cosine"]
    run = train(cfg(*schedule, "train.epochs=4", "train.stop_at_epoch=2"), out=tmp_path / "r")
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run), "train.epochs=6"]) == 2
    err = capsys.readouterr().err
    assert "train.epochs=6 differs from the run's 4" in err and "--extend" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, nothing lost
    with pytest.raises(ConfigError, match="--extend"):
        resume(run, "train.epochs=3")
    assert main(["train", "--resume", str(run), "train.epochs=6", "--extend"]) == 0
    extended = capsys.readouterr().err
    assert "extending the run from 4 to 6 epochs" in extended
    assert main(["train", "--resume", str(run), "train.epochs=5", "--extend"]) == 2
    assert "has trained 6 epochs already" in capsys.readouterr().err
    steps = train(cfg(*schedule, "train.max_steps=3"), out=tmp_path / "steps")
    assert main(["train", "--resume", str(steps), "train.epochs=50", "--extend"]) == 2
    assert "schedule of a train.time_budget or train.max_steps run" in capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5, 6]
    state = torch.load(run / "checkpoints/last/state.pt", weights_only=True)
    per_epoch = state["step"] // 6
    assert state["step"] == 6 * per_epoch

    def cosine(step: int, total: int) -> float:  # warm-up of one epoch, then cosine to 0
        if step < per_epoch:
            return 0.001 * (step + 1) / per_epoch
        return 0.001 * 0.5 * (1 + math.cos(math.pi * (step - per_epoch) / (total - per_epoch)))

    for r in records[:2]:  # planned over 4 epochs
        assert r["lr"] == pytest.approx(cosine(r["epoch"] * per_epoch - 1, 4 * per_epoch))
    for r in records[2:]:  # extended: over 6 epochs from step 2 * per_epoch on
        assert r["lr"] == pytest.approx(cosine(r["epoch"] * per_epoch - 1, 6 * per_epoch))
    now, was = cosine(2 * per_epoch, 6 * per_epoch), cosine(2 * per_epoch, 4 * per_epoch)
    said = (  # steps counted from 1: the next one is step 2e + 1
        f"the next step's learning rate (step {2 * per_epoch + 1}) is {now:.3e} (was {was:.3e}), "
        f"the last's (step {6 * per_epoch}) {records[-1]['lr']:.3e}"
    )
    assert said in extended, extended
    assert "epochs: 6" in (run / "config.yaml").read_text()


def test_out_naming_an_existing_run_is_refused_unless_overwritten(tmp_path: Path, capsys) -> None:
    """--out at an existing run once wiped its metrics.jsonl; now refused, naming --resume and
    --overwrite; --overwrite replaces the old run's files."""
    out = tmp_path / "r"
    args = ["train", *FAST, "train.epochs=1", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    (out / "metrics.jsonl").write_text('{"epoch": 1, "marker": "old run"}\n')
    (out / "notes.txt").write_text("the user's own file")
    (out / "time_budget.json").write_text('{"steps": 3, "final": true}\n')  # an old plan
    assert main(["eval", str(out), "--data", "digits", "--split", "val"]) == 0  # its matrix
    assert (out / "confusion_matrix_val.png").is_file()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert "old run" in (out / "metrics.jsonl").read_text()
    (out / "elsewhere").mkdir()  # a run that stopped before its first checkpoint (a NaN loss):
    shutil.copytree(out / "checkpoints", out / "elsewhere" / "checkpoints")
    shutil.rmtree(out / "checkpoints")  # not told to --resume it, which would fail
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "it has no checkpoint to continue from: choose another --out, or pass --overwrite" in err
    assert "--resume" not in err
    shutil.move(out / "elsewhere" / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "elsewhere")
    missing = "data.name=imagefolder:" + str(tmp_path / "missing")
    assert main([*args[:-2], missing, *args[-2:], "--overwrite"]) == 2  # fails on bad input:
    assert "old run" in (out / "metrics.jsonl").read_text()  # the old run stays whole
    assert (out / "checkpoints" / "last").is_dir() and (out / "time_budget.json").exists()
    finetune = "finetune.from=" + str(out)  # read first, then replaced
    assert main([*args[:-2], finetune, *args[-2:], "--overwrite"]) == 0
    assert "old run" not in (out / "metrics.jsonl").read_text()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "notes.txt").read_text() == "the user's own file"  # not a run file: kept
    assert not (out / "time_budget.json").exists()  # a later --resume would keep its plan
    assert not (out / "confusion_matrix_val.png").exists()  # the old checkpoint's results
    assert main(["train", "--resume", str(out), "--overwrite"]) == 2  # once silently ignored
    assert "drop --config/--out/--overwrite" in capsys.readouterr().err
    kept = tmp_path / "elsewhere"  # a symlinked run folder part: the link goes, not its target
    shutil.move(out / "checkpoints", kept)
    (out / "checkpoints").symlink_to(kept)
    assert main([*args, "--overwrite"]) == 0  # rmtree refused the link: a failed replace
    assert (out / "checkpoints").is_dir() and not (out / "checkpoints").is_symlink()
    assert (kept / "last" / "model.safetensors").is_file()
    alone = tmp_path / "plan-only"  # a run stopped before its first checkpoint
    alone.mkdir()
    (alone / "time_budget.json").write_text('{"steps": 3, "final": true}\n')
    assert main(["train", *FAST, "train.epochs=1", "--out", str(alone)]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *FAST, "train.epochs=1", "--out", str(empty)]) == 0


HOLD = (  # a process holding a run folder's lock as a running `vitlab train` does
    "import sys, time; from pathlib import Path; from vitlab.train.folder import "
    "claim_run_folder; print(claim_run_folder(Path(sys.argv[1]), True), flush=True); "
    "time.sleep(300)"
)


def another_claim(out: Path) -> bytes:
    """What another process claiming `out` says first: b"None" where it took the lock."""
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE)
    try:
        return other.stdout.readline().strip()
    finally:
        other.kill()
        other.wait()


def test_a_folder_another_vitlab_train_runs_in_is_refused(tmp_path: Path, capsys) -> None:
    """Two `vitlab train --out X` started together both passed the check for a run in X and
    wrote into one folder, as could a second --resume of X: X's lock (an flock, held while a run
    lasts) refuses the second, naming the holder, and writes nothing; a killed holder leaves no
    stale lock."""
    out = tmp_path / "r"
    args = ["train", *FAST, "train.epochs=1", "--out", str(out)]
    for command in (args, ["train", "--resume", str(out)]):  # a new run, then a resumed one
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline().strip() == b"None"  # it holds the lock
            before = sorted(p.name for p in out.iterdir())
            assert main(command) == 2
            err = capsys.readouterr().err
            assert f"in use by another `vitlab train` (pid {holder.pid} on" in err, err
            assert sorted(p.name for p in out.iterdir()) == before  # nothing written
        finally:
            holder.kill()
            holder.wait()
        if command is args:
            assert main(args) == 0  # the killed holder's lock went with it
    assert main(["train", "--resume", str(out), "train.epochs=2", "--extend"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    (tmp_path / "a-file").write_text("not a folder")
    assert main([*args[:-1], str(tmp_path / "a-file")]) == 2
    assert f"{tmp_path / 'a-file'} is a file: expected a folder" in capsys.readouterr().err
    bad = "data.name=imagefolder:" + str(tmp_path / "missing")
    assert main([*args[:-2], bad, "--out", str(tmp_path / "new" / "nested")]) == 2
    assert not (tmp_path / "new").exists()  # a start that failed left nothing, lock included
    assert (out / ".vitlab-lock").exists()  # a run's own stays


def test_a_lock_file_removed_as_it_is_taken_is_not_held(tmp_path: Path, monkeypatch) -> None:
    """A failed start removes the lock file it made as it lets go of the lock: a second start
    that opened the file just before then locked a file no longer in the folder, while a third
    could lock the new one, and both ran there. The lock is taken again on the file that is."""
    from vitlab.train import folder

    out = tmp_path / "r"
    out.mkdir()
    (out / folder.LOCK).write_text("")
    opened = folder._open_existing

    def removed_once_open(path: Path) -> int:
        fd = opened(path)
        path.unlink()  # the failed start's release, between this open and the flock
        return fd

    monkeypatch.setattr(folder, "_open_existing", removed_once_open)
    assert folder.claim_run_folder(out, overwrite=False) is None
    try:
        (held,) = [h for h in folder._held if h[2] == out]
        assert os.fstat(held[1]).st_ino == (out / folder.LOCK).stat().st_ino  # the file there
        assert b"in use by another `vitlab train`" in another_claim(out)  # refused
    finally:
        folder.release_run_folders()


def test_a_forked_child_does_not_keep_the_runs_lock(tmp_path: Path) -> None:
    """DataLoader workers are forked with the lock's descriptor: a killed run's lock stayed
    while they lived on. A child closes its copy; the parent's still holds the lock."""
    from vitlab.train import folder

    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("a file of the user's: the lock file stays")
    assert folder.claim_run_folder(out, overwrite=False) is None
    child = os.fork()
    if child == 0:  # a worker that outlives its run
        time.sleep(60)
        os._exit(0)
    try:
        assert b"in use by another `vitlab train`" in another_claim(out)  # held
        folder.release_run_folders()  # the run ends; its worker lives on
        assert another_claim(out) == b"None"  # the lock went with the run
    finally:
        folder.release_run_folders()
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_filesystem_without_locks_runs_with_a_warning(
    tmp_path: Path, monkeypatch, capsys, caplog
):
    """Where flock fails for another reason than a holder (ENOLCK on some NFS mounts), the run
    is not refused: a warning says the folder is not locked."""
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert main(["train", *FAST, "train.epochs=1", "--out", str(tmp_path / "r")]) == 0
    assert "warning: could not lock the run folder" in capsys.readouterr().err
    assert not (tmp_path / "r" / LOCK).exists()  # a lock file nothing holds is not left
    out = tmp_path / "reproduce"  # `vitlab reproduce all`: its experiments re-enter the hold
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"), holding(out, "a"), holding(out, "b"):
        pass
    said = [r for r in caplog.records if "could not lock" in r.getMessage()]
    assert len(said) == 1 and not list(out.iterdir())  # once, and no lock file left


def test_a_lock_file_of_an_older_vitlab_names_the_process(tmp_path: Path) -> None:
    """A lock file an older vitlab wrote holds "pid N on HOST" alone: the refusal says that."""
    out = tmp_path / "r"
    out.mkdir()
    script = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "os.write(fd, b'pid 7 on old-host'); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(300)"
    )
    old = subprocess.Popen([sys.executable, "-c", script, str(out / LOCK)], stdout=subprocess.PIPE)
    try:
        assert old.stdout.readline().strip() == b"held"
        refusal = claim_run_folder(out, overwrite=False)
        assert "in use by another process (pid 7 on old-host)" in refusal, refusal
    finally:
        old.kill()
        old.wait()


def test_resume_drops_metrics_of_epochs_the_checkpoint_does_not_hold(tmp_path: Path) -> None:
    """A kill after an epoch's metrics line but before its checkpoint: that epoch is trained
    again on resume, and logged once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    run = train(cfg("train.epochs=3", "train.stop_at_epoch=1"), out=tmp_path / "r")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2, "train_loss": 9.0}\n{"epoch": 3, "tr')  # and a torn line
    first = set((run / "tensorboard").iterdir())
    with SummaryWriter(str(run / "tensorboard")) as tb:  # the killed run's TensorBoard event
        tb.add_scalar("train_loss", 9.0, 2)
    # TensorBoard reads a folder's event files in name order: time (seconds), host, pid, then a
    # count per process. The killed run's file is named before the resume's, as a real one is
    # (an earlier second); made in the resume's second, count 9 against 10 had named it after.
    (killed,) = set((run / "tensorboard").iterdir()) - first
    killed.rename(killed.with_name("events.out.tfevents.0000000001.killed"))
    resume(run)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records[1]["train_loss"] != 9.0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()  # what TensorBoard shows: each epoch once, the retrained epoch 2's loss
    logged = [(e.step, round(e.value, 6)) for e in events.Scalars("train_loss")]
    assert logged == [(r["epoch"], r["train_loss"]) for r in records]


def test_ctrl_c_saves_and_resume_finishes_identically(tmp_path: Path) -> None:
    # one thread each: the uninterrupted run trains alongside (two 2-thread processes on two
    # cores wait on each other's threads)
    args = [*VITLAB, "train", *FAST, "train.epochs=6", "train.threads=1"]
    straight, log = tmp_path / "straight", tmp_path / "straight.log"
    with open(log, "w") as f:
        uninterrupted = subprocess.Popen([*args, "--out", str(straight)], stdout=f, stderr=f)
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [*args, "--out", str(stopped)], stderr=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        for line in proc.stderr:  # interrupt as soon as the first epoch is done
            if line.startswith("epoch 1:"):
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, rest
        assert uninterrupted.wait(timeout=300) == 0, log.read_text()[-2000:]
    finally:
        for p in (proc, uninterrupted):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "checkpoint saved" in rest and "--resume" in rest
    state = torch.load(stopped / "checkpoints/last/state.pt", weights_only=True)
    assert state["epoch"] < 6
    resume(stopped)
    a, b = weights_of(straight), weights_of(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigterm_in_the_training_loop_saves_and_exits_143(tmp_path, monkeypatch, capsys):
    """SIGTERM inside the training loop saved and exited 130, Ctrl-C's code; 143 now, as a
    SIGTERM anywhere else (and as the signal's default action would give)."""
    from vitlab.train import run as run_mod

    real = run_mod.train_epoch

    def terminated(*a, **k):
        signal.raise_signal(signal.SIGTERM)  # the stop flag's handler: stop before a step, save
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "train_epoch", terminated)
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *FAST, "train.epochs=2"]) == 143
    err = capsys.readouterr().err
    assert "stopped at epoch 1, batch 0; checkpoint saved" in err and "--resume" in err, err
    assert (run / "checkpoints" / "last" / "state.pt").is_file()


def test_ctrl_c_after_the_last_epoch_is_one_line_and_resume_finishes(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the trained run writes its curves (outside the training loop's handler)
    was a KeyboardInterrupt traceback; now exit code 130 and a line on how to finish."""
    from vitlab.train import log as log_mod

    real = log_mod.save_curves

    def ctrl_c(*a, **k):
        monkeypatch.setattr(log_mod, "save_curves", real)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(log_mod, "save_curves", ctrl_c)
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *FAST, "train.epochs=2"]) == 130
    err = capsys.readouterr().err
    assert "vitlab train: interrupted" in err and "--resume" in err and "Traceback" not in err
    assert not (run / "results.json").exists()
    assert main(["train", "--resume", str(run)]) == 0
    assert json.loads((run / "results.json").read_text())["top1"] > 0.1  # chance: 0.1


def test_ctrl_c_during_the_last_epochs_save_stops_before_the_test(tmp_path, monkeypatch, capsys):
    """A Ctrl-C as the last epoch was saved said "stop requested: saving a checkpoint after this
    step", then ran the whole test and exited 0 (a QA pass): now the run stops there, exit 130,
    and --resume evaluates the test split."""
    import os

    from vitlab.train.run import Run

    real = Run.save

    def save(self, name, *args, **kwargs):
        real(self, name, *args, **kwargs)
        if name == "last" and self.pos.epoch == at:  # the handler's signal
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Run, "save", save)
    at, run = 1, tmp_path / "early"  # at train.stop_at_epoch's: it exited 0 (a review)
    assert (
        main(["train", "--out", str(run), *FAST, "train.epochs=2", "train.stop_at_epoch=1"]) == 130
    )
    assert "stopped after epoch 1; checkpoint saved: continue with" in capsys.readouterr().err
    at, run = 2, tmp_path / "run"
    assert main(["train", "--out", str(run), *FAST, "train.epochs=2"]) == 130
    err = capsys.readouterr().err
    assert "stopped after epoch 2; checkpoint saved: continue with" in err, err
    assert not (run / "results.json").exists() and "Traceback" not in err
    monkeypatch.setattr(Run, "save", real)
    assert main(["train", "--resume", str(run)]) == 0
    assert json.loads((run / "results.json").read_text())["top1"] > 0.1  # chance: 0.1


def test_sigterm_after_the_last_epoch_is_one_line(tmp_path, monkeypatch, capsys):
    """A real SIGTERM while the trained run writes its curves (after the training loop, whose
    handler saves and stops) ended the process silently with 143; now the same exit code and a
    line on how to finish, and the caller's SIGTERM handler is back afterwards."""
    from vitlab.train import log as log_mod

    real = log_mod.save_curves

    def sigterm(*a, **k):
        monkeypatch.setattr(log_mod, "save_curves", real)  # once
        signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
        raise AssertionError("SIGTERM did not stop the command")

    def caller(signum, frame):  # the test process's own: without vitlab's, the test fails
        raise RuntimeError("SIGTERM reached the caller's handler")

    monkeypatch.setattr(log_mod, "save_curves", sigterm)
    before = signal.signal(signal.SIGTERM, caller)
    run = tmp_path / "run"
    try:
        assert main(["train", "--out", str(run), *FAST, "train.epochs=1"]) == 143
        assert signal.getsignal(signal.SIGTERM) is caller
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "vitlab train: terminated" in err and "--resume" in err and "Traceback" not in err
    assert (run / "checkpoints" / "last").is_dir() and not (run / "results.json").exists()


def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    run = train(cfg("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "run")
    before = weights_of(run)
    last = run / "checkpoints" / "last"

    def die(*a, **k):
        raise OSError("simulated kill while writing")

    monkeypatch.setattr(formats_base, "save_file", die)
    with pytest.raises(state_mod.CheckpointWriteError, match="simulated.*is intact"):
        resume(run)
    monkeypatch.undo()
    after = load_weights(resolve_checkpoint(last))
    assert all(torch.equal(before[k], after[k]) for k in before)

    # killed between the two renames: only the aside copy exists, and it is found
    real_replace, calls = os.replace, []

    def die_before_the_new_one_lands(src, dst):
        calls.append(dst)
        if Path(dst) == last and Path(src).name == ".last.tmp":  # old one already moved aside
            raise OSError("simulated kill mid-swap")
        real_replace(src, dst)

    monkeypatch.setattr(state_mod.os, "replace", die_before_the_new_one_lands)
    with pytest.raises((OSError, state_mod.CheckpointWriteError), match="mid-swap"):
        resume(run)
    monkeypatch.undo()
    assert not last.exists() and calls
    assert resolve_checkpoint(last).parent.name == ".last.old"
    aside = load_weights(run / "checkpoints" / ".last.old" / "model.safetensors")
    assert all(torch.equal(before[k], aside[k]) for k in before)


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    run = train(cfg("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "run")
    before = weights_of(run)
    real_ce, calls = torch.nn.functional.cross_entropy, [0]

    def poisoned(logits, target, **kw):
        calls[0] += 1
        loss = real_ce(logits, target, **kw)
        return loss * float("nan") if calls[0] == 5 else loss

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned)
    with pytest.raises(
        NonFiniteLoss, match=r"loss became nan at step \d+ \(epoch 2, batch 5\)"
    ) as e:
        resume(run)
    # the rate of the update that made the weights, by hand: both epochs are the default 2
    # warm-up epochs, where step k updates at lr (k + 1) / warm-up steps; k = this step - 1
    step = int(re.search(r"at step (\d+)", str(e.value))[1])
    warmup = 2 * (len(load_split("digits", "train")) * 9 // 10 // 64)  # val 10%, batch 64
    rate = 0.002 * step / warmup
    assert f"after an update at learning rate {rate:.3g} (optim.lr=0.002)" in str(e.value)
    calls[0] = 4  # a new run's first loss: no update made those weights, so no rate is blamed
    with pytest.raises(NonFiniteLoss, match=r"at step 0 .*, before an update \(optim.lr="):
        train(cfg("train.epochs=1"), out=tmp_path / "fresh")
    monkeypatch.undo()
    after = weights_of(run)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_gradients_skip_the_step_and_stop_the_run_when_they_persist(
    tmp_path, monkeypatch, caplog
):
    """A finite loss with NaN gradients at an epoch's last step: that step is skipped (weights
    unchanged, as AMP's scaler skips), said, and neither `last` nor `best` gets NaN weights (the
    epoch end saved NaN weights over both). Ten in a row and more stop the run, both kept."""
    import logging

    run = train(cfg("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "run")
    before = {w: weights_of(run, w) for w in ("last", "best")}
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    real_ce, calls = torch.nn.functional.cross_entropy, [0]

    def poisoned(at):  # + sqrt|0 x sum|: adds 0, its gradient is 0 x inf
        def ce(logits, target, **kw):
            calls[0] += 1
            loss = real_ce(logits, target, **kw)
            return loss + (logits.sum() * 0).abs().sqrt() if at(calls[0]) else loss

        return ce

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned(lambda n: n == 20))
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        resume(run)
    assert re.search(r"gradients became nan at step \d+ \(epoch 2, batch 20\).*step skipped",
                     caplog.text)  # fmt: skip
    for which in ("last", "best"):
        after = weights_of(run, which)
        assert all(torch.isfinite(v).all() for v in after.values()), which
        assert any(not torch.equal(before[which][k], after[k]) for k in after), which  # trained
    calls[0] = 0
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned(lambda n: n >= 5))
    with pytest.raises(NonFiniteLoss, match=r"gradients became nan at .*batch 15.*11 steps in a"):
        resume(copy)
    monkeypatch.undo()
    for which, weights in before.items():
        after = weights_of(copy, which)
        assert all(torch.equal(weights[k], after[k]) for k in weights), which


def test_configs_that_cannot_work_fail_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a multiple of patch_size 2"):
        train(cfg("model.img_size=9"), out=tmp_path / "d")
    with pytest.raises(DatasetError, match="unknown dataset"):
        train(cfg("data.name=mnist"), out=tmp_path / "a")
    with pytest.raises(DatasetError, match="not found"):
        train(cfg("data.name=cifar10", f"data.dir={tmp_path}"), out=tmp_path / "b")
    with pytest.raises(ConfigError, match="num_classes=5 but dataset digits has 10"):
        train(cfg("model.num_classes=5"), out=tmp_path / "c")
    with pytest.raises(ConfigError, match="channels_last with train.strategy=fsdp"):
        train(cfg("train.channels_last=true", "train.strategy=fsdp"), out=tmp_path / "e")
    with pytest.raises(ConfigError, match="random_resized_crop and data.crop_padding are two"):
        train(cfg("data.random_resized_crop=true", "data.crop_padding=2"), out=tmp_path / "f")
    for magnitude in (31, -1):  # 31 failed at the first batch, -1 ran as the strongest
        with pytest.raises(ConfigError, match=f"scale 0-30 .*, got {magnitude}"):
            train(cfg("data.randaugment_ops=2", f"data.randaugment_magnitude={magnitude}"),
                  out=tmp_path / "g")  # fmt: skip
    for scale in ("[1.5,0.1]", "[-1,2]", "[0.5,0.2]"):  # a torchvision traceback, "math domain"
        with pytest.raises(ConfigError, match=r"crop_scale is a range .* got \["):
            train(cfg("data.random_resized_crop=true", f"data.crop_scale={scale}"),
                  out=tmp_path / "h")  # fmt: skip
    assert not any((tmp_path / x).exists() for x in "acdefgh")


@pytest.mark.parametrize(
    "override, message",
    [  # each once accepted: trained uphill, 40 empty epochs, a traceback, ignored, ...
        ("optim.clip_grad=-1", "^optim.clip_grad must be >= 0 \\(0, null: none\\), got -1"),
        ("optim.min_lr=0.01", "^optim.min_lr must be in \\[0, lr\\], got 0.01$"),
        ("optim.momentum=2", "^optim.momentum must be in \\[0, 1\\), got 2"),
        ("optim.betas=[0.9,1.5]", "optim.betas must be in \\[0, 1\\) each, got \\(0.9, 1.5\\)"),
        ("optim.lr=.nan", "optim.lr: expected float, got nan \\(float\\): numbers must be"),
        ("optim.lr=nan", "optim.lr: expected float, got 'nan' \\(str\\)$"),  # YAML's is .nan
        ("optim.lr=1e400", "optim.lr: expected float, got inf \\(float\\): numbers must be"),
        ("train.time_budget=.inf", "expected str \\| float \\| None, got inf .*must be finite"),
        ("train.time_budget=off", "\\(null or ~: no budget\\), got False \\(YAML reads off"),
        ("train.time_budget=yes", "\\(null or ~: no budget\\), got True \\(YAML reads on, yes"),
        ("train.time_budget=None", "\\(null or ~: no budget\\), got 'None'"),
        ("train.time_budget=0", "got 0.0 \\(null turns the budget off\\)"),
        ("train.max_steps=0", "^train.max_steps must be >= 1, got 0$"),  # each by its key and
        ("train.accum_steps=0", "^train.accum_steps must be >= 1, got 0$"),  # value (one line
        ("train.threads=-2", "^train.threads must be >= 0 \\(0: unset\\), got -2$"),  # for all)
        ("train.stop_at_epoch=-1", "^train.stop_at_epoch must be >= 0 \\(0: unset\\), got -1$"),
        ("data.mixup=-1", "^data.mixup must be >= 0, got -1.0$"),
        ("data.shuffle_buffer=0", "^data.shuffle_buffer must be >= 1, got 0$"),
        ("optim.lr=-0.1", "^optim.lr must be > 0, got -0.1$"),  # not min_lr's too
    ],
)
def test_settings_out_of_range_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg(override)


def test_zero_stays_the_unset_value_old_runs_saved() -> None:
    """clip_grad 0 (no clipping), threads 0 (torch's count) and stop_at_epoch 0 (never) have
    always run so: a run's config.yaml holding them must still load for eval and --resume."""
    loaded = cfg("optim.clip_grad=0", "train.threads=0", "train.stop_at_epoch=0")
    assert (loaded.optim.clip_grad, loaded.train.threads, loaded.train.stop_at_epoch) == (0, 0, 0)


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 1e-3 as the string '1e-3', which was refused as "expected float"
    in a config file while optim.lr=1e-3 on the command line was taken."""
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 1e-3\n  min_lr: 5E-6\n")
    loaded = load_run_config(str(tmp_path / "c.yaml"))
    assert (loaded.optim.lr, loaded.optim.min_lr) == (1e-3, 5e-6)
    (tmp_path / "c.yaml").write_text("optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match="optim.lr: expected float, got 'fast'"):
        load_run_config(str(tmp_path / "c.yaml"))


def test_config_numbers_are_read_as_yaml_1_2_reads_them(tmp_path: Path) -> None:
    """PyYAML reads YAML 1.1, where `time_budget: 1:30` is sexagesimal 90 (seconds, the log said
    "time budget 90.0") and `seed: 012` octal 10, while a quoted "0.001" was taken for optim.lr
    though a quoted "1" for train.epochs was refused. Numbers are now YAML 1.2's, in a file and
    on the command line alike, and a quoted value is text for every field."""
    (tmp_path / "c.yaml").write_text("train:\n  seed: 012\n  batch_size: 0x40\n  epochs: 1_0\n")
    loaded = load_run_config(str(tmp_path / "c.yaml"), ["optim.lr=2e-3", "train.threads=0o2"])
    assert (loaded.train.seed, loaded.train.batch_size, loaded.train.epochs) == (12, 64, 10)
    assert (loaded.optim.lr, loaded.train.threads) == (0.002, 2)
    assert load_run_config(None, ["train.seed=012"]).train.seed == 12
    for text in ("train:\n  time_budget: 1:30\n", None):
        args = (str(tmp_path / "c.yaml"), []) if text else (None, ["train.time_budget=1:30"])
        if text:
            (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match="time_budget: expected a duration .* got '1:30'"):
            load_run_config(*args)
    (tmp_path / "c.yaml").write_text('optim:\n  lr: "0.001"\n')
    with pytest.raises(
        ConfigError, match="^optim.lr: expected float, got '0.001' \\(str\\): a number in q"
    ):
        load_run_config(str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match="^optim.lr: expected float, got '0.003'"):
        load_run_config(None, ["optim.lr='0.003'"])
    # a prefix without digits is text (it was read as octal and failed inside int()), and a
    # number Python cannot hold names its key (a bare ValueError before)
    with pytest.raises(ConfigError, match="^train.seed: expected int, got '0o_'"):
        load_run_config(None, ["train.seed=0o_"])
    with pytest.raises(ConfigError, match="^train.seed='1111.*is not a value vitlab can read"):
        load_run_config(None, ["train.seed=" + "1" * 5000])


def test_finetune_at_another_resolution_with_a_new_head(
    trained_run: Path, tmp_path: Path, monkeypatch
) -> None:
    reads = []
    real_read = build_mod.read_source
    for module in (build_mod, checkpoint_mod):
        monkeypatch.setattr(module, "read_source", lambda *a: reads.append(a) or real_read(*a))
    run = train(
        load_run_config(
            None,
            [
                f"finetune.from={trained_run}",
                "model.img_size=32",
                "model.num_classes=10",
                "train.epochs=1",
            ],
        ),
        out=tmp_path / "ft",
    )
    assert len(reads) == 1  # the source checkpoint is read once (it may be gigabytes)
    model, meta = load_checkpoint(run)
    assert meta.config.img_hw == (32, 32)
    assert model.pos_embed.weight.shape == (1, 1 + 64, 64)


def test_more_threads_than_cores_are_refused_before_the_run_folder(tmp_path, capsys) -> None:
    """train.threads=100000 crashed in torch (SIGSEGV, no word, a run folder holding only its
    lock) and 1000 trained at 1% of the pace: more than this process's cores is refused."""
    cores = len(os.sched_getaffinity(0))
    out = tmp_path / "r"
    assert main(["train", *FAST, f"train.threads={cores + 1}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"train.threads={cores + 1} is more than the {cores} CPU cores" in err, err
    assert f"at most {cores}" in err and not out.exists()
    assert main(["train", *FAST, f"train.threads={cores}", "train.max_steps=1", "--out",
                 str(out)]) == 0  # fmt: skip


def test_finetune_says_a_model_name_of_another_architecture_is_not_used(caplog) -> None:
    """finetune.from=NANO model.name=vit_micro_patch4_28 trained the nano without a word (only a
    name of another family was warned of). A name of the source's architecture, at another
    size and with keys set on top (the imagenet-finetune-384 preset's way), is not warned of."""
    from vitlab.data import dataset_info
    from vitlab.models.registry import get_config

    info = dataset_info("digits", load_split("digits", "train"))
    nano = get_config("vit_nano_patch4_28")
    cases = {  # model.name and keys -> warned
        ("model.name=vit_micro_patch4_28",): True,
        ("model.name=vit_micro_patch4_28", "model.embed_dim=64", "model.depth=4"): True,  # heads
        ("model.name=vit_nano_patch4_32", "model.img_size=56", "model.drop_path=0.1"): False,
        ("model.name=resnet18_28",): True,
        (): False,
    }
    for keys, warned in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitlab"):
            run_cfg = load_run_config(None, ["finetune.from=x", *keys])
            build_mod.resolve_model_config(run_cfg, info, base=nano)
        said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
        assert len(said) == warned, (keys, said)
        if keys == ("model.name=vit_nano_patch4_32", "model.img_size=56", "model.drop_path=0.1"):
            caplog.clear()  # a source's dropout rates (no tensor tells them) are not its shape,
            with caplog.at_level(logging.WARNING, logger="vitlab"):  # but the run takes them
                plain = load_run_config(None, ["finetune.from=x", keys[0]])
                tuned = build_mod.resolve_model_config(
                    plain, info, base=nano.replace(drop_path=0.3)
                )
            assert "is not used" not in caplog.text and tuned.drop_path == 0.3
            assert (
                "vit_nano_patch4_32's drop_path=0.0: not used, the run takes finetune.from's "
                "drop_path=0.3" in caplog.text
            ), caplog.text
        if warned and "micro" in keys[0] and len(keys) == 1:
            assert said[0] == (
                "model.name=vit_micro_patch4_28 [D=128, 6 layers, patch 4, 28x28] is not used: "
                "finetune.from's architecture [D=64, 4 layers, patch 4, 28x28] is trained "
                "(model.* keys apply to it)"
            )


def test_finetune_new_head_and_a_kept_head_of_other_class_names(trained_run, caplog) -> None:
    """A source of as many classes keeps its head: digits' 0..9 were taken for Fashion-MNIST's
    ten classes without a word. That is now said, naming both; finetune.new_head=true starts a
    zero head anyway (the backbone loaded either way)."""
    from vitlab.models.checkpoint import read_source

    clothes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
               "Sneaker", "Bag", "Ankle boot"]  # fmt: skip
    source_model, _ = load_checkpoint(trained_run)
    for classes, new_head in ((clothes, False), (clothes, True), (source_model.classes, False)):
        model = create_model("vit_nano_patch4_28")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitlab"):
            notes = build_mod.finetune_weights(model, read_source(trained_run), classes, new_head)
        warned = [r.getMessage() for r in caplog.records if "the head is kept" in r.getMessage()]
        head = model.head.weight
        assert torch.equal(model.pos_embed.weight, source_model.pos_embed.weight)
        if new_head:
            assert not warned and not head.any() and "finetune.new_head" in notes[-1]
        else:
            assert torch.equal(head, source_model.head.weight)
            assert len(warned) == (classes is clothes), warned  # the same names: no word
        said = "10 classes (0, 1, 2, 3, ...) are taken for the data's (T-shirt/top, Trouser"
        assert all(said in w for w in warned), warned


@pytest.mark.parametrize(
    "kind,said",
    [
        ("learned", "position embeddings resampled to the token grid (4, 4) -> (8, 8)"),
        ("relative", "relative position tables resampled to the token grid (4, 4) -> (8, 8)"),
        ("sincos2d", "the fixed 2-D sin-cos table (no weights) computed for the token grid"),
        ("none", "no position embeddings; the token grid (4, 4) -> (8, 8)"),
    ],
)
def test_finetune_at_another_size_says_what_the_position_embedding_gets(tmp_path, kind, said):
    """Every kind was said to be "position embeddings resampled": a model without any, and the
    fixed sin-cos table (no weights, computed for the grid), too (a QA pass)."""
    from tests.helpers import tiny_config
    from vitlab import VisionTransformer, save_pretrained
    from vitlab.models.checkpoint import read_source

    save_pretrained(VisionTransformer(tiny_config(pos_embed=kind, img_size=8, patch_size=2)),
                    tmp_path / "src")  # fmt: skip
    model = VisionTransformer(tiny_config(pos_embed=kind, img_size=16, patch_size=2))
    notes = build_mod.finetune_weights(model, read_source(tmp_path / "src"))
    assert any(said in n for n in notes), notes


def test_finetune_leaves_out_the_pre_logits_layer_as_the_paper_does(tmp_path, caplog) -> None:
    """The paper fine-tunes with one zero-initialised linear head: the pre-training head's
    pre-logits layer goes (model.representation_size=null, as the imagenet-finetune-384 preset
    has it). Left in the source's weights, it was refused as having no place in the model; the
    preset also fine-tuned at the source's 224 (the 384 of its model.name is not used)."""
    pre = train(cfg("train.epochs=1", "model.representation_size=16"), out=tmp_path / "pre")
    assert "pre_logits.fc.weight" in weights_of(pre)
    with caplog.at_level(logging.INFO, logger="vitlab"):
        tuned = train(cfg("train.epochs=1", f"finetune.from={pre}", "model.img_size=16",
                          "model.representation_size=null"), out=tmp_path / "ft")  # fmt: skip
    assert "head (pre-logits layer and classifier) replaced by one zero-init" in caplog.text
    model, meta = load_checkpoint(tuned)
    assert meta.config.representation_size is None and meta.config.img_hw == (16, 16)
    assert not any(k.startswith("pre_logits.") for k in model.state_dict())
    preset = load_run_config("configs/imagenet-finetune-384.yaml").model.overrides
    assert preset == {"img_size": 384, "representation_size": None}
    # the other way, a pre-logits layer the source lacks: said as that, before a folder is made
    # (it was "shapes differ: head.weight ... missing from the checkpoint: pre_logits.fc.weight")
    with pytest.raises(ConfigError, match="representation_size=8 adds a pre-logits layer .* has "
                                          "no weights for"):  # fmt: skip
        train(cfg(f"finetune.from={tuned}", "model.representation_size=8"), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=f"finetune.from={tuned}: model.patch_size=8: the "
                                          "weights' patch size is 2"):  # fmt: skip
        train(cfg(f"finetune.from={tuned}", "model.patch_size=8"), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_finetune_from_timm_weights_takes_model_num_heads_as_the_sources(tmp_path, capsys):
    """A timm ViT of width 32 (no head count to guess from it): the refusal asked to pass
    num_heads=, which `vitlab train` had no way to: model.num_heads=2 is now the source's count.
    Checked against timm's own features of the same weights (1 head reads them otherwise)."""
    import timm

    ref = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1,
                            embed_dim=32, depth=1, num_heads=2, num_classes=10).eval()  # fmt: skip
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    args = ["train", f"finetune.from={tmp_path / 'w.pth'}", "data.name=digits", "train.epochs=1",
            "train.max_steps=1", "optim.lr=1e-30", "optim.warmup_epochs=0",
            "train.threads=1"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 2  # heads unknown: refused, as before
    assert "`vitlab convert SRC DST num_heads=N`" in capsys.readouterr().err  # a remedy for all
    assert main([*args, "model.num_heads=2", "--out", str(tmp_path / "b")]) == 0
    model, meta = load_checkpoint(tmp_path / "b" / "checkpoints" / "last")
    assert meta.config.num_heads == 2
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model.eval().forward_features(x), ref.forward_features(x),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


# SGD: Adam would turn the float noise in the key bias's (mathematically zero) gradient into
# full-size steps, so two summation orders drift apart there
TWO_RANKS = [*FAST, "train.epochs=2", "data.val_fraction=0", "train.precision=fp32",
             "optim.name=sgd", "optim.lr=0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's run of TWO_RANKS, which both strategies below are held to."""
    return train(load_run_config(None, TWO_RANKS), out=tmp_path_factory.mktemp("one") / "single")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one_process(tmp_path: Path, strategy: str, single: Path) -> None:
    """torchrun with 2 CPU processes (gloo) against one process with the same global batch."""
    multi = tmp_path / strategy
    proc = torchrun_train(multi, *TWO_RANKS, f"train.strategy={strategy}", timeout=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stderr
    assert proc.stdout.split() == [str(multi)]  # the run folder once, as one process prints it
    a, b = weights_of(single), weights_of(multi)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)
    assert not torch.equal(a["head.weight"], torch.zeros_like(a["head.weight"]))
    ra = json.loads((single / "results.json").read_text())
    rb = json.loads((multi / "results.json").read_text())
    assert ra["num_images"] == rb["num_images"] == 359  # every test image counted once
    assert ra["top1"] == pytest.approx(rb["top1"], abs=1 / 359)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path: Path) -> None:
    """2 x 32 accumulated == one batch of 64 (the same samples, the mean loss), with SGD."""
    common = ["train.epochs=1", "data.val_fraction=0", "optim.name=sgd", "optim.lr=0.05"]
    common.append("train.precision=fp32")  # bf16 rounds the two batchings differently
    big = train(cfg(*common, "train.batch_size=64"), out=tmp_path / "big")
    accum = train(cfg(*common, "train.batch_size=32", "train.accum_steps=2"), out=tmp_path / "acc")
    a, b = weights_of(big), weights_of(accum)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


def test_precision_auto_takes_bf16_where_the_device_computes_in_it(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert not use_bf16("fp32", cpu) and use_bf16("bf16", cpu)
    for native in (False, True):
        monkeypatch.setattr(runtime, "cpu_has_bf16", lambda native=native: native)
        assert use_bf16("auto", cpu) is native
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux: the kernel's own flags say whether the CPU has bf16 arithmetic
        flags = set(cpuinfo.read_text().split())
        monkeypatch.undo()
        assert runtime.cpu_has_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})
    # PyTorch's kernels held to AVX2 (an AVX2-only CPU's path): bf16 is emulated there
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not runtime.cpu_has_bf16() and not use_bf16("auto", cpu)


def test_default_run_folders_of_runs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    from vitlab.train.folder import default_run_folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: fmt.replace("%Y%m%d-%H%M%S", "T"))
    first = default_run_folder(cfg())
    assert first == Path("runs/digits-T") and first.is_dir()  # taken as it is named
    assert default_run_folder(cfg()) == Path("runs/digits-T-2")  # the second start: another
    assert default_run_folder(cfg()) == Path("runs/digits-T-3")


def test_a_failed_start_leaves_no_empty_default_folder(tmp_path: Path, monkeypatch) -> None:
    """The default folder is made at the start (two runs cannot take one); a start that fails
    on bad input once left it behind, empty, each time."""
    r = subprocess.run([*VITLAB, "train", "data.name=imagefolder:missing"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "missing" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "runs").iterdir())
    # in a process that goes on (a notebook), when train() fails, not at the process's exit
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="model.num_classes=3 but dataset digits has 10"):
        train(cfg("model.num_classes=3"))
    assert not list((tmp_path / "runs").iterdir())


def test_curves_of_a_run_without_accuracy_have_no_empty_panel(tmp_path: Path) -> None:
    """An mpp patch_l2 run has losses only: its curves.png had an empty accuracy panel beside
    the loss; now the loss alone, half the width of a classifier's two panels."""
    from vitlab.train.log import save_curves

    rec = {"train_loss": 1.0, "val_loss": 1.1, "train_acc": None, "val_acc": None}
    save_curves([{"epoch": e, **rec} for e in (1, 2)], tmp_path / "loss.png")
    rec.update(train_acc=0.5, val_acc=0.4)
    save_curves([{"epoch": e, **rec} for e in (1, 2)], tmp_path / "both.png")
    loss, both = (Image.open(tmp_path / f"{n}.png").size for n in ("loss", "both"))
    assert loss[1] == both[1] and 2 * loss[0] == both[0]


def test_signal_handlers_for_a_block_leave_the_callers_as_they_were(monkeypatch) -> None:
    """runtime.handling, under both the command's SIGTERM line and training's stop flag: a signal
    the caller ignores stays ignored where asked, what the block sets as previous is put back,
    off the main thread nothing is installed; and a distributed run that fails in its loop leaves
    SIGTERM ignored (torchrun's agent would cut short the report of the lost rank)."""
    from vitlab.runtime import handling
    from vitlab.train.stop import StopFlag

    seen = []

    def mine(signum, frame):
        seen.append(signum)

    def callers(signum, frame):
        raise AssertionError("the caller's handler ran inside the block")

    before = signal.signal(signal.SIGTERM, callers), signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with handling((signal.SIGTERM, signal.SIGINT), mine, keep_ignored=True) as old:
            assert (
                old == {signal.SIGTERM: callers}
                and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            )
            signal.raise_signal(signal.SIGTERM)
            old[signal.SIGTERM] = signal.SIG_DFL
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with handling((signal.SIGINT,), mine) as old:
            assert signal.getsignal(signal.SIGINT) is mine and old == {
                signal.SIGINT: signal.SIG_IGN
            }
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        elsewhere = []

        def thread() -> None:
            with handling((signal.SIGTERM,), mine) as old:
                elsewhere.append((old, signal.getsignal(signal.SIGTERM)))

        t = threading.Thread(target=thread)
        t.start()
        t.join()
        assert elsewhere == [({}, signal.SIG_DFL)]
        signal.signal(signal.SIGTERM, callers)
        with pytest.raises(RuntimeError), StopFlag(distributed=True):
            assert signal.getsignal(signal.SIGTERM) is not callers
            raise RuntimeError("a rank was lost")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGTERM, callers)
        with StopFlag(distributed=True) as stop:
            signal.raise_signal(signal.SIGTERM)
        assert stop.requested and signal.getsignal(signal.SIGTERM) is callers
        with stop:  # a flag can be entered again, unrequested, but not inside its own block
            assert signal.getsignal(signal.SIGTERM) is not callers and not stop.requested
            with pytest.raises(RuntimeError, match="in use"), stop:
                pass
            assert signal.getsignal(signal.SIGTERM) is not callers
        assert signal.getsignal(signal.SIGTERM) is callers
        with pytest.raises(OSError), handling((signal.SIGTERM, signal.SIGKILL), mine):
            pass  # SIGKILL cannot be handled: SIGTERM's handler, already installed, goes back
        assert signal.getsignal(signal.SIGTERM) is callers
        # a handler set from C, which getsignal reports as None, cannot be put back: SIG_DFL
        real = signal.getsignal
        monkeypatch.setattr(
            signal, "getsignal", lambda sig: None if sig == signal.SIGTERM else real(sig)
        )
        with StopFlag():
            assert real(signal.SIGTERM) is not callers
        assert real(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def test_quiet_hides_the_training_progress_bar_not_the_epoch_lines(tmp_path: Path, capsys) -> None:
    """`vitlab -q train` printed the progress bar (fewshot's and probe's -q hid theirs): now the
    run says its header, epoch and test lines only."""
    args = ["train", *FAST, "data.name=digits", "train.epochs=1", "optim.warmup_epochs=0"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    shown = capsys.readouterr().err
    assert main(["-q", *args, "--out", str(tmp_path / "b")]) == 0
    quiet = capsys.readouterr().err
    assert "epoch 1/1" in shown and "batch/s" in shown  # the bar, without -q
    assert "epoch 1/1" not in quiet and "batch/s" not in quiet, quiet
    assert "epoch 1: train loss" in quiet and "test: top-1" in quiet


def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    """`--out FILE`, or a path under a file: the run was refused with `cannot use FILE as a run
    folder: [Errno 17] File exists`; now the file is named and a folder said to be expected."""
    file = tmp_path / "afile"
    file.write_text("mine")
    args = ["train", *FAST, "train.epochs=1"]
    assert main([*args, "--out", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"error: {file} is a file: expected a folder (new or existing) for the run" in err, err
    assert main([*args, "--out", str(file / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{file / 'run'} cannot be made: {file} is a file, not a folder" in err, err
    assert "Errno" not in err and file.read_text() == "mine"


def test_a_data_dir_that_is_a_file_is_refused_not_ignored(tmp_path: Path, capsys) -> None:
    """data.dir=FILE trained on digits as if it were not given (and fewshot's --data-dir FILE
    was ignored alike: tests/test_fewshot.py); it is refused, whatever the dataset."""
    file = tmp_path / "afile"
    file.write_text("")
    out = tmp_path / "run"
    assert main(["train", *FAST, "train.epochs=1", f"data.dir={file}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the data folder {file} (data.dir, --data-dir) is a file, not a folder" in err, err
    assert not (out / "checkpoints").exists()


def test_a_torn_metrics_line_is_said_on_resume(tmp_path: Path, caplog) -> None:
    """A kill mid-write cut metrics.jsonl's last line: --resume dropped it silently (and a
    non-UTF-8 byte stopped the run with a decode error naming no file). The line is named."""
    run = train(cfg("train.epochs=3", "train.stop_at_epoch=2"), out=tmp_path / "r")
    metrics = run / "metrics.jsonl"
    text = metrics.read_bytes()
    metrics.write_bytes(text[:-20] + b"\xff\n")  # epoch 2's line cut short, a stray byte
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        resume(run)
    assert f"{metrics}: line 2 is not an epoch's record (cut short?)" in caplog.text
    epochs = [json.loads(x)["epoch"] for x in metrics.read_text().splitlines()]
    assert epochs == [1, 3]  # epoch 2's figures are lost, its weights were in the checkpoint


def test_resuming_a_run_killed_before_its_first_checkpoint_says_how_to_start_it(
    tmp_path: Path, capsys
) -> None:
    """A run killed in its first epoch leaves config.yaml and no checkpoint: --resume said "no
    checkpoint at .../last: expected a run folder ...", though it is one; it says what happened
    and what starts it again (which works)."""
    run = tmp_path / "r"
    assert main(["train", *FAST, "train.epochs=1", "--out", str(run)]) == 0
    shutil.rmtree(run / "checkpoints")  # as a kill -9 before the first save leaves it
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint yet (a run still in its first epoch, or stopped before" in err
    assert f"--out {run} --overwrite" in err
    assert main(["train", *FAST, "train.epochs=1", "--out", str(run), "--overwrite"]) == 0
    shutil.rmtree(run / "checkpoints" / "last")  # killed between its first best and last saves:
    assert main(["train", "--resume", str(run)]) == 2  # said as that (a QA pass)
    said = f"it has no last checkpoint, only {run / 'checkpoints' / 'best'} (which vitlab eval"
    assert said in capsys.readouterr().err


def test_weights_of_another_depth_copied_in_are_refused_on_resume(tmp_path: Path, capsys):
    """The run's model is its config.yaml's, whatever `last` holds: a checkpoint of a 2-layer
    model copied into a 4-layer run (no depth override to compare) is refused, exit 2 (a review
    caught a resume that took the checkpoint's architecture and trained it on)."""
    args = ["train", "model.img_size=8", "model.patch_size=2", "train.epochs=2",
            "train.stop_at_epoch=1", "train.batch_size=64"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "model.depth=2", "--out", str(tmp_path / "b")]) == 0
    last = tmp_path / "a" / "checkpoints" / "last"
    shutil.rmtree(last)
    shutil.copytree(tmp_path / "b" / "checkpoints" / "last", last)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "a")]) == 2
    assert "does not fit the model" in capsys.readouterr().err


def test_resuming_a_finished_run_says_so_and_how_to_train_longer(tmp_path: Path, capsys) -> None:
    """--resume of a run that had finished trained nothing and printed the same test without a
    word; it now says the run had finished, and (an epochs run) that --extend lengthens it."""
    out = tmp_path / "run"
    assert main(["train", *FAST, "train.epochs=1", "--out", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert "the run had finished" not in capsys.readouterr().err  # a fresh run: nothing said
    assert main(["train", "--resume", str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: the run had finished (epoch 1 of 1): nothing left to train" in err, err
    assert "--extend train.epochs=N trains it longer" in err
    assert (out / "metrics.jsonl").read_text().splitlines() == lines  # no epoch trained again
    steps = tmp_path / "steps"  # a train.max_steps run cannot be extended: not offered
    assert main(["train", *FAST, "train.epochs=2", "train.max_steps=3", "--out", str(steps)]) == 0
    assert main(["train", "--resume", str(steps)]) == 0
    err = capsys.readouterr().err
    assert "note: the run had finished (train.max_steps=3, in epoch 1)" in err, err
    assert "--extend" not in err


def test_fsdp_in_one_process_is_said_to_shard_nothing(tmp_path: Path, capsys) -> None:
    """train.strategy=fsdp without torchrun (or under torchrun with one process) trained the whole
    model in one process without a word, as if FSDP had been tried; ddp (the default) has nothing
    to say, and -q hides it as it hides other warnings."""
    args = ["train", *FAST, "train.epochs=1", "model.depth=1"]
    assert main([*args, "train.strategy=fsdp", "--out", str(tmp_path / "f")]) == 0
    said = ("warning: train.strategy=fsdp is set but not used: it applies with more than one "
            "process (torchrun --nproc_per_node=N, N >= 2)")  # fmt: skip
    assert said in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "d")]) == 0
    assert "train.strategy" not in capsys.readouterr().err
    assert main(["-q", *args, "train.strategy=fsdp", "--out", str(tmp_path / "q")]) == 0
    assert "train.strategy" not in capsys.readouterr().err


def test_the_channel_count_is_worded_for_one_channel() -> None:
    """'expected images with 1 channels': the count's noun agrees with it."""
    model = create_model("vit_nano_patch4_28")  # grey, one channel
    with pytest.raises(ValueError, match=r"expected images with 1 channel, got 3$"):
        model(torch.zeros(1, 3, 28, 28))


def test_a_batch_the_processes_cannot_share_says_what_to_change() -> None:
    """A run of batch 63 resumed on 2 ranks was told "train.batch_size 63 is not divisible by 2
    processes", and the batch size it then chose was refused (a resumed run keeps it). A resumed
    run is told which process counts divide its batch; a new run, batch sizes that work."""
    resumed = build_mod.batch_split(63, 2, resumed=True)
    assert resumed.startswith("train.batch_size 63 is not divisible by 2 processes: a resumed")
    assert resumed.endswith("processes that divides 63 (1, 3, 7, 9, 21, 63)")
    assert build_mod.batch_split(63, 2, resumed=False).endswith("multiple of 2 (e.g. 62 or 64)")
    assert build_mod.batch_split(3, 4, resumed=False).endswith("multiple of 4 (e.g. 4)")


def test_a_step_failing_after_a_stop_signal_is_a_stop_not_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """A SIGTERM to the process group during torch.compile's first compilation killed its gcc
    too: the step failed with a 1,900-line CppCompileError traceback, exit 1. A step that fails
    once a stop was asked is now the stop: one line, 143, what was kept and how to go on.
    (Here the step fails as gcc's did: after the signal, with an error of its own.)"""
    from vitlab.train import run as run_mod

    real, calls = run_mod.train_epoch, []

    def killed_with_its_helpers(*a, **k):
        calls.append(1)
        if len(calls) < fail_at:
            return real(*a, **k)
        signal.raise_signal(signal.SIGTERM)
        raise RuntimeError("C++ compile error: cc1plus killed")

    monkeypatch.setattr(run_mod, "train_epoch", killed_with_its_helpers)
    fail_at, first = 1, tmp_path / "first"
    assert main(["train", "--out", str(first), *FAST, "train.epochs=2"]) == 143
    err = capsys.readouterr().err
    assert "stopped at epoch 1: the step failed after the stop signal, which may have" in err
    assert "RuntimeError: C++ compile error: cc1plus killed; nothing" in err  # what failed
    assert "none yet: start the run again" in err
    assert "Traceback" not in err and "--resume" not in err
    calls.clear()
    fail_at, second = 2, tmp_path / "second"
    assert main(["train", "--out", str(second), *FAST, "train.epochs=2"]) == 143
    err = capsys.readouterr().err
    assert "stopped at epoch 2: the step failed" in err and f"--resume {second}" in err, err
    monkeypatch.setattr(run_mod, "train_epoch", real)
    assert main(["train", "--resume", str(second)]) == 0  # from epoch 1's checkpoint
    assert json.loads((second / "results.json").read_text())["top1"] > 0.1

    def broken(*a, **k):  # no stop asked: the failure is the error it is
        raise RuntimeError("C++ compile error")

    monkeypatch.setattr(run_mod, "train_epoch", broken)
    with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
        main(["train", "--out", str(tmp_path / "third"), *FAST])


def test_train_in_a_notebook_keeps_the_callers_random_stream_and_says_what_it_takes(
    tmp_path,
) -> None:
    """train() seeded torch's global generator with train.seed and left it there: a notebook's
    own seeded stream was lost (the next torch.rand differed from the one without training).
    It is put back; and a dict of sections, which it once met with AttributeError deep inside,
    is refused naming what to build from it."""
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    train(cfg("train.epochs=1", "train.max_steps=2"), out=tmp_path / "run")
    assert torch.equal(torch.rand(3), want)
    with pytest.raises(TypeError, match="RunConfig.from_tree\\(a dict of sections\\)\\), got dict"):
        train({"model": {"name": "vit_nano_patch4_28"}}, out=tmp_path / "dict")


def test_a_runs_config_yaml_reads_back_the_text_it_was_given(tmp_path) -> None:
    """config.yaml was written with PyYAML's YAML 1.1 quoting and read with YAML 1.2's numbers:
    data.label_key='1e5' went out plain (`label_key: 1e5`) and came back a float, so --resume,
    `vitlab cost RUN` and reproduce's reuse refused the run's own settings."""
    import yaml

    from vitlab.config import load_saved_config

    texts = ["data.label_key='1e5'", "data.image_key='1:30'"]
    run = train(cfg(*texts, "train.epochs=1", "train.max_steps=1"), out=tmp_path / "run")
    saved = load_saved_config(run / "config.yaml")
    assert (saved.data.label_key, saved.data.image_key) == ("1e5", "1:30")
    # and as PyYAML's own YAML 1.1 reader reads it (scripts, earlier vitlab): 1:30 is 90 there
    plain = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert (plain["label_key"], plain["image_key"]) == ("1e5", "1:30")


def test_a_fine_tuning_runs_model_keys_are_named_as_written(trained_run, tmp_path) -> None:
    """A fine-tuning run lays its model.* keys over the source's architecture, where a wrong
    type was named by the Python class (ViTConfig.dropout), as `vitlab cost` of such a run
    did; the run config's key now, as for a run from scratch."""
    source = f"finetune.from={trained_run}"
    for override, key in (("model.dropout=x", "dropout"), ("model.patch_size=x", "patch_size")):
        with pytest.raises(ConfigError, match=f"^(finetune.from=.*: )?model.{key}: expected"):
            train(load_run_config(None, [source, override]), out=tmp_path / key)
    from vitlab.cli.cost import config_at

    (tmp_path / "ft.yaml").write_text(f"finetune:\n  from: {trained_run}\nmodel:\n  dropout: x\n")
    with pytest.raises(ConfigError, match="^model.dropout: expected float"):
        config_at(tmp_path / "ft.yaml")


def test_a_failed_steps_stop_line_names_the_failure_it_can(tmp_path) -> None:
    """The stop line quotes the failure's first informative line: not an empty ': ' for an
    error without text, nor a first line that only announces the next one (torch's
    BackendCompilerFailed: "backend='x' raised:")."""
    from vitlab.train.stop import failed_on_stop

    said = {
        RuntimeError(): "signals): RuntimeError; nothing",
        RuntimeError("backend='x' raised:\nCppCompileError: C++ compile error\n\ngcc -c"):
            "signals): RuntimeError: CppCompileError: C++ compile error; nothing",
    }  # fmt: skip
    for error, text in said.items():
        assert text in failed_on_stop(error, 1, tmp_path, "vitlab train --resume x", 15).where
