"""Loading the checkpoints other libraries write: each reference library builds its own model with
random weights (random heads too), saves it the way it saves, vitlab loads the file and must give
the same logits and pre-logits features (fp32, max abs diff <= 1e-4). Round trips vitlab -> timm
-> vitlab and vitlab -> HF -> vitlab are exact. Broken and hostile files are refused."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import tiny_checkpoint
from vitlab import ConfigError, load_pretrained
from vitlab.formats.timm import vitlab_to_timm
from vitlab.formats.timm_names import (
    DEIT_HEADS,
    REGISTERED,
    REGISTERED_DEIT,
    timm_hybrid_arch,
    timm_model_args,
)
from vitlab.models.checkpoint import CheckpointError, load_checkpoint, save_pretrained
from vitlab.models.registry import get_config, list_models
from vitlab.models.vit import VisionTransformer, ViTConfig

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

TOL = 1e-4


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm scales around 1), so that no tensor can be silently skipped."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            is_scale = p.ndim == 1 and ("norm" in name or "ln" in name) and "weight" in name
            p.copy_(noise + 1.0 if is_scale else noise)
    return model.eval()


def images(size: int | tuple[int, int], chans: int = 3, n: int = 2, seed: int = 1) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(n, chans, h, w, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff <= TOL, diff
    return diff


def timm_features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.forward_features(x), pre_logits=True)


def ours_features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.forward_features(x), pre_logits=True)


# --- timm ----------------------------------------------------------------------------------------

TIMM_CASES = {
    "Ti/16 at 224": ("vit_tiny_patch16_224", {}, 224),
    "Ti/16 at 384": ("vit_tiny_patch16_384", {"depth": 4}, 384),
    "GAP with fc_norm": ("vit_tiny_patch16_224", {"depth": 2, "global_pool": "avg"}, 224),
    "no class token": (
        "vit_tiny_patch16_224",
        {"depth": 2, "class_token": False, "global_pool": "avg", "fc_norm": False},
        224,
    ),
    "no_embed_class (DeiT-3, layer scale)": ("deit3_small_patch16_224", {"depth": 2}, 224),
    "DeiT distilled": ("deit_tiny_distilled_patch16_224", {"depth": 2}, 224),
}


@pytest.mark.parametrize(
    "case,save",
    [(case, "save_for_hf") for case in TIMM_CASES]
    + [("Ti/16 at 224", "torch.save"), ("DeiT distilled", "torch.save")],
)
def test_timm_checkpoints_give_timm_outputs(case: str, save: str, tmp_path: Path) -> None:
    name, kwargs, size = TIMM_CASES[case]
    ref = randomize(timm.create_model(name, num_classes=7, **kwargs))
    if save == "save_for_hf":
        from timm.models._hub import save_for_hf

        save_for_hf(ref, tmp_path / "m", safe_serialization=True)
        source = tmp_path / "m"
    else:  # a DeiT-style training checkpoint: {"model": state_dict}
        source = tmp_path / "m.pth"
        torch.save({"model": ref.state_dict(), "epoch": 3}, source)
    model = load_pretrained(source)
    x = images(size)
    with torch.no_grad():
        close(model(x), ref(x))
        close(ours_features(model, x), timm_features(ref, x))
    assert model.config.num_classes == 7


@pytest.mark.parametrize("size", [(64, 80), (64, 96)])
def test_a_timm_state_dict_of_a_non_square_grid_loads_at_the_size_named(size, tmp_path) -> None:
    """A bare state dict trained at 64x80 (4x5 patches, 21 rows) or 64x96 (4x6 patches + the class
    token: 25 rows, which also read as a 5x5 grid without class-token row) loads at img_size=
    as timm's model: the table is not resampled."""
    ref = randomize(
        timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=5, img_size=size)
    )
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    model, meta = load_checkpoint(tmp_path / "w.safetensors", img_size=size)
    assert model.config.img_hw == size and not model.config.no_embed_class
    x = images(size)
    with torch.no_grad():
        close(model(x), ref(x))
    if size == (64, 80):
        with pytest.raises(
            CheckpointError, match=r"21 rows fits no square grid: pass img_size=\(H"
        ):
            load_checkpoint(tmp_path / "w.safetensors")
    else:  # the square reading is taken, and said
        _, meta = load_checkpoint(tmp_path / "w.safetensors")
        assert any("non-square grid of 24 patches need img_size" in n for n in meta.info["notes"])


