"""BiT's ResNet-v2-50 as a CNN baseline (models.resnetv2): against its timm twin, the hybrid's
backbone with four stages and a head (`timm.models.resnetv2.ResNetV2(layers=(3, 4, 6, 3),
preact=False, stem_type="same", conv_layer=partial(StdConv2dSame, eps=1e-8))`), parameter count,
names and logits; the small stem; the CNN interface; checkpoints in vitlab's and timm's format
(and the refusals: torchvision, pre-activation / BatchNorm ResNet-v2s); the cost against
FlopCounterMode on the twin; a run on digits through train, eval, predict and fine-tuning."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import check_eval_and_predict, weights_of
from vitlab import create_model, load_checkpoint, save_pretrained
from vitlab.analysis.cost import cost_report, format_cost_report
from vitlab.cli.main import main
from vitlab.config import ConfigError, load_run_config
from vitlab.data import dataset_info, load_split
from vitlab.formats.base import CheckpointError, Source
from vitlab.formats.families import state_family
from vitlab.models.checkpoint import infer_config, read_source
from vitlab.models.cnn import CNNConfig, ResNet
from vitlab.models.registry import build_model, family_of, get_config, list_models, shape_of
from vitlab.models.resnetv2 import BiTResNet
from vitlab.train.build import finetune_weights, resolve_model_config
from vitlab.train.run import train

timm = pytest.importorskip("timm")
from timm.layers import StdConv2d, StdConv2dSame  # noqa: E402
from timm.models.resnetv2 import ResNetV2  # noqa: E402

PARAMS = (
    25_557_032  # resnetv2_50 at 1000 classes, ours and the twin's (torchvision's resnet50's too)
)
MACS_224 = 4_089_184_256  # FlopCounterMode's on the twin at 224, halved


def twin(num_classes: int = 10, in_chans: int = 3, small_stem: bool = False) -> nn.Module:
    """timm's network that vitlab's resnetv2_50 is: the hybrids' backbone, four stages, a head;
    the small stem put in as vitlab builds it (timm has no such stem type)."""
    conv = partial(StdConv2dSame, eps=1e-8)
    net = ResNetV2(layers=(3, 4, 6, 3), preact=False, stem_type="same", conv_layer=conv,
                   num_classes=num_classes, in_chans=in_chans)  # fmt: skip
    if small_stem:
        net.stem.conv = conv(in_chans, 64, kernel_size=3, stride=1)
        net.stem.pool = nn.Identity()
    return net


def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random GroupNorm scales and shifts and a non-zero head, so that logits test them too."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.GroupNorm):
            m.weight.data.copy_(torch.rand(m.num_channels, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_channels, generator=g) * 0.1)
    head = model.get_submodule("head.fc")
    if isinstance(head, nn.Conv2d):
        head.weight.data.normal_(std=0.05, generator=g)
    return model.eval()


def paired(small_stem: bool = False, in_chans: int = 3) -> tuple[BiTResNet, nn.Module]:
    """A random timm twin and vitlab's model with its weights."""
    torch.manual_seed(0)
    ref = randomized(twin(in_chans=in_chans, small_stem=small_stem))
    ours = create_model("resnetv2_50", num_classes=10, in_chans=in_chans, small_stem=small_stem)
    ours.load_state_dict(ref.state_dict())
    return ours.eval(), ref


# --- the model -----------------------------------------------------------------------------------


def test_parameter_count_and_names_are_the_timm_twins() -> None:
    with torch.device("meta"):
        ours, theirs = create_model("resnetv2_50"), twin(num_classes=1000)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == PARAMS
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)  # the same names in the same order
    assert all(a[k].shape == b[k].shape for k in a)
    assert b["head.fc.weight"].shape == (1000, 2048, 1, 1)  # timm's head: a 1x1 conv
    assert isinstance(ours, BiTResNet) and not isinstance(ours, ResNet)


