"""The paper's hybrid (§3.1): a BiT ResNet-v2 stem feeding the ViT. Against timm 1.0.31 (module
layout, state-dict names, parameter counts, logits), Google's .npz naming (written here from a
timm model by a mapping of this file's own), costs against FlopCounterMode and timm's figure, and
the analyses on the stride grid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vitlab
from vitlab import load_pretrained
from vitlab.analysis.attention import mean_attention_distance, patch_centres
from vitlab.analysis.cost import cost_report, forward_macs, macs_by_part
from vitlab.cli.main import main
from vitlab.config import ConfigError
from vitlab.formats.timm import vitlab_to_timm
from vitlab.formats.timm_names import REGISTERED_HYBRIDS, timm_model_args
from vitlab.models.checkpoint import CheckpointError, save_pretrained
from vitlab.models.registry import build_model, get_config, list_models
from vitlab.models.stems import pad_same

timm = pytest.importorskip("timm")

TOL = 1e-4
# the registered hybrids timm also has (the vit_nano_r_s4_* / vit_pico_r_s4_* are vitlab's own)
TIMM_NAMES = [n for n in list_models("vit_*_r*_s*") if not n.startswith(("vit_nano_", "vit_pico_"))]


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm scales around 1), so that no tensor can be silently skipped."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            is_scale = p.ndim == 1 and "norm" in name and name.endswith("weight")
            p.copy_(noise + 1.0 if is_scale else noise)
    return model.eval()


def images(side: int, n: int = 2, chans: int = 3) -> torch.Tensor:
    return torch.randn(n, chans, side, side, generator=torch.Generator().manual_seed(1))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= TOL, (a - b).abs().max().item()


def small_timm(name: str, **kwargs: object) -> torch.nn.Module:
    """timm's model of that name at 64x64 with one transformer block (the ResNet is the entry
    point's, whole), 5 classes, every weight random."""
    return randomize(timm.create_model(name, img_size=64, depth=1, num_classes=5, **kwargs))


# --- the registry ---------------------------------------------------------------------------------


def test_registered_names_aliases_and_shapes() -> None:
    assert set(TIMM_NAMES) == {
        f"vit_{n}_{r}"
        for n in ("base_r50_s16", "small_r26_s32", "large_r50_s32")
        for r in (224, 384)
    }
    assert set(TIMM_NAMES) <= set(timm.list_models("vit_*_r*_s*"))
    assert set(TIMM_NAMES) == REGISTERED_HYBRIDS
    r50 = get_config("R50+B/16")
    assert r50 == get_config("vit_base_r50_s16_224")
    assert (r50.stem, r50.stem_width, r50.stem_depths, r50.patch_size) == (
        "resnet",
        64,
        (3, 4, 9),
        16,
    )
    assert r50.grid == (14, 14)  # the token grid is the image over the stride
    assert get_config("R26+S/32").stem_depths == (2, 2, 2, 2)
    assert get_config("R50+L/32") == get_config("vit_large_r50_s32_224")
    assert get_config("vit_large_r50_s32_384").grid == (12, 12)
    for res, chans, grid in ((28, 1, (7, 7)), (32, 3, (8, 8))):
        cfg = get_config(f"vit_nano_r_s4_{res}")
        assert (cfg.in_chans, cfg.grid, cfg.patch_size, cfg.stem_depths) == (chans, grid, 4, (2,))
        pico = get_config(f"vit_pico_r_s4_{res}")  # the quick preset's: one unit, two layers
        fields = (pico.in_chans, pico.grid, pico.patch_size, pico.stem_width, pico.stem_depths)
        assert fields == (chans, grid, 4, 32, (1,))
        assert (pico.embed_dim, pico.depth, pico.num_heads, pico.mlp_dim) == (64, 2, 4, 128)


