"""What a run carries from step to step: the EMA's update by hand, compiled training keeps its EMA
and its accumulation,
image-folder runs (augmented in DataLoader workers) resume exactly from the middle of an epoch, and
channels-last runs keep their memory layout through a resume."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL, resume, weights_of
from vitlab.config import DataConfig, load_run_config
from vitlab.data import BatchAugment, Preprocessing, load_split, make_loader
from vitlab.train import run as run_mod
from vitlab.train.optim import EMA
from vitlab.train.run import TrainingStopped, train
from vitlab.train.state import load_train_state

FAST = TINY_MODEL
# SGD in fp32: two batchings (or eager against compiled kernels) then agree to float noise
EXACT = ["train.precision=fp32", "optim.name=sgd", "optim.lr=0.05", "data.val_fraction=0"]


def cfg(*overrides: str):
    return load_run_config(None, [*FAST, *overrides])


def test_the_ema_update_by_hand() -> None:
    """ema = d ema + (1 - d) w for every floating-point tensor, BatchNorm's running statistics
    included and its integer batch count left out (as timm's ModelEmaV3); apply_to puts the
    averages in the model and hands back the raw weights."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ema = EMA(model, 0.9)
    model.train()(torch.randn(8, 2) * 3 + 1)  # running_mean / var move
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    now = {k: v.clone() for k, v in model.state_dict().items()}
    assert "1.num_batches_tracked" not in ema.state_dict()
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(v, 0.9 * start[k] + 0.1 * now[k], msg=k)
    assert not torch.equal(ema.state_dict()["1.running_mean"], start["1.running_mean"])
    raw = ema.apply_to(model)
    torch.testing.assert_close(model[0].weight, 0.9 * start["0.weight"] + 0.1 * now["0.weight"])
    torch.testing.assert_close(raw["0.weight"], now["0.weight"])


def test_compiled_training_with_ema_and_accumulation_equals_the_larger_batch(tmp_path) -> None:
    """train.compile with train.ema and 2 x 32 accumulated == eager training on batches of 64:
    the same samples per step, the same mean loss, the same EMA updates (compiling once crashed on
    the first EMA update: the compiled wrapper's keys carry `_orig_mod.`)."""
    common = [*EXACT, "train.epochs=1", "train.ema=0.9"]
    big = train(cfg(*common, "train.batch_size=64"), out=tmp_path / "eager")
    compiled = train(
        cfg(*common, "train.batch_size=32", "train.accum_steps=2", "train.compile=true"),
        out=tmp_path / "compiled",
    )
    for which in ("last", "best"):  # last: the raw weights; best: the EMA weights
        a, b = weights_of(big, which), weights_of(compiled, which)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=f"{which} {k}")
    raw, ema = weights_of(compiled), weights_of(compiled, "best")
    assert not torch.allclose(raw["head.weight"], ema["head.weight"])  # the EMA really lags
    state = load_train_state(compiled / "checkpoints" / "last")
    # 1,438 training images: 44 batches of 32, a step every 2 (eager: 22 batches of 64)
    assert state["step"] == 22


