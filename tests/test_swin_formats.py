"""Swin checkpoints in every format vitlab speaks: timm's files and hub folders and transformers'
SwinModel / SwinForImageClassification folders give their library's outputs (fp32, max abs diff
<= 1e-4); `convert --to timm / hf` writes what timm and transformers load with vitlab's logits;
vitlab's own format records the family; the config is inferred from the tensors; overrides resize,
adapt channels and replace the head; damaged files and unwritable models are named."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.test_checkpoint import close, images, randomize
from vitlab import create_model, formats, load_checkpoint, load_pretrained, save_pretrained
from vitlab.cli.main import main
from vitlab.config import ConfigError
from vitlab.formats import timm_swin
from vitlab.formats.base import CheckpointError, Files
from vitlab.formats.vitlab import CheckpointMeta, read_metadata
from vitlab.models.checkpoint import infer_config, read_source
from vitlab.models.registry import get_config, list_models
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.vit import ViTConfig
from vitlab.preprocessing import Preprocessing

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

# windows of 4 tile the 16x16 and 8x8 maps: transformers computes what timm and vitlab do
SMALL = dict(
    img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4)
)
# 14x14, 7x7 and 4x4 maps, window 7: the last stage's clamped to 4x4 (timm shrinks its table)
CLAMPED = dict(
    img_size=28, patch_size=2, in_chans=1, window_size=7, embed_dim=8, depths=(1, 1, 2),
    num_heads=(1, 2, 2),
)  # fmt: skip


def timm_model(num_classes: int = 5, **kw) -> torch.nn.Module:
    """timm's own Swin with random weights, built through its registered entry point."""
    kw = {**SMALL, **kw}
    return randomize(timm.create_model("swin_tiny_patch4_window7_224", num_classes=num_classes,
                                       **kw))  # fmt: skip


def hf_config(num_labels: int = 5, **kw) -> transformers.SwinConfig:
    arch = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4])
    return transformers.SwinConfig(window_size=4, num_labels=num_labels, **{**arch, **kw})


def vitlab_swin(name: str = "swin_nano_patch2_window4_32", **kw) -> SwinTransformer:
    return randomize(create_model(name, **kw))


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(pixel_values=x) if isinstance(model, transformers.PreTrainedModel) else model(x)
    return getattr(out, "logits", out)


# --- timm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pth", "safetensors", "training checkpoint"])
def test_timm_state_dict_files_give_timms_logits(kind: str, tmp_path: Path) -> None:
    ref = timm_model()
    path = tmp_path / ("w.safetensors" if kind == "safetensors" else "w.pth")
    if kind == "safetensors":
        save_file(ref.state_dict(), path)
    else:
        obj = ref.state_dict() if kind == "pth" else {"model": ref.state_dict(), "epoch": 3}
        torch.save(obj, path)
    model, meta = load_checkpoint(path, img_size=32)  # no file tells the size: taken as given
    assert isinstance(model, SwinTransformer) and meta.info["source_format"] == "timm"
    assert model.config == SwinConfig(**SMALL, num_classes=5)
    x = images(32)
    close(logits(model, x), logits(ref, x))
    with torch.no_grad():
        close(model.forward_head(model.forward_features(x), pre_logits=True),
              ref.forward_head(ref.forward_features(x), pre_logits=True))  # fmt: skip


@pytest.mark.parametrize("resize", [dict(img_size=48, window_size=6), dict(img_size=8)])
def test_a_timm_file_resized_gives_timms_logits_at_the_new_size(resize, tmp_path: Path) -> None:
    """timm's loader resamples a table to another window its own way (BEiT's geometric spacing,
    not bicubic): 48 / window 6 resizes every table, 8 clamps the second stage's window to 2."""
    save_file(timm_model().state_dict(), tmp_path / "w.safetensors")
    theirs = timm_model(**resize).eval()
    state = load_file(tmp_path / "w.safetensors")
    theirs.load_state_dict(timm.models.swin_transformer.checkpoint_filter_fn(state, theirs))
    model = load_pretrained(tmp_path / "w.safetensors", **resize)
    x = images(resize["img_size"])
    close(logits(model, x), logits(theirs, x))
    bicubic = load_pretrained(tmp_path / "w.safetensors", img_size=32)  # the official code's way
    bicubic.set_image_size(**resize)
    key = "layers.1.blocks.0.attn.relative_position_bias_table"  # resized in both cases
    table = theirs.state_dict()[key]
    close(model.state_dict()[key], table)
    assert (bicubic.state_dict()[key] - table).abs().max() > 0.05 * table.abs().max()


