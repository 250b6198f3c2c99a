"""The model family: every registered model runs and trains, exact sizes, API behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitlab
from tests.helpers import count_calls, randomize_head, tiny_config
from vitlab.analysis.cost import macs_by_part
from vitlab.models import cpu_kernels
from vitlab.models.layers import DropPath
from vitlab.models.registry import build_model
from vitlab.models.vit import VisionTransformer

# (name, exact parameter count with 1000 classes) from VIT_REFERENCE.md §2
EXACT_PARAMS = [
    ("Ti/16", 5_717_416),
    ("S/16", 22_050_664),
    ("B/16", 86_567_656),
    ("B/32", 88_224_232),
    ("L/16", 304_326_632),
    ("L/32", 306_535_400),
    ("H/14", 632_045_800),
    ("vit_tiny_patch16_384", 5_790_376),
    ("vit_small_patch16_384", 22_196_584),
    ("vit_base_patch16_384", 86_859_496),
    ("vit_large_patch16_384", 304_715_752),
]


@pytest.mark.parametrize("name", vitlab.list_models(family="vit"))
def test_every_registered_model_runs_and_every_parameter_gets_a_gradient(name: str) -> None:
    cfg = vitlab.get_config(name)
    side = 2 * cfg.patch_size  # small inputs: a 2x2 patch grid
    overrides: dict[str, object] = {"img_size": side}
    with torch.device("meta"):
        big = sum(p.numel() for p in VisionTransformer(cfg).parameters()) > 100_000_000
    if big:  # keep width, heads and patch; two blocks are enough to exercise them
        overrides["depth"] = 2
    torch.manual_seed(0)
    model = vitlab.create_model(name, **overrides)
    randomize_head(model)
    x = torch.randn(2, cfg.in_chans, side, side)
    logits = model(x)
    assert logits.shape == (2, cfg.num_classes)
    assert torch.isfinite(logits).all()
    logits.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: {pname} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name}: {pname} has an all-zero gradient"


@pytest.mark.parametrize("name,expected", EXACT_PARAMS)
def test_exact_parameter_counts_on_meta_device(name: str, expected: int) -> None:
    with torch.device("meta"):
        model = vitlab.create_model(name)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected


def test_aliases_and_unknown_names() -> None:
    assert vitlab.get_config("B/16") == vitlab.get_config("vit_base_patch16_224")
    assert vitlab.get_config("b/16") == vitlab.get_config("B/16")
    with pytest.raises(vitlab.UnknownModelError) as err:
        vitlab.create_model("vit_base_patch16_225")
    msg = str(err.value)
    assert "vit_base_patch16_225" in msg and "vit_base_patch16_224" in msg
    assert set(vitlab.list_models("vit_base_patch*")) == {
        f"vit_base_patch{p}_{s}" for p in (8, 16, 32) for s in (224, 384)
    }
    assert vitlab.list_models("B/16") == ["vit_base_patch16_224"]  # aliases match: `models B/16`
    assert vitlab.list_models("Swin-?", family="swin") == [
        "swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224",
        "swin_base_patch4_window7_224", "swin_large_patch4_window7_224",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="family must be 'vit', 'swin' or 'cnn'.*'cnnx'"):
        vitlab.list_models(family="cnnx")  # once an empty list
    with pytest.raises(vitlab.UnknownModelError, match="a model name is a string.*got 16"):
        vitlab.create_model(16)  # once AttributeError: 'int' object has no attribute 'lower'
    # timm's list of patterns (any one matches); a config built as create_model(name) builds it
    assert vitlab.list_models(["vit_tiny*", "Swin-T"]) == [
        "vit_tiny_patch16_224", "vit_tiny_patch16_384", "swin_tiny_patch4_window7_224",
    ]  # fmt: skip
    with pytest.raises(TypeError, match="pattern is a glob pattern or a list of them, got \\[1\\]"):
        vitlab.list_models([1])
    with pytest.raises(TypeError, match="pattern is a glob pattern or a list of them, got 5"):
        vitlab.list_models(5)
    cfg = vitlab.get_config("vit_nano_patch4_28")
    model = vitlab.create_model(cfg, num_classes=3)
    assert model.config == cfg.replace(num_classes=3) and model.head.weight.shape == (3, 64)
    with pytest.raises(vitlab.UnknownModelError, match="create_model\\(config\\) builds a config"):
        vitlab.get_config(cfg)


@pytest.mark.parametrize(
    ("ours", "timms", "args"),
    [
        ("vit_nano_patch4_28", "vit_tiny_patch16_224", {}),
        ("vit_nano_patch4_28", "deit_tiny_distilled_patch16_224", {"distilled": True}),
        ("swin_nano_patch2_window7_28", "swin_tiny_patch4_window7_224", {}),
        ("resnet18_28", "resnet18", {}),
        ("resnetv2_50_28", "resnetv2_50", {}),
    ],
)
def test_timm_classifier_names_work_on_every_family(ours, timms, args) -> None:
    """Code written for timm reads `model.num_classes` and `model.get_classifier()`: vitlab's
    models had neither (AttributeError). They give what timm's model of the family gives: the
    layer making the logits (a distilled model's two heads), and the count after a reset."""
    timm = pytest.importorskip("timm")
    mine = vitlab.create_model(ours, num_classes=7, **args)
    with torch.device("meta"):
        theirs = timm.create_model(timms, pretrained=False, num_classes=7)
    assert mine.num_classes == theirs.num_classes == 7
    got, want = mine.get_classifier(), theirs.get_classifier()
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert [type(g) for g in got] == [type(w) for w in want]
    assert [g.weight.shape[0] for g in got] == [w.weight.shape[0] for w in want] == [7] * len(want)
    assert got[0] is mine.classifier and got[-1](torch.zeros(1, *got[-1].weight.shape[1:])).numel()
    mine.reset_classifier(0)
    heads = mine.get_classifier()
    heads = heads if isinstance(heads, tuple) else (heads,)
    assert mine.num_classes == 0 and len(heads) == len(got)
    assert all(isinstance(h, torch.nn.Identity) for h in heads)
    assert mine(torch.zeros(1, 1, 28, 28)).shape == (1, mine.num_features)


def test_config_overrides_are_strict() -> None:
    with pytest.raises(vitlab.ConfigError, match="unknown key 'embed_dims'.*embed_dim"):
        vitlab.create_model("Ti/16", embed_dims=10)
    with pytest.raises(vitlab.ConfigError, match="depth: expected int, got '12'"):
        vitlab.create_model("Ti/16", depth="12")
    with pytest.raises(vitlab.ConfigError, match="pool"):
        vitlab.create_model("Ti/16", pool="max")
    with pytest.raises(vitlab.ConfigError, match="^num_classes must be >= 0, got -1$"):
        vitlab.create_model("Ti/16", num_classes=-1)  # it named depth too: "got 12, -1"
    with pytest.raises(vitlab.ConfigError, match="^depth .* -1; num_classes must be >= 0, got -2$"):
        vitlab.create_model("Ti/16", depth=-1, num_classes=-2)
    with pytest.raises(vitlab.ConfigError, match="class_token"):
        vitlab.create_model("Ti/16", class_token=False, pool="token")
    with pytest.raises(vitlab.ConfigError, match="not a multiple of patch_size 16"):
        vitlab.create_model("Ti/16", img_size=200)
    with pytest.raises(vitlab.ConfigError, match="divisible by num_heads"):
        vitlab.create_model("Ti/16", num_heads=5)
    with pytest.raises(vitlab.ConfigError, match=r"positive, got img_size=\(224, 0\), mlp_dim=-1$"):
        vitlab.create_model("Ti/16", img_size=[224, 0], mlp_dim=-1)  # not the config's repr
    with pytest.raises(vitlab.ConfigError, match=r"positive, got window_size=0$"):
        vitlab.create_model("Swin-T", window_size=0)
    cfg = vitlab.get_config("Ti/16", img_size=[32, 48], dropout=0)
    assert cfg.img_size == (32, 48) and isinstance(cfg.dropout, float)


def test_input_errors_name_the_expected_and_received_sizes() -> None:
    model = VisionTransformer(tiny_config())
    with pytest.raises(ValueError, match="expected images of size 16x16, got 20x20"):
        model(torch.randn(1, 3, 20, 20))
    with pytest.raises(ValueError, match="multiples of the patch size 4: got 18x16"):
        model(torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match="expected images with 3 channels, got 1"):
        model(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match=r"shape \(B, 3, 16, 16\).*\(3, 16, 16\)"):
        model(torch.randn(3, 16, 16))


@pytest.mark.parametrize(
    "name", ["vit_nano_patch4_28", "vit_pico_r_s4_28", "resnet18_28", "swin_nano_patch2_window7_28"]
)
def test_a_batch_of_another_dtype_is_named_and_autocast_still_casts(name: str) -> None:
    """uint8 images (torchvision.io's) and float64 ones (numpy's) get vitlab's error, not
    PyTorch's "expected scalar type Byte but found Float" from deep inside a conv; under autocast
    float32 and float16 batches run, as autocast casts them, and float64 ones, which it does not,
    are refused; a float64 model takes float64 images."""
    model = vitlab.create_model(name).eval()
    with pytest.raises(ValueError, match=r"expected float images, got torch.uint8: scale"):
        model(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))
    for array in (np.zeros((2, 1, 28, 28), np.float32), [[0.0]]):  # an AttributeError before
        with pytest.raises(ValueError, match=r"got a (ndarray|list), not a torch.Tensor: scale"):
            model(array)
    with pytest.raises(ValueError, match=r"model's dtype torch.float32, got torch.float64: conv"):
        model(torch.zeros(2, 1, 28, 28, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype in (torch.float32, torch.float16):
            assert model(torch.zeros(2, 1, 28, 28, dtype=dtype)).dtype == torch.bfloat16
        with pytest.raises(ValueError, match="got torch.float64"):
            model(torch.zeros(2, 1, 28, 28, dtype=torch.float64))
    assert model.double()(torch.zeros(2, 1, 28, 28, dtype=torch.float64)).dtype == torch.float64
    with torch.device("meta"):  # shapes and FLOP counts: no autocast state to ask there
        assert vitlab.create_model(name)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("in_chans,size", [(1, (16, 16)), (5, (16, 24)), (3, (24, 8))])
def test_any_channel_count_and_rectangular_images(in_chans: int, size: tuple[int, int]) -> None:
    model = VisionTransformer(tiny_config(in_chans=in_chans, img_size=size))
    tokens = model.forward_features(torch.randn(2, in_chans, *size))
    n = (size[0] // 4) * (size[1] // 4)
    assert tokens.shape == (2, 1 + n, 32)
    assert model.config.grid == (size[0] // 4, size[1] // 4)


def test_init_follows_the_jax_reference() -> None:
    torch.manual_seed(0)
    model = vitlab.create_model("B/16", depth=2)
    d = 768
    assert torch.count_nonzero(model.cls_token) == 0
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    assert abs(model.pos_embed.weight.std().item() - 0.02) < 1e-3
    blk = model.blocks[0]
    assert (
        torch.count_nonzero(blk.attn.qkv.bias) == 0 and torch.count_nonzero(blk.attn.proj.bias) == 0
    )
    assert 0 < blk.mlp.fc1.bias.abs().max() < 1e-5
    # Xavier-uniform with q, k and v each a D x D matrix: bound sqrt(6 / 2D)
    bound = (6 / (2 * d)) ** 0.5
    assert blk.attn.qkv.weight.abs().max() <= bound
    assert abs(blk.attn.qkv.weight.std().item() - bound / 3**0.5) < 1e-3
    fc1_bound = (6 / (d + 3072)) ** 0.5
    assert abs(blk.mlp.fc1.weight.std().item() - fc1_bound / 3**0.5) < 1e-3
    # LeCun normal on the patch conv: std sqrt(1 / fan_in), fan_in = 3 * 16 * 16
    w = model.patch_embed.proj.weight
    assert abs(w.std().item() - (1 / 768) ** 0.5) < 2e-3
    assert torch.count_nonzero(model.patch_embed.proj.bias) == 0


def test_pre_logits_head_and_reset_classifier() -> None:
    model = VisionTransformer(tiny_config(representation_size=48))
    x = torch.randn(3, 3, 16, 16)
    feats = model.forward_head(model.forward_features(x), pre_logits=True)
    assert feats.shape == (3, 48)
    assert feats.abs().max() <= 1.0  # tanh
    model.reset_classifier(11)
    assert model.config.num_classes == 11
    assert model(x).shape == (3, 11)
    assert torch.count_nonzero(model.head.weight) == 0
    model.reset_classifier(0)
    assert model(x).shape == (3, 48)


def test_gap_pool_is_mean_of_normed_patch_tokens() -> None:
    for class_token in (True, False):
        model = VisionTransformer(tiny_config(pool="gap", class_token=class_token))
        tokens = model.forward_features(torch.randn(2, 3, 16, 16))
        assert tokens.shape[1] == 16 + int(class_token)
        pooled = model.forward_head(tokens, pre_logits=True)
        torch.testing.assert_close(pooled, tokens[:, int(class_token) :].mean(1))


def test_gelu_tanh_activation() -> None:
    model = VisionTransformer(tiny_config(act="gelu_tanh"))
    assert model.blocks[0].mlp.act.approximate == "tanh"
    assert VisionTransformer(tiny_config()).blocks[0].mlp.act.approximate == "none"


def test_drop_path_drops_whole_samples_and_rescales_the_kept() -> None:
    """Each sample's branch is zeroed with probability p or kept scaled by 1 / (1 - p), so its
    expectation is the branch itself; in eval the branch passes unchanged."""
    drop = DropPath(0.25).train()
    out = drop(torch.ones(4000, 3, 5))
    per_sample = out.flatten(1)
    assert ((per_sample == 0).all(1) | (per_sample == 1 / 0.75).all(1)).all()  # whole samples
    assert (per_sample[:, 0] > 0).float().mean().item() == pytest.approx(0.75, abs=0.03)
    assert out.mean().item() == pytest.approx(1.0, abs=0.04)
    x = torch.randn(6, 4)
    assert torch.equal(drop.eval()(x), x)


def test_drop_path_rates_rise_linearly_and_only_act_in_training() -> None:
    model = VisionTransformer(tiny_config(depth=5, drop_path=0.4))  # no dropout: drop path alone
    rates = [blk.drop_path1.p for blk in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    x = torch.randn(4, 3, 16, 16)
    model.eval()
    torch.testing.assert_close(model.forward_features(x), model.forward_features(x))
    model.train()
    assert not torch.allclose(model.forward_features(x), model.forward_features(x))


def test_grad_checkpointing_gives_same_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(depth=3, dropout=0.1, drop_path=0.2, attn_dropout=0.1))
    randomize_head(model)
    x = torch.randn(4, 3, 16, 16)

    def run(ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        model.set_grad_checkpointing(ckpt)
        torch.manual_seed(123)
        out = model(x)
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_plain, grads_plain = run(False)
    out_ckpt, grads_ckpt = run(True)
    torch.testing.assert_close(out_ckpt, out_plain)
    for a, b in zip(grads_ckpt, grads_plain, strict=True):
        torch.testing.assert_close(a, b)


def test_no_weight_decay_names() -> None:
    model = VisionTransformer(tiny_config(representation_size=16))
    names = model.no_weight_decay()
    params = dict(model.named_parameters())
    assert {"cls_token", "pos_embed.weight", "norm.weight", "norm.bias", "head.bias"} <= names
    assert "blocks.0.attn.qkv.bias" in names and "blocks.1.norm2.weight" in names
    decayed = set(params) - names
    assert decayed == {n for n, p in params.items() if p.ndim >= 2 and n not in names}
    assert {"blocks.0.attn.qkv.weight", "head.weight", "patch_embed.proj.weight"} <= decayed
    rel = VisionTransformer(tiny_config(pos_embed="relative"))
    assert "blocks.0.attn.rel_pos.table" in rel.no_weight_decay()
    two_d = VisionTransformer(tiny_config(pos_embed="learned_2d"))
    assert {"pos_embed.x_embed", "pos_embed.y_embed", "pos_embed.prefix"} <= two_d.no_weight_decay()


def test_zero_head_blocks_gradients_so_tests_randomize_it() -> None:
    """Guards the gradient and parity tests: with the zero-initialised head, logits and all
    gradients before the head are zero, so those tests re-initialise it."""
    model = VisionTransformer(tiny_config())
    x = torch.randn(2, 3, 16, 16)
    out = model(x)
    assert torch.count_nonzero(out) == 0
    out.square().sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad.abs().sum() == 0
    model.zero_grad()
    randomize_head(model)
    model(x).square().sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "variant",
    [
        {"stem": "conv"},
        {"stem": "conv", "stem_depths": (2, 1)},
        {"distilled": True},
        {"no_embed_class": True, "layer_scale": 0.1},
        {"pool": "gap", "fc_norm": True},
    ],
)
def test_checkpoint_variants_run_train_and_change_resolution(variant: dict) -> None:
    """Conv stem, DeiT distillation token, positions without the class row + layer scale, and
    fc_norm: outputs at two resolutions and a gradient for every parameter."""
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_28", **variant)
    randomize_head(model)
    if model.head_dist is not None:
        torch.nn.init.normal_(model.head_dist.weight, std=0.02)
    logits = model(torch.randn(3, 1, 28, 28))
    assert logits.shape == (3, 10) and torch.isfinite(logits).all()
    logits.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    model.set_image_size(36)
    assert model(torch.randn(2, 1, 36, 36)).shape == (2, 10)
    assert model.num_prefix_tokens == 1 + int(variant.get("distilled", False))


def test_conv_stem_has_the_patch_grid_and_rejects_odd_patches() -> None:
    model = vitlab.create_model("vit_nano_patch4_28", stem="conv", stem_width=16)
    convs = [m for m in model.patch_embed.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 32]  # log2(4) stride-2 layers, doubling
    assert model.forward_features(torch.randn(1, 1, 28, 28)).shape == (1, 1 + 49, 64)
    with pytest.raises(vitlab.ConfigError, match="power-of-two patch_size"):
        vitlab.create_model("vit_nano_patch4_28", stem="conv", patch_size=7)


def test_conv_stem_depths_add_stride_1_convs_per_stage() -> None:
    """stem_depths (2, 2): each stage's stride-2 conv is followed by a 3x3 stride-1 one at the
    same width and resolution; the grid stays that of 4x4 patches."""
    model = vitlab.create_model(
        "vit_nano_patch4_28", stem="conv", stem_width=16, stem_depths=(2, 2)
    )
    convs = [m for m in model.patch_embed.stem if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride[0]) for c in convs] == [
        (1, 16, 2), (16, 16, 1), (16, 32, 2), (32, 32, 1)
    ]  # fmt: skip
    # by hand: 3x3 kernels 9 * (1*16 + 16*16 + 16*32 + 32*32), BatchNorm 2 * (16+16+32+32),
    # the 1x1 projection 32*64 + 64
    stem_params = sum(p.numel() for p in model.patch_embed.parameters())
    assert stem_params == 9 * (16 + 256 + 512 + 1024) + 2 * 96 + 32 * 64 + 64 == 18_576
    x = torch.randn(2, 1, 28, 28)
    assert model.forward_features(x).shape == (2, 1 + 49, 64)
    shapes = []
    for layer in model.patch_embed.stem:
        x = layer(x)
        shapes.append(tuple(x.shape[2:]))
    assert shapes[::3] == [(14, 14), (14, 14), (7, 7), (7, 7)]
    # () is the one-conv-a-stage stem of earlier checkpoints: the same names and shapes as (1, 1)
    old, ones = (
        {k: v.shape for k, v in vitlab.create_model("vit_nano_patch4_28", stem="conv",
                                                    stem_depths=d).state_dict().items()}
        for d in ((), (1, 1))
    )  # fmt: skip
    assert old == ones
    assert [k for k in old if k.startswith("patch_embed.stem.") and k.endswith("weight")] == [
        "patch_embed.stem.0.weight", "patch_embed.stem.1.weight",
        "patch_embed.stem.3.weight", "patch_embed.stem.4.weight",
    ]  # fmt: skip
    with pytest.raises(vitlab.ConfigError, match=r"2 stride-2 stages: stem_depths must give 2"):
        vitlab.create_model("vit_nano_patch4_28", stem="conv", stem_depths=(2, 2, 2))
    with pytest.raises(vitlab.ConfigError, match=r"each >= 1.*got \(2, 0\)"):
        vitlab.create_model("vit_nano_patch4_28", stem="conv", stem_depths=(2, 0))


@pytest.mark.parametrize("depths", [(), (2, 2), (1, 3)])
def test_forward_macs_of_a_conv_stem_count_its_every_conv(depths: tuple[int, ...]) -> None:
    """The conv stem's MACs (vitlab.analysis.cost) against FlopCounterMode on a real forward, and
    by hand for (2, 2) at 28 px: 14x14x9 (1x32 + 32x32), 7x7x9 (32x64 + 64x64), 49 x 64 x 64."""
    cfg = vitlab.get_config("vit_nano_patch4_28", stem="conv", stem_depths=depths, depth=1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        build_model(cfg).eval()(torch.randn(1, 1, 28, 28))
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.convolution"] == 2 * macs_by_part(cfg)["patch_embed"]
    if depths == (2, 2):
        by_hand = 196 * 9 * (32 + 32 * 32) + 49 * 9 * (32 * 64 + 64 * 64) + 49 * 64 * 64
        assert macs_by_part(cfg)["patch_embed"] == by_hand == 4_772_992


def test_distilled_model_averages_its_two_heads() -> None:
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_28", distilled=True).eval()
    randomize_head(model)
    torch.nn.init.normal_(model.head_dist.weight, std=0.02)
    x = torch.randn(2, 1, 28, 28)
    tokens = model.forward_features(x)
    expected = (model.head(tokens[:, 0]) + model.head_dist(tokens[:, 1])) / 2
    assert torch.allclose(model(x), expected)
    assert torch.allclose(model.forward_head(tokens, pre_logits=True), tokens[:, :2].mean(1))


@pytest.mark.parametrize("in_chans", [1, 3])
def test_patch_embedding_as_a_matrix_product_is_the_convolution(in_chans: int, monkeypatch) -> None:
    """One input channel on the CPU in float32, where vitlab's kernels run: the patches' pixels
    times the flattened kernel (patch_embed.PatchEmbed.project), not the conv; outputs and the
    kernel's gradients are the conv's in float64. Three channels, or a hook on the conv: the
    conv itself."""
    torch.manual_seed(0)
    embed = VisionTransformer(tiny_config(in_chans=in_chans, img_size=12, patch_size=4)).patch_embed
    x = torch.randn(3, in_chans, 12, 12)
    grad = torch.randn(3, 9, embed.proj.out_channels)
    conv = torch.nn.Conv2d(in_chans, embed.proj.out_channels, 4, stride=4).double()
    conv.load_state_dict(embed.proj.state_dict())
    expected = conv(x.double()).flatten(2).transpose(1, 2)
    expected.backward(grad.double())
    calls = count_calls(monkeypatch, torch.nn.Conv2d, "forward")
    out = embed(x)
    assert out.shape == (3, 9, embed.proj.out_channels)
    product = in_chans == 1 and cpu_kernels.library() is not None  # where the kernels run
    assert len(calls) == (not product)  # the conv runs for three channels (or no kernels)
    out.backward(grad)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for mine, ref in ((embed.proj.weight, conv.weight), (embed.proj.bias, conv.bias)):
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
    seen = []
    handle = embed.proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    torch.testing.assert_close(embed(x), out, atol=1e-5, rtol=1e-5)
    handle.remove()
    assert seen == [(3, embed.proj.out_channels, 3, 3)]  # a watched conv runs as itself


def test_intermediate_indices_take_numpy_and_tensor_ints_and_refuse_the_rest() -> None:
    """numpy / 0-d tensor indices (what a loop over np.arange gives) once failed with "not
    iterable", a bool silently meant the last block, a str compared ints with strs."""
    import numpy as np

    from vitlab.models.indices import chosen_indices

    assert chosen_indices(np.int64(2), 4, "block") == [2, 3] == chosen_indices(2, 4, "block")
    assert chosen_indices(torch.tensor(1), 4, "block") == [3] == chosen_indices(np.array(1), 4, "b")
    assert chosen_indices([np.int32(0), torch.tensor(-1)], 4, "block") == [0, 3]
    assert chosen_indices(range(2), 4, "block") == [0, 1] == chosen_indices(torch.arange(2), 4, "b")
    for bad in (2.0, True, "a", [1.0], torch.tensor(1.0), [True], np.array(1.5)):
        with pytest.raises(ValueError, match="block indices are an int .* or a sequence of ints"):
            chosen_indices(bad, 4, "block")
    with pytest.raises(ValueError, match="block index 4 out of range for a 4-block model"):
        chosen_indices([np.int64(4)], 4, "block")


def test_timm_keywords_build_timms_model() -> None:
    """timm's create_model keywords were unknown keys: code written for timm
    (`pretrained=False, drop_path_rate=0.1, global_pool="avg"`) failed. They now build the model
    timm builds: its weights load strictly and the outputs match timm's (global_pool='avg' is
    pool='gap' with timm's fc_norm rule). pretrained=True points at load_pretrained."""
    timm = pytest.importorskip("timm")
    kw = {"num_classes": 5, "depth": 2, "drop_path_rate": 0.2, "attn_drop_rate": 0.1}
    for pool in ("avg", "token"):
        theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, global_pool=pool, **kw)
        mine = vitlab.create_model("vit_tiny_patch16_224", pretrained=False, global_pool=pool, **kw)
        assert (mine.config.pool, mine.config.fc_norm) == (("gap", True) if pool == "avg" else (
            "token", False))  # fmt: skip
        assert (mine.config.drop_path, mine.config.attn_dropout) == (0.2, 0.1)
        mine.load_state_dict(theirs.state_dict())
        x = torch.randn(2, 3, 224, 224)
        with torch.no_grad():
            torch.testing.assert_close(mine.eval()(x), theirs.eval()(x), rtol=1e-5, atol=1e-5)
    # a config's fc_norm is its architecture: global_pool changes the pool only (a review: a
    # gap config without fc_norm got one, and its checkpoint's weights no longer fitted)
    gap = vitlab.get_config("vit_tiny_patch16_224", pool="gap", depth=2)
    assert vitlab.create_model(gap, global_pool="avg").config == gap
    assert vitlab.create_model(gap.replace(fc_norm=True), global_pool="token").config.fc_norm
    assert vitlab.create_model("Swin-T", drop_path_rate=0.3).config.drop_path == 0.3
    with pytest.raises(vitlab.ConfigError, match="pretrained=True.*vitlab.load_pretrained"):
        vitlab.create_model("vit_tiny_patch16_224", pretrained=True)
    with pytest.raises(vitlab.ConfigError, match="drop_path_rate .timm's name. and drop_path"):
        vitlab.create_model("Ti/16", drop_path_rate=0.1, drop_path=0.2)
    with pytest.raises(vitlab.ConfigError, match="unknown key 'drop_path_rate' for CNNConfig"):
        vitlab.create_model("resnet18", drop_path_rate=0.1)  # no such field: the name given


@pytest.mark.parametrize("size", ["tiny", "small", "base"])
def test_deit_names_build_timms_deit_models(size) -> None:
    """timm's DeiT names were unknown (`create_model("deit_small_patch16_224")`: no such model),
    though their weights loaded: each is registered with timm's shape and parameter count, and a
    distilled one takes timm's weights strictly and gives its outputs (the average of its two
    heads in eval)."""
    timm = pytest.importorskip("timm")
    sizes = [224, 384] if size == "base" else [224]
    for res, kind in [(r, k) for r in sizes for k in ("", "_distilled")]:
        name = f"deit_{size}{kind}_patch16_{res}"
        with torch.device("meta"):
            mine, theirs = vitlab.create_model(name), timm.create_model(name, pretrained=False)
        count = sum(p.numel() for p in mine.parameters())
        assert count == sum(p.numel() for p in theirs.parameters()), name
        assert mine.config.distilled == bool(kind) and mine.config.img_size == res
    if size != "tiny":  # one forward comparison, the smallest
        return
    theirs = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, depth=2).eval()
    mine = vitlab.create_model("deit_tiny_distilled_patch16_224", depth=2).eval()
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), theirs(x), rtol=1e-5, atol=1e-5)
