"""The Swin Transformer: exact sizes and logits against timm 1.0 (and Hugging Face's where no map is
padded), the shifted-window mask against a brute-force one, windows, intermediates, checkpointing,
the bf16 path, resizing, errors and the registry."""

from __future__ import annotations

import itertools
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers.pos_embed_rel import resize_rel_pos_bias_table
from timm.models import swin_transformer as timm_swin
from torch import nn

import vitlab
from vitlab.config import ConfigError, ModelSection
from vitlab.models.registry import config_of, list_models, register_model
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.swin_layers import (
    MASKED,
    WindowAttention,
    relative_position_index,
    resample_rel_pos_table,
    shift_window_mask,
    window_partition,
    window_reverse,
)

TIMM_NAMES = [
    "swin_tiny_patch4_window7_224",
    "swin_small_patch4_window7_224",
    "swin_base_patch4_window7_224",
    "swin_base_patch4_window12_384",
    "swin_large_patch4_window7_224",
]
SMALL = dict(
    img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4)
)
# name -> hyper-parameters shared by timm's SwinTransformer and SwinConfig
PARITY_CASES = {
    "plain windows only": {**SMALL, "depths": (1, 1)},
    "shifted windows": SMALL,
    # 14x14 and 7x7 maps padded to windows of 4, an odd map merged, a window clamped to 4x4
    "padded": dict(SMALL, img_size=28, in_chans=1, depths=(2, 2, 2), num_heads=(2, 2, 4)),
    "non-square image and window": dict(SMALL, img_size=(24, 40), window_size=(3, 5)),
}


def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter redrawn (biases and norms included), so parity covers all of them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def images(cfg: SwinConfig, n: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.in_chans, *cfg.img_hw, generator=g)


def small(**overrides: object) -> SwinConfig:
    return SwinConfig(**{**SMALL, "num_classes": 5, **overrides})


# --- parity with timm ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_parameter_count_and_names_equal_timms(name: str) -> None:
    with torch.device("meta"):
        ours = vitlab.create_model(name)
        theirs = timm.create_model(name, pretrained=False)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    if name == "swin_tiny_patch4_window7_224":
        assert count == 28_288_354  # 28.29M (VIT_REFERENCE.md §10)


