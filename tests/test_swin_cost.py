"""`vitlab cost` for Swin: per-stage numbers by hand, totals against an independent count
(torch.utils.flop_counter on real forwards), Swin-T's published size, and --scaling's table
against the closed forms."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import help_of
from vitlab.analysis.cost import cost_report, format_cost_report
from vitlab.analysis.scaling import attention_scaling
from vitlab.cli.main import main
from vitlab.models.registry import build_model, get_config, list_models


def test_swin_t_at_224_stage_by_stage() -> None:
    report = cost_report("Swin-T")
    assert report["model"] == "swin_tiny_patch4_window7_224" and report["family"] == "swin"
    assert report["params"]["total"] == 28_288_354  # timm's swin_tiny_patch4_window7_224
    stages = report["stages"]
    assert [s["grid"] for s in stages] == [[56, 56], [28, 28], [14, 14], [7, 7]]
    assert [s["windows"] for s in stages] == [64, 16, 4, 1]
    assert [s["window_tokens"] for s in stages] == [49] * 4
    assert [s["shift"] for s in stages] == [[3, 3]] * 3 + [[0, 0]]  # 7x7 map: one window
    assert [(s["width"], s["heads"], s["blocks"]) for s in stages] == [
        (96, 3, 2),
        (192, 6, 2),
        (384, 12, 6),
        (768, 24, 2),
    ]
    s0 = stages[0]
    assert s0["attention_macs_per_block"] == 2 * 3136 * 49 * 96 == 29_503_488
    assert s0["linear_macs_per_block"] == 12 * 3136 * 96**2  # qkv, proj and a 4C MLP
    assert s0["attention_matrix_bytes"] == 64 * 3 * 49**2 * 4
    assert stages[2]["merge_macs"] == 196 * (4 * 192) * 384
    assert report["attention_macs"] == 2 * 49 * (
        2 * 3136 * 96 + 2 * 784 * 192 + 6 * 196 * 384 + 2 * 49 * 768
    )
    assert report["forward_macs"] == 4_490_566_656
    # timm's table and fvcore say 4.51 G: fvcore also counts the LayerNorms (~0.02 G)
    assert report["forward_macs"] == pytest.approx(4.51e9, rel=0.01)
    text = format_cost_report(report)
    assert "28,288,354" in text and "4.49 GMACs" in text and "56x56" in text


def test_small_swin_with_padding_odd_merging_and_a_clamped_window_by_hand() -> None:
    # swin_nano_patch2_window4_32 at 36: maps 18, 9 (odd: padded before merging), 5; window 4
    # pads them to 20, 12, 8. C = 32, 64, 128; MLP 4C; 3 channels, 10 classes.
    r = cost_report("swin_nano_patch2_window4_32", img_size=36)
    s0, s1, s2 = r["stages"]
    assert (s0["tokens"], s0["padded_grid"], s0["windows"]) == (324, [20, 20], 25)
    assert s0["attention_macs"] == 2 * (2 * 400 * 16 * 32)
    assert s0["linear_macs"] == 2 * (4 * 400 * 32**2 + 2 * 324 * 32 * 128)
    assert (s1["tokens"], s1["padded_grid"], s1["windows"]) == (81, [12, 12], 9)
    assert s1["merge_macs"] == 81 * 4 * 32 * 64
    assert s1["linear_macs"] == 2 * (4 * 144 * 64**2 + 2 * 81 * 64 * 256) + 81 * 4 * 32 * 64
    assert (s2["grid"], s2["padded_grid"], s2["windows"]) == ([5, 5], [8, 8], 4)
    assert s2["attention_macs"] == 2 * (2 * 64 * 16 * 128)
    assert r["patch_embed"]["macs"] == 324 * 2 * 2 * 3 * 32 and r["head_macs"] == 128 * 10
    assert r["params"]["patch_embed"] == 2 * 2 * 3 * 32 + 32 + 2 * 32  # conv, bias, LayerNorm
    assert "padded to 12x12" in format_cost_report(r)
    # swin_nano_patch2_window7_28 at 24: a 12x12 map (padded to 14), then 6x6 under a window
    # clamped to 6x6 without shift
    r = cost_report("swin_nano_patch2_window7_28", img_size=24)
    last = r["stages"][1]
    assert (last["window"], last["shift"], last["windows"]) == ([6, 6], [0, 0], 1)
    assert last["attention_macs_per_block"] == 2 * 36 * 36 * 96
    assert "clamped" in format_cost_report(r)


@pytest.mark.parametrize(
    "name, size",
    [
        ("Swin-T", None),
        ("swin_nano_patch2_window4_32", 36),
        ("swin_nano_patch2_window7_28", 24),
        ("swin_nano_patch2_window4_32", (32, 20)),
    ],
)
def test_forward_macs_equal_the_flop_counter_on_a_real_forward(name, size) -> None:
    """FlopCounterMode counts every matrix product the model runs (conv, linear, SDPA): the
    closed forms must give exactly half its FLOPs, padding and clamped windows included."""
    cfg = get_config(name, **({} if size is None else {"img_size": size}))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(1, cfg.in_chans, *cfg.img_hw))
    report = cost_report(name, img_size=size)
    assert report["forward_macs"] == counter.get_total_flops() // 2
    assert report["params"]["total"] == sum(p.numel() for p in model.parameters())


def test_cost_cli_on_every_registered_swin(capsys) -> None:
    names = list_models(family="swin")
    assert len(names) == 7
    for name in names:
        assert main(["cost", name, "--json"]) == 0, name
        report = json.loads(capsys.readouterr().out)
        assert report["family"] == "swin" and len(report["stages"]) == len(report["depths"])
        assert report["forward_macs"] == report["attention_macs"] + report["linear_macs"]
    assert main(["cost", "Swin-T", "--img-size", "256"]) == 0
    assert "256x256 image" in capsys.readouterr().out
    assert main(["cost", "Swin-T", "--patch-sizes", "4,8"]) == 2
    assert "patch sizes apply to ViTs" in capsys.readouterr().err
    assert main(["cost", "Swin-T", "--img-size", "226"]) == 2
    assert "not a multiple of patch_size 4" in capsys.readouterr().err


def swin_t_attention(side: int) -> int:
    """Swin-T's attention products at `side`: 2 Np M^2 C per block, Np the stage's map padded to
    multiples of 7."""
    total = 0
    for i, (blocks, width) in enumerate(zip((2, 2, 6, 2), (96, 192, 384, 768))):
        n = math.ceil(side / 4 / 2**i)
        padded = math.ceil(n / 7) * 7
        total += blocks * 2 * padded**2 * 49 * width
    return total


def test_scaling_table_equals_the_closed_forms_and_writes_the_plot(tmp_path, capsys) -> None:
    sides = [224, 384, 512, 768, 1024, 1536]
    result = attention_scaling("Swin-T", "B/16", sides)
    assert result["models"] == ["Swin-T", "B/16"]
    for row, side in zip(result["rows"], sides):
        swin, vit = swin_t_attention(side), 12 * 2 * (side // 16) ** 4 * 768
        assert row["attention_macs"] == [swin, vit], side
        assert row["tokens"] == [(side // 4) ** 2, (side // 16) ** 2]
        assert row["ratio"] == pytest.approx(vit / swin)
    first, last = result["rows"][0], result["rows"][-1]
    assert last["growth"][1] == pytest.approx((1536 / 224) ** 4)  # quadratic in tokens
    # linear in tokens, up to the padding of maps the 7x7 window does not tile (4% at 1536)
    assert last["growth"][0] == pytest.approx((1536 / 224) ** 2, rel=0.05)
    assert first["ratio"] == pytest.approx(5.05, abs=0.01) and last["ratio"] > 230
    out = tmp_path / "plots" / "scaling.png"
    assert main(["cost", "Swin-T", "--scaling", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"Plot (log-log): {out}" in text and "B/16 / Swin-T" in text and "x2210.9" in text
    with Image.open(out) as im:
        assert im.format == "PNG" and im.width > 300
    json_out = tmp_path / "s.png"
    args = ["cost", "Swin-T", "--scaling", "--vs", "S/16", "--sides", "224,448"]
    assert main([*args, "--json", "--out", str(json_out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"] == ["Swin-T", "S/16"] and data["plot"] == str(json_out)
    assert [r["side"] for r in data["rows"]] == [224, 448] and json_out.is_file()
    assert main(["cost", "Swin-T", "--scaling", "--sides", "224,1000"]) == 2  # 1000 = 16 x 62.5
    assert "not a multiple of patch_size 16" in capsys.readouterr().err
    assert main(["cost", "Swin-T", "--out", str(json_out)]) == 2
    assert "--out applies to --scaling only" in capsys.readouterr().err
    assert main(["cost", "Swin-T", "--scaling", "--img-size", "384"]) == 2
    assert "takes image sides from --sides" in capsys.readouterr().err
    scaling = ["cost", "B/16", "--scaling", "--out", str(tmp_path / "b.png")]
    assert main(scaling) == 0  # ratios under 1 (Swin-T / B/16) keep digits
    ratios = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[3:9]]
    assert ratios == [f"{swin_t_attention(s) / (24 * (s // 16) ** 4 * 768):.3g}" for s in sides]
    assert ratios[0] == "0.198" and ratios[-1] == "0.00432"  # it printed 0.2, 0.1 and 0.0 x4


def test_cost_help_documents_swin_and_scaling(capsys) -> None:
    out = help_of(capsys, "cost")
    for word in ["--scaling", "--vs", "--sides", "--out", "attention_scaling.png", "2 N M^2 C"]:
        assert word in out, word