def test_the_pico_hybrid_is_the_nano_hybrid_less_two_blocks_and_a_unit() -> None:
    """Counted by hand: a block of D=64, MLP 128 (two LayerNorms, qkv, proj, fc1, fc2) and a
    bottleneck unit of 128 channels around 32 without a projection (three GroupNorms, 1x1, 3x3,
    1x1 convolutions without bias)."""
    block = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64)
    unit = 2 * 128 + 128 * 32 + 2 * 32 + 9 * 32 * 32 + 2 * 32 + 32 * 128
    count = {n: sum(p.numel() for p in vitlab.create_model(n).parameters())
             for n in ("vit_nano_r_s4_28", "vit_pico_r_s4_28")}  # fmt: skip
    assert count["vit_pico_r_s4_28"] == count["vit_nano_r_s4_28"] - 2 * block - unit == 99_946


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_parameter_counts_and_state_dict_names_equal_timms(name: str) -> None:
    """On the meta device: the same tensors under the same names with the same shapes, so the same
    count, as timm.create_model(name); timm's vit_base_r50_s16_224 is headless (its in21k
    weights), vitlab's registered one has the ImageNet-1k head like every vitlab name."""
    with torch.device("meta"):
        theirs = timm.create_model(name, pretrained=False)
        ours = vitlab.create_model(name, num_classes=theirs.num_classes)
    their_shapes = {k: v.shape for k, v in theirs.state_dict().items()}
    our_shapes = {k: v.shape for k, v in vitlab_to_timm(ours.state_dict()).items()}
    assert our_shapes == their_shapes
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    exact = {
        "vit_base_r50_s16_224": 97_890_112,  # no head (timm's default for this name)
        "vit_base_r50_s16_384": 98_950_952,
        "vit_small_r26_s32_224": 36_431_912,
        "vit_large_r50_s32_384": 329_092_136,
    }
    if name in exact:
        assert count == exact[name]


def test_config_errors_say_what_the_resnet_stem_needs() -> None:
    with pytest.raises(ConfigError, match=r"stride 16: .* patch_size must be 16, got 32"):
        vitlab.get_config("R50+B/16", patch_size=32)
    with pytest.raises(ConfigError, match=r"patch_size must be 32"):
        vitlab.get_config("R50+B/16", stem_depths=(3, 4, 6, 3))
    assert vitlab.get_config("R50+B/16", stem_depths=(3, 4, 6, 3), patch_size=32).grid == (7, 7)
    with pytest.raises(ConfigError, match="multiple of 32"):
        vitlab.get_config("R50+B/16", stem_width=48)
    with pytest.raises(ConfigError, match=r"needs stem_depths.*got \(\)"):
        vitlab.get_config("B/16", stem="resnet", patch_size=4)
    with pytest.raises(ConfigError, match=r"units per stage \(each >= 1\)"):
        vitlab.get_config("R50+B/16", stem_depths=(3, 0, 9))
    with pytest.raises(ConfigError, match="apply to stem='conv' or 'resnet', not 'patch'"):
        vitlab.get_config("B/16", stem_depths=(3, 4, 9))
    with pytest.raises(ConfigError, match="not a multiple of patch_size 16"):
        vitlab.get_config("R50+B/16", img_size=200)


def test_same_padding_puts_the_odd_pixel_at_the_end() -> None:
    from timm.layers.padding import pad_same as timm_pad_same

    for side, k, s in ((8, 3, 2), (7, 3, 2), (8, 7, 2), (9, 7, 2), (6, 1, 2), (5, 3, 1)):
        x = torch.arange(side * side, dtype=torch.float32).reshape(1, 1, side, side)
        ours = pad_same(x, k, s)
        assert torch.equal(ours, timm_pad_same(x, (k, k), (s, s)))
        assert (ours.shape[-1] - k) // s + 1 == -(-side // s)  # ceil(side / stride) outputs
    # an even side under a 3x3 stride-2 kernel: one pixel of padding, at the bottom and right
    assert torch.equal(pad_same(torch.ones(1, 1, 4, 4), 3, 2)[0, 0, :, -1], torch.zeros(5))


