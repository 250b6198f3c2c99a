"""CNN baselines (torchvision's ResNet-18 / 34 / 50): torchvision's sizes, initialisation and
logits; the small stem at 32 px and below; the vitlab model interface; checkpoints in vitlab's and
torchvision's format (and timm's ResNet files, the same names); the cost report against an
independent count; and a run on digits through train, resume, eval, predict and fewshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision.models as tvm
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import check_eval_and_predict, resume, torchrun_train, weights_of
from vitlab import create_model, load_checkpoint, save_pretrained
from vitlab.analysis.cost import cost_report, format_cost_report
from vitlab.cli.main import main
from vitlab.config import ConfigError, load_run_config
from vitlab.data import dataset_info, load_split
from vitlab.eval.features import represent
from vitlab.formats.base import CheckpointError
from vitlab.models.checkpoint import infer_config, read_source
from vitlab.models.cnn import CNNConfig, ResNet
from vitlab.models.registry import build_model, family_of, get_config, list_models, shape_of
from vitlab.train.build import finetune_weights, resolve_model_config
from vitlab.train.run import train

TORCHVISION = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032}


def builder(arch: str) -> nn.Module:
    return {"resnet18": tvm.resnet18, "resnet34": tvm.resnet34, "resnet50": tvm.resnet50}[arch]()


def randomized(model: ResNet, seed: int = 0) -> ResNet:
    """Random BatchNorm statistics and scales, so that eval-mode outputs test them too."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


# --- the models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(TORCHVISION))
def test_sizes_init_and_logits_are_torchvisions(arch: str) -> None:
    with torch.device("meta"):
        ours = sum(p.numel() for p in create_model(arch).parameters())
        theirs = sum(p.numel() for p in builder(arch).parameters())
    assert ours == theirs == TORCHVISION[arch]
    torch.manual_seed(0)
    model = create_model(arch)
    torch.manual_seed(0)
    reference = builder(arch)
    a, b = model.state_dict(), reference.state_dict()
    assert list(a) == list(b)  # the same names in the same order, the same draws
    assert all(torch.equal(a[k], b[k]) for k in a)
    randomized(model)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))


def test_registry_family_shape_and_presets() -> None:
    bit = ["resnetv2_50", "resnetv2_50_28", "resnetv2_50_32"]  # tests/test_resnetv2.py
    assert list_models(family="cnn") == [*TORCHVISION, "resnet18_28", "resnet18_32", *bit]
    assert not set(list_models(family="cnn")) & set(list_models(family="vit"))
    cfg = get_config("resnet18_28")
    assert family_of(cfg) == "cnn" and (cfg.in_chans, cfg.num_classes) == (1, 10)
    assert shape_of(cfg) == "ResNet-18, small stem, 28x28"
    assert shape_of(get_config("resnet50")) == "ResNet-50, standard stem, 224x224"
    assert isinstance(build_model(cfg), ResNet)
    with pytest.raises(ConfigError, match="arch"):
        get_config("resnet18", arch="resnet101")
    with pytest.raises(ConfigError, match="unknown key 'patch_size'"):
        get_config("resnet18", patch_size=4)
    with pytest.raises(ConfigError, match="num_classes must be >= 0"):
        CNNConfig(num_classes=-1)
    with pytest.raises(ConfigError, match="positive"):
        CNNConfig(img_size=(32, 0))


def test_small_stem_at_32_px_and_below_the_standard_one_above() -> None:
    assert CNNConfig(img_size=32).uses_small_stem and CNNConfig(img_size=(8, 28)).uses_small_stem
    assert not CNNConfig(img_size=33).uses_small_stem
    assert not CNNConfig(img_size=(32, 64)).uses_small_stem
    assert not CNNConfig(img_size=28, small_stem=False).uses_small_stem
    assert CNNConfig(img_size=224, small_stem=True).uses_small_stem
    small, standard = create_model("resnet18_32"), create_model("resnet18_32", img_size=64)
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, nn.Identity)
    assert standard.conv1.kernel_size == (7, 7) and isinstance(standard.maxpool, nn.MaxPool2d)
    with torch.no_grad():
        assert small.forward_features(torch.randn(1, 3, 32, 32)).shape == (1, 512, 4, 4)
        assert standard.forward_features(torch.randn(1, 3, 64, 64)).shape == (1, 512, 2, 2)
        # the small stem on 28 px: 28, 14, 7, 4 (a stride-2 conv rounds up)
        maps = create_model("resnet18_28").forward_intermediates(torch.randn(1, 1, 28, 28))
    assert [tuple(m.shape[1:]) for m in maps] == [(64, 28, 28), (128, 14, 14), (256, 7, 7),
                                                  (512, 4, 4)]  # fmt: skip


