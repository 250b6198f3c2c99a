"""Masked patch prediction (train.objective=mpp): the corruption's proportions, the 3-bit
mean-colour target against hand computations, training without labels end to end (an unlabelled
image folder, resume, torchrun), and fine-tuning from its encoder."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL, resume, torchrun_train, weights_of
from vitlab import load_checkpoint
from vitlab.cli.main import main
from vitlab.config import ConfigError, MPPConfig, load_run_config
from vitlab.data import Preprocessing, label_subset, load_split, make_loader
from vitlab.eval.mpp import evaluate_mpp
from vitlab.models.mpp import (
    MaskedPatchViT,
    MPPHead,
    draw_corruption,
    mean_color_classes,
    mpp_loss,
    patch_pixels,
)
from vitlab.models.vit import ViTConfig
from vitlab.train.run import train

FAST = [*TINY_MODEL, "train.batch_size=64", "train.objective=mpp"]


def cfg(*overrides: str):
    return load_run_config(None, [*FAST, *overrides])


def test_corruption_takes_half_the_patches_and_splits_them_80_10_10() -> None:
    torch.manual_seed(0)
    plan = draw_corruption(4000, 49, MPPConfig(), torch.device("cpu"))
    assert (plan.corrupted.sum(dim=1) == round(0.5 * 49)).all()  # 24 of 49 in every image
    assert not (plan.masked & ~plan.corrupted).any() and not (plan.replaced & ~plan.corrupted).any()
    assert not (plan.masked & plan.replaced).any()
    total = plan.corrupted.sum().item()  # 96,000 corrupted patches
    masked, replaced = plan.masked.sum().item() / total, plan.replaced.sum().item() / total
    assert masked == pytest.approx(0.8, abs=0.006)  # 5 standard deviations of a binomial share
    assert replaced == pytest.approx(0.1, abs=0.005)
    assert 1 - masked - replaced == pytest.approx(0.1, abs=0.005)
    # every position is equally likely to be corrupted
    per_position = plan.corrupted.float().mean(dim=0)
    assert per_position.min() > 0.45 and per_position.max() < 0.55
    other = draw_corruption(4000, 49, MPPConfig(corrupt=0.25, mask=1.0, random=0.0), "cpu")
    assert (other.corrupted.sum(dim=1) == 12).all() and torch.equal(other.masked, other.corrupted)


def test_corrupt_masks_replaces_with_another_patch_and_keeps_the_rest() -> None:
    torch.manual_seed(1)
    b, n, d = 8, 16, 5
    head = MPPHead(d, 7)
    emb = torch.randn(b, n, d)
    plan = draw_corruption(b, n, MPPConfig(), emb.device)
    out = head.corrupt(emb, plan)
    token = head.mask_token.detach().view(d)
    assert torch.equal(out[plan.masked], token.expand(int(plan.masked.sum()), d))
    untouched = ~(plan.masked | plan.replaced)
    assert torch.equal(out[untouched], emb[untouched])
    flat = emb.reshape(b * n, d)
    for i, j in plan.replaced.nonzero().tolist():
        matches = (flat == out[i, j]).all(dim=1).nonzero().squeeze(1).tolist()
        assert matches and i * n + j not in matches  # another patch's embedding, not its own


def test_mean_color_target_equals_a_hand_computation() -> None:
    # one RGB image of two 2x2 patches; channel means (0.5, 0.1, 0.99) and (0.0, 1.0, 0.3)
    img = torch.zeros(1, 3, 2, 4)
    img[0, 0, :, :2], img[0, 1, :, :2], img[0, 2, :, :2] = 0.5, 0.1, 0.99
    img[0, 0, :, 2:] = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    img[0, 1, :, 2:], img[0, 2, :, 2:] = 1.0, torch.tensor([[0.2, 0.4], [0.2, 0.4]])
    # 3 bits: floor(8 * mean) capped at 7 -> (4, 0, 7) and (0, 7, 2); R most significant
    expected = [4 * 64 + 0 * 8 + 7, 0 * 64 + 7 * 8 + 2]
    assert mean_color_classes(img, 2, 3).tolist() == [expected]
    # one channel: 8 classes; a patch of mean 0.3 -> floor(2.4) = 2; 1 bit: 0.3 -> 0, 0.6 -> 1
    gray = torch.tensor([[[[0.2, 0.4, 0.6, 0.6], [0.2, 0.4, 0.6, 0.6]]]])
    assert mean_color_classes(gray, 2, 3).tolist() == [[2, 4]]
    assert mean_color_classes(gray, 2, 1).tolist() == [[0, 1]]


def test_a_patch_mean_on_a_class_edge_is_the_class_above_through_the_normalisation() -> None:
    """8-bit 4x4 patches whose sums are multiples of 510 have means on 3-bit class edges (k / 8):
    the class is sum // 510, by integers. The targets were taken from the normalised input's
    floats, which put some just under their edge (a QA run: 4 of 12,544 digits patches)."""
    vit = ViTConfig(img_size=4, patch_size=4, in_chans=1, num_classes=0, embed_dim=16, depth=1,
                    num_heads=2, mlp_dim=32)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    patches = torch.randint(0, 256, (4000, 16), generator=gen)
    patches[:, -1] = 0
    edge = (patches.sum(1) + 255) // 510 * 510  # the next edge the last pixel can reach
    patches[:, -1] = edge - patches.sum(1)
    patches = patches[(patches[:, -1] >= 0) & (patches[:, -1] <= 255)]
    assert len(patches) > 1500 and (patches.sum(1) % 510 == 0).all()
    expected = (patches.sum(1) // 510).clamp(max=7).view(-1, 1)
    img = patches.view(-1, 1, 4, 4).float() / 255
    assert torch.equal(mean_color_classes(img, 4, 3), expected)
    for mean, std in ((0.3061,), (0.3954,)), ((0.2860,), (0.3530,)), ((0.485,), (0.229,)):
        model = MaskedPatchViT(vit, MPPConfig(), mean, std)
        assert torch.equal(model.targets((img - mean[0]) / std[0]), expected), (mean, std)


def test_model_targets_undo_the_input_normalisation() -> None:
    torch.manual_seed(0)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    vit = ViTConfig(img_size=8, patch_size=4, in_chans=3, num_classes=0, embed_dim=16, depth=1,
                    num_heads=2, mlp_dim=32)  # fmt: skip
    model = MaskedPatchViT(vit, MPPConfig(), mean, std)
    pixels = torch.rand(3, 3, 8, 8)
    normalised = (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.equal(model.targets(normalised), mean_color_classes(pixels, 4, 3))
    torch.manual_seed(0)
    predictions, targets = model(normalised)
    assert predictions.shape == (3 * 2, 512) and targets.shape == (3 * 2,)  # 2 of 4 patches each
    # the targets are the drawn patches' (not the others'), for any corrupted share
    every = model.targets(normalised)
    for share in (0.5, 0.25, 0.75):
        model.mpp_config = MPPConfig(corrupt=share)
        _, targets = model(normalised, generator=torch.Generator().manual_seed(7))
        plan = draw_corruption(3, 4, model.mpp_config, "cpu", torch.Generator().manual_seed(7))
        assert plan.corrupted.sum(dim=1).tolist() == [round(4 * share)] * 3
        assert torch.equal(targets, every[plan.corrupted])
        assert not torch.equal(targets, every[~plan.corrupted][: len(targets)])
    model.mpp_config = MPPConfig()
    l2 = MaskedPatchViT(vit, MPPConfig(target="patch_l2"), mean, std)
    predictions, targets = l2(normalised)
    assert predictions.shape == targets.shape == (6, 3 * 4 * 4)
    assert patch_pixels(normalised, 4)[0, 1].tolist() == normalised[0, :, :4, 4:].flatten().tolist()
    loss, right = mpp_loss(predictions, targets, "patch_l2")
    assert right is None and loss.item() == pytest.approx(targets.pow(2).mean().item(), rel=1e-6)
    with pytest.raises(ConfigError, match="num_classes must be 0"):
        MaskedPatchViT(vit.replace(num_classes=10), MPPConfig(), mean, std)
    with pytest.raises(ConfigError, match="representation_size"):  # it would get no gradient
        MaskedPatchViT(vit.replace(representation_size=16), MPPConfig(), mean, std)
    with pytest.raises(ConfigError, match="2\\^24 colour classes"):
        MaskedPatchViT(vit, MPPConfig(bits=8), mean, std)
    # a model that normalises after pooling normalises the patch tokens it predicts from
    fc = MaskedPatchViT(vit.replace(fc_norm=True, pool="gap"), MPPConfig(), mean, std)
    torch.nn.init.normal_(fc.mpp.head.weight)
    predictions, targets = fc(normalised)
    mpp_loss(predictions, targets, "mean_color")[0].backward()
    assert fc.fc_norm.weight.grad is not None and fc.fc_norm.weight.grad.abs().sum() > 0


def test_evaluation_counts_padding_images_out_but_runs_them() -> None:
    """Under torchrun a rank's last evaluation batch may be all padding (labels -1): the model
    still runs on it (ranks step together) and the metrics stay finite and count each image once."""
    vit = ViTConfig(img_size=8, patch_size=2, in_chans=1, num_classes=0, embed_dim=16, depth=1,
                    num_heads=2, mlp_dim=32)  # fmt: skip
    model = MaskedPatchViT(vit, MPPConfig(), (0.5,), (0.25,))
    part = load_split("digits", "test").subset(torch.arange(257))
    pre = Preprocessing((8, 8), 1, (0.5,), (0.25,))
    calls = []
    model.register_forward_hook(lambda m, args, out: calls.append(len(args[0])))
    cpu = torch.device("cpu")
    loaders = [make_loader(part, 128, pre, rank=r, world=2) for r in (0, 1)]
    results = [evaluate_mpp(model, loader, cpu) for loader in loaders]
    assert sum(r["num_images"] for r in results) == 257
    assert all(np.isfinite(r["loss"]) and 0 <= r["top1"] <= 1 for r in results)
    assert results[1]["num_patches"] == results[1]["num_images"] * 8
    assert len(calls) == 4  # two batches per rank, the padding one included
    again = evaluate_mpp(model, make_loader(part, 128, pre, rank=0, world=2), cpu)
    assert again == results[0]  # the same draws at every evaluation


def test_label_subset_takes_the_same_share_of_every_class() -> None:
    train = load_split("digits", "train")
    part = label_subset(train, 0.1, seed=0)
    counts = torch.bincount(train.labels, minlength=10)
    assert torch.bincount(part.labels, minlength=10).tolist() == [
        max(1, round(0.1 * c)) for c in counts.tolist()
    ]
    again, other = label_subset(train, 0.1, seed=0), label_subset(train, 0.1, seed=1)
    assert torch.equal(part.images, again.images) and not torch.equal(part.images, other.images)
    assert label_subset(train, 1.0, 0) is train


def test_pretraining_learns_colours_and_finetuning_starts_from_its_encoder(
    tmp_path: Path, capsys, caplog
) -> None:
    run = train(cfg("train.epochs=4"), out=tmp_path / "mpp")
    weights = weights_of(run, "best")
    assert {"mpp.mask_token", "mpp.head.weight", "mpp.head.bias"} <= weights.keys()
    assert "head.weight" not in weights  # no classifier
    result = json.loads((run / "results.json").read_text())
    assert result["num_images"] == 359 and result["num_patches"] == 359 * 8  # 8 of 16 patches
    # an independent floor: always guessing the test patches' most common mean colour
    test = load_split("digits", "test")
    classes = mean_color_classes(test.images.float() / 255, 2, 3)
    majority = torch.bincount(classes.flatten()).max().item() / classes.numel()
    assert result["top1"] > majority + 0.05, (result["top1"], majority)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.3

    model, meta = load_checkpoint(run)  # the encoder alone
    assert meta.config.num_classes == 0 and meta.info["objective"] == "mpp"
    assert not any(k.startswith("mpp.") for k in model.state_dict())
    assert main(["eval", str(run)]) == 2  # nothing to classify with
    assert "no classifier" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="vitlab"):  # a note, which -q hides
        ft = train(
            load_run_config(
                None,
                [*TINY_MODEL, "train.epochs=1", f"finetune.from={run}", "data.label_fraction=0.1"],
            ),
            out=tmp_path / "ft",
        )
    assert json.loads((ft / "results.json").read_text())["num_images"] == 359
    text = caplog.text  # the few labels, and the fully labelled validation split
    assert re.search(r"label_fraction=0.1 labels 1\d\d training .* keeps all 144 of its", text)
    tuned = weights_of(ft)
    assert tuned["head.weight"].shape == (10, 32)
    assert tuned["blocks.0.attn.qkv.weight"].shape == weights["blocks.0.attn.qkv.weight"].shape
    assert "fine-tune: new zero-initialised head for 10 classes" in text
    caplog.clear()  # and back to pre-training from the classifier: it had no "head for 0 classes"
    with caplog.at_level(logging.INFO, logger="vitlab"):
        train(cfg("train.max_steps=2", f"finetune.from={ft}"), out=tmp_path / "again")
    assert "fine-tune: the classifier of 10 classes left out" in caplog.text
    assert "head for 0 classes" not in caplog.text


def test_pretraining_resumes_exactly(tmp_path: Path) -> None:
    extra = ["train.epochs=3", "mpp.target=patch_l2", "model.drop_path=0.1"]
    straight = train(cfg(*extra), out=tmp_path / "straight")
    half = train(cfg(*extra, "train.stop_at_epoch=1"), out=tmp_path / "half")
    resumed = resume(half)
    a, b = weights_of(straight), weights_of(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    records = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_acc"] for r in records] == [None] * 3  # a regression has no accuracy


def _unlabelled_folder(root: Path, n: int = 40) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    for i in range(n):
        tone = rng.integers(0, 255, size=3)
        pixels = np.clip(tone + rng.integers(-20, 20, size=(8, 8, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"img{i:03d}.png")
    return root


def test_an_image_folder_without_classes_trains_by_mpp_only(tmp_path: Path, capsys) -> None:
    data = _unlabelled_folder(tmp_path / "photos")
    common = [*TINY_MODEL, "train.batch_size=8", "train.epochs=2", "data.workers=0",
              f"data.name=imagefolder:{data}"]  # fmt: skip
    with pytest.raises(ConfigError, match="no labels"):
        train(load_run_config(None, common), out=tmp_path / "supervised")
    one = tmp_path / "one"  # one class: every prediction right (it trained to loss 0, 100%)
    (one / "cat").mkdir(parents=True)
    for f in data.iterdir():
        (one / "cat" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=r"has one class \('cat'\): classification needs two"):
        train(load_run_config(None, [*common, f"data.name=imagefolder:{one}"]), out=tmp_path / "1")
    run = train(load_run_config(None, [*common, "train.objective=mpp"]), out=tmp_path / "mpp")
    result = json.loads((run / "results.json").read_text())
    assert result["num_images"] == 8 and result["classes"] == []  # 20% of 40 held out
    assert (run / "curves.png").is_file()
    with pytest.raises(ConfigError, match="mix labels"):
        train(load_run_config(None, [*common, "train.objective=mpp", "data.mixup=0.2"]))
    with pytest.raises(ConfigError, match="no classifier"):
        train(load_run_config(None, [*common, "train.objective=mpp", "model.num_classes=3"]))
    assert main(["fewshot", str(run), "--shots", "1"]) == 2  # its own data has no labels
    assert "no labels" in capsys.readouterr().err


def test_pretraining_under_torchrun_counts_every_test_image_once(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    proc = torchrun_train(out, *FAST, "train.epochs=1", "train.precision=fp32", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stderr
    result = json.loads((out / "results.json").read_text())
    assert result["num_images"] == 359 and result["num_patches"] == 359 * 8


def test_label_fraction_with_mpp_is_said_as_images_not_labels(tmp_path: Path, caplog) -> None:
    """Masked patch prediction reads no labels: the note said the fraction 'labels' N images."""
    with caplog.at_level(logging.INFO, logger="vitlab"):
        train(cfg("train.epochs=1", "data.label_fraction=0.5"), out=tmp_path / "mpp")
    said = r"label_fraction=0.5 keeps [\d,]+ training images \(masked patch prediction reads no"
    assert re.search(said + r" labels\); the validation split keeps all 144", caplog.text)
    assert " labels " not in caplog.text.replace("no labels", "")