def test_logits_features_and_pooled_vector_are_the_timm_twins() -> None:
    ours, ref = paired()
    for x in (torch.randn(2, 3, 64, 64), torch.randn(1, 3, 61, 50)):  # odd sides: SAME padding
        with torch.no_grad():
            feats, theirs = ours.forward_features(x), ref.forward_features(x)
            torch.testing.assert_close(feats, theirs, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(
                ours.forward_head(feats, pre_logits=True),
                ref.forward_head(theirs, pre_logits=True),
                atol=1e-5,
                rtol=1e-5,
            )
            logits = ours(x)
            assert (logits - ref(x)).abs().max() <= 1e-4 and logits.abs().max() > 0.1


def test_small_stem_at_32_px_and_below_is_the_twins_with_a_3x3_stride_1_root() -> None:
    assert get_config("resnetv2_50_28").uses_small_stem
    small = create_model("resnetv2_50_28")
    assert small.stem.conv.kernel_size == (3, 3) and small.stem.conv.stride == (1, 1)
    assert small.stem.conv.weight.shape == (64, 1, 3, 3)
    assert create_model("resnetv2_50_32", img_size=64).stem.conv.kernel_size == (7, 7)
    with torch.no_grad():
        maps = small.forward_intermediates(torch.randn(1, 1, 28, 28))
    # 28, 14, 7, 4 (a stride-2 SAME conv rounds up), no max-pool
    assert [tuple(m.shape[1:]) for m in maps] == [(256, 28, 28), (512, 14, 14), (1024, 7, 7),
                                                  (2048, 4, 4)]  # fmt: skip
    ours, ref = paired(small_stem=True, in_chans=1)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    x = torch.randn(2, 1, 20, 20)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-4


def test_registry_and_the_cnn_interface() -> None:
    assert list_models("resnetv2*", family="cnn") == ["resnetv2_50", "resnetv2_50_28",
                                                      "resnetv2_50_32"]  # fmt: skip
    cfg = get_config("resnetv2_50_32")
    assert family_of(cfg) == "cnn" and (cfg.in_chans, cfg.num_classes) == (3, 10)
    assert shape_of(cfg) == "BiT ResNet-v2-50, small stem, 32x32"
    assert cfg.first_conv == "stem.conv.weight" and cfg.num_features == 2048
    assert isinstance(build_model(get_config("resnet50")), ResNet)  # same depths, torchvision's
    with pytest.raises(ConfigError, match="BiTResNet"):
        ResNet(cfg)
    torch.manual_seed(0)
    model = randomized(create_model("resnetv2_50_32", num_classes=7))
    assert model.num_prefix_tokens == 0 and len(model.blocks) == 16
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 2048, 2, 2)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.mean((2, 3)))
    decay_free = model.no_weight_decay()
    assert {"head.fc.bias", "stem.norm.weight", "stages.3.blocks.2.norm3.bias"} <= decay_free
    assert not any(name.endswith("conv.weight") or name == "head.fc.weight" for name in decay_free)
    model.reset_classifier(3)
    assert model.head.fc.weight.shape == (3, 2048, 1, 1) and not model(x).any()  # a zero head
    model.reset_classifier(0)
    assert model(x).shape == (2, 2048)
    model.set_image_size(64)  # recorded; the stem stays the small one, stated
    assert model.config.img_hw == (64, 64) and model.config.small_stem is True
    with pytest.raises(ConfigError, match="stem is fixed"):
        model.set_image_size(64, small_stem=False)
    zero = create_model("resnetv2_50_28", zero_init_residual=True)
    assert not any(block.norm3.weight.any() for block in zero.blocks)


def test_grad_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    a = randomized(create_model("resnetv2_50_28", num_classes=4)).train()
    b = create_model("resnetv2_50_28", num_classes=4).train()
    b.load_state_dict(a.state_dict())
    b.set_grad_checkpointing()
    x = torch.randn(2, 1, 8, 8)
    for model in (a, b):
        model(x).square().sum().backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, msg=name)


# --- checkpoints ---------------------------------------------------------------------------------