def test_timm_folder_carries_preprocessing_and_infers_pooling(tmp_path: Path) -> None:
    from timm.models._hub import save_for_hf

    ref = randomize(timm.create_model("vit_tiny_patch16_224", depth=1, global_pool="avg"))
    ref.fc_norm = torch.nn.Identity()  # an avg-pooled model without fc_norm: only config tells
    ref.norm = randomize(torch.nn.LayerNorm(192, eps=1e-6))
    save_for_hf(ref, tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path)
    assert model.config.pool == "gap" and not model.config.fc_norm
    pre = model.preprocessing
    assert pre.mean == tuple(ref.pretrained_cfg["mean"]) and pre.crop_pct == 0.9
    assert pre.interpolation == "bicubic"
    x = images(224)
    with torch.no_grad():
        close(model(x), ref(x))
    config = json.loads((tmp_path / "config.json").read_text())
    config["pretrained_cfg"].update(crop_mode="squash", crop_pct=1.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_pretrained(tmp_path).preprocessing.crop_pct is None  # whole image resized


def test_timm_weights_without_their_config_say_the_preprocessing_assumed(tmp_path, caplog):
    """A bare timm ViT state dict states no preprocessing: ImageNet's is taken (README), which
    for timm's augreg ViTs (mean = std = 0.5) flips predictions; it was taken without a word. The
    same weights in a folder with timm's config.json take its mean, and say nothing."""
    from timm.models._hub import save_for_hf

    ref = randomize(timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32))
    assert tuple(ref.pretrained_cfg["mean"]) == (0.5, 0.5, 0.5)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    save_for_hf(ref, tmp_path / "hub", safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        bare = load_pretrained(tmp_path / "w.pth").preprocessing
    assert bare.mean == (0.485, 0.456, 0.406)
    assert "timm weights without timm's config.json: ImageNet mean and std" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert load_pretrained(tmp_path / "hub").preprocessing.mean == (0.5, 0.5, 0.5)
        assert load_pretrained(tmp_path / "hub" / "model.safetensors").preprocessing.mean[0] == 0.5
    assert "without timm's config.json" not in caplog.text


def test_timm_settings_vitlab_cannot_build_are_refused_or_said(tmp_path: Path, caplog) -> None:
    """An act_layer other than GELU once loaded as GELU (logits 0.3 off for relu), and an
    architecture vitlab does not register took the paper's head count without a word
    (vit_base_patch16_gap_224 has 16 heads at width 768: logits 0.5 off)."""
    from timm.models._hub import save_for_hf

    relu = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, act_layer="relu")
    save_for_hf(relu, tmp_path / "relu", safe_serialization=True)
    with pytest.raises(CheckpointError, match="act_layer 'relu' is not supported"):
        load_pretrained(tmp_path / "relu")
    ref = randomize(timm.create_model("vit_base_patch16_gap_224", depth=1, img_size=32))
    assert ref.blocks[0].attn.num_heads == 16
    save_for_hf(ref, tmp_path / "gap", safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        guessed = load_pretrained(tmp_path / "gap")
    assert "'vit_base_patch16_gap_224' is not one vitlab registers" in caplog.text
    assert guessed.config.num_heads == 12  # the guess, said; the head count asked for is right:
    model = load_pretrained(tmp_path / "gap", num_heads=16)
    with torch.no_grad():
        close(model(images(32)), ref(images(32)))


def test_timms_deit_folders_load_without_a_guess_and_are_written_by_their_name(
    tmp_path: Path, caplog
) -> None:
    """timm's DeiT and DeiT III entry points are no names vitlab registers: their head counts
    were guessed, with a warning on every load of such a folder (right at these widths, wrong
    for a DeiT III of another width), and a tiny distilled DeiT was written as deit_base's."""
    from timm.models._hub import save_for_hf

    for name in timm.list_models("deit*"):  # every entry point's heads, as timm builds them
        with torch.device("meta"):
            heads = timm.create_model(name).blocks[0].attn.num_heads
        assert DEIT_HEADS[name.split("_patch")[0].removesuffix("_distilled")] == heads, name
    assert not REGISTERED_DEIT - set(timm.list_models("deit_*"))
    ref = randomize(timm.create_model("deit_tiny_distilled_patch16_224", depth=1, img_size=32,
                                      embed_dim=384))  # fmt: skip
    assert ref.blocks[0].attn.num_heads == 3  # the entry point's, not the width's 6
    save_for_hf(ref, tmp_path / "deit", safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        model = load_pretrained(tmp_path / "deit")
    assert "head count is guessed" not in caplog.text
    assert model.config.num_heads == 3 and model.config.distilled
    with torch.no_grad():
        close(model(images(32)), ref(images(32)))
    tiny = randomize(VisionTransformer(get_config("vit_tiny_patch16_224").replace(
        distilled=True, depth=1, num_classes=3)))  # fmt: skip
    save_pretrained(tiny, tmp_path / "out", "timm")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architecture"] == "deit_tiny_distilled_patch16_224"


def test_overrides_resample_positions_like_timm_and_replace_the_head(tmp_path: Path) -> None:
    ref = randomize(timm.create_model("vit_tiny_patch16_224", depth=2, num_classes=7))
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    # timm's own loader at 256, resampling the table on load
    at256 = timm.create_model(
        "vit_tiny_patch16_224",
        depth=2,
        num_classes=7,
        img_size=256,
        pretrained=True,
        pretrained_cfg_overlay={"file": str(tmp_path / "w.safetensors"), "num_classes": 7},
    ).eval()
    model = load_pretrained(tmp_path / "w.safetensors", img_size=256)
    assert model.config.img_hw == (256, 256) and model.preprocessing.img_size == (256, 256)
    x = images(256)
    with torch.no_grad():
        close(model(x), at256(x))
    # a square 8x8 table asked for at 64x256 (4x16: as many patches) is resampled, not misread
    from timm.layers import resample_abs_pos_embed

    square = randomize(timm.create_model("vit_tiny_patch16_224", depth=1, img_size=128))
    save_file(square.state_dict(), tmp_path / "sq.safetensors")
    wide = load_pretrained(tmp_path / "sq.safetensors", img_size=(64, 256))
    table = resample_abs_pos_embed(square.pos_embed, (4, 16), (8, 8), num_prefix_tokens=1)
    close(wide.pos_embed.weight.detach(), table.detach())
    five = load_pretrained(tmp_path / "w.safetensors", num_classes=5)
    assert five.head.weight.shape == (5, 192) and five.head.weight.abs().sum() == 0
    with torch.no_grad():
        close(ours_features(five, images(224)), timm_features(ref, images(224)))
    # another patch size: refused as that (it said "img_size 224x224 is not a multiple of
    # patch_size 32" of the file's size, or "shapes differ" of a table resampled first)
    for asked in ({"patch_size": 32}, {"patch_size": 32, "img_size": 256}):
        with pytest.raises(CheckpointError, match="patch_size=32: the weights' patch size is 16"):
            load_pretrained(tmp_path / "w.safetensors", **asked)
    assert load_pretrained(tmp_path / "w.safetensors", patch_size=16).config.patch_size == 16


# --- Hugging Face --------------------------------------------------------------------------------


def hf_config(**kw) -> transformers.ViTConfig:
    base = dict(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=192,
        image_size=32,
        patch_size=8,
    )
    return transformers.ViTConfig(**{**base, **kw})


def test_hf_classifier_folder(tmp_path: Path) -> None:
    ref = randomize(transformers.ViTForImageClassification(hf_config(num_labels=6)))
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert model.config.norm_eps == 1e-12 and model.config.num_heads == 4
    assert model.classes == [f"LABEL_{i}" for i in range(6)]
    x = images(32)
    with torch.no_grad():
        close(model(x), ref(pixel_values=x).logits)
        close(ours_features(model, x), ref.vit(pixel_values=x).last_hidden_state[:, 0])


def test_hf_deit_folders_give_transformers_outputs_and_are_written_back(tmp_path: Path) -> None:
    """The hub's distilled DeiTs are transformers' DeiT classes (`deit.` names, two classifiers):
    they were refused as tensors with no place in a ViT, and a distilled ViT was not written."""
    cfg = transformers.DeiTConfig(**hf_config(num_labels=5).to_dict())
    teacher = randomize(transformers.DeiTForImageClassificationWithTeacher(cfg))
    teacher.save_pretrained(tmp_path / "teacher")
    model = load_pretrained(tmp_path / "teacher")
    assert model.config.distilled and model.config.norm_eps == 1e-12
    x = images(32)
    with torch.no_grad():
        close(model(x), teacher(pixel_values=x).logits)  # the two heads' mean
    save_pretrained(model, tmp_path / "back", "hf")
    again = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "back")
    assert type(again).__name__ == "DeiTForImageClassificationWithTeacher"
    with torch.no_grad():
        close(again.eval()(pixel_values=x).logits, model(x))
    bare = randomize(transformers.DeiTModel(cfg))  # with its pooler: ignored, said
    bare.save_pretrained(tmp_path / "bare")
    features = load_pretrained(tmp_path / "bare")
    assert features.config.num_classes == 0
    with torch.no_grad():
        close(features.forward_features(x), bare(pixel_values=x).last_hidden_state)
    plain = randomize(transformers.DeiTForImageClassification(cfg))
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="classifier reads the class token alone"):
        load_pretrained(tmp_path / "plain")