def test_the_model_interface() -> None:
    torch.manual_seed(0)
    model = randomized(create_model("resnet50", img_size=40, num_classes=7))
    assert model.num_features == 2048 and model.num_prefix_tokens == 0
    assert model.preprocessing is None and model.classes is None
    x = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        feats = model.forward_features(x)  # (B, C, h, w)
        pooled = model.forward_head(feats, pre_logits=True)
        assert feats.shape == (2, 2048, 2, 2)
        torch.testing.assert_close(pooled, feats.mean(dim=(2, 3)))
        torch.testing.assert_close(model.forward_head(feats), model.fc(pooled))
        torch.testing.assert_close(model(x), model.forward_head(feats))
        maps = model.forward_intermediates(x)
        assert [m.shape[1] for m in maps] == [256, 512, 1024, 2048]
        assert [m.shape[2] for m in maps] == [10, 5, 3, 2]  # strides 4, 8, 16, 32
        torch.testing.assert_close(maps[-1], feats)
        assert [m.shape[1] for m in model.forward_intermediates(x, indices=[0, -1])] == [256, 2048]
        assert len(model.forward_intermediates(x, indices=1)) == 1
        # fewshot / probe features: prelogits, and gap the same for a CNN
        torch.testing.assert_close(represent(model, x, "gap"), pooled)
        torch.testing.assert_close(represent(model, x, "prelogits"), pooled)
    decay_free = model.no_weight_decay()
    assert "fc.bias" in decay_free and "bn1.weight" in decay_free
    assert "layer1.0.bn3.bias" in decay_free and "layer4.0.downsample.1.weight" in decay_free
    assert not any(name.endswith("conv1.weight") or name == "fc.weight" for name in decay_free)
    assert len(model.blocks) == 16  # 3 + 4 + 6 + 3 bottlenecks, which FSDP shards
    model.reset_classifier(3)
    assert model.config.num_classes == 3 and not model(x).any()  # a zero head
    model.reset_classifier(0)
    assert model(x).shape == (2, 2048)
    with pytest.raises(ValueError, match="expected images with 3 channels, got 1"):
        model(torch.randn(2, 1, 40, 40))
    with pytest.raises(ValueError, match=r"shape \(B, 3, H, W\)"):
        model(torch.randn(3, 40, 40))


def test_set_image_size_records_the_size_and_keeps_the_stem() -> None:
    model = create_model("resnet18_28")
    model.set_image_size(64)  # a CNN takes any size: the stem stays the small one, stated
    assert model.config.img_hw == (64, 64) and model.config.small_stem is True
    assert model.conv1.kernel_size == (3, 3)
    model.set_image_size(16, small_stem=True)
    assert model.config.img_size == 16
    with pytest.raises(ConfigError, match="stem is fixed when the model is built"):
        model.set_image_size(16, small_stem=False)


def test_every_cnn_runs_and_every_parameter_gets_a_gradient() -> None:
    for name in list_models(family="cnn"):
        cfg = get_config(name)
        torch.manual_seed(0)
        model = create_model(name, img_size=16, small_stem=cfg.uses_small_stem, num_classes=3)
        model.classifier.weight.data.normal_(std=0.1)
        logits = model(torch.randn(2, cfg.in_chans, 16, 16))
        assert logits.shape == (2, 3) and torch.isfinite(logits).all()
        logits.square().mean().backward()
        for pname, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: {pname}"


def test_grad_checkpointing_gives_the_same_gradients_and_batchnorm_statistics() -> None:
    torch.manual_seed(0)
    a = create_model("resnet18_32", num_classes=4).train()
    b = create_model("resnet18_32", num_classes=4).train()
    b.load_state_dict(a.state_dict())
    b.set_grad_checkpointing()
    x = torch.randn(4, 3, 16, 16)
    for model in (a, b):
        model(x).square().sum().backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:  # running statistics updated once, not again by the recomputation
        torch.testing.assert_close(sb[k], sa[k], msg=k)
    assert int(sb["layer1.0.bn1.num_batches_tracked"]) == 1


# --- checkpoints ---------------------------------------------------------------------------------