def write_image_folder(root: Path, per_class: int = 40) -> Path:
    """3 classes of 8x8 RGB PNGs: noise around a class colour."""
    rng = np.random.default_rng(0)
    for c, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(rng.normal(colour, 50, size=(8, 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i:03d}.png")
    return root


class CtrlCAtCheck(run_mod.StopFlag):
    """The trainer's own Ctrl-C handling, with SIGINT raised at the `at`-th stop check (the
    engine checks once an optimizer step, the run once more after each epoch's save), so the
    interruption lands mid-epoch every time."""

    at = 8
    sent = signal.SIGINT  # or SIGTERM: the same stop, another exit code

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.checks = 0
        super().__init__(*args, **kwargs)

    @property
    def requested(self) -> bool:
        self.checks += 1
        if self.checks == self.at:
            signal.raise_signal(self.sent)  # handled before this returns
        return self._requested

    @requested.setter
    def requested(self, value: bool) -> None:
        self._requested = value


def test_image_folder_run_interrupted_mid_epoch_resumes_exactly(tmp_path, monkeypatch) -> None:
    """Per-image augmentation in a DataLoader worker, Ctrl-C in epoch 2, resume: the weights equal
    an uninterrupted run's bit for bit (workers were seeded from the global RNG after its state was
    saved, so a resumed run drew other augmentations)."""
    root = write_image_folder(tmp_path / "images")
    common = [
        f"data.name=imagefolder:{root}",
        "data.crop_padding=1",
        "data.hflip=0.5",
        "data.random_erasing=0.25",
        "data.workers=1",
        "data.val_fraction=0.2",
        "model.dropout=0.1",
        "train.batch_size=16",
        "train.epochs=2",
        "train.precision=fp32",
    ]
    straight = train(cfg(*common), out=tmp_path / "straight")
    monkeypatch.setattr(run_mod, "StopFlag", CtrlCAtCheck)
    with pytest.raises(TrainingStopped, match="stopped at epoch 2, batch 2"):
        train(cfg(*common), out=tmp_path / "stopped")
    monkeypatch.undo()
    # 120 images: 24 test, 96 train of which 19 validation: 77 = 4 batches of 16 an epoch;
    # checks 1-4 in epoch 1's steps, the 5th after its save, the 8th before epoch 2's third batch
    state = load_train_state(tmp_path / "stopped" / "checkpoints" / "last")
    assert (state["epoch"], state["batch"], state["step"]) == (1, 2, 6)
    assert state["partial"][3] == 2 * 16  # epoch 2's two batches so far, with their figures
    resumed = resume(tmp_path / "stopped")
    for which in ("last", "best"):
        a, b = weights_of(straight, which), weights_of(resumed, which)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{which} {k}"
    # the resumed epoch's logged figures are the whole epoch's, as the straight run's (they were
    # the batches after the resume only)
    logged = [
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (straight, resumed)
    ]
    for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
        assert logged[1][1][key] == pytest.approx(logged[0][1][key], rel=1e-6), key


def test_a_resume_on_changed_data_is_warned_of(tmp_path, caplog) -> None:
    """Images added to a folder whose test split is drawn by seed, between a stop and its
    --resume: some training images become test images. The run keeps a digest of its splits as
    listed and says so; the same data resumes without a word."""
    from PIL import Image

    root = write_image_folder(tmp_path / "images", per_class=10)
    common = [f"data.name=imagefolder:{root}", "train.batch_size=8", "train.epochs=2",
              "train.stop_at_epoch=1", "data.val_fraction=0"]  # fmt: skip
    for run, changed in (("same", False), ("changed", True)):
        train(cfg(*common), out=tmp_path / run)  # stops, resumably, after epoch 1
        if changed:
            for i in range(5):
                Image.new("RGB", (8, 8), (i, 0, 0)).save(root / "class1" / f"new{i}.png")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitlab"):
            resume(tmp_path / run, "train.stop_at_epoch=null")
        said = "is not what the run trained on" in caplog.text
        assert said == changed, caplog.text


def test_channels_last_trains_the_same_model_in_nhwc_memory(tmp_path, monkeypatch) -> None:
    """train.channels_last on RGB images: the conv stem's kernels and the images the model gets
    are NHWC, the weights learnt are the default layout's (to float noise), and a resume is exact,
    also from a checkpoint of the other layout (fused AdamW reads its moments in the weights'
    memory order: moments restored in another order would silently scramble)."""
    root = write_image_folder(tmp_path / "images")
    common = [f"data.name=imagefolder:{root}", "model.stem=conv", "model.stem_width=8",
              "model.patch_size=4", "train.batch_size=16", "train.epochs=2",
              "train.precision=fp32", "data.val_fraction=0"]  # fmt: skip
    seen = set()  # (kernel NCHW, kernel NHWC, images NCHW, images NHWC) at each forward
    real_epoch = run_mod.train_epoch

    def layout(t: torch.Tensor) -> tuple[bool, bool]:
        return t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last)

    def epoch(model, *args, **kwargs):
        kernel = next(p for p in model.parameters() if p.ndim == 4)  # 3 -> 8 channels, 3x3
        hook = model.register_forward_pre_hook(
            lambda _, inputs: seen.add((*layout(kernel), *layout(inputs[0])))
        )
        try:
            return real_epoch(model, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(run_mod, "train_epoch", epoch)
    default = train(cfg(*common), out=tmp_path / "default")
    assert seen == {(True, False, True, False)}  # NCHW kernels and images
    seen.clear()
    nhwc = [*common, "train.channels_last=true"]
    straight = train(cfg(*nhwc), out=tmp_path / "straight")
    assert seen == {(False, True, False, True)}
    half = train(cfg(*nhwc, "train.stop_at_epoch=1"), out=tmp_path / "half")
    resumed = resume(half)
    nchw_half = train(cfg(*common, "train.stop_at_epoch=1"), out=tmp_path / "nchw_half")
    flipped = train(cfg(*nhwc), resume=nchw_half)  # the Python API takes any config
    a, b = weights_of(default), weights_of(straight)
    c, d = weights_of(resumed), weights_of(flipped)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3, msg=k)
        torch.testing.assert_close(d[k], a[k], atol=1e-4, rtol=1e-3, msg=k)
        assert torch.equal(c[k], b[k]), k
    top1 = [json.loads((r / "results.json").read_text())["top1"] for r in (default, straight)]
    assert top1[0] == pytest.approx(top1[1], abs=1 / 24) and top1[0] > 0.5  # chance: 1/3


def test_folder_augmentation_is_a_function_of_seed_epoch_and_batch(tmp_path) -> None:
    """Workers draw each batch's augmentation from a seed of (seed, epoch, batch, rank): the same
    batches from any start and any number of workers, fresh draws every epoch, and the trainer's
    global RNG untouched."""
    split = load_split(f"imagefolder:{write_image_folder(tmp_path / 'images', 8)}", "train")
    pre = Preprocessing((8, 8), 3, (0.5,) * 3, (0.5,) * 3)
    aug = BatchAugment(DataConfig(crop_padding=1, hflip=0.5), pre, 3)

    def loader(workers: int):
        return make_loader(split, 4, pre, augment=aug, shuffle=True, seed=5, workers=workers)

    before = torch.get_rng_state()
    epoch0 = list(loader(2).iterate(0))
    assert torch.equal(torch.get_rng_state(), before)  # no draw from the global RNG
    assert len(epoch0) == len(split) // 4 == 4
    for whole, part in zip(epoch0[2:], loader(2).iterate(0, start=2), strict=True):
        assert torch.equal(whole[0], part[0]) and torch.equal(whole[1], part[1])
    for a, b in zip(epoch0, loader(0).iterate(0), strict=True):
        assert torch.equal(a[0], b[0])

    def by_index(epoch: int) -> dict[int, torch.Tensor]:
        plan = loader(1).plan
        batches = zip(plan.batches(epoch), loader(1).iterate(epoch), strict=True)
        return {i: x for index, (xs, _) in batches for i, x in zip(index.tolist(), xs)}

    first, second = by_index(0), by_index(1)
    plain = make_loader(split, len(split), pre).iterate()
    originals = next(iter(plain))[0]
    shared = sorted(first.keys() & second.keys())
    assert len(shared) >= 8
    assert sum(not torch.equal(first[i], second[i]) for i in shared) >= len(shared) * 3 // 4
    assert sum(not torch.equal(first[i], originals[i]) for i in first) >= len(first) * 3 // 4


def test_resume_after_an_epoch_with_a_dropped_partial_window_is_exact(tmp_path) -> None:
    """13 batches with accum_steps=2: the 13th is drawn (augmented) but never stepped on; a run
    stopped after epoch 1 must resume from the random state after that draw, as the straight
    run goes on from it (the checkpoint held the state before it)."""
    common = [
        "data.crop_padding=1",
        "data.hflip=0.5",
        "model.dropout=0.1",
        "train.batch_size=96",  # 1,294 training images: 13 batches, 6 steps an epoch
        "train.accum_steps=2",
        "train.epochs=2",
    ]
    straight = train(cfg(*common), out=tmp_path / "straight")
    half = train(cfg(*common, "train.stop_at_epoch=1"), out=tmp_path / "half")
    assert load_train_state(half / "checkpoints" / "last")["step"] == 6
    resumed = resume(half)
    a, b = weights_of(straight), weights_of(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
