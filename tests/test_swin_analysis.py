"""`vitlab analyze` for Swin: window geometry and mean attention distance against hand-computed and
brute-force values, the probabilities against the model's own forward, and the page end to end."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vitlab.analysis.report import Images, analyze
from vitlab.analysis.windows import (
    mean_window_attention_distance,
    swin_attention_statistics,
    swin_blocks,
    window_token_centres,
)
from vitlab.cli.main import main
from vitlab.data.transforms import Preprocessing
from vitlab.models.registry import get_config
from vitlab.models.swin import SwinConfig, SwinTransformer
from vitlab.models.swin_layers import shift_window_mask, window_partition


def test_uniform_attention_over_a_plain_window_by_hand() -> None:
    # 4x4 map of 8-pixel tokens, 2x2 windows: from each query the keys lie 0, 8, 8 and 8 sqrt 2 away
    centres, real = window_token_centres((4, 4), (2, 2), (0, 0), 8)
    uniform = torch.full((3, 4, 5, 4, 4), 0.25)  # (B, windows, heads, N, N)
    expected = (0 + 8 + 8 + 8 * math.sqrt(2)) / 4
    torch.testing.assert_close(
        mean_window_attention_distance(uniform, centres, real), torch.full((5,), expected)
    )


def test_a_shifted_window_is_measured_in_the_image_with_the_roll_undone() -> None:
    """4x4 map, 2x2 windows, shift 1: the rolled map's last window holds the image's corner tokens
    (3, 3), (3, 0), (0, 3), (0, 0) and the two windows beside it wrap around one edge."""
    centres, real = window_token_centres((4, 4), (2, 2), (1, 1), 1)
    assert real.all()
    torch.testing.assert_close(
        centres[3],
        torch.tensor([[3.5, 3.5], [3.5, 0.5], [0.5, 3.5], [0.5, 0.5]], dtype=torch.float64),
    )
    # uniform over whole windows: a compact 2x2 block (2 + sqrt 2), two windows across one edge
    # (4 + sqrt 10 each) and the corners (6 + 3 sqrt 2), over 16 queries
    uniform = torch.full((1, 4, 1, 4, 4), 0.25)
    expected = (2 + math.sqrt(2) + 2 * (4 + math.sqrt(10)) + 6 + 3 * math.sqrt(2)) / 16
    assert mean_window_attention_distance(uniform, centres, real).item() == pytest.approx(expected)
    # what the model's mask allows: uniform within each region; the edge windows split into
    # adjacent pairs (0.5 each), the corner window into single tokens (0)
    masked = shift_window_mask((4, 4), (2, 2), (1, 1)).softmax(dim=-1)[None, :, None]
    expected = (2 + math.sqrt(2) + 4 * 0.5 + 4 * 0.5 + 0) / 16
    assert mean_window_attention_distance(masked, centres, real).item() == pytest.approx(expected)


def test_padding_keys_are_dropped_and_padding_queries_left_out() -> None:
    # a 3x3 map in 2x2 windows is padded to 4x4: windows of 4, 2, 2 and 1 real tokens
    centres, real = window_token_centres((3, 3), (2, 2), (0, 0), 1)
    assert real.sum(dim=1).tolist() == [4, 2, 2, 1]
    uniform = torch.full((1, 4, 1, 4, 4), 0.25)
    expected = (2 + math.sqrt(2) + 2 * 0.5 + 2 * 0.5 + 0) / 9
    assert mean_window_attention_distance(uniform, centres, real).item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="does not fit 4 windows"):
        mean_window_attention_distance(torch.ones(1, 3, 1, 4, 4), centres, real)


def test_where_windows_do_not_tile_the_map_a_shifted_window_wraps_unmasked() -> None:
    """timm labels the shift regions on the padded map: a 5-row map in 4-row windows shifted by 2
    puts image rows 2, 3, 4 and 0 in one window, unmasked, and they are measured where they are."""
    centres, _ = window_token_centres((5, 5), (4, 4), (2, 2), 1)
    rows = centres[0, :, 0].reshape(4, 4)[:, 0] - 0.5
    assert rows.tolist() == [2.0, 3.0, 4.0, 0.0]
    allowed = shift_window_mask((5, 5), (4, 4), (2, 2))[0] == 0
    apart = torch.cdist(centres[0], centres[0])[allowed]
    # beyond the window's diagonal (3 sqrt 2): the padded shifted window holds rows 2, 3, 4 and 0
    assert apart.max().item() == pytest.approx(math.hypot(4, 4))


def tiny_swin(seed: int = 0, img_size: int = 36) -> SwinTransformer:
    """swin_nano_patch2_window4_32; at 36: maps 18, 9 (odd: padded to merge), 5 in 4x4 windows,
    all padded, all shifted in their second block; at 32: maps 16, 8, 4, tiled by the windows
    (the last one whole, unshifted)."""
    torch.manual_seed(seed)
    return SwinTransformer(get_config("swin_nano_patch2_window4_32", img_size=img_size))


def test_attention_probs_are_the_weights_the_model_applies() -> None:
    model = tiny_swin().eval()
    block = model.layers[0].blocks[1]  # shifted: mask included
    seen = {}
    block.attn.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    model(torch.randn(2, 3, 36, 36))
    windows, mask = seen["args"]
    probs = block.attn.attention_probs(windows, mask)  # (B, nW, h, N, N)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    b, nw, n, c = windows.shape
    v = block.attn.qkv(windows).reshape(b, nw, n, 3, 2, c // 2)[:, :, :, 2].transpose(2, 3)
    out = (probs @ v).transpose(2, 3).reshape(b, nw, n, c)
    torch.testing.assert_close(block.attn.proj(out), seen["out"], atol=1e-5, rtol=1e-5)


def brute_force_uniform(cfg: SwinConfig, stage: int, shifted: bool) -> float:
    """Mean distance under uniform attention over what each query may see, enumerated from image
    positions forward: tokens see each other when the rolled map puts them in one window and one
    region (timm's labels on the padded map: [0, L - M), [L - M, L - s), [L - s, L))."""
    spec = cfg.stage(stage)
    (h, w), (mh, mw), (hp, wp) = spec.grid, spec.window, spec.padded
    sh, sw = spec.shift if shifted else (0, 0)
    stride = cfg.patch_size * 2**stage

    def label(r: int, length: int, m: int, s: int) -> int:
        return 0 if not s or r < length - m else 1 if r < length - s else 2

    def seat(y: int, x: int) -> tuple[int, ...]:
        r, c = (y - sh) % h, (x - sw) % w
        return r // mh, c // mw, label(r, hp, mh, sh), label(c, wp, mw, sw)

    tokens = list(itertools.product(range(h), range(w)))
    total = 0.0
    for q in tokens:
        keys = [k for k in tokens if seat(*k) == seat(*q)]
        total += sum(math.dist(q, k) * stride for k in keys) / len(keys)
    return total / len(tokens)


def test_statistics_of_a_real_forward_equal_a_brute_force_count() -> None:
    """With q = k = 0 and no relative bias the model's attention is uniform over each query's
    window (and region, in shifted blocks): every head's distance is the enumerated one."""
    model = tiny_swin().eval()
    with torch.no_grad():
        for _, _, block in swin_blocks(model):
            block.attn.qkv.weight.zero_()
            block.attn.qkv.bias.zero_()
            block.attn.relative_position_bias_table.zero_()
    distances, maps = swin_attention_statistics(
        model, torch.randn(3, 3, 36, 36), map_blocks=[(0, 1), (2, 0)], batch_size=2
    )
    for (stage, j, _), dist in zip(swin_blocks(model), distances):
        expected = brute_force_uniform(model.config, stage, shifted=j % 2 == 1)
        torch.testing.assert_close(dist, torch.full_like(dist, expected), rtol=1e-5, atol=1e-5)
    assert maps[(0, 1)].shape == (3, 18, 18) and maps[(2, 0)].shape == (3, 5, 5)
    # the 5x5 map padded to 8x8, four 4x4 windows: only the first one's centre slot (2, 2) is a
    # token; it spreads 1/16 over its window, the others are centred on padding (NaN)
    expected = torch.full((3, 5, 5), float("nan"))
    expected[:, :4, :4] = 1 / 16
    torch.testing.assert_close(maps[(2, 0)], expected, equal_nan=True)


def referenced(index: Path) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', index.read_text())


def sharpened_page(tmp_path: Path, img_size: int) -> tuple[Path, dict]:
    """analyze() on tiny_swin with sharper attention than at initialisation, 3 images."""
    model = tiny_swin(img_size=img_size).eval()
    with torch.no_grad():
        for _, _, block in swin_blocks(model):
            block.attn.qkv.weight.mul_(30)
    pre = Preprocessing((img_size, img_size), 3, (0.5,) * 3, (0.5,) * 3)
    display = torch.randint(0, 256, (3, 3, img_size, img_size), dtype=torch.uint8)
    images = Images(["a", "b", "c"], display, pre.batch(display))
    index = analyze(model, pre, images, tmp_path, "swin")
    return index, json.loads((tmp_path / "analysis.json").read_text())


def test_window_figures_lay_the_image_under_the_maps_pixel_for_pixel(tmp_path, monkeypatch):
    """The input was drawn at imshow's default extent (pixel centres, -0.5 to W - 0.5) under
    heat maps, window lines and queries placed on pixel edges (0 to W): half a pixel up and left,
    a strip of heat over no image along two sides. Every image of the figure spans 0 to W now."""
    import matplotlib.pyplot as plt

    shown, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (shown.append(fig), close(fig))[1])
    sharpened_page(tmp_path, 32)
    titles = {f: f._suptitle.get_text() for f in shown if f is not None and f._suptitle}
    windows = [f for f, title in titles.items() if "centre query" in title]
    assert len(windows) == 3
    extents = {tuple(im.get_extent()) for f in windows for ax in f.axes for im in ax.get_images()}
    assert extents == {(0, 32, 32, 0)}


