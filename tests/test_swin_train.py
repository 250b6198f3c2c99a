"""Swin trains through the same commands as a ViT: it learns, resumes exactly, shards under FSDP
with the same weights as one process, and refuses what only a ViT can do."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import check_eval_and_predict, resume, torchrun_train, weights_of
from vitlab import load_checkpoint
from vitlab.cli.main import main
from vitlab.config import ConfigError, load_run_config
from vitlab.models.swin import SwinTransformer
from vitlab.train.run import train

# a Swin small enough for 8x8 digits: patch 2 -> 4x4 tokens, window 2, two stages
TINY_SWIN = [
    "model.name=swin_nano_patch2_window4_32",
    "model.img_size=8",
    "model.window_size=2",
    "model.depths=[2,2]",
    "model.num_heads=[2,4]",
    "model.embed_dim=16",
    "train.batch_size=64",
]


def cfg(*overrides: str):
    return load_run_config(None, [*TINY_SWIN, *overrides])


def test_a_swin_run_learns_and_resumes_exactly(tmp_path: Path) -> None:
    extra = ["train.epochs=4", "optim.warmup_epochs=1", "model.drop_path=0.1", "data.hflip=0.5"]
    straight = train(cfg(*extra), out=tmp_path / "straight")
    result = json.loads((straight / "results.json").read_text())
    assert result["num_images"] == 359 and result["top1"] > 0.5  # chance: 0.1
    half = train(cfg(*extra, "train.stop_at_epoch=1"), out=tmp_path / "half")
    resumed = resume(half)
    a, b = weights_of(straight), weights_of(resumed)
    assert a.keys() == b.keys() and "layers.1.downsample.reduction.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_swin_refuses_masked_patch_prediction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pre-trains a ViT"):
        train(cfg("train.objective=mpp", "train.epochs=1"), out=tmp_path / "mpp")


def test_fsdp_shards_swin_blocks_and_equals_one_process(tmp_path: Path) -> None:
    """torchrun with 2 CPU processes, FSDP (each stage's blocks sharded), against one process with
    the same global batch (SGD, fp32)."""
    common = [*TINY_SWIN, "train.epochs=1", "data.val_fraction=0", "train.precision=fp32",
              "optim.name=sgd", "optim.lr=0.05", "model.drop_path=0"]  # fmt: skip
    single, multi = tmp_path / "single", tmp_path / "fsdp"
    train(load_run_config(None, common), out=single)
    proc = torchrun_train(multi, *common, "train.strategy=fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stderr
    a, b = weights_of(single), weights_of(multi)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)


def test_a_swin_checkpoint_works_with_every_command(tmp_path: Path, capsys, caplog) -> None:
    run = train(cfg("train.epochs=2"), out=tmp_path / "run")
    model, meta = load_checkpoint(run)
    assert isinstance(model, SwinTransformer) and meta.config.depths == (2, 2)
    check_eval_and_predict(run, tmp_path, capsys)
    assert main(["fewshot", str(run), "--shots", "5", "--seeds", "1", "--features", "gap",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["results"][0]["mean"] > 0.2  # chance: 0.1
    assert main(["analyze", str(run), "--out", str(tmp_path / "analysis")]) == 0
    assert (tmp_path / "analysis" / "index.html").is_file()
    capsys.readouterr()
    for to in ("timm", "hf"):
        assert main(["convert", str(run), str(tmp_path / to), "--to", to]) == 0
        back, _ = load_checkpoint(tmp_path / to)
        x = torch.randn(3, 1, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(back.eval()(x), model.eval()(x), atol=1e-5, rtol=1e-5)
    # fine-tuning at twice the resolution with twice the window: bias tables resampled
    with caplog.at_level(logging.INFO, logger="vitlab"):  # the fine-tune note, a log line
        tuned = train(cfg(f"finetune.from={run}", "model.img_size=16", "model.window_size=4",
                          "train.epochs=1"), out=tmp_path / "ft")  # fmt: skip
    config = load_checkpoint(tuned)[1].config
    assert config.img_hw == (16, 16) and config.window_size == 4
    assert "relative position tables resampled to the window 2 -> 4" in caplog.text
    assert "tables resampled to the token grid" not in caplog.text  # they span a window, not it
    assert re.search(r"token grid \(\d+, \d+\) -> \(\d+, \d+\)", caplog.text), caplog.text


def test_fine_tuning_a_swin_takes_its_keys_without_model_name(tmp_path: Path, capsys) -> None:
    """`finetune.from=SWIN model.window_size=4` was refused ("unknown key 'window_size' for
    ViTConfig": the keys were checked against the default model.name, which fine-tuning does
    not use); a model.name of another family is said to be unused."""
    run = train(cfg("train.epochs=1"), out=tmp_path / "run")
    args = ["train", f"finetune.from={run}", "model.img_size=16", "model.window_size=4",
            "train.epochs=1", "train.batch_size=64"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "ft")]) == 0, capsys.readouterr().err
    config = load_checkpoint(tmp_path / "ft")[1].config
    assert config.img_hw == (16, 16) and config.window_size == 4 and config.depths == (2, 2)
    capsys.readouterr()
    assert main([*args, "model.name=resnet18_28", "--out", str(tmp_path / "ft2")]) == 0
    err = capsys.readouterr().err
    said = "model.name=resnet18_28 [ResNet-18, small stem, 28x28] is not used: finetune.from's"
    assert said in err and "architecture [Swin C=" in err and "8x8] is trained" in err, err
    # the default model named: said too (it was taken for no model.name)
    assert main([*args, "model.name=vit_nano_patch4_28", "--out", str(tmp_path / "ft4")]) == 0
    assert "model.name=vit_nano_patch4_28 [D=64" in capsys.readouterr().err
    assert main([*args, "model.depth=2", "--out", str(tmp_path / "ft3")]) == 2  # a ViT's key
    assert "unknown key 'depth' for SwinConfig" in capsys.readouterr().err