def test_timm_folder_gives_timms_logits_config_and_preprocessing(tmp_path: Path) -> None:
    from timm.models._hub import save_for_hf

    ref = timm_model(num_classes=3)
    ref.pretrained_cfg = {**ref.pretrained_cfg, "mean": (0.1, 0.2, 0.3), "crop_pct": 0.8}
    save_for_hf(ref, tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["architecture"].startswith("swin")
    model, meta = load_checkpoint(tmp_path)
    assert meta.config == SwinConfig(**SMALL, num_classes=3)  # size and window from config.json
    pre = model.preprocessing
    assert pre.mean == (0.1, 0.2, 0.3) and pre.crop_pct == 0.8 and pre.interpolation == "bicubic"
    x = images(32)
    close(logits(model, x), logits(ref, x))


def test_infer_config_recovers_the_exact_swin_config(tmp_path: Path, caplog) -> None:
    """A state dict alone: everything but the image size is in the tensors, and the size is the
    smallest consistent with the tables, here the trained one (the last stage's clamped window
    pins it to 13..16 patches, of which 14 is the one the windows tile)."""
    ref = timm_model(num_classes=3, **CLAMPED)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        cfg = infer_config(read_source(tmp_path / "w.pth"))
    assert cfg == SwinConfig(**CLAMPED, num_classes=3)
    assert "assuming img_size=28" in caplog.text and "stage 2: 4" in caplog.text
    x = images(28, chans=1)
    close(logits(load_pretrained(tmp_path / "w.pth"), x), logits(ref, x))


def test_the_original_microsoft_layout_loads(tmp_path: Path) -> None:
    """Swin's own releases merge patches at the end of a stage, name the classifier `head` and
    keep their index and mask buffers; timm's checkpoint_filter_fn moves them, vitlab too."""
    ref = timm_model()
    old = {}
    for key, value in ref.state_dict().items():
        if ".downsample." in key:
            i = int(key.split(".")[1])
            key = key.replace(f"layers.{i}.", f"layers.{i - 1}.", 1)
        old[key.replace("head.fc.", "head.")] = value
    old["layers.0.blocks.1.attn_mask"] = torch.zeros(16, 16, 16)
    old["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(16, 16, dtype=torch.long)
    torch.save({"model": old}, tmp_path / "swin.pth")
    model, meta = load_checkpoint(tmp_path / "swin.pth", img_size=32)
    assert any("original Swin layout" in n for n in meta.info["notes"])
    close(logits(model, images(32)), logits(ref, images(32)))
    key = "layers.0.blocks.0.attn.relative_position_bias_table"  # at another window, its
    resized = load_pretrained(tmp_path / "swin.pth", img_size=48, window_size=6)  # code's way:
    grid = old[key].t().reshape(1, 2, 7, 7)  # bicubic, no antialias (Swin's load_pretrained)
    official = torch.nn.functional.interpolate(grid, size=(11, 11), mode="bicubic")
    close(resized.state_dict()[key], official.reshape(2, -1).t())


def test_timm_arch_names_are_registered_in_timm_and_build_vitlabs_shapes() -> None:
    assert not timm_swin.REGISTERED - set(timm.list_models("swin_*"))
    for name in list_models(family="swin"):
        cfg = get_config(name)
        arch, args = timm_swin.timm_swin_model_args(cfg)
        assert arch == name if name in timm_swin.REGISTERED else arch in timm_swin.REGISTERED
        with torch.device("meta"):
            theirs = timm.create_model(arch, pretrained=False, **args).state_dict()
            ours = create_model(name).state_dict()
        assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}
    assert timm_swin.timm_arch(SwinConfig(**SMALL)) == "swin_tiny_patch4_window7_224"


# --- Hugging Face --------------------------------------------------------------------------------


def test_hf_classifier_folder_gives_transformers_logits(tmp_path: Path) -> None:
    ref = randomize(transformers.SwinForImageClassification(hf_config()))
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")  # older hub files keep the index buffers
    index = "swin.encoder.layers.0.blocks.0.attention.self.relative_position_index"
    state[index] = torch.zeros(16, 16, dtype=torch.long)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    processor = transformers.ViTImageProcessor(
        size={"height": 32, "width": 32}, resample=2, image_mean=[0.3] * 3, image_std=[0.4] * 3
    )
    processor.save_pretrained(tmp_path)
    model, meta = load_checkpoint(tmp_path)
    assert meta.info["source_format"] == "hf" and meta.config.num_classes == 5
    assert model.classes == [f"LABEL_{i}" for i in range(5)]
    assert (
        model.preprocessing.mean == (0.3,) * 3 and model.preprocessing.interpolation == "bilinear"
    )
    x = images(32)
    close(logits(model, x), logits(ref, x))


def test_hf_swin_model_pooled_output_is_vitlabs_pre_logits(tmp_path: Path) -> None:
    cfg = hf_config(depths=[2, 2, 2], num_heads=[2, 4, 4])  # maps 16, 8, 4: the last one window
    ref = randomize(transformers.SwinModel(cfg))
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert model.config.num_classes == 0 and model.preprocessing.mean == (0.485, 0.456, 0.406)
    x = images(32)
    with torch.no_grad():
        out = ref(pixel_values=x)
        close(model.forward_head(model.forward_features(x), pre_logits=True), out.pooler_output)
        close(model.forward_features(x).flatten(1, 2), out.last_hidden_state)


def test_hf_in_memory_names_of_transformers_5(tmp_path: Path) -> None:
    ref = randomize(transformers.SwinForImageClassification(hf_config(num_labels=3)))
    torch.save(ref.state_dict(), tmp_path / "sd.bin")  # attention.q_proj, mlp.fc1, ...
    assert any(".attention.q_proj." in k for k in ref.state_dict())
    model = load_pretrained(tmp_path / "sd.bin", img_size=32)
    close(logits(model, images(32)), logits(ref, images(32)))


def test_hf_folder_whose_windows_do_not_tile_loads_with_a_note(tmp_path: Path) -> None:
    """transformers pads a 14x14 map before the cyclic shift, vitlab after it: the weights load,
    and the model says that its outputs differ from transformers' there."""
    ref = transformers.SwinForImageClassification(hf_config(image_size=28))
    ref.save_pretrained(tmp_path)
    model, meta = load_checkpoint(tmp_path)
    assert model.config.img_hw == (28, 28)
    assert any("windows of 4 do not tile stage 0's 14x14 map" in n for n in meta.info["notes"])


# --- writing: convert --to timm / hf, save_pretrained --------------------------------------------


@pytest.fixture
def vitlab_checkpoint(tmp_path: Path) -> tuple[SwinTransformer, Path]:
    """A vitlab Swin checkpoint: three stages (16, 8, 4: the last one window), named classes."""
    model = vitlab_swin(num_classes=4)
    model.classes = ["cat", "dog", "ship", "frog"]
    model.preprocessing = Preprocessing((32, 32), 3, (0.2, 0.3, 0.4), (0.5, 0.6, 0.7), "bicubic")
    save_pretrained(model, tmp_path / "ck")
    return model, tmp_path / "ck"


def test_convert_to_timm_loads_in_timm(vitlab_checkpoint, tmp_path: Path, capsys) -> None:
    model, ck = vitlab_checkpoint
    assert main(["convert", str(ck), str(tmp_path / "t"), "--to", "timm"]) == 0
    assert "Swin, blocks [2, 2, 2]" in capsys.readouterr().out
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    arch, args = config["architecture"], config["model_args"]
    assert arch in timm.list_models("swin_*") and config["label_names"] == model.classes
    theirs = timm.create_model(arch, pretrained=False, **args).eval()
    theirs.load_state_dict(load_file(tmp_path / "t" / "model.safetensors"), strict=True)
    x = images(32)
    close(logits(theirs, x), logits(model, x))
    again = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
    close(logits(again, x), logits(model, x))
    assert again.pretrained_cfg["mean"] == [0.2, 0.3, 0.4]


def test_convert_to_hf_loads_in_transformers(vitlab_checkpoint, tmp_path: Path) -> None:
    model, ck = vitlab_checkpoint
    assert main(["convert", str(ck), str(tmp_path / "h"), "--to", "hf"]) == 0
    ref = transformers.SwinForImageClassification.from_pretrained(tmp_path / "h").eval()
    assert ref.config.id2label[2] == "ship"
    x = images(32)
    close(logits(ref, x), logits(model, x))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "h")
    assert list(processor.image_mean) == [0.2, 0.3, 0.4]
    back = load_pretrained(tmp_path / "h")  # and back, exactly
    assert back.config == model.config and back.classes == model.classes
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_a_headless_swin_is_written_as_hf_swin_model(tmp_path: Path) -> None:
    model = vitlab_swin(num_classes=0)
    save_pretrained(model, tmp_path / "h", format="hf")
    ref = transformers.SwinModel.from_pretrained(tmp_path / "h").eval()
    x = images(32)
    with torch.no_grad():
        close(ref(pixel_values=x).pooler_output, model(x))