@pytest.mark.parametrize("case", PARITY_CASES)
def test_logits_features_and_stages_equal_timms(case: str) -> None:
    kw = {**PARITY_CASES[case], "num_classes": 7}
    theirs = randomized(timm_swin.SwinTransformer(**kw))
    cfg = SwinConfig(**kw)
    ours = SwinTransformer(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for name, buf in theirs.named_buffers():  # indices and masks, built independently
        assert torch.equal(buf, dict(ours.named_buffers())[name]), name
    x = images(cfg)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            ours.forward_features(x), theirs.forward_features(x), atol=1e-4, rtol=0
        )
        _, stages = theirs.forward_intermediates(x, norm=False)
        for a, b in zip(ours.forward_intermediates(x), stages, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_timm_checkpoint_with_a_window_clamped_to_the_map_loads() -> None:
    """Stage maps smaller than the window get a smaller window and table (timm), e.g. the 28x28
    preset's last stage of a 3-stage variant: 4x4 map, window 7 -> 4."""
    cfg = SwinConfig(
        img_size=28,
        patch_size=2,
        in_chans=1,
        embed_dim=8,
        depths=(1, 1, 2),
        num_heads=(1, 2, 2),
        window_size=7,
        num_classes=3,
    )
    kw = {k: getattr(cfg, k) for k in ("img_size", "patch_size", "in_chans", "embed_dim")}
    theirs = timm_swin.SwinTransformer(
        **kw, depths=cfg.depths, num_heads=cfg.num_heads, window_size=7, num_classes=3
    )
    ours = SwinTransformer(cfg).eval()
    ours.load_state_dict(randomized(theirs).state_dict(), strict=True)
    assert [s.blocks[0].window for s in ours.layers] == [(7, 7), (7, 7), (4, 4)]
    assert ours.layers[2].blocks[1].attn_mask is None  # 4x4 map in one window: no shift
    with torch.no_grad():
        torch.testing.assert_close(ours(images(cfg)), theirs(images(cfg)), atol=1e-4, rtol=0)


def hf_to_timm_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's SwinForImageClassification state dict in timm's names: HF merges patches at
    the end of stage i, timm at the start of stage i + 1; HF's q, k, v are joined into qkv."""
    renames = [
        ("swin.embeddings.patch_embeddings.projection", "patch_embed.proj"),
        ("swin.embeddings.norm", "patch_embed.norm"),
        ("swin.layernorm", "norm"),
        ("classifier", "head.fc"),
        ("swin.encoder.layers.", "layers."),
        (".layernorm_before", ".norm1"),
        (".layernorm_after", ".norm2"),
        (".attention.relative_position_bias.", ".attn."),
        (".attention.o_proj", ".attn.proj"),
        (".intermediate.dense", ".mlp.fc1"),
        (".output.dense", ".mlp.fc2"),
    ]
    out = {}
    for key, value in state.items():
        key = re.sub(
            r"encoder\.layers\.(\d+)\.downsample",
            lambda m: f"encoder.layers.{int(m.group(1)) + 1}.downsample",
            key,
        )
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    for key in [k for k in out if ".attention.q_proj." in k]:
        base, kind = key.split(".attention.q_proj.")
        parts = [out.pop(f"{base}.attention.{n}_proj.{kind}") for n in "qkv"]
        out[f"{base}.attn.qkv.{kind}"] = torch.cat(parts)
    return {k: v for k, v in out.items() if not k.endswith("relative_position_index")}


@pytest.mark.parametrize("img_size, window", [(32, 4), (56, 7)])
def test_logits_equal_hugging_faces_where_the_windows_tile_the_maps(img_size, window) -> None:
    """Hugging Face places patch merging at the end of a stage; moved to the next stage's start,
    its weights give vitlab's logits. (Where a map must be padded HF pads before the cyclic shift,
    timm and vitlab after it, so the outputs differ there.)"""
    transformers = pytest.importorskip("transformers")
    arch = dict(embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 4], window_size=window)
    hf_cfg = transformers.SwinConfig(
        image_size=img_size, patch_size=2, num_labels=5, drop_path_rate=0.0, **arch
    )
    theirs = randomized(transformers.SwinForImageClassification(hf_cfg))
    cfg = SwinConfig(img_size=img_size, patch_size=2, num_classes=5, **arch)
    ours = SwinTransformer(cfg).eval()
    ours.load_state_dict(hf_to_timm_names(theirs.state_dict()), strict=True)
    x = images(cfg)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(pixel_values=x).logits, atol=1e-4, rtol=0)


# --- windows, offsets and the shifted-window mask ------------------------------------------------


def test_window_partition_and_reverse_are_inverse() -> None:
    x = torch.randn(2, 6, 10, 3)
    windows = window_partition(x, (3, 5))  # (B, 4 windows, 15 tokens, C)
    assert windows.shape == (2, 4, 15, 3)
    # window 1 is the top-right one, its tokens row-major
    torch.testing.assert_close(windows[:, 1], x[:, 0:3, 5:10].reshape(2, 15, 3))
    assert torch.equal(window_reverse(windows, (3, 5), (6, 10)), x)
    assert torch.equal(window_partition(window_reverse(windows, (3, 5), (6, 10)), (3, 5)), windows)


def test_relative_position_index_is_the_offsets_row() -> None:
    mh, mw = 3, 4
    index = relative_position_index((mh, mw))
    cells = list(itertools.product(range(mh), range(mw)))
    for (i, (yi, xi)), (j, (yj, xj)) in itertools.product(enumerate(cells), repeat=2):
        assert index[i, j] == (yi - yj + mh - 1) * (2 * mw - 1) + (xi - xj + mw - 1)
    assert index.max() == (2 * mh - 1) * (2 * mw - 1) - 1
    torch.testing.assert_close(index, timm_swin.get_relative_position_index(mh, mw))