def test_hf_model_with_pooler_is_the_pre_logits_layer(tmp_path: Path) -> None:
    ref = randomize(transformers.ViTModel(hf_config(), add_pooling_layer=True))
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert model.config.representation_size == 96 and model.config.num_classes == 0
    assert model.classes == []  # transformers' default id2label names no classes of this model
    x = images(32)
    with torch.no_grad():
        close(model(x), ref(pixel_values=x).pooler_output)


def test_hf_pooler_of_another_width_travels_and_another_activation_is_refused(tmp_path) -> None:
    """A headless model whose pre-logits width differs from D is written with pooler_output_size
    (it was refused, blaming a classifier it has not); a pooler_act other than tanh was once
    loaded as tanh."""
    from vitlab import create_model

    model = randomize(create_model("vit_nano_patch4_32", num_classes=0, representation_size=48))
    save_pretrained(model, tmp_path / "hf", "hf")
    ref = transformers.ViTModel.from_pretrained(tmp_path / "hf").eval()
    x = images(32)
    with torch.no_grad():
        close(ref(pixel_values=x).pooler_output, model(x))
    relu = transformers.ViTModel(hf_config(pooler_act="relu"), add_pooling_layer=True)
    relu.save_pretrained(tmp_path / "relu")
    with pytest.raises(CheckpointError, match="pooler_act 'relu' is not supported"):
        load_pretrained(tmp_path / "relu")
    relu = transformers.ViTForImageClassification(hf_config(pooler_act="relu", num_labels=3))
    relu.save_pretrained(tmp_path / "classifier")  # no pooler used: its activation is moot
    assert load_pretrained(tmp_path / "classifier").config.num_classes == 3