def test_analyze_a_tiny_swin_writes_its_figures_and_notes(tmp_path) -> None:
    index, data = sharpened_page(tmp_path, 32)
    for name in [
        "mean_attention_distance.png",
        "embedding_filters.png",
        "window_attention_000.png",
        "window_attention_002.png",
        "analysis.json",
    ]:
        assert (tmp_path / name).is_file(), name
    assert not (tmp_path / "pos_embed_similarity.png").exists()
    assert not list(tmp_path.glob("rollout_*.png"))
    refs = referenced(index)
    assert all((tmp_path / r).is_file() for r in refs) and "window_attention_001.png" in refs
    page = index.read_text()
    assert "rollout does not apply" in page and "no absolute position embeddings" in page
    assert data["family"] == "swin" and data["num_images"] == 3
    assert [b["heads"] for b in data["blocks"]] == [2, 2, 4, 4, 8, 8]
    assert sorted(data["window_maps"]) == [
        "stage0_block0",
        "stage0_block1",
        "stage2_block0",
        "stage2_block1",
    ]
    spread = []
    for block, dist in zip(data["blocks"], data["mean_attention_distance"]):
        diagonal = math.hypot(block["window"][0] - 1, block["window"][1] - 1) * block["stride"]
        assert len(dist) == block["heads"]
        assert all(0 <= d <= diagonal for d in dist), (block, dist)
        spread.append(np.ptp(dist))
    assert max(spread) > 0.5  # heads differ once attention is not uniform