def test_vitlab_format_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomized(create_model("resnetv2_50_28", img_size=20))
    save_pretrained(model, tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert f.metadata()["family"] == "cnn"
        assert json.loads(f.metadata()["config"])["arch"] == "resnetv2_50"
    back, meta = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(back, BiTResNet) and meta.config == model.config
    x = torch.randn(2, 1, 20, 20)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_family_detection_tells_bit_from_a_hybrid_and_torchvision() -> None:
    bit = create_model("resnetv2_50_28").state_dict()
    assert state_family(bit) == "cnn"
    hybrid = create_model("vit_nano_r_s4_28").state_dict()
    assert "patch_embed.backbone.stem.conv.weight" in hybrid and state_family(hybrid) == "vit"
    assert state_family(create_model("resnet18_28").state_dict()) == "cnn"


def test_a_timm_state_dict_loads_with_its_architecture_and_logits(tmp_path: Path) -> None:
    ours, ref = paired()
    save_file(ref.state_dict(), tmp_path / "bit.safetensors")
    model, meta = load_checkpoint(tmp_path / "bit.safetensors")
    assert meta.config == CNNConfig(arch="resnetv2_50", num_classes=10, small_stem=False)
    assert meta.info["source_format"] == "timm" and isinstance(model, BiTResNet)
    x = torch.randn(1, 3, 40, 40)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-4
    # torchvision's resnet50 has the same depths: its names still make it torchvision's
    with torch.device("meta"):
        r50 = create_model("resnet50").state_dict()
    assert infer_config(Source(r50, "torchvision", "r50")).arch == "resnet50"
    # a small stem's 3x3 root, grey input, headless
    small = create_model("resnetv2_50_28", num_classes=0).state_dict()
    save_file(small, tmp_path / "small.safetensors")
    cfg = load_checkpoint(tmp_path / "small.safetensors")[1].config
    assert (cfg.arch, cfg.small_stem, cfg.in_chans, cfg.num_classes) == ("resnetv2_50", True, 1, 0)
    # a tensor out of place, a stage short
    save_file(
        {**small, "stages.0.blocks.0.extra.weight": torch.zeros(1)}, tmp_path / "x.safetensors"
    )
    with pytest.raises(CheckpointError, match=r"no place .*stages\.0\.blocks\.0\.extra"):
        load_checkpoint(tmp_path / "x.safetensors")
    short = {k: v for k, v in small.items() if not k.startswith("stages.3.blocks.2.")}
    save_file(short, tmp_path / "short.safetensors")
    with pytest.raises(CheckpointError, match="bottleneck blocks 3-4-6-2 per stage are none"):
        load_checkpoint(tmp_path / "short.safetensors")


def test_timms_other_resnetv2s_are_refused_by_name(tmp_path: Path) -> None:
    """timm's registered resnetv2_50 (pre-activation, BatchNorm) and BiT's released ResNet-v2
    (resnetv2_50x1_bit: pre-activation, GroupNorm, `fixed` stem), one unit per stage."""
    batchnorm = timm.create_model("resnetv2_50", layers=(1, 1, 1, 1), num_classes=2)
    preact = ResNetV2(layers=(1, 1, 1, 1), stem_type="fixed", num_classes=2,
                      conv_layer=partial(StdConv2d, eps=1e-8))  # fmt: skip
    for net, why in ((batchnorm, "with BatchNorm"), (preact, "a pre-activation ResNet-v2")):
        save_file(net.state_dict(), tmp_path / "other.safetensors")
        with pytest.raises(CheckpointError, match=why):
            load_checkpoint(tmp_path / "other.safetensors")


def test_convert_to_timm_builds_the_twin_in_timm_and_reads_back(tmp_path: Path, capsys) -> None:
    ours, ref = paired()
    save_pretrained(ours, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "t"), "--to", "timm"]) == 0
    assert "BiT ResNet-v2-50, standard stem, 224x224" in capsys.readouterr().out
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert config["architecture"] == "resnetv2_50" and config["model_args"]["preact"] is False
    assert config["pretrained_cfg"]["classifier"] == "head.fc"
    conv = partial(StdConv2dSame, eps=1e-8)
    again = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True, conv_layer=conv)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(again.eval()(x), ours(x))
    with pytest.raises(TypeError):  # without the conv layer, timm does not build another network
        timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True)
    back, meta = load_checkpoint(tmp_path / "t")
    assert meta.config == ours.config.replace(img_size=(224, 224))  # config.json's input_size
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))


def test_timm_folders_of_other_resnetv2s_and_small_stem_folders_are_refused(
    tmp_path: Path, capsys
) -> None:
    ours, _ = paired()
    save_pretrained(ours, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "t"), "--to", "timm"]) == 0
    config_path = tmp_path / "t" / "config.json"
    written = json.loads(config_path.read_text())
    load_checkpoint(tmp_path / "t")  # as written: read back
    # the same tensor names, another function: told by config.json's model_args
    for change, why in (({"preact": True}, "preact=True"), ({"stem_type": "fixed"}, "stem_type"),
                        ({"conv_layer": "std_conv"}, "conv_layer")):  # fmt: skip
        config = json.loads(json.dumps(written))
        config["model_args"].update(change)
        config_path.write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=why):
            load_checkpoint(tmp_path / "t")
    # timm builds the standard stem only: a small-stem model goes out as a state dict
    save_pretrained(create_model("resnetv2_50_28"), tmp_path / "small")
    assert main(["convert", str(tmp_path / "small"), str(tmp_path / "s"), "--to", "timm"]) == 2
    assert "no small stem" in capsys.readouterr().err and not (tmp_path / "s").exists()
    out = tmp_path / "s.safetensors"
    assert main(["convert", str(tmp_path / "small"), str(out), "--to", "timm"]) == 0
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("stem.conv.weight").shape == (64, 1, 3, 3)