def test_a_sharded_hf_checkpoint_loads_whole_from_its_folder_index_or_a_shard(tmp_path) -> None:
    """save_pretrained(max_shard_size=...) writes model-0000k-of-0000n.safetensors beside
    model.safetensors.index.json: the folder, the index or any one shard loads them all (it
    was "holds several weight files: name one", and one shard a cryptic half model)."""
    ref = randomize(transformers.ViTForImageClassification(hf_config(num_labels=3)))
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    shards = sorted((tmp_path / "hf").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    x = images(32)
    for source in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors.index.json", shards[1]):
        model = load_pretrained(source)
        assert model.config.norm_eps == 1e-12, source  # config.json read beside them
        with torch.no_grad():
            close(model(x), ref(pixel_values=x).logits)
    shards[0].unlink()
    with pytest.raises(CheckpointError, match="names shards that are not beside it"):
        load_pretrained(tmp_path / "hf")


def test_hf_in_memory_names_of_transformers_5(tmp_path: Path) -> None:
    ref = randomize(transformers.ViTForImageClassification(hf_config(num_labels=3)))
    torch.save(ref.state_dict(), tmp_path / "sd.bin")  # vit.layers.{i}.attention.q_proj ...
    model = load_pretrained(tmp_path / "sd.bin", norm_eps=1e-12, num_heads=4)
    x = images(32)
    with torch.no_grad():
        close(model(x), ref(pixel_values=x).logits)


def test_hf_pooler_beside_a_classifier_is_ignored_as_transformers_does(
    tmp_path: Path, caplog
) -> None:
    """Older hub files of ViTForImageClassification still hold the pooler, which transformers
    does not use; vitlab skips it too, and says so."""
    ref = randomize(transformers.ViTForImageClassification(hf_config(num_labels=3)))
    ref.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    state["vit.pooler.dense.weight"] = torch.randn(96, 96)
    state["vit.pooler.dense.bias"] = torch.randn(96)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        model = load_pretrained(tmp_path)
    assert "pooler weights beside a classifier ignored" in caplog.text
    assert model.pre_logits is None
    with torch.no_grad():
        close(model(images(32)), ref(pixel_values=images(32)).logits)


def test_a_new_size_resamples_positions_as_the_writing_library_does(tmp_path: Path) -> None:
    """HF and torchvision ViTs loaded at another size once took timm's resampling (bicubic with
    antialias): logits 4e-3 from the library's own model at that size. Now each library's way:
    transformers' interpolate_pos_encoding, torchvision's interpolate_embeddings."""
    from torchvision.models.vision_transformer import VisionTransformer as TV
    from torchvision.models.vision_transformer import interpolate_embeddings

    ref = randomize(transformers.ViTForImageClassification(hf_config(num_labels=3))).eval()
    ref.save_pretrained(tmp_path / "hf")
    x = images(48)
    with torch.no_grad():
        want = ref(pixel_values=x, interpolate_pos_encoding=True).logits
        close(load_pretrained(tmp_path / "hf", img_size=48)(x), want)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # resampled in float32, as HF
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "bf16").float()
    with torch.no_grad():  # (the table once came back rounded to bf16: 7e-3 off)
        want = ref(pixel_values=x, interpolate_pos_encoding=True).logits
        close(load_pretrained(tmp_path / "bf16", img_size=48)(x), want)
    kw = dict(patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=3)
    small = randomize(TV(image_size=64, **kw))
    torch.save(small.state_dict(), tmp_path / "tv.pth")
    large = TV(image_size=112, **kw).eval()
    large.load_state_dict(interpolate_embeddings(112, 16, small.state_dict()))
    x = images(112)
    with torch.no_grad():
        close(load_pretrained(tmp_path / "tv.pth", img_size=112, num_heads=4)(x), large(x))
    state = small.state_dict()
    del state["encoder.pos_embedding"]  # a cut file: an error naming it, not a KeyError
    torch.save(state, tmp_path / "cut.pth")
    with pytest.raises(CheckpointError, match="cut.pth: a torchvision ViT without its position"):
        load_pretrained(tmp_path / "cut.pth")


# --- torchvision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("representation_size", [None, 128])
def test_torchvision_vit_b32_shape(representation_size: int | None, tmp_path: Path) -> None:
    from torchvision.models.vision_transformer import VisionTransformer as TV

    ref = TV(
        image_size=64,
        patch_size=32,
        num_layers=2,
        num_heads=12,
        hidden_dim=768,
        mlp_dim=3072,
        num_classes=5,
        representation_size=representation_size,
    )
    randomize(ref)
    torch.save(ref.state_dict(), tmp_path / "vit_b_32.pth")
    model = load_pretrained(tmp_path / "vit_b_32.pth")
    from torchvision.models import ViT_B_32_Weights  # its released weights' evaluation transform

    tv = ViT_B_32_Weights.IMAGENET1K_V1.transforms()
    assert model.preprocessing.crop_pct == tv.crop_size[0] / tv.resize_size[0]
    assert model.preprocessing.interpolation == tv.interpolation.value == "bilinear"
    seen = {}
    ref.heads.head.register_forward_hook(lambda m, inp, out: seen.update(f=inp[0]))
    x = images(64)
    with torch.no_grad():
        close(model(x), ref(x))
        close(ours_features(model, x), seen["f"])


# --- Google .npz ---------------------------------------------------------------------------------


