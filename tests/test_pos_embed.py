"""Position embeddings: the five kinds, resampling to new grids, resolution change, and that every
kind trains with both pooling modes on real data (scikit-learn's digits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import vitlab
from tests.helpers import tiny_config
from vitlab.models.pos_embed import resample_pos_embed, sincos_2d
from vitlab.models.vit import VisionTransformer

KINDS = ["learned", "learned_2d", "relative", "sincos2d", "none"]


def test_resample_to_the_same_grid_is_the_identity() -> None:
    pe = torch.randn(1, 1 + 6 * 4, 16)
    out = resample_pos_embed(pe, (6, 4), (6, 4), num_prefix_tokens=1)
    assert torch.equal(out, pe)


def test_resample_keeps_prefix_tokens_and_handles_rectangular_grids() -> None:
    pe = torch.randn(1, 2 + 3 * 5, 8, dtype=torch.float64)
    out = resample_pos_embed(pe, (6, 4), (3, 5), num_prefix_tokens=2)
    assert out.shape == (1, 2 + 24, 8) and out.dtype == torch.float64
    assert torch.equal(out[:, :2], pe[:, :2])
    # a constant table stays constant (interpolation preserves constants)
    const = torch.full((1, 1 + 9, 4), 0.5)
    torch.testing.assert_close(
        resample_pos_embed(const, (5, 7), num_prefix_tokens=1)[:, 1:], torch.full((1, 35, 4), 0.5)
    )


@pytest.mark.parametrize("old,new", [((14, 14), (24, 24)), ((14, 14), (10, 12)), ((4, 6), (8, 3))])
def test_resample_matches_timm(old: tuple[int, int], new: tuple[int, int]) -> None:
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    pe = torch.randn(1, 1 + old[0] * old[1], 32)
    ours = resample_pos_embed(pe, new, old, num_prefix_tokens=1)
    ref = timm_layers.resample_abs_pos_embed(pe, list(new), list(old), num_prefix_tokens=1)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_resample_errors() -> None:
    with pytest.raises(ValueError, match="old_grid 3x3 has 9"):
        resample_pos_embed(torch.randn(1, 11, 4), (4, 4), (3, 3), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="cannot infer the grid"):
        resample_pos_embed(torch.randn(1, 13, 4), (4, 4), num_prefix_tokens=1)
    # one number is a square grid (it was "'int' object is not subscriptable"); others said
    timm_layers = pytest.importorskip("timm.layers")
    pe = torch.randn(1, 1 + 14 * 14, 8)
    ref = timm_layers.resample_abs_pos_embed(pe, [10, 10], [14, 14], num_prefix_tokens=1)
    torch.testing.assert_close(resample_pos_embed(pe, 10, 14, 1), ref, atol=1e-6, rtol=0)
    assert resample_pos_embed(pe, np.int64(10)).shape == ref.shape  # numpy's integers too
    for grid in [(0, 3), (1, 2, 3), 2.5, "ab", True, (2.0, 2.0), (float("inf"), 2)]:
        with pytest.raises(ValueError, match=r"new_grid is \(rows, columns\) of patches or one"):
            resample_pos_embed(pe, grid)


@pytest.mark.parametrize("kind", KINDS)
def test_set_image_size_runs_and_keeps_other_weights(kind: str) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(pos_embed=kind))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_image_size((24, 32))
    assert model.config.img_hw == (24, 32) and model.config.grid == (6, 8)
    out = model(torch.randn(2, 3, 24, 32))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    after = model.state_dict()
    positional = ("pos_embed.", "rel_pos.")
    for k, v in before.items():
        if not any(p in k for p in positional):
            assert torch.equal(after[k], v), f"{k} changed"
    with pytest.raises(ValueError, match="expected images of size 24x32, got 16x16"):
        model(torch.randn(1, 3, 16, 16))


def test_set_image_size_224_to_384_resamples_the_learned_table() -> None:
    model = vitlab.create_model("Ti/16", depth=1)
    old = model.pos_embed.weight.detach().clone()
    model.set_image_size(384)
    new = model.pos_embed.weight
    assert new.shape == (1, 1 + 24 * 24, 192)
    assert torch.equal(new[:, :1], old[:, :1])
    torch.testing.assert_close(new, resample_pos_embed(old, (24, 24), (14, 14), 1))
    assert model(torch.randn(1, 3, 384, 384)).shape == (1, 1000)
    model.set_image_size(224)  # and back: shape restored
    assert model.pos_embed.weight.shape == old.shape


def test_sincos_table_is_fixed_and_near_patches_are_more_similar() -> None:
    model = VisionTransformer(tiny_config(pos_embed="sincos2d", img_size=32, embed_dim=64))
    assert not list(model.pos_embed.parameters())
    assert "pos_embed.pe" not in model.state_dict()  # recomputed, never stored
    vecs = torch.nn.functional.normalize(model.pos_embed.patch_vectors(), dim=-1)  # (64, D)
    sim = vecs @ vecs.T
    centre, near, far = 3 * 8 + 3, 3 * 8 + 4, 7 * 8 + 7
    assert sim[centre, near] > sim[centre, far]
    torch.testing.assert_close(model.pos_embed.table()[0, 1:], sincos_2d((8, 8), 64))
    assert torch.count_nonzero(model.pos_embed.table()[0, 0]) == 0
    # big_vision's posemb_sincos_2d, written out in numpy on a 3x5 grid (rows y, columns x)
    h, w, dim = 3, 5, 16
    y, x = np.mgrid[:h, :w]
    omega = 1.0 / 10000.0 ** (np.arange(dim // 4) / (dim // 4 - 1))
    ys, xs = y.flatten()[:, None] * omega[None], x.flatten()[:, None] * omega[None]
    reference = np.concatenate([np.sin(xs), np.cos(xs), np.sin(ys), np.cos(ys)], axis=1)
    torch.testing.assert_close(sincos_2d((h, w), dim), torch.tensor(reference, dtype=torch.float32))


def test_learned_2d_concatenates_x_and_y_tables() -> None:
    model = VisionTransformer(tiny_config(pos_embed="learned_2d", img_size=(8, 12)))
    pe = model.pos_embed
    vecs = pe.patch_vectors()  # (2 * 3, 32)
    assert pe.x_embed.shape == (3, 16) and pe.y_embed.shape == (2, 16)
    for r in range(2):
        for c in range(3):
            torch.testing.assert_close(vecs[r * 3 + c], torch.cat([pe.x_embed[c], pe.y_embed[r]]))


def test_none_and_relative_add_nothing_at_the_input() -> None:
    for kind in ("none", "relative"):
        model = VisionTransformer(tiny_config(pos_embed=kind))
        assert model.pos_embed.table() is None and model.pos_embed.patch_vectors() is None
        assert not list(model.pos_embed.parameters())


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0  # (1797, 1, 8, 8)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    return ((x - 0.5) / 0.5)[perm], torch.tensor(data.target)[perm]


@pytest.mark.parametrize("pool", ["token", "gap"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_position_embedding_trains_with_both_poolings(digits, kind: str, pool: str) -> None:
    x, y = digits
    torch.manual_seed(0)
    cfg = tiny_config(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, pos_embed=kind, pool=pool
    )
    model = VisionTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loss_fn = torch.nn.CrossEntropyLoss()
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    gen = torch.Generator().manual_seed(0)
    for _ in range(15):
        for idx in torch.randperm(1500, generator=gen).split(100):
            loss = loss_fn(model(train_x[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(test_x).argmax(-1) == test_y).float().mean().item()
    # with positions every kind reaches ~0.87-0.95; without, a bag of patches stays near 0.72
    floor = 0.6 if kind == "none" else 0.8
    assert acc > floor, f"{kind}/{pool}: held-out accuracy {acc:.2f} after 15 epochs"