def test_vitlab_format_round_trip_records_the_family(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomized(create_model("resnet18_28", img_size=20))
    save_pretrained(model, tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert f.metadata()["family"] == "cnn"
    back, meta = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(back, ResNet) and meta.config == model.config
    x = torch.randn(2, 1, 20, 20)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    with pytest.raises(ConfigError, match="unknown key 'window_size'"):
        load_checkpoint(tmp_path / "ckpt", window_size=7)


def test_a_plain_torchvision_state_dict_loads_with_its_architecture(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = builder("resnet34")
    state = randomized(create_model("resnet34")).state_dict()
    reference.load_state_dict(state)
    # torchvision's released files predate BatchNorm's counters
    torch.save({k: v for k, v in state.items() if "num_batches" not in k}, tmp_path / "r34.pth")
    model, meta = load_checkpoint(tmp_path / "r34.pth")
    assert meta.config == CNNConfig(arch="resnet34", small_stem=False)
    assert meta.info["source_format"] == "torchvision"
    pre = meta.preprocessing
    assert (pre.crop_pct, pre.interpolation, pre.img_size) == (224 / 256, "bilinear", (224, 224))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))
    # overrides: grey images, 5 classes (a zero head), another size
    grey, meta = load_checkpoint(tmp_path / "r34.pth", in_chans=1, num_classes=5, img_size=96)
    assert (meta.config.in_chans, meta.config.num_classes, meta.config.img_size) == (1, 5, 96)
    assert grey.conv1.weight.shape == (64, 1, 7, 7) and not grey.fc.weight.any()


def test_the_architecture_is_read_from_the_tensors(tmp_path: Path) -> None:
    small = create_model("resnet18_32", num_classes=0).state_dict()
    save_file(small, tmp_path / "small.safetensors")
    model, meta = load_checkpoint(tmp_path / "small.safetensors")
    assert meta.config == CNNConfig(img_size=32, num_classes=0, small_stem=True)
    assert "assumed 32 for the small stem" in meta.info["notes"][0]
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, 512)  # no classifier: pooled features
    assert load_checkpoint(tmp_path / "small.safetensors", img_size=24)[1].config.img_size == 24
    with pytest.raises(CheckpointError, match="small_stem=False does not fit"):
        load_checkpoint(tmp_path / "small.safetensors", small_stem=False)
    state = create_model("resnet18").state_dict()
    bad = {**state, "layer1.0.conv3.weight": torch.zeros(64, 64, 1, 1)}
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match="bottleneck blocks 2-2-2-2 per stage are none"):
        load_checkpoint(tmp_path / "bad.safetensors")
    wide = {**state, "layer1.0.conv2.weight": torch.zeros(64, 32, 3, 3)}  # a ResNeXt's groups
    save_file(wide, tmp_path / "wide.safetensors")
    with pytest.raises(CheckpointError, match="wide ResNet or a ResNeXt"):
        load_checkpoint(tmp_path / "wide.safetensors")


def test_timm_resnet_files_are_torchvisions_names(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    reference = timm.create_model("resnet18", num_classes=4).eval()
    folder = tmp_path / "timm_resnet18"
    folder.mkdir()
    save_file(reference.state_dict(), folder / "model.safetensors")
    pretrained = {"input_size": [3, 160, 160], "interpolation": "bicubic", "crop_pct": 0.95,
                  "mean": [0.5] * 3, "std": [0.25] * 3}  # fmt: skip
    config = {"architecture": "resnet18", "num_classes": 4, "pretrained_cfg": pretrained}
    (folder / "config.json").write_text(json.dumps(config))
    model, meta = load_checkpoint(folder)
    assert meta.config.img_hw == (160, 160) and meta.preprocessing.crop_pct == 0.95
    assert meta.preprocessing.mean == (0.5,) * 3
    x = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


def test_convert_to_torchvision_and_refusals(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = randomized(create_model("resnet18", num_classes=3))
    save_pretrained(model, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "r18.pth"), "--to",
                 "torchvision"]) == 0  # fmt: skip
    assert (
        "ResNet-18, standard stem, 224x224, 3-channel images, 3 classes" in capsys.readouterr().out
    )
    reference = tvm.resnet18(num_classes=3)
    reference.load_state_dict(torch.load(tmp_path / "r18.pth", weights_only=True))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(reference.eval()(x), model(x))
    for to in ("timm", "hf"):
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / to), "--to", to]) == 2
        assert "write a ResNet with --to torchvision" in capsys.readouterr().err
        assert not (tmp_path / to).exists()
    with pytest.raises(CheckpointError, match="CNNs \\(ResNets\\) only"):
        save_pretrained(create_model("vit_nano_patch4_28"), tmp_path / "vit.pth", "torchvision")


# --- cost ----------------------------------------------------------------------------------------