def google_arrays(
    rng: np.random.Generator, d: int, depth: int, heads: int, mlp: int, p: int, grid: int,
    classes: int, linen: bool, stacked: bool, cls: bool, pre_logits: int | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """A ViT in Google's .npz naming: the released one, or Flax linen / big_vision's."""
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05  # noqa: E731
    one = lambda *s: (1 + r(*s)).astype(np.float32)  # noqa: E731
    hd = d // heads
    a = {"embedding/kernel": r(p, p, 3, d), "embedding/bias": r(d)}
    if cls:
        a["cls"] = r(1, 1, d)
    if linen:  # big_vision: positions of the patches only, at the top level
        a["pos_embedding"] = r(1, grid * grid, d)
    else:
        a["Transformer/posembed_input/pos_embedding"] = r(1, grid * grid + int(cls), d)
    ln1, mha, ln2, mb = (
        ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
        if linen
        else ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    )

    def block() -> dict[str, np.ndarray]:
        b = {}
        for ln in (ln1, ln2):
            b[f"{ln}/scale"], b[f"{ln}/bias"] = one(d), r(d)
        for n in ("query", "key", "value"):
            b[f"{mha}/{n}/kernel"], b[f"{mha}/{n}/bias"] = r(d, heads, hd), r(heads, hd)
        b[f"{mha}/out/kernel"], b[f"{mha}/out/bias"] = r(heads, hd, d), r(d)
        b[f"{mb}/Dense_0/kernel"], b[f"{mb}/Dense_0/bias"] = r(d, mlp), r(mlp)
        b[f"{mb}/Dense_1/kernel"], b[f"{mb}/Dense_1/bias"] = r(mlp, d), r(d)
        return b

    blocks = [block() for _ in range(depth)]
    if stacked:
        for k in blocks[0]:
            a[f"Transformer/encoderblock/{k}"] = np.stack([b[k] for b in blocks])
    else:
        for i, b in enumerate(blocks):
            a.update({f"Transformer/encoderblock_{i}/{k}": v for k, v in b.items()})
    a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"] = one(d), r(d)
    width = d
    if pre_logits:
        a["pre_logits/kernel"], a["pre_logits/bias"] = r(d, pre_logits), r(pre_logits)
        width = pre_logits
    a["head/kernel"], a["head/bias"] = r(width, classes), r(classes)
    return {("params/" if linen else "") + k: v for k, v in a.items()}


@pytest.mark.parametrize("naming", ["released", "big_vision stacked"])
def test_google_npz_at_another_size_resamples_positions_as_vit_jax(naming, tmp_path) -> None:
    """vit_jax's and big_vision's resample_posemb zoom the grid with scipy (order 1): a Google
    checkpoint loaded at another size is resampled so (it once took timm's bicubic)."""
    from scipy.ndimage import zoom

    linen = naming != "released"
    d, p, grid = 64, 8, 4
    arrays = google_arrays(np.random.default_rng(0), d, 1, 4, 128, p, grid, 5,
                           linen=linen, stacked=linen, cls=not linen)  # fmt: skip
    np.savez(tmp_path / "vit.npz", **arrays)
    table = next(v for k, v in arrays.items() if k.endswith("pos_embedding"))[0]  # (T, D)
    prefix = 0 if linen else 1
    patches = table[prefix:].reshape(grid, grid, d)
    want = np.concatenate([table[:prefix], zoom(patches, (6 / grid, 6 / grid, 1), order=1)
                           .reshape(36, d)])  # fmt: skip
    model = load_pretrained(tmp_path / "vit.npz", img_size=6 * p)
    got = model.pos_embed.weight.detach()[0].numpy()
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("naming", ["released", "big_vision stacked"])
def test_google_npz_matches_timms_npz_loader(naming: str, tmp_path: Path) -> None:
    from timm.models.vision_transformer import VisionTransformer as TimmViT
    from timm.models.vision_transformer import _load_weights

    linen = naming != "released"
    d, depth, heads, mlp, p, grid, k = 64, 2, 4, 128, 8, 4, 5
    arrays = google_arrays(
        np.random.default_rng(0), d, depth, heads, mlp, p, grid, k,
        linen=linen, stacked=linen, cls=not linen,
    )  # fmt: skip
    np.savez(tmp_path / "vit.npz", **arrays)
    ref = TimmViT(
        img_size=grid * p, patch_size=p, embed_dim=d, depth=depth, num_heads=heads,
        mlp_ratio=mlp / d, num_classes=k, act_layer="gelu_tanh",
        class_token=not linen, global_pool="avg" if linen else "token", fc_norm=False,
    ).eval()  # fmt: skip
    with torch.no_grad():
        _load_weights(ref, str(tmp_path / "vit.npz"))
    model = load_pretrained(tmp_path / "vit.npz")
    assert model.config.act == "gelu_tanh" and model.config.num_heads == heads
    assert model.preprocessing.mean == (0.5, 0.5, 0.5) and model.preprocessing.std == (0.5,) * 3
    x = images(grid * p)
    with torch.no_grad():
        close(model(x), ref(x))
        close(ours_features(model, x), timm_features(ref, x))


def test_google_npz_keeps_pre_logits(tmp_path: Path) -> None:
    from timm.models.vision_transformer import VisionTransformer as TimmViT
    from timm.models.vision_transformer import _load_weights

    arrays = google_arrays(
        np.random.default_rng(1), 64, 1, 2, 128, 8, 4, 3,
        linen=False, stacked=False, cls=True, pre_logits=32,
    )  # fmt: skip
    np.savez(tmp_path / "vit.npz", **arrays)
    model = load_pretrained(tmp_path / "vit.npz")
    assert model.config.representation_size == 32
    ref = TimmViT(
        img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_ratio=2,
        num_classes=0, act_layer="gelu_tanh",
    ).eval()  # fmt: skip
    with torch.no_grad():
        _load_weights(ref, str(tmp_path / "vit.npz"))  # timm drops pre_logits: apply it by hand
        pooled = timm_features(ref, images(32))
        kernel, bias = (torch.from_numpy(arrays[f"pre_logits/{n}"]) for n in ("kernel", "bias"))
        expected = torch.tanh(pooled @ kernel + bias)
        close(ours_features(model, images(32)), expected)
        head_k, head_b = (torch.from_numpy(arrays[f"head/{n}"]) for n in ("kernel", "bias"))
        close(model(images(32)), expected @ head_k + head_b)


# --- round trips ---------------------------------------------------------------------------------


def test_round_trip_vitlab_timm_vitlab_is_exact(tmp_path: Path) -> None:
    ref = randomize(timm.create_model("vit_small_patch16_224", depth=2, num_classes=4))
    torch.save(ref.state_dict(), tmp_path / "a.pth")
    model = load_pretrained(tmp_path / "a.pth")
    model.classes = list("abcd")
    save_pretrained(model, tmp_path / "out", "timm")
    again = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = images(224)
    with torch.no_grad():
        assert torch.equal(again(x), ref(x))
    back = load_pretrained(tmp_path / "out")
    assert back.classes == list("abcd")
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_a_timm_folder_stating_another_size_than_its_table_is_resampled_as_timm_does(
    tmp_path: Path, caplog
) -> None:
    """timm builds a local-dir model at its config.json's img_size and resamples a position
    table of another square grid to it; vitlab refused the folder ("position table has 17 rows;
    a 96x96 image ... has 36"), with an img_size=96 override too. Now it loads as timm's, said."""
    ref = randomize(timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1, num_classes=3))
    save_pretrained(load_pretrained_state(ref, tmp_path), tmp_path / "out", "timm")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["model_args"]["img_size"] = [96, 96]
    config["pretrained_cfg"]["input_size"] = [3, 96, 96]
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    timm_96 = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = images(96)
    for overrides in ({}, {"img_size": 96}):
        with caplog.at_level(logging.WARNING):
            model = load_pretrained(tmp_path / "out", **overrides)
        assert "config.json states img_size 96x96, but the position table is a 64x64" in caplog.text
        caplog.clear()
        assert model.config.img_hw == (96, 96) and model.preprocessing.img_size == (96, 96)
        with torch.no_grad():
            close(model(x), timm_96(x))
    model = load_pretrained(tmp_path / "out", img_size=80)  # another size asked: as in timm
    timm_80 = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True, img_size=80)
    with torch.no_grad():
        close(model(images(80)), timm_80.eval()(images(80)))
    # every reader of the folder (a review found `vitlab cost` and finetune.from refusing it)
    from vitlab.cli.cost import config_at
    from vitlab.config import load_run_config
    from vitlab.train.build import finetune_source

    assert config_at(tmp_path / "out").img_hw == (96, 96)  # the cost of the model as it loads
    run = load_run_config(None, ["data.name=digits", f"finetune.from={tmp_path / 'out'}"])
    source, base = finetune_source(run)
    assert base.img_hw == (96, 96) and source.config.img_hw == (64, 64)  # the model as it loads;
    # the tensors' own size, which the fine-tune resamples from


