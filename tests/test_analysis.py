"""The paper's analyses on constructed attention with known answers (issue 5's functions)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.helpers import tiny_config
from vitlab.analysis.attention import (
    attention_rollout,
    embedding_filters,
    mean_attention_distance,
    pos_embed_similarity,
)
from vitlab.models.vit import VisionTransformer


def test_attending_to_itself_is_distance_zero() -> None:
    attn = torch.eye(1 + 12).expand(2, 3, 13, 13)
    assert torch.equal(mean_attention_distance(attn, (3, 4), 16, 1), torch.zeros(3))


def test_uniform_attention_gives_the_analytic_mean_distance() -> None:
    grid, p = (3, 4), 10
    cells = list(itertools.product(range(grid[0]), range(grid[1])))
    expected = (
        sum(((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5 * p for a in cells for b in cells)
        / len(cells) ** 2
    )
    attn = torch.full((1, 2, 13, 13), 1 / 13)  # the class column's weight is dropped, rows renormed
    torch.testing.assert_close(
        mean_attention_distance(attn, grid, p, 1), torch.full((2,), expected, dtype=torch.float32)
    )


def test_attending_to_the_right_neighbour_is_one_patch_side() -> None:
    grid, n = (4, 4), 16
    attn = torch.zeros(1, 1, n, n)
    for q in range(n):
        r, c = divmod(q, 4)
        neighbour = c + 1 if c < 3 else c - 1  # the last column looks left: also one side away
        attn[0, 0, q, r * 4 + neighbour] = 1.0
    torch.testing.assert_close(mean_attention_distance(attn, grid, 16, 0), torch.tensor([16.0]))


def test_a_head_on_the_class_token_is_measured_on_the_little_left_on_patches() -> None:
    """Queries putting all but 1e-16 of their weight on the class token (float32 holds such
    weights to seven digits) were renormalised by a sum clamped at 1e-12 and so counted near 0
    pixels: a timm ViT-Ti head read 26.4 where its attention gives 30.4. Hand computation: one
    query's remaining weight all on its right neighbour (16 px), the other's split 1:3 between
    itself and the patch below (12 px); a query with no weight at all on patches is left out,
    and a head with no query left is NaN."""
    attn = torch.zeros(1, 2, 5, 5)  # grid 2x2, one class token; head 0 then head 1
    attn[0, 0, 1, 0], attn[0, 0, 1, 2] = 1.0, 3e-16  # query 0 -> its right neighbour
    attn[0, 0, 2, 0], attn[0, 0, 2, 2], attn[0, 0, 2, 4] = 1.0, 1e-16, 3e-16  # 1:3, 16 px below
    attn[0, 0, 3:, 0] = 1.0  # queries 2 and 3: nothing on patches
    attn[0, 1, :, 0] = 1.0  # head 1: no query has any weight on patches
    got = mean_attention_distance(attn, (2, 2), 16, 1)
    assert got[0].item() == pytest.approx((16 + 0.75 * 16) / 2, rel=1e-6) and got[1].isnan()


def test_rollout_of_identity_attention_is_the_identity() -> None:
    eye = torch.eye(5).expand(2, 4, 5, 5)
    out = attention_rollout([eye, eye, eye], num_prefix_tokens=1)
    assert torch.equal(out, torch.zeros(2, 4))  # the class token only ever attends to itself
    out = attention_rollout([eye, eye], num_prefix_tokens=0)
    torch.testing.assert_close(out, torch.full((2, 5), 1 / 5))


def test_rollout_by_hand_on_two_layers_that_do_not_commute() -> None:
    """Abnar & Zuidema's rollout, written out: each layer's heads averaged, the identity added,
    rows re-normalised, the later layer's matrix on the left (identity attention cannot tell the
    order); the class token's row over the patches."""
    torch.manual_seed(0)
    first, second = (torch.rand(1, 2, 4, 4).softmax(-1) for _ in range(2))

    def step(a):
        m = a[0].mean(0) + torch.eye(4)
        return m / m.sum(-1, keepdim=True)

    want = step(second) @ step(first)
    got = attention_rollout([first, second], num_prefix_tokens=1)
    torch.testing.assert_close(got, want[0, 1:][None].float())
    assert not torch.allclose(got, (step(first) @ step(second))[0, 1:][None].float())