def test_hf_refuses_a_swin_whose_windows_do_not_tile_and_timm_takes_it(tmp_path: Path) -> None:
    model = randomize(SwinTransformer(SwinConfig(**CLAMPED, num_classes=3)))
    with pytest.raises(CheckpointError, match=r"windows of 7 do not tile stage 2's 4x4 map"):
        save_pretrained(model, tmp_path / "h", format="hf")
    padded = randomize(SwinTransformer(SwinConfig(**dict(SMALL, img_size=28), num_classes=3)))
    with pytest.raises(CheckpointError, match=r"stage 0's 14x14 map.*pads such a map before"):
        save_pretrained(padded, tmp_path / "h", format="hf")
    uneven = SwinTransformer(SwinConfig(**dict(SMALL, img_size=(32, 16)), num_classes=3))
    with pytest.raises(CheckpointError, match=r"stage 1's 8x4 map is one window of 4 along one"):
        save_pretrained(uneven, tmp_path / "h", format="hf")
    save_pretrained(model, tmp_path / "t", format="timm")  # timm clamps and pads as vitlab does
    again = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
    x = images(28, chans=1)
    close(logits(again, x), logits(model, x))


# --- vitlab's format -----------------------------------------------------------------------------


def test_vitlab_format_records_the_family_and_round_trips(vitlab_checkpoint) -> None:
    model, ck = vitlab_checkpoint
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["family"] == "swin"
    assert formats.detect(Files(ck / "model.safetensors")) == "vitlab"
    loaded, meta = load_checkpoint(ck)
    assert meta.config == model.config and meta.preprocessing == model.preprocessing
    assert loaded.classes == model.classes
    x = images(32)
    assert torch.equal(logits(loaded, x), logits(model, x))