def load_pretrained_state(ref: torch.nn.Module, tmp_path: Path) -> torch.nn.Module:
    """timm's model `ref` through its state dict, as vitlab loads it."""
    save_file(ref.state_dict(), tmp_path / "ref.safetensors")
    return load_pretrained(tmp_path / "ref.safetensors")


@pytest.mark.parametrize("case", ["GAP with fc_norm", "no_embed_class (DeiT-3, layer scale)",
                                  "DeiT distilled"])  # fmt: skip
def test_timm_layout_written_by_vitlab_loads_in_timm(case: str, tmp_path: Path) -> None:
    name, kwargs, size = TIMM_CASES[case]
    ref = randomize(timm.create_model(name, num_classes=3, **kwargs))
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    model = load_pretrained(tmp_path / "w.safetensors")
    save_pretrained(model, tmp_path / "out", "timm")
    again = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = images(size)
    with torch.no_grad():
        close(again(x), model(x))


def test_a_distilled_model_with_tanh_gelu_keeps_it_in_timm(tmp_path: Path) -> None:
    """A DeiT with the JAX reference's tanh GELU (as from a Google .npz): timm builds it so."""
    cfg = get_config("vit_nano_patch4_32", num_classes=3).replace(distilled=True, act="gelu_tanh")
    model = randomize(VisionTransformer(cfg)).eval()
    save_pretrained(model, tmp_path / "out", "timm")
    again = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = images(32)
    with torch.no_grad():
        exact = VisionTransformer(cfg.replace(act="gelu")).eval()
        exact.load_state_dict(model.state_dict())  # what timm built before, 3e-5 off: told apart
        assert (again(x) - model(x)).abs().max() < 2e-6 < (exact(x) - model(x)).abs().max()