def test_sincos_similarity_is_higher_near_than_far() -> None:
    model = VisionTransformer(tiny_config(pos_embed="sincos2d", img_size=32, embed_dim=64))
    sim = pos_embed_similarity(model)
    assert sim.shape == (64, 8, 8)
    centre = 3 * 8 + 3
    assert sim[centre, 3, 4] > sim[centre, 7, 7] and sim[centre, 3, 3] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no per-patch vectors"):
        pos_embed_similarity(VisionTransformer(tiny_config(pos_embed="relative")))


def test_embedding_filters_are_orthonormal_principal_components() -> None:
    torch.manual_seed(0)  # distinct eigenvalues: each component is defined up to its sign
    model = VisionTransformer(tiny_config(in_chans=3))
    f = embedding_filters(model, k=5)
    assert f.shape == (5, 3, 4, 4)
    flat = f.reshape(5, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(5), atol=1e-5, rtol=0)
    # the top five principal components of the D filters, as scikit-learn's PCA finds them (each
    # up to its sign)
    from sklearn.decomposition import PCA

    w = model.patch_embed.proj.weight.detach().reshape(model.config.embed_dim, -1).double()
    pca = PCA(n_components=5).fit(w.numpy())
    dots = (flat.double() * torch.from_numpy(pca.components_)).sum(1).abs()
    torch.testing.assert_close(dots, torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0)
    assert len(embedding_filters(model, k=np.int64(100))) == model.config.embed_dim  # D < C*P*P
    for k in (0, -1, 2.5, True):  # -1 gave 47 filters (slicing), 0 none
        with pytest.raises(ValueError, match="k must be a positive number"):
            embedding_filters(model, k=k)


def test_statistics_hold_one_layer_of_attention_at_a_time() -> None:
    """When block i starts, no earlier block's attention maps are alive any more."""
    import weakref

    from vitlab.analysis.report import attention_statistics

    model = VisionTransformer(tiny_config(depth=4)).eval()
    alive: list[weakref.ref] = []
    seen_alive = []

    def keep_ref(module, args, output):
        alive.append(weakref.ref(output[1]))

    def check(module, args):
        seen_alive.append(sum(r() is not None for r in alive))

    for blk in model.blocks:
        blk.register_forward_pre_hook(check)
        blk.register_forward_hook(keep_ref)
    distances, maps = attention_statistics(model, torch.randn(3, 3, 16, 16))
    assert seen_alive == [0, 0, 0, 0]
    assert distances.shape == (4, 4) and maps.shape == (3, 16)


def test_head_fusion_is_checked_and_only_the_chosen_one_computed() -> None:
    """An unknown fusion is a ValueError naming the choices (once a bare KeyError); each layer
    reduces the heads once, by the fusion asked for (once all three, then one picked)."""
    from torch.overrides import TorchFunctionMode

    from vitlab.analysis.attention import rollout_step

    torch.manual_seed(0)
    attn = torch.rand(2, 3, 5, 5).softmax(-1)
    with pytest.raises(ValueError, match="head_fusion must be one of mean, max, min, got 'median'"):
        attention_rollout([attn], num_prefix_tokens=1, head_fusion="median")
    with pytest.raises(ValueError, match="got 'median'"):
        rollout_step(None, attn, "median")

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    reductions = {"mean": "mean", "max": "amax", "min": "amin"}
    for fusion, reduction in reductions.items():
        with Calls() as calls:
            got = rollout_step(None, attn, fusion)
        assert [n for n in calls.names if n in reductions.values()] == [reduction], fusion
        fused = getattr(attn.double(), reduction)(dim=1) + torch.eye(5, dtype=torch.float64)
        torch.testing.assert_close(got, fused / fused.sum(-1, keepdim=True))