def test_vitlab_metadata_without_a_family_is_a_vit(tmp_path: Path) -> None:
    """Files written before Swin have no `family`: they are ViTs."""
    vit = create_model("vit_nano_patch4_32")
    save_pretrained(vit, tmp_path / "v.safetensors")
    with safe_open(str(tmp_path / "v.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert metadata.pop("family") == "vit"
    save_file(load_file(tmp_path / "v.safetensors"), tmp_path / "old.safetensors", metadata)
    assert read_metadata(tmp_path / "old.safetensors").config == vit.config
    assert isinstance(load_pretrained(tmp_path / "old.safetensors").config, ViTConfig)
    save_file(load_file(tmp_path / "v.safetensors"), tmp_path / "bad.safetensors",
              {**metadata, "family": "convnext"})  # fmt: skip
    with pytest.raises(CheckpointError, match="family 'convnext' is not one vitlab builds"):
        read_metadata(tmp_path / "bad.safetensors")


def test_a_training_runs_swin_checkpoint_round_trips(tmp_path: Path) -> None:
    from vitlab.train.state import resolve_checkpoint, save_checkpoint

    model = vitlab_swin()
    pre = Preprocessing((32, 32), 3, (0.5,) * 3, (0.25,) * 3)
    meta = CheckpointMeta(model.config, pre, [str(i) for i in range(10)], {"epoch": 2})
    save_checkpoint(tmp_path / "run" / "checkpoints" / "last", model.state_dict(), meta)
    assert read_metadata(resolve_checkpoint(tmp_path / "run")) == meta
    loaded, back = load_checkpoint(tmp_path / "run")
    assert back.config == model.config and back.info == {"epoch": 2}
    assert torch.equal(logits(loaded, images(32)), logits(model, images(32)))


# --- overrides and errors ------------------------------------------------------------------------


def test_overrides_resize_adapt_channels_and_replace_the_head(tmp_path: Path) -> None:
    ref = randomize(SwinTransformer(SwinConfig(**dict(CLAMPED, in_chans=3), num_classes=3)))
    save_pretrained(ref, tmp_path / "ck")

    def resized(img_size: int, window_size: int | None = None) -> SwinTransformer:
        model = copy.deepcopy(ref)
        model.set_image_size(img_size, window_size=window_size)
        return model

    # 56: the last stage's map grows to 7x7, its window from 4 to 7 (table resampled)
    bigger = load_pretrained(tmp_path / "ck", img_size=56)
    assert bigger.config == resized(56).config and bigger.preprocessing.img_size == (56, 56)
    assert bigger.layers[2].blocks[0].attn.window == (7, 7)
    close(logits(bigger, images(56)), logits(resized(56), images(56)))
    smaller_windows = load_pretrained(tmp_path / "ck", window_size=4)
    close(logits(smaller_windows, images(28)), logits(resized(28, 4), images(28)))
    grey = load_pretrained(tmp_path / "ck", in_chans=1, num_classes=5)
    assert grey.config.in_chans == 1 and grey.preprocessing.in_chans == 1
    assert grey.head.fc.weight.shape == (5, 32) and not grey.head.fc.weight.any()
    x = images(28, chans=1)
    with torch.no_grad():  # grey kernels are the colour kernels summed
        pooled = grey.forward_head(grey.forward_features(x), pre_logits=True)
        rgb = x.repeat(1, 3, 1, 1)
        close(pooled, ref.forward_head(ref.forward_features(rgb), pre_logits=True))
    with pytest.raises(ConfigError, match="unknown key 'depth'.*depths"):
        load_pretrained(tmp_path / "ck", depth=3)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("drop layers.1.blocks.1.mlp.fc2.weight", r"missing from the checkpoint: layers\.1\.blocks"
         r"\.1\.mlp\.fc2\.weight"),
        ("drop layers.1.blocks.0.attn.relative_position_bias_table", r"no layers\.1\.blocks\.0\."
         r"attn\.relative_position_bias_table tensor, so not a complete Swin"),
        ("drop patch_embed.proj.weight", r"no patch_embed\.proj\.weight tensor"),
        ("add layers.0.blocks.0.attn.logit_scale", r"a Swin V2 checkpoint"),
        ("add layers.0.blocks.0.attn.extra", r"no place in a vitlab model \(timm Swin\): "
         r"layers\.0\.blocks\.0\.attn\.extra"),
        ("shrink layers.1.blocks.1.mlp.fc1.weight", r"layers\.1\.blocks\.1\.mlp\.fc1\.weight: "
         r"checkpoint \(64, 32\), model \(128, 32\)"),
    ],
)  # fmt: skip
def test_a_damaged_swin_state_dict_names_the_tensor(damage: str, message: str, tmp_path) -> None:
    state = timm_model().state_dict()
    verb, key = damage.split()
    if verb == "drop":
        del state[key]
    elif verb == "add":
        state[key] = torch.ones(4, 1, 1)
    else:
        state[key] = state[key][:64]
    save_file(state, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(tmp_path / "w.safetensors", img_size=32)


def test_swin_v2_and_absolute_positions_are_refused_by_name(tmp_path: Path) -> None:
    import timm
    import transformers

    small = dict(img_size=16, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2),
                 num_heads=(2, 4), num_classes=3)  # fmt: skip
    v2 = timm.create_model("swinv2_tiny_window8_256", pretrained=False, **small)
    save_file(v2.state_dict(), tmp_path / "v2.safetensors")
    with pytest.raises(CheckpointError, match="Swin V2"):
        read_source(tmp_path / "v2.safetensors")
    # the original Microsoft code's `ape=True` (timm 1.0 has no such option)
    ape = timm.models.swin_transformer.SwinTransformer(**small).state_dict()
    torch.save({**ape, "absolute_pos_embed": torch.zeros(1, 64, 16)}, tmp_path / "ape.pth")
    with pytest.raises(CheckpointError, match="absolute position embeddings"):
        read_source(tmp_path / "ape.pth")
    hf = transformers.SwinForImageClassification(
        transformers.SwinConfig(image_size=16, patch_size=2, window_size=4, embed_dim=16,
                                depths=[2, 2], num_heads=[2, 4], use_absolute_embeddings=True)
    )  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="absolute position embeddings"):
        read_source(tmp_path / "hf")