def test_small_presets_train_at_two_resolutions() -> None:
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_r_s4_28")
    torch.nn.init.normal_(model.head.weight, std=0.02)
    logits = model(torch.randn(3, 1, 28, 28))
    assert logits.shape == (3, 10)
    logits.square().mean().backward()
    backbone = [n for n, p in model.named_parameters() if n.startswith("patch_embed.backbone.")]
    # root conv + GN; unit 0: 3 convs, 3 GNs, the projected shortcut's conv + GN; unit 1
    assert len(backbone) == 3 + (9 + 3) + 9
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.set_image_size(36)
    assert model.forward_features(torch.randn(1, 1, 36, 36)).shape == (1, 1 + 81, 64)
    no_decay = model.no_weight_decay()
    assert "patch_embed.backbone.stem.norm.weight" in no_decay
    assert "patch_embed.backbone.stem.conv.weight" not in no_decay


# --- timm's checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["vit_base_r50_s16_224", "vit_small_r26_s32_224", "vit_large_r50_s32_224"]
)
def test_timm_state_dict_loads_strictly_with_timms_logits(name: str, tmp_path: Path) -> None:
    """A timm hybrid's state dict alone: the ResNet (units, width, stride) and the ViT are read from
    the tensors, and the logits and pre-logits features are timm's."""
    ref = small_timm(name)
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    model = load_pretrained(tmp_path / "w.safetensors")
    cfg, want = model.config, get_config(name)
    assert (cfg.stem, cfg.stem_width, cfg.stem_depths) == ("resnet", 64, want.stem_depths)
    assert cfg.patch_size == want.patch_size and cfg.img_hw == (64, 64) and cfg.depth == 1
    x = images(64)
    with torch.no_grad():
        close(model(x), ref(x))
        close(
            model.forward_head(model.forward_features(x), pre_logits=True),
            ref.forward_head(ref.forward_features(x), pre_logits=True),
        )


def test_vitlab_writes_timms_folder_timm_loads_it_strictly_and_back(tmp_path: Path) -> None:
    """`vitlab convert --to timm` of a hybrid: timm builds it from config.json (the entry point
    that builds its ResNet, at a resolution timm has no name for), loads the weights strictly and
    gives vitlab's logits; read back, every tensor is the same."""
    ref = small_timm("vit_small_r26_s32_224")
    torch.save({"model": ref.state_dict()}, tmp_path / "t.pth")
    assert main(["convert", str(tmp_path / "t.pth"), str(tmp_path / "out"), "--to", "timm"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] == "vit_small_r26_s32_224"
    assert config["model_args"]["patch_size"] == 1 and config["model_args"]["img_size"] == [64, 64]
    assert config["pretrained_cfg"]["first_conv"] == "patch_embed.backbone.stem.conv"
    again = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    model = load_pretrained(tmp_path / "out")
    back = load_pretrained(tmp_path / "t.pth")
    x = images(64)
    with torch.no_grad():
        assert torch.equal(again(x), ref(x))
        close(model(x), ref(x))
    for k, v in back.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_what_timm_cannot_build_or_vitlab_has_no_place_for_is_named(tmp_path: Path) -> None:
    tiny = randomize(vitlab.create_model("vit_nano_r_s4_32"))
    with pytest.raises(CheckpointError, match=r"ResNet stem of width 32 and units \(2,\)"):
        save_pretrained(tiny, tmp_path / "t", "timm")
    save_pretrained(tiny, tmp_path / "v")  # vitlab's own format holds any hybrid
    back = load_pretrained(tmp_path / "v")
    assert back.config == tiny.config
    # timm's stem-only hybrid: a ResNet root and 8x8 patches on its map
    state = timm.create_model("vit_tiny_r_s16_p8_224", img_size=64, depth=1).state_dict()
    save_file(state, tmp_path / "s.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"no place .* patch_embed.backbone.conv.weight.*; "
        r"a hybrid of a ResNet stem without stages \(timm's vit_\*_r_s16_p8_\*",
    ):
        load_pretrained(tmp_path / "s.safetensors")  # the reason said, not the tensors alone
    regs = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, reg_tokens=4)
    save_file(regs.state_dict(), tmp_path / "r.safetensors")
    with pytest.raises(CheckpointError, match=r"reg_token; register tokens \(timm's reg_tokens"):
        load_pretrained(tmp_path / "r.safetensors")
    state["pos_embed.weight"] = state.pop("pos_embed")  # in vitlab's names, it is read as such
    save_file(state, tmp_path / "v.safetensors")
    with pytest.raises(CheckpointError, match="not a ResNet stem with stages"):
        load_pretrained(tmp_path / "v.safetensors")