def test_resnet18_cost_by_hand_and_torchvisions_published_figure() -> None:
    r = cost_report("resnet18")
    assert r["family"] == "cnn" and r["params"]["total"] == TORCHVISION["resnet18"]
    assert r["stem"] == {"grid": [56, 56], "stride": 4, "macs": 49 * 3 * 64 * 112 * 112}
    stages = r["stages"]
    assert [s["grid"] for s in stages] == [[56, 56], [28, 28], [14, 14], [7, 7]]
    assert stages[0]["macs"] == 4 * 9 * 64 * 64 * 56 * 56
    # layer2: 3x3 64->128 at stride 2, three 3x3 128->128, a 1x1 64->128 downsample, on 28x28
    assert stages[1]["conv_macs"] == 9 * 28 * 28 * (64 * 128 + 3 * 128 * 128)
    assert stages[1]["downsample_macs"] == 64 * 128 * 28 * 28
    assert r["head_macs"] == 512 * 1000
    published = tvm.ResNet18_Weights.IMAGENET1K_V1.meta["_ops"]  # torchvision's "GFLOPS": MACs
    assert round(r["forward_macs"] / 1e9, 2) == round(published, 2) == 1.81
    text = format_cost_report(r)
    assert "11,689,512" in text and "1.81 GMACs" in text and "layer4" in text
    with pytest.raises(ValueError, match="patch sizes apply to ViTs"):
        cost_report("resnet18", patch_sizes=[16])


@pytest.mark.parametrize("name,size", [("resnet18_28", None), ("resnet50", 36), ("resnet34", 19)])
def test_cost_equals_the_flop_counter_on_a_real_forward(name: str, size: int | None) -> None:
    r = cost_report(name, img_size=size)
    model = create_model(name, img_size=r["img_size"], small_stem=r["small_stem"]).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(1, r["in_chans"], *r["img_size"]))
    assert 2 * r["forward_macs"] == counter.get_total_flops()


def test_cost_at_another_size_builds_a_name_as_create_model_and_keeps_a_configs_stem() -> None:
    """`vitlab cost resnet18 --img-size 32` counted the standard stem where create_model (and a
    config file's model.img_size) takes the small one, 15x fewer MACs; a built model's config (a
    checkpoint's, a run's) keeps its stem, as set_image_size does."""
    for name, size in (("resnet18", 32), ("resnet18_28", 224), ("resnet50", 20)):
        r = cost_report(name, img_size=size)
        built = create_model(name, img_size=size)
        assert r["small_stem"] == built.config.uses_small_stem == (size <= 32), name
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            built.eval()(torch.randn(1, r["in_chans"], size, size))
        assert 2 * r["forward_macs"] == counter.get_total_flops(), name
    trained = create_model("resnet18_28").config  # small_stem None, the small one built
    assert cost_report(trained, img_size=224)["small_stem"] is True