def brute_force_mask(grid, window, shift, label) -> torch.Tensor:
    """(nW, N, N) built pair by pair: each pixel of the padded, rolled map gets label(axis, i,
    padded length); two pixels of one window may attend iff their labels are equal."""
    padded = [-(-n // m) * m for n, m in zip(grid, window)]
    windows = []
    for wy, wx in itertools.product(range(padded[0] // window[0]), range(padded[1] // window[1])):
        cells = [
            (wy * window[0] + dy, wx * window[1] + dx)
            for dy, dx in itertools.product(range(window[0]), range(window[1]))
        ]
        rows = []
        for y, x in cells:
            lab = (label(0, y, padded[0]), label(1, x, padded[1]))
            rows.append(
                [
                    0.0 if lab == (label(0, v, padded[0]), label(1, u, padded[1])) else MASKED
                    for v, u in cells
                ]
            )
        windows.append(rows)
    return torch.tensor(windows)


@pytest.mark.parametrize(
    "grid, window, shift",
    [
        ((8, 8), (4, 4), (2, 2)),
        ((14, 14), (7, 7), (3, 3)),
        ((12, 9), (4, 3), (2, 1)),
        ((8, 4), (4, 4), (2, 0)),
    ],
)
def test_shift_mask_keeps_pixels_that_were_not_neighbours_apart(grid, window, shift) -> None:
    """Without padding, a pixel of the map rolled by -s wrapped around along an axis iff it sits
    in the last s rows (columns); pairs may attend iff they wrapped alike along both axes."""

    def wrapped(axis: int, i: int, length: int) -> int:
        return int(i >= length - shift[axis])

    mask = shift_window_mask(grid, window, shift)
    assert torch.equal(mask, brute_force_mask(grid, window, shift, wrapped))


@pytest.mark.parametrize("grid", [(14, 14), (7, 7), (7, 10)])
def test_shift_mask_on_a_padded_map_labels_regions_as_timm_does(grid) -> None:
    """A map the window does not tile is padded to whole windows after the roll; the regions are
    the slices [0, P - M), [P - M, P - s), [P - s, P) of the padded length P (timm 1.0)."""
    window, shift = (4, 4), (2, 2)

    def region(axis: int, i: int, length: int) -> int:
        return 0 if i < length - window[axis] else 1 if i < length - shift[axis] else 2

    mask = shift_window_mask(grid, window, shift)
    assert torch.equal(mask, brute_force_mask(grid, window, shift, region))
    assert shift_window_mask(grid, window, (0, 0)) is None


# --- forward, intermediates, training ------------------------------------------------------------


def test_forward_intermediates_shapes_and_strides() -> None:
    cfg = SwinConfig(
        img_size=64,
        window_size=2,
        embed_dim=8,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 2, 2),
        num_classes=3,
    )
    model = SwinTransformer(cfg).eval()
    x = images(cfg)
    with torch.no_grad():
        maps = model.forward_intermediates(x)
        features = model.forward_features(x)
        assert [tuple(m.shape) for m in maps] == [
            (2, 8 * 2**i, 64 // s, 64 // s) for i, s in enumerate((4, 8, 16, 32))
        ]
        assert features.shape == (2, 2, 2, 64)  # (B, H/32, W/32, 8C), channels last
        assert model.num_features == 64 and model.num_prefix_tokens == 0
        # norm=True normalises the last stage only; it is then forward_features, channels first
        normed = model.forward_intermediates(x, norm=True)
        torch.testing.assert_close(normed[-1], features.permute(0, 3, 1, 2))
        torch.testing.assert_close(normed[0], maps[0])
        assert len(model.forward_intermediates(x, indices=2)) == 2
        torch.testing.assert_close(model.forward_intermediates(x, indices=[0])[0], maps[0])
        pooled = model.forward_head(features, pre_logits=True)
        torch.testing.assert_close(pooled, features.mean(dim=(1, 2)))
        assert model.forward_head(features).shape == (2, 3)
    with pytest.raises(ValueError, match="stage index 4 out of range"):
        model.forward_intermediates(x, indices=[4])


def test_grad_checkpointing_gives_the_same_gradients() -> None:
    cfg = small(drop_path=0.0)
    x = images(cfg)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = SwinTransformer(cfg)
        model.set_grad_checkpointing(ckpt)
        model(x).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_cpu_takes_the_explicit_path_equal_to_sdpa_and_close_in_bf16(monkeypatch) -> None:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    model = randomized(SwinTransformer(small()), seed=3)
    x = images(model.config)
    with torch.no_grad():
        explicit = model(x)
        assert not calls  # CPU: the explicit path, fp32 too
        monkeypatch.setattr(WindowAttention, "fused", True)
        reference = model(x)
        assert calls and set(calls) == {torch.float32}
        torch.testing.assert_close(explicit, reference, atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(WindowAttention, "fused", None)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
    assert not calls and low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, atol=0.05 * reference.abs().max(), rtol=0)


def test_every_parameter_gets_a_gradient_in_training_mode() -> None:
    torch.manual_seed(0)
    model = SwinTransformer(small(dropout=0.1, attn_dropout=0.1, drop_path=0.2, head_dropout=0.1))
    model.train()
    model(images(model.config, n=8)).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing
    rates = [blk.drop_path1.p for stage in model.layers for blk in stage.blocks]
    assert rates == pytest.approx([0.0, 0.2 / 3, 0.4 / 3, 0.2])  # linear over all blocks


# full sizes are only built (test_parameter_count_and_names_equal_timms): too slow to run here
CPU_SIZED = [n for n in list_models(family="swin") if max(vitlab.get_config(n).img_hw) <= 32]


@pytest.mark.parametrize("name", CPU_SIZED)
def test_every_small_registered_swin_runs_and_trains(name: str) -> None:
    cfg = vitlab.get_config(name)
    torch.manual_seed(0)
    model = vitlab.create_model(name)
    x = images(cfg)
    logits = model(x)
    assert logits.shape == (2, cfg.num_classes) and logits.isfinite().all()
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_small_presets_sizes() -> None:
    counts = {}
    for name in ("swin_nano_patch2_window7_28", "swin_nano_patch2_window4_32"):
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in vitlab.create_model(name).parameters())
    assert counts == {
        "swin_nano_patch2_window7_28": 303_580,
        "swin_nano_patch2_window4_32": 567_046,
    }


# --- construction, resizing ----------------------------------------------------------------------


def test_init_no_weight_decay_and_reset_classifier() -> None:
    torch.manual_seed(0)
    model = SwinTransformer(SwinConfig(img_size=32, embed_dim=64, depths=(2,), num_heads=(4,)))
    fc1 = model.layers[0].blocks[0].mlp.fc1
    assert abs(fc1.weight.std().item() - 0.02) < 0.002 and fc1.weight.abs().max() <= 2.0
    assert not fc1.bias.any() and torch.equal(model.norm.weight, torch.ones(64))
    table = model.layers[0].blocks[0].attn.relative_position_bias_table
    assert table.shape == (169, 4) and 0.01 < table.std().item() < 0.03
    nwd = model.no_weight_decay()
    assert "layers.0.blocks.0.attn.relative_position_bias_table" in nwd
    assert "layers.0.blocks.0.attn.qkv.bias" in nwd and "norm.weight" in nwd
    assert "layers.0.blocks.0.attn.qkv.weight" not in nwd and "head.fc.weight" not in nwd
    model.reset_classifier(4)
    assert model.config.num_classes == 4 and not model.head.fc.weight.any()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    model.reset_classifier(0)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 64)  # pooled features


def test_resampling_the_table_keeps_the_same_window_and_resizes_others() -> None:
    table = torch.randn(49, 3)
    assert torch.equal(resample_rel_pos_table(table, (4, 4), (4, 4)), table)
    bigger = resample_rel_pos_table(table, (4, 4), (6, 5))
    assert bigger.shape == (11 * 9, 3)
    # the zero offset sits on a sample point of both grids: bicubic keeps it
    torch.testing.assert_close(bigger[5 * 9 + 4], table[3 * 7 + 3])


def test_the_tables_resample_as_the_official_swin_code_and_as_timms_loader() -> None:
    table = torch.randn(13 * 13, 3)
    grid = table.t().reshape(1, 3, 13, 13)  # Swin's load_pretrained: bicubic, no antialias
    official = F.interpolate(grid, size=(23, 23), mode="bicubic", align_corners=False)
    torch.testing.assert_close(
        resample_rel_pos_table(table, (7, 7), (12, 12)), official.reshape(3, -1).t()
    )
    for old, new in [((7, 7), (12, 12)), ((7, 7), (4, 4)), ((4, 6), (7, 5))]:
        rows = (2 * new[0] - 1) * (2 * new[1] - 1)
        table = torch.randn((2 * old[0] - 1) * (2 * old[1] - 1), 2)
        theirs = resize_rel_pos_bias_table(table, new, (rows, 2), old_window_size=old)
        torch.testing.assert_close(resample_rel_pos_table(table, old, new, "timm"), theirs)
    with pytest.raises(ValueError, match="one of .*'bicubic', 'timm'.*got 'cubic'"):
        resample_rel_pos_table(table, (4, 4), (6, 6), "cubic")
    with pytest.raises(ValueError, match="table_resampling must be one of"):
        randomized(SwinTransformer(small())).set_image_size(32, table_resampling="cubic")


@pytest.mark.parametrize("img_size, window_size", [(48, None), (64, 8), ((32, 48), 2)])
def test_set_image_size_gives_the_model_of_the_new_config(img_size, window_size) -> None:
    model = randomized(SwinTransformer(small()))
    model.set_image_size(img_size, window_size=window_size)
    cfg = small().replace(img_size=img_size, window_size=window_size or 4)
    assert model.config == cfg
    fresh = SwinTransformer(cfg).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)  # every table has its new shape
    for name, buf in fresh.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    x = images(cfg, n=1)
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    with pytest.raises(ValueError, match="expected images of size"):
        model(torch.randn(1, 3, 32, 32))


def test_set_image_size_to_the_same_size_changes_nothing() -> None:
    model = randomized(SwinTransformer(small()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_image_size(32)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- errors --------------------------------------------------------------------------------------


def test_wrong_inputs_say_what_was_expected() -> None:
    model = SwinTransformer(small())
    with pytest.raises(ValueError, match="expected images of size 32x32, got 40x40"):
        model(torch.randn(1, 3, 40, 40))
    with pytest.raises(ValueError, match="expected images with 3 channels, got 1"):
        model(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="multiples of the patch size 2: got 33x32"):
        model(torch.randn(1, 3, 33, 32))
    with pytest.raises(ValueError, match=r"shape \(B, 3, 32, 32\)"):
        model(torch.randn(3, 32, 32))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_heads=(2, 3)), "stage 1 width 32 .* not divisible by its num_heads 3"),
        (dict(depths=(2, 2, 2)), "one entry per stage"),
        (dict(depths=(), num_heads=()), "one entry per stage"),
        (dict(depths=(2, 0)), "must be positive"),
        (dict(img_size=33), "not a multiple of patch_size 2"),
        (dict(window_size=0), "sizes must be positive"),
        (dict(drop_path=1.0), "drop_path must be in"),
        (dict(depths=[2, "2"]), "depths: expected tuple"),
    ],
)
def test_config_errors(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        small(**overrides)


# --- registry ------------------------------------------------------------------------------------


def test_registry_names_aliases_and_overrides() -> None:
    assert set(TIMM_NAMES) <= set(list_models(family="swin"))
    assert not set(list_models(family="vit")) & set(list_models(family="swin"))
    families = [set(list_models(family=f)) for f in ("vit", "swin", "cnn")]
    assert set(list_models()) == set.union(*families)  # the CNN baselines: tests/test_cnn.py
    assert list_models("swin_base*", family="swin") == TIMM_NAMES[2:4]
    for alias, name in [("Swin-T", 0), ("Swin-S", 1), ("Swin-B", 2), ("Swin-L", 4)]:
        assert vitlab.get_config(alias) == vitlab.get_config(TIMM_NAMES[name])
    model = vitlab.create_model("Swin-T", num_classes=3, img_size=32, depths=(1, 1, 1, 1))
    assert isinstance(model, SwinTransformer) and model.config.num_classes == 3
    assert isinstance(vitlab.create_model("vit_nano_patch4_28"), vitlab.VisionTransformer)
    cfg = config_of(ModelSection("swin-t", {"window_size": 12, "img_size": 384}))
    assert isinstance(cfg, SwinConfig) and cfg.window_hw == (12, 12)
    with pytest.raises(ConfigError, match="unknown key 'depth'.*valid keys: .*depths"):
        config_of(ModelSection("Swin-T", {"depth": 12}))
    with pytest.raises(ConfigError, match="unknown key 'mlp_dim'"):
        vitlab.create_model("swin_nano_patch2_window7_28", mlp_dim=10)
    with pytest.raises(TypeError, match="ViTConfig, SwinConfig or CNNConfig"):
        register_model("not_a_model", {"embed_dim": 8})  # type: ignore[arg-type]