def test_in_chans_override_adapts_the_resnet_root(tmp_path: Path) -> None:
    ref = small_timm("vit_base_r50_s16_224")
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    grey = load_pretrained(tmp_path / "w.safetensors", in_chans=1)
    root = ref.state_dict()["patch_embed.backbone.stem.conv.weight"]
    assert torch.equal(grey.patch_embed.backbone.stem.conv.weight, root.sum(1, keepdim=True))
    assert grey(images(64, chans=1)).shape == (2, 5)


# --- Google's .npz --------------------------------------------------------------------------------


def google_npz(ref: torch.nn.Module) -> dict[str, np.ndarray]:
    """timm hybrid -> Google's R50+ViT-B_16.npz naming (vit_jax's models.py): HWIO conv kernels,
    per-head attention kernels, 1-based block/unit numbers."""
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    a: dict[str, np.ndarray] = {}

    def conv(theirs: str, ours: str) -> None:
        a[f"{theirs}/kernel"] = sd[f"{ours}.weight"].transpose(2, 3, 1, 0)

    def gn(theirs: str, ours: str) -> None:
        a[f"{theirs}/scale"], a[f"{theirs}/bias"] = sd[f"{ours}.weight"], sd[f"{ours}.bias"]

    bb = "patch_embed.backbone."
    conv("conv_root", bb + "stem.conv")
    gn("gn_root", bb + "stem.norm")
    for i, stage in enumerate(ref.patch_embed.backbone.stages):
        for j, unit in enumerate(stage.blocks):
            theirs, ours = f"block{i + 1}/unit{j + 1}/", f"{bb}stages.{i}.blocks.{j}."
            for r in (1, 2, 3):
                conv(f"{theirs}conv{r}", f"{ours}conv{r}")
                gn(f"{theirs}gn{r}", f"{ours}norm{r}")
            if unit.downsample is not None:
                conv(f"{theirs}conv_proj", f"{ours}downsample.conv")
                gn(f"{theirs}gn_proj", f"{ours}downsample.norm")
    conv("embedding", "patch_embed.proj")
    a["embedding/bias"] = sd["patch_embed.proj.bias"]
    a["cls"] = sd["cls_token"]
    a["Transformer/posembed_input/pos_embedding"] = sd["pos_embed"]
    d, heads = ref.embed_dim, ref.blocks[0].attn.num_heads
    for i in range(len(ref.blocks)):
        t, b = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        for theirs, ours in (("LayerNorm_0", "norm1"), ("LayerNorm_2", "norm2")):
            a[f"{t}{theirs}/scale"], a[f"{t}{theirs}/bias"] = (
                sd[b + ours + ".weight"],
                sd[b + ours + ".bias"],
            )
        qkv_w, qkv_b = sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]
        mha = f"{t}MultiHeadDotProductAttention_1/"
        for n, name in enumerate(("query", "key", "value")):
            rows = slice(n * d, (n + 1) * d)
            a[f"{mha}{name}/kernel"] = qkv_w[rows].T.reshape(d, heads, d // heads)
            a[f"{mha}{name}/bias"] = qkv_b[rows].reshape(heads, d // heads)
        a[f"{mha}out/kernel"] = sd[b + "attn.proj.weight"].T.reshape(heads, d // heads, d)
        a[f"{mha}out/bias"] = sd[b + "attn.proj.bias"]
        for r in (0, 1):
            a[f"{t}MlpBlock_3/Dense_{r}/kernel"] = sd[f"{b}mlp.fc{r + 1}.weight"].T
            a[f"{t}MlpBlock_3/Dense_{r}/bias"] = sd[f"{b}mlp.fc{r + 1}.bias"]
    a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"] = (
        sd["norm.weight"],
        sd["norm.bias"],
    )
    a["head/kernel"], a["head/bias"] = sd["head.weight"].T, sd["head.bias"]
    return a


def test_google_npz_of_a_hybrid_gives_timms_logits(tmp_path: Path) -> None:
    """A random timm R50+ViT-B/16 (tanh GELU, as Google's weights mean) in Google's naming: timm's
    own .npz loader rebuilds it exactly (so the file is right), and vitlab gives its logits."""
    from timm.models.vision_transformer import _load_weights

    ref = small_timm("vit_base_r50_s16_224", act_layer="gelu_tanh")
    arrays = google_npz(ref)
    arrays["gn_root/scale"] = arrays["gn_root/scale"].reshape(1, 1, 1, -1)  # BiT's GN layout
    np.savez(tmp_path / "R50+ViT-B_16.npz", **arrays)
    check = timm.create_model(
        "vit_base_r50_s16_224", img_size=64, depth=1, num_classes=5, act_layer="gelu_tanh"
    ).eval()
    with torch.no_grad():
        _load_weights(check, str(tmp_path / "R50+ViT-B_16.npz"))
    for k, v in ref.state_dict().items():
        assert torch.equal(v, check.state_dict()[k]), k
    model = load_pretrained(tmp_path / "R50+ViT-B_16.npz")
    cfg = model.config
    assert (cfg.stem_depths, cfg.patch_size, cfg.act, cfg.num_heads) == (
        (3, 4, 9),
        16,
        "gelu_tanh",
        12,
    )
    assert model.preprocessing.mean == (0.5, 0.5, 0.5)
    x = images(64)
    with torch.no_grad():
        close(model(x), ref(x))
    del arrays["block3/unit2/gn2/bias"]
    np.savez(tmp_path / "broken.npz", **arrays)
    with pytest.raises(CheckpointError, match="block3/unit2/gn2/bias"):
        load_pretrained(tmp_path / "broken.npz")


# --- cost and analyses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,side", [("R50+B/16", 80), ("R26+S/32", 96), ("vit_nano_r_s4_28", 28)]
)
def test_forward_macs_count_every_conv_and_matmul_of_a_real_forward(name: str, side: int) -> None:
    """torch's FlopCounterMode on a real forward: its convolutions are the ResNet and the 1x1
    projection, its matrix products the encoder's linear layers and the head; the attention
    products (2 T^2 D a layer, which it does not see on CPU's fused kernel) are added."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = get_config(name, img_size=side, depth=1)
    model = build_model(cfg).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images(side, n=1, chans=cfg.in_chans))
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    parts = macs_by_part(cfg)
    assert counts["aten.convolution"] == 2 * (parts["backbone"] + parts["patch_embed"])
    t = cfg.num_patches + 1
    attention = 2 * t * t * cfg.embed_dim
    assert counter.get_total_flops() == 2 * (forward_macs(cfg) - attention)


def test_cost_of_r50_b16_at_384_with_the_cnn_as_its_own_part(capsys) -> None:
    report = cost_report("vit_base_r50_s16_384")
    # timm lists 67.43 GMACs; its counter also counts the norms (B/16: 17.58 G against our 17.56)
    assert report["forward_macs"] == pytest.approx(67.43e9, rel=5e-3)
    assert report["macs_by_part"]["backbone"] == pytest.approx(11.56e9, rel=1e-3)
    assert report["params"]["total"] == 98_950_952
    with torch.device("meta"):
        model = vitlab.create_model("vit_base_r50_s16_384")
    backbone = sum(p.numel() for n, p in model.named_parameters() if ".backbone." in n)
    assert report["params"]["backbone"] == backbone == 11_894_848
    assert report["stem"] == {
        "kind": "resnet",
        "width": 64,
        "depths": [3, 4, 9],
        "stride": 16,
        "channels": 1024,
    }
    assert main(["cost", "vit_base_r50_s16_384"]) == 0
    out = capsys.readouterr().out
    assert "backbone     11,894,848" in out and "backbone      11.56 G" in out
    assert "units [3, 4, 9] from width 64, stride 16, 1,024 channels" in out


def test_analyses_measure_distances_in_pixels_on_the_stride_grid(tmp_path: Path) -> None:
    """R50+B/16 at 64x64: tokens sit on a 4x4 grid of 16-pixel cells (centres 8, 24, 40, 56), and
    the mean attention distance is in those pixels; the ResNet has no linear filters to show."""
    from vitlab.analysis.report import Images, analyze
    from vitlab.data.transforms import Preprocessing

    model = randomize(vitlab.create_model("R50+B/16", img_size=64, depth=2))
    assert patch_centres(model.config.grid, model.config.patch_size)[:4, 1].tolist() == [
        8,
        24,
        40,
        56,
    ]
    pre = Preprocessing((64, 64), 3, (0.5,) * 3, (0.5,) * 3)
    display = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    x = pre.batch(display)
    analyze(model, pre, Images(["a", "b"], display, x), tmp_path, "hybrid")
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert data["patch_size"] == 16 and data["grid"] == [4, 4]
    with torch.no_grad():
        attn = model.forward_intermediates(x, return_attention=True).attentions
    expected = torch.stack([mean_attention_distance(a, (4, 4), 16, 1) for a in attn])
    assert np.allclose(data["mean_attention_distance"], expected.numpy(), atol=1e-4)
    assert not (tmp_path / "embedding_filters.png").exists()
    assert any("resnet stem has no" in n for n in data["notes"])


def test_timm_layout_of_every_registered_hybrid_builds_in_timm() -> None:
    """timm_model_args names the entry point that builds the ResNet and keeps patch_size 1 on the
    feature map; timm builds exactly vitlab's shapes from them (meta device)."""
    for name in TIMM_NAMES:
        cfg = get_config(name, num_classes=3, img_size=get_config(name).img_hw[0] + 64)
        arch, args = timm_model_args(cfg)
        assert arch in REGISTERED_HYBRIDS and args["patch_size"] == 1
        with torch.device("meta"):
            theirs = timm.create_model(arch, **args).state_dict()
            ours = vitlab_to_timm(build_model(cfg).state_dict())
        assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}, (
            name
        )


def test_a_small_hybrid_refused_by_hf_and_timm_says_why(tmp_path: Path) -> None:
    """HF's ViT has no ResNet stem, and timm builds its hybrids' ResNets at width 64: the small
    hybrids are refused by both, HF's refusal naming the ResNet stem (it said "a conv stem", the
    other stem) and the format that writes them."""
    model = vitlab.create_model("vit_pico_r_s4_28")
    with pytest.raises(CheckpointError, match=r"a ResNet stem \(a hybrid\) \(--to vitlab writes"):
        save_pretrained(model, tmp_path / "hf", "hf")
    with pytest.raises(CheckpointError, match="a ResNet stem of width 32 and units \\(1,\\)"):
        save_pretrained(model, tmp_path / "timm", "timm")