def at_new_size(name: str) -> ViTConfig:
    """A registered model's config two patches larger than its registered size (a resolution no
    timm name carries), with a 3-way head."""
    cfg = get_config(name, num_classes=3)
    return cfg.replace(img_size=cfg.img_hw[0] + 2 * cfg.patch_size)


# all but the small hybrid presets, whose ResNet no timm entry point builds (test_hybrid.py checks
# that writing them names why)
TIMM_BUILDS = [
    n for n in list_models(family="vit")
    if get_config(n).stem != "resnet" or timm_hybrid_arch(get_config(n))
]  # fmt: skip


@pytest.mark.parametrize("name", TIMM_BUILDS)
def test_timm_layout_of_every_registered_size_builds_in_timm(name: str, tmp_path: Path) -> None:
    """`vitlab convert --to timm` names an architecture timm registers, and timm builds the very
    shapes from it (on the meta device, so H/14 costs nothing); written and read back with
    `local-dir:`, timm's logits are vitlab's (models wider than Ti with one block, to stay fast)."""
    cfg = at_new_size(name)
    arch, args = timm_model_args(cfg)
    assert arch in timm.list_models(arch), f"timm registers no {arch!r}"
    with torch.device("meta"):
        theirs = timm.create_model(arch, **args).state_dict()
        ours = vitlab_to_timm(VisionTransformer(cfg).state_dict())
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}
    small = cfg if cfg.embed_dim <= 192 else cfg.replace(depth=1)
    model = randomize(VisionTransformer(small))
    save_pretrained(model, tmp_path / "t", "timm")
    again = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
    x = images(small.img_hw, chans=small.in_chans, n=1)
    with torch.no_grad():
        close(again(x), model(x))


def test_every_timm_name_vitlab_writes_is_registered_in_timm() -> None:
    assert not REGISTERED - set(timm.list_models("vit_*"))
    assert "deit_base_distilled_patch16_224" in timm.list_models("deit_*")


def test_timm_layout_keeps_an_mlp_width_that_is_no_whole_ratio(tmp_path: Path) -> None:
    """D=448, MLP 488: timm builds its MLP as int(D * mlp_ratio), and 488 / 448 * 448 is
    487.99..., so the ratio written must be one that comes back as 488."""
    cfg = ViTConfig(img_size=32, patch_size=8, embed_dim=448, depth=2, num_heads=7, mlp_dim=488)
    model = randomize(VisionTransformer(cfg.replace(num_classes=5)))
    save_pretrained(model, tmp_path / "t", "timm")
    again = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
    assert again.blocks[0].mlp.fc1.out_features == 488
    x = images(32)
    with torch.no_grad():
        close(again(x), model(x))


def test_round_trip_vitlab_hf_vitlab_is_exact(tmp_path: Path) -> None:
    from vitlab import create_model

    model = randomize(create_model("vit_nano_patch4_32", num_classes=4))
    model.classes = ["cat", "dog", "ship", "frog"]
    save_pretrained(model, tmp_path / "hf", "hf")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert ref.config.id2label[2] == "ship"
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert mode["model.safetensors"] == mode["config.json"] != 0o600  # not safetensors' 0600
    x = images(32)
    with torch.no_grad():
        close(ref(pixel_values=x).logits, model(x))
    back = load_pretrained(tmp_path / "hf")
    assert back.classes == model.classes
    assert back.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_a_replaced_head_and_a_new_size_travel_into_every_format(tmp_path: Path) -> None:
    """A loaded model fine-tuned timm's way (reset_classifier, set_image_size) once kept its old
    class names and preprocessing size: the HF folder it wrote listed 4 labels beside a 2-class
    head, which transformers refused, and `.preprocessing` made inputs of the old size."""
    from vitlab import create_model
    from vitlab.models.registry import build_model

    model = randomize(create_model("vit_nano_patch4_32", num_classes=4))
    model.classes = ["cat", "dog", "ship", "frog"]
    save_pretrained(model, tmp_path / "four")
    loaded = load_pretrained(tmp_path / "four")
    loaded.reset_classifier(4)  # the same classes, a new head: the names stay
    assert loaded.classes == model.classes
    loaded.reset_classifier(2)
    loaded.set_image_size(48)
    assert loaded.classes is None and loaded.preprocessing.img_size == (48, 48)
    save_pretrained(loaded, tmp_path / "hf", "hf")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf")
    assert ref.config.id2label == {0: "0", 1: "1"} and ref.config.image_size == 48
    loaded.classes = ["cat", "dog", "ship", "frog"]  # set by hand, of another count: numbered
    save_pretrained(loaded, tmp_path / "timm", "timm")
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["label_names"] == ["0", "1"]
    for name in ("resnet18_28", "swin_nano_patch2_window7_28"):  # the CNN and the Swin too
        other = build_model(get_config(name))
        other.classes, other.preprocessing = list("abcdefghij"), loaded.preprocessing
        other.reset_classifier(3)
        other.set_image_size(56)
        assert other.classes is None and other.preprocessing.img_size == (56, 56), name