def test_adapting_the_standardised_root_to_grey_is_said_to_be_approximate(tmp_path: Path) -> None:
    """Summed RGB kernels answer a grey image exactly behind a plain conv, but a StdConv
    standardises the sum anew: the output moves, and fine-tuning says so."""
    rgb = create_model("resnetv2_50_32", num_classes=10)
    for m in rgb.modules():  # GroupNorm scales away from 1, so the per-channel rescale shows
        if isinstance(m, nn.GroupNorm):
            nn.init.normal_(m.weight, 1.0, 0.5)
    save_pretrained(rgb, tmp_path / "rgb")
    grey, _ = load_checkpoint(tmp_path / "rgb", in_chans=1)
    x = torch.rand(4, 1, 32, 32)
    with torch.no_grad():
        moved = (grey.eval()(x) - rgb.eval()(x.expand(-1, 3, -1, -1))).abs().max().item()
    assert moved > 1e-3  # not the same function (a plain conv's sum would be)
    source = read_source(str(tmp_path / "rgb"))
    source.config = infer_config(source)
    cfg = load_run_config(None, ["data.name=digits", "model.img_size=32"])
    info = dataset_info("digits", load_split("digits", "train"))
    model = build_model(resolve_model_config(cfg, info, source.config))
    assert model.config.in_chans == 1
    notes = finetune_weights(model, source)
    assert any("adapted 3 -> 1 channels (approximate" in n for n in notes), notes


def test_torchvision_and_hf_conversions_are_refused(tmp_path: Path, capsys) -> None:
    save_pretrained(create_model("resnetv2_50_28"), tmp_path / "src")
    for to, why in (("torchvision", "torchvision has no model for"), ("hf", "--to timm")):
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / to), "--to", to]) == 2
        assert why in capsys.readouterr().err
        assert not (tmp_path / to).exists()


# --- cost ----------------------------------------------------------------------------------------


def test_cost_equals_the_flop_counter_on_the_twin_and_on_a_small_stem() -> None:
    r = cost_report("resnetv2_50")
    assert r["params"]["total"] == PARAMS and r["stage_names"][0] == "stages.0"
    with torch.device("meta"), FlopCounterMode(display=False) as counter, torch.no_grad():
        twin(num_classes=1000).eval()(torch.randn(1, 3, 224, 224))
    assert 2 * r["forward_macs"] == counter.get_total_flops() == 2 * MACS_224
    assert "4.09 GMACs" in format_cost_report(r)
    # by hand: the 7x7/2 root on 224 -> 112, and the head
    assert r["stem"]["macs"] == 49 * 3 * 64 * 112 * 112 and r["head_macs"] == 2048 * 1000
    small = cost_report("resnetv2_50_28")
    assert small["stem"] == {"grid": [28, 28], "stride": 1, "macs": 9 * 64 * 28 * 28}
    with torch.device("meta"), FlopCounterMode(display=False) as counter, torch.no_grad():
        create_model("resnetv2_50_28").eval()(torch.randn(1, 1, 28, 28))
    assert 2 * small["forward_macs"] == counter.get_total_flops()
    assert main(["models", "--family", "cnn", "--json"]) == 0


# --- a run ---------------------------------------------------------------------------------------

# the small stem on 8x8 digits, a twentieth of the training images: a few steps
RUN = ["model.name=resnetv2_50_28", "model.img_size=8", "data.label_fraction=0.05",
       "train.batch_size=16", "train.precision=fp32", "train.epochs=1"]  # fmt: skip


def test_a_run_trains_evaluates_predicts_and_fine_tunes(tmp_path: Path, capsys) -> None:
    run = train(load_run_config(None, RUN), out=tmp_path / "run")
    model, meta = load_checkpoint(run)
    assert isinstance(model, BiTResNet) and meta.config.img_size == 8
    assert meta.config.uses_small_stem
    check_eval_and_predict(run, tmp_path, capsys)
    # fine-tuning at 16 px: the steps `vitlab train finetune.from=RUN model.img_size=16` takes
    # before its first epoch; the small stem and its weights are kept
    cfg = load_run_config(None, [*RUN, f"finetune.from={run}", "model.img_size=16"])
    source = read_source(run)
    info = dataset_info("digits", load_split("digits", "train"))
    config = resolve_model_config(cfg, info, infer_config(source))
    assert config.arch == "resnetv2_50" and config.small_stem is True
    tuned = build_model(config)
    notes = finetune_weights(tuned, source)
    assert any("weights are kept" in n for n in notes)
    assert torch.equal(tuned.stem.conv.weight, weights_of(run, "best")["stem.conv.weight"])
    # GroupNorm has no statistics to keep: compile with grad checkpointing is allowed
    both = load_run_config(None, [*RUN, "train.compile=true", "train.grad_checkpointing=true"])
    assert resolve_model_config(both, info).arch == "resnetv2_50"