def test_windows_centred_on_padding_are_null_in_the_json(tmp_path) -> None:
    index, data = sharpened_page(tmp_path, 36)
    heat = np.array(data["window_maps"]["stage2_block0"]["a"], dtype=float)  # None -> nan
    assert heat.shape == (5, 5) and np.isnan(heat[4]).all() and not np.isnan(heat[:4, :4]).any()
    assert all((tmp_path / r).is_file() for r in referenced(index))


def test_the_analyze_command_passes_a_swin_through(tmp_path, monkeypatch, capsys) -> None:
    """The command on a model given through load_checkpoint (stubbed here for a 16x16 model that
    needs no training; tests/test_swin_train.py runs it on a real run's checkpoint): digits
    images at the model's size, the Swin page."""
    import vitlab.models.checkpoint as checkpoint

    cfg = SwinConfig(
        img_size=16, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depths=(2, 2),
        num_heads=(2, 4), window_size=4,
    )  # fmt: skip
    model = SwinTransformer(cfg).eval()
    meta = SimpleNamespace(
        preprocessing=Preprocessing((16, 16), 1, (0.5,), (0.5,)),
        classes=[str(i) for i in range(10)],
    )
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda source, device: (model, meta))
    out = tmp_path / "page"
    args = ["analyze", str(tmp_path / "swin"), "--num-images", "2", "--out", str(out)]
    assert main(args) == 0
    assert Path(capsys.readouterr().out.strip()) == out / "index.html"
    data = json.loads((out / "analysis.json").read_text())
    assert data["family"] == "swin" and len(data["mean_attention_distance"]) == 4
    assert (out / "window_attention_001.png").is_file()
    assert main([*args, "--head-fusion", "max"]) == 2  # once accepted and ignored
    assert "SwinTransformer has none" in capsys.readouterr().err


def test_window_partition_of_the_centres_matches_the_model_layout() -> None:
    """The slot order is the model's: window_partition of the rolled map of token indices."""
    h, w, m, s = 6, 6, 3, 1
    index = torch.arange(h * w).reshape(1, h, w, 1)
    rolled = torch.roll(index, shifts=(-s, -s), dims=(1, 2))
    slots = window_partition(rolled, (m, m))[0, :, :, 0]  # (nW, N) token index per slot
    centres, _ = window_token_centres((h, w), (m, m), (s, s), 4)
    expected = torch.stack([slots // w, slots % w], dim=-1).double() * 4 + 2
    torch.testing.assert_close(centres, expected)


def test_statistics_run_in_eval_mode_and_leave_the_model_as_it_was() -> None:
    """A Swin comes with drop path (0.1 by default): in training mode the distances were other
    numbers every call; they are eval mode's, and the model's own modes come back after, also
    when the forward fails."""
    model = tiny_swin(img_size=32)
    assert model.training and model.config.drop_path > 0
    model.layers[0].eval()  # a part the caller keeps in eval mode
    modes = {name: m.training for name, m in model.named_modules()}
    x = torch.randn(4, 3, 32, 32)
    first, second = (swin_attention_statistics(model, x, [(1, 1)]) for _ in range(2))
    assert {name: m.training for name, m in model.named_modules()} == modes
    reference = swin_attention_statistics(model.eval(), x, [(1, 1)])
    for distances, maps in (first, second):
        torch.testing.assert_close(distances, reference[0])
        torch.testing.assert_close(maps, reference[1])
    model.train()
    model.layers[0].eval()
    with pytest.raises(ValueError, match="channels"):
        swin_attention_statistics(model, torch.randn(1, 5, 32, 32))
    assert {name: m.training for name, m in model.named_modules()} == modes