def test_hf_refuses_another_layernorm_eps(tmp_path: Path) -> None:
    model = create_model("swin_nano_patch2_window4_32", norm_eps=1e-6)
    with pytest.raises(CheckpointError, match="layer_norm_eps"):
        save_pretrained(model, tmp_path / "hf", format="hf")


def test_cost_takes_its_img_size_as_the_trained_one_where_the_tables_fit(tmp_path, capsys):
    """A Swin state dict trained at 32 (16 patches, the last window clamped to 4 as at 28): the
    size is guessed as 28 and warned of, with the way a command is given it (analyze and cost take
    no img_size=); `vitlab cost --img-size 32` takes it without a guess (it warned and guessed)."""
    ref = timm_model(num_classes=3, **{**CLAMPED, "img_size": 32})
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    assert main(["cost", str(tmp_path / "w.pth")]) == 0
    out, err = capsys.readouterr()
    assert "assuming img_size=28" in err and "`vitlab convert SRC DST img_size=N`" in err
    assert "28x28 image" in out
    assert main(["cost", str(tmp_path / "w.pth"), "--img-size", "32"]) == 0
    out, err = capsys.readouterr()
    assert "assuming" not in err and "32x32 image" in out
    assert main(["convert", str(tmp_path / "w.pth"), str(tmp_path / "v"), "img_size=32"]) == 0
    assert infer_config(read_source(tmp_path / "v")).img_size == 32  # as the warning says