def test_statistics_run_in_eval_mode_and_leave_the_model_as_it_was() -> None:
    """With dropout and drop path a model in training mode once gave other numbers every call:
    the statistics are those of eval mode, and every module's own mode comes back after, also
    when the forward fails."""
    from vitlab.analysis.report import attention_statistics

    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(depth=3, dropout=0.3, attn_dropout=0.3, drop_path=0.3))
    model.blocks[0].eval()  # a part the caller keeps in eval mode
    x = torch.randn(3, 3, 16, 16)
    first, second = attention_statistics(model, x), attention_statistics(model, x)
    modes = {name: m.training for name, m in model.named_modules()}
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    reference = attention_statistics(model.eval(), x)
    model.train()
    model.blocks[0].eval()
    for got in (first, second):
        torch.testing.assert_close(got, reference)
    with pytest.raises(ValueError, match="expected images with 3 channels"):
        attention_statistics(model, torch.randn(1, 5, 16, 16))
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_a_model_without_blocks_is_refused_before_anything_is_written(tmp_path) -> None:
    from vitlab.analysis.page import Images
    from vitlab.analysis.report import analyze
    from vitlab.preprocessing import Preprocessing

    model = VisionTransformer(tiny_config(depth=0)).eval()
    pre = Preprocessing((16, 16), 3, (0.5,) * 3, (0.5,) * 3)
    display = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8)
    images = Images(["a"], display, pre.batch(display))
    with pytest.raises(ValueError, match="a model without blocks has no attention to analyse"):
        analyze(model, pre, images, tmp_path / "out", "t")
    assert not (tmp_path / "out").exists()


def test_distances_do_not_depend_on_how_the_images_are_batched() -> None:
    """A head with no patch weight in one batch made that head NaN for the whole analysis
    (each batch's mean, NaN, was added up), and the other batches' queries were weighted by
    batch, not counted: now queries are counted over all batches. Image 0's head 1 puts all
    its weight on the class token; image 1's on its right neighbour (4 px at patch 4): head 1
    is 4 px whether the two images come together or one at a time. The inside experiment's
    trends leave such a head out, and refuse a layer none of whose heads has a distance."""
    from vitlab.analysis.report import attention_statistics
    from vitlab.experiments.inside import trends

    attn = torch.zeros(2, 2, 5, 5)  # grid 2x2, one class token
    attn[:, 0, 1:, 1:] = torch.eye(4)  # head 0: each patch on itself, 0 px
    attn[0, 1, :, 0] = 1.0
    attn[1, 1, 1:, 1:] = torch.tensor([1, 0, 3, 2]).view(4, 1).eq(torch.arange(4)).float()
    torch.testing.assert_close(
        mean_attention_distance(attn, (2, 2), 4, 1), torch.tensor([0.0, 4.0])
    )
    model = VisionTransformer(tiny_config(depth=1, num_heads=2, img_size=8)).eval()
    model.iter_intermediates = lambda x, return_attention: iter(
        [(0, None, attn[x[:, 0, 0, 0].long()])]
    )
    images = torch.zeros(2, 3, 8, 8)
    images[1] = 1.0  # image i's attention is attn[i]
    for batch_size in (1, 2):
        distances, _ = attention_statistics(model, images, batch_size=batch_size)
        torch.testing.assert_close(distances, torch.tensor([[0.0, 4.0]]))
    nan = float("nan")
    growth, mixing = trends(torch.tensor([[2.0, 6.0, nan], [5.0, 7.0, 9.0]]))
    assert (growth, mixing) == (3.0, 0.0)  # layer means 4 and 7; spreads 4 and 4
    with pytest.raises(ValueError, match="layer 2: no head attended to any patch"):
        trends(torch.tensor([[2.0, 6.0], [nan, nan]]))