def test_a_model_without_positions_travels_to_timm(tmp_path: Path) -> None:
    """timm builds pos_embed='none' (it was refused as "learned tables only"); a bare state dict
    without a table loads at the img_size asked for (it was refused even with one)."""
    from vitlab import create_model

    model = randomize(create_model("vit_nano_patch4_32", pos_embed="none", num_classes=3))
    save_pretrained(model, tmp_path / "t", "timm")
    save_pretrained(model, tmp_path / "w.safetensors", "timm")
    ref = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True).eval()
    assert ref.pos_embed is None
    x = images(32)
    with torch.no_grad():
        close(ref(x), model(x))
        back = load_pretrained(tmp_path / "w.safetensors", num_heads=4, img_size=32)
        close(back(x), model(x))
    assert back.config.pos_embed == "none" and back.config.img_hw == (32, 32)
    with pytest.raises(CheckpointError, match="no position table to read the image size from"):
        load_pretrained(tmp_path / "w.safetensors", num_heads=4)


def test_layouts_that_cannot_hold_a_model_say_why(tmp_path: Path) -> None:
    from vitlab import create_model

    model = create_model("vit_nano_patch4_28", pos_embed="relative")
    with pytest.raises(CheckpointError, match="pos_embed='relative'"):
        save_pretrained(model, tmp_path / "t", "timm")
    with pytest.raises(CheckpointError, match="position tables other than learned"):
        save_pretrained(model, tmp_path / "h", "hf")


# --- broken and hostile files --------------------------------------------------------------------


class Payload:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {Path.cwd() / 'PWNED'}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_with_code_is_refused_and_never_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"patch_embed.proj.weight": Payload()}, f)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):
        load_pretrained(tmp_path / "evil.pth")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("kind", ["safetensors", "pth", "npz"])
def test_truncated_files_are_named(kind: str, tmp_path: Path) -> None:
    ref = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=2)
    path = tmp_path / f"w.{kind}"
    if kind == "safetensors":
        save_file(ref.state_dict(), path)
    elif kind == "pth":
        torch.save(ref.state_dict(), path)
    else:
        arrays = google_arrays(np.random.default_rng(0), 64, 1, 2, 128, 8, 4, 3, False, False, True)
        np.savez(path, **arrays)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path)):
        load_pretrained(path)


def test_a_runs_damaged_best_checkpoint_is_named_with_its_last(tmp_path: Path) -> None:
    """A run whose checkpoints/best/model.safetensors was cut short (a bad copy): the error names
    that file and the run's last checkpoint, instead of "holds no weights" for the run folder;
    the last one loads."""
    run = tmp_path / "run"
    for which in ("best", "last"):
        tiny_checkpoint(run / "checkpoints" / which)
    best = run / "checkpoints" / "best" / "model.safetensors"
    best.write_bytes(best.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="is not a readable safetensors") as e:
        load_checkpoint(run)
    assert str(best) in str(e.value) and str(run / "checkpoints" / "last") in str(e.value)
    model, _ = load_checkpoint(run / "checkpoints" / "last")
    assert model.config.num_classes == 10


def test_not_a_checkpoint_and_mismatches_are_named(tmp_path: Path) -> None:
    (tmp_path / "notes.bin").write_text("hello")
    with pytest.raises(CheckpointError, match="notes.bin"):
        load_pretrained(tmp_path / "notes.bin")
    ref = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=2)
    state = ref.state_dict()
    state["blocks.0.attn.q_norm.weight"] = torch.ones(64)  # a qk-norm model: not a plain ViT
    save_file(state, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.q_norm\.weight"):
        load_pretrained(tmp_path / "extra.safetensors")
    save_file(ref.state_dict(), tmp_path / "ok.safetensors")
    with pytest.raises(
        CheckpointError, match=r"cls_token: checkpoint \(1, 1, 192\), model \(1, 1, 256\)"
    ):
        load_pretrained(tmp_path / "ok.safetensors", embed_dim=256, num_heads=4, mlp_dim=768)
    with pytest.raises(CheckpointError, match="no file or folder"):
        load_pretrained(tmp_path / "missing.safetensors")
    for bad in ({"img_size": "96x128"}, {"img_size": 96.5}, {"num_heads": "abc"}):  # typed, named
        with pytest.raises(ConfigError, match=f"ViTConfig.{next(iter(bad))}: expected int"):
            load_pretrained(tmp_path / "ok.safetensors", **bad)
    with pytest.raises(CheckpointError, match=r"by num_heads 5 \(with the overrides"):
        load_pretrained(tmp_path / "ok.safetensors", num_heads=5)  # the override's fault, said
    model = load_pretrained(tmp_path / "ok.safetensors", num_classes=np.int64(6))  # labels.max()+1
    assert model.config.num_classes == 6 and model.head.out_features == 6
    for typo in ("cv/missing.safetensors", "runs/my-run", "ck/w.PTH"):  # relative, mistyped:
        with pytest.raises(CheckpointError, match=f"no file or folder {typo}"):  # not a Hub query
            load_pretrained(typo)


def test_vitlab_checkpoint_loads_through_the_same_door(tmp_path: Path) -> None:
    from vitlab import create_model
    from vitlab.preprocessing import Preprocessing

    model = randomize(create_model("vit_nano_patch4_28"))
    pre = Preprocessing((28, 28), 1, (0.3,), (0.4,))
    model.preprocessing, model.classes = pre, list("0123456789")
    save_pretrained(model, tmp_path / "ck")
    loaded, meta = load_checkpoint(tmp_path / "ck")
    assert meta.preprocessing == pre and loaded.preprocessing == pre
    x = images(28, chans=1)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