def test_cost_and_models_commands(capsys) -> None:
    assert main(["cost", "resnet18_28", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["small_stem"] and report["stem"]["grid"] == [28, 28]
    assert main(["cost", "resnet18", "--scaling", "--out", "unused.png"]) == 2
    assert "a CNN, which has no attention" in capsys.readouterr().err
    assert main(["models", "--family", "cnn", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["params"] for r in rows[:3]] == list(TORCHVISION.values())
    assert rows[3]["small_stem"] and rows[3]["stem_stride"] == 1 and rows[2]["bottleneck"]
    assert main(["models", "resnet*"]) == 0
    assert "25,557,032" in capsys.readouterr().out
    assert main(["models", "resnet*", "--family", "swin", "--json"]) == 1  # as the table: no match
    assert json.loads(capsys.readouterr().out) == []


# --- a run ---------------------------------------------------------------------------------------

# ResNet-18 with the small stem on 8x8 digits, a fifth of the training images to stay quick
RUN = ["model.name=resnet18_28", "model.img_size=8", "data.label_fraction=0.2",
       "train.batch_size=32", "train.precision=fp32"]  # fmt: skip


def run_config(*overrides: str):
    return load_run_config(None, [*RUN, *overrides])


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(run_config("train.epochs=2"), out=tmp_path_factory.mktemp("cnn") / "run")


def test_a_cnn_run_learns_and_resumes_exactly(cnn_run: Path, tmp_path: Path) -> None:
    result = json.loads((cnn_run / "results.json").read_text())
    assert result["num_images"] == 359 and result["top1"] > 0.3  # chance: 0.1
    half = train(run_config("train.epochs=2", "train.stop_at_epoch=1"), out=tmp_path / "half")
    resumed = resume(half)
    a, b = weights_of(cnn_run), weights_of(resumed)
    assert a.keys() == b.keys() and "layer4.1.bn2.running_var" in a
    for k in a:  # BatchNorm statistics and counters included
        assert torch.equal(a[k], b[k]), k


def test_a_cnn_refuses_masked_patch_prediction(tmp_path: Path, cnn_run: Path) -> None:
    with pytest.raises(ConfigError, match="pre-trains a ViT.*cnn model"):
        train(run_config("train.objective=mpp", "train.epochs=1"), out=tmp_path / "mpp")
    # a fine-tune names its source's architecture (it named the default model.name, a ViT), and
    # a CNN student is told it cannot have a distillation head (it was told to set distilled)
    with pytest.raises(ConfigError, match=f"the architecture of {cnn_run} .*is a cnn model"):
        train(run_config(f"finetune.from={cnn_run}", "train.objective=mpp"), out=tmp_path / "f")
    with pytest.raises(ConfigError, match="which a CNN has none of: the student is a ViT"):
        train(run_config(f"distill.teacher={cnn_run}"), out=tmp_path / "d")
    from vitlab.models.registry import get_config
    from vitlab.train import distill

    swin = get_config("swin_nano_patch2_window7_28")  # a Swin student, the same words
    with pytest.raises(ConfigError, match="which a Swin has none of: the student is a ViT"):
        distill.prepare(run_config(f"distill.teacher={cnn_run}"), swin, [], None, "cpu", False)
    with pytest.raises(ConfigError, match="compile with train.grad_checkpointing"):
        train(run_config("train.compile=true", "train.grad_checkpointing=true"))


def test_finetuning_a_small_stem_run_at_64_px_keeps_its_stem(cnn_run: Path) -> None:
    """The run was built with the small stem at 8 px; at 64 px the automatic choice would be the
    standard stem, but the weights are the small stem's, and so is the config they carry. The
    steps `vitlab train finetune.from=RUN model.img_size=64` takes before its first epoch."""
    assert load_checkpoint(cnn_run)[1].config.small_stem is True
    cfg = run_config(f"finetune.from={cnn_run}", "model.img_size=64")
    source = read_source(cnn_run)
    info = dataset_info("digits", load_split("digits", "train"))
    config = resolve_model_config(cfg, info, infer_config(source))
    assert config.img_hw == (64, 64) and config.small_stem is True
    model = build_model(config)
    notes = finetune_weights(model, source)
    assert model.conv1.kernel_size == (3, 3) and any("weights are kept" in n for n in notes)
    assert torch.equal(model.conv1.weight, weights_of(cnn_run, "best")["conv1.weight"])
    # the other stem asked for: said as that (it was "shapes differ: conv1.weight: checkpoint
    # (64, 1, 3, 3), model (64, 1, 7, 7)", a QA pass); the same stem named is taken
    cfg = run_config(f"finetune.from={cnn_run}", "model.small_stem=false")
    with pytest.raises(ConfigError, match="model.small_stem=False: the weights' stem is the small "
                                          r"\(3x3 stride-1 conv1, no max-pool\) one"):  # fmt: skip
        resolve_model_config(cfg, info, infer_config(source))
    cfg = run_config(f"finetune.from={cnn_run}", "model.small_stem=true", "model.img_size=64")
    assert resolve_model_config(cfg, info, infer_config(source)).small_stem is True


def test_under_ddp_validation_is_the_saved_models(tmp_path: Path, capsys) -> None:
    """BatchNorm statistics are rank 0's on every rank before validation and saving, so the
    validation accuracy logged under torchrun is the saved checkpoint's (fp32: exactly)."""
    out = tmp_path / "ddp"
    proc = torchrun_train(out, *RUN, "train.epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["val_acc"]
    assert main(["eval", str(out), "--split", "val", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top1"] == pytest.approx(logged, abs=1e-6)


def test_a_cnn_run_works_with_eval_predict_and_fewshot(cnn_run: Path, tmp_path: Path,
                                                       capsys) -> None:  # fmt: skip
    model, meta = load_checkpoint(cnn_run)
    assert isinstance(model, ResNet) and meta.config.img_size == 8 and meta.config.uses_small_stem
    check_eval_and_predict(cnn_run, tmp_path, capsys)
    means = {}
    for kind in ("prelogits", "gap"):
        assert main(["fewshot", str(cnn_run), "--shots", "5", "--seeds", "1", "--features", kind,
                     "--json"]) == 0  # fmt: skip
        means[kind] = json.loads(capsys.readouterr().out)["results"][0]["mean"]
    assert means["gap"] == means["prelogits"] > 0.2  # chance: 0.1
    assert main(["analyze", str(cnn_run), "--out", str(tmp_path / "analysis")]) == 2
    assert f"a CNN ({meta.config.arch}) has neither" in capsys.readouterr().err
