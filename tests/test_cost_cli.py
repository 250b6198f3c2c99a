"""The cost calculator against hand-computed values, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import help_of
from vitlab.analysis.cost import cost_report, format_cost_report
from vitlab.cli.main import main
from vitlab.models.checkpoint import save_pretrained
from vitlab.models.registry import build_model, get_config


def test_cost_json_for_b16_at_224_matches_hand_computed_values(capsys) -> None:
    assert main(["cost", "B/16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "vit_base_patch16_224"
    assert report["img_size"] == [224, 224] and report["embed_dim"] == 768
    # parameters by part: conv 3*16*16*768 + 768; 197 x 768 positions; 12 blocks of
    # qkv (768*2304 + 2304) + proj (768*768 + 768) + fc1 (768*3072 + 3072) + fc2 (3072*768 + 768)
    # + two LayerNorms (4 * 768); final norm 2 * 768; head 768 * 1000 + 1000
    block = (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    block += 4 * 768
    assert report["params"] == {
        "patch_embed": 590_592,
        "cls_token": 768,
        "pos_embed": 151_296,
        "blocks": 12 * block,
        "norm": 1_536,
        "pre_logits": 0,
        "head": 769_000,
        "total": 86_567_656,
    }
    layers = {r["patch_size"]: r for r in report["per_layer"]}
    assert sorted(layers) == [4, 8, 14, 16, 28, 32, 56]
    p16 = layers[16]
    assert p16["tokens"] == 196
    assert p16["attention_macs"] == 2 * 196**2 * 768 == 59_006_976
    assert p16["linear_macs"] == 12 * 196 * 768**2 == 1_387_266_048
    assert p16["attention_share"] == pytest.approx(59_006_976 / (59_006_976 + 1_387_266_048))
    assert p16["attention_matrix_bytes"] == 12 * 197**2 * 4 == 1_862_832
    p4 = layers[4]
    assert p4["tokens"] == 56 * 56 and p4["attention_macs"] == 2 * 3136**2 * 768
    assert report["crossover_tokens"] == 6 * 768 == 4608
    assert report["forward_macs"] == pytest.approx(17.58e9, rel=2e-3)  # timm/fvcore: 17.58 G


def test_relative_positions_add_their_product_to_the_count_of_a_real_forward() -> None:
    """With relative position embeddings every layer also multiplies its queries by each offset's
    vector (T^2 D more MACs): torch's FlopCounterMode on a real forward (meta tensors) counts
    exactly what the report says, and the crossover moves to (4D + 2M) / 3."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cfg = get_config("B/16", pos_embed="relative")
    with torch.device("meta"):
        model = build_model(cfg).eval()
        x = torch.empty(1, 3, 224, 224)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    report = cost_report(cfg)
    assert counter.get_total_flops() == 2 * report["forward_macs"]
    assert report["forward_macs"] - cost_report(get_config("B/16"))["forward_macs"] == (
        12 * 197**2 * 768
    )
    p16 = {r["patch_size"]: r for r in report["per_layer"]}[16]
    assert p16["attention_macs"] == 3 * 196**2 * 768
    assert report["crossover_tokens"] == (4 * 768 + 2 * 3072) // 3 == 3072
    text = format_cost_report(report)
    assert "N = (4D + 2M) / 3 = 3,072" in text
    # the table's header gives the count it uses (it once said 2N^2D for every model)
    assert "attention 3N^2D, linear" in text and "2N^2D" not in text
    assert "attention 2N^2D, linear" in format_cost_report(cost_report(get_config("B/16")))


def test_cost_other_size_and_patch_list() -> None:
    report = cost_report("B/16", img_size=384, patch_sizes=[16, 32])
    assert report["params"]["total"] == 86_859_496
    assert [r["tokens"] for r in report["per_layer"]] == [576, 144]
    rect = cost_report("Ti/16", img_size=(224, 320), patch_sizes=[16])
    assert rect["per_layer"][0]["tokens"] == 14 * 20
    text = format_cost_report(report)
    assert "86,859,496" in text and "4,608 tokens" in text and "attn share" in text


def test_cost_runs_on_every_registered_model_with_no_options(capsys) -> None:
    """The default patch sizes are those of the paper's list that tile the model's image, plus
    the model's own (28x28 presets: 4, 14, 28; the list once failed on them with 'patch size 32
    does not fit')."""
    from vitlab.models.registry import list_models

    names = list_models(family="vit")
    assert "vit_nano_patch4_28" in names
    for name in names:
        assert main(["cost", name, "--json"]) == 0, name
        report = json.loads(capsys.readouterr().out)
        sizes = [r["patch_size"] for r in report["per_layer"]]
        h, w = report["img_size"]
        assert report["patch_size"] in sizes, name
        assert all(h % p == 0 and w % p == 0 for p in sizes), (name, sizes)
    assert main(["cost", "vit_nano_patch4_28", "--json"]) == 0
    sizes = [r["patch_size"] for r in json.loads(capsys.readouterr().out)["per_layer"]]
    assert sizes == [4, 14, 28]
    assert main(["cost", "vit_huge_patch14_518", "--json"]) == 0  # 518 = 14 x 37: only its own
    sizes = [r["patch_size"] for r in json.loads(capsys.readouterr().out)["per_layer"]]
    assert sizes == [14]
    assert main(["cost", "vit_nano_patch4_28"]) == 0
    assert "patch" in capsys.readouterr().out


def test_cost_rejects_bad_input(capsys) -> None:
    assert main(["cost", "B/17"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'B/17'" in err and "B/16" in err
    assert main(["cost", "B/16", "--img-size", "200"]) == 2
    assert "not a multiple of patch_size 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cost", "B/16", "--patch-sizes", "16,x"])
    assert "comma-separated whole numbers >= 1" in capsys.readouterr().err
    for bad, said in (("10,10", "10 given twice in '10,10'"), ("8,,16", "got '8,,16'"),
                      ("0,16", "got '0,16'")):  # fmt: skip
        with pytest.raises(SystemExit):  # the row twice, an entry dropped: slips, refused
            main(["cost", "B/16", "--patch-sizes", bad])
        assert said in capsys.readouterr().err


def test_models_command(capsys) -> None:
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert by_name["vit_huge_patch14_224"]["params"] == 632_045_800
    assert by_name["vit_base_patch16_224"]["aliases"] == ["B/16"]
    assert main(["models", "vit_nano*"]) == 0
    out = capsys.readouterr().out
    assert "vit_nano_patch4_28" in out and "vit_base" not in out
    capsys.readouterr()
    assert main(["models", "nothing*", "--family", "swin"]) == 1  # said on stderr, as errors are
    said = capsys.readouterr()
    assert not said.out and "no model matches 'nothing*' in family 'swin'" in said.err
    assert main(["models", "swin-t", "--json"]) == 0  # any case, as `cost b/16` resolves names
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == [
        "swin_tiny_patch4_window7_224"
    ]


@pytest.mark.parametrize("command", [[], ["models"], ["cost"]])
def test_help_documents_every_option(command: list[str], capsys) -> None:
    out = help_of(capsys, *command)
    expected = {(): ["models", "cost"], ("models",): ["--json", "pattern"]}.get(
        tuple(command), ["--img-size", "--patch-sizes", "--json", "2 N^2 D"]
    )
    for word in expected:
        assert word in out


def test_cost_reads_a_run_config_a_run_folder_and_a_checkpoint(
    capsys, tmp_path, monkeypatch
) -> None:
    """`vitlab cost` on a preset's YAML, a run folder and a checkpoint: the model they hold, here
    the conv-stem model of configs/fashion-mnist-95.yaml (stem width 96, two 3x3 convs per
    stride-2 stage), its stem's MACs and parameters counted by hand; a run folder's model is its
    checkpoint's (classes from the data), not its config file's."""
    preset = Path(__file__).parents[1] / "configs" / "fashion-mnist-95.yaml"
    assert main(["cost", str(preset), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(preset)
    assert report["embed_dim"] == 64 and report["depth"] == 4 and report["patch_size"] == 4
    assert report["stem"] == {
        "kind": "conv", "width": 96, "depths": [2, 2], "stride": 4, "channels": 192
    }  # fmt: skip
    # 14x14 map: 3x3 conv 1 -> 96 and 96 -> 96; 7x7 map: 96 -> 192 and 192 -> 192; 1x1 192 -> 64
    stem = 14 * 14 * 9 * (96 + 96 * 96) + 7 * 7 * 9 * (96 * 192 + 192 * 192) + 49 * 192 * 64
    assert report["macs_by_part"]["patch_embed"] == stem == 41_414_016
    # the four convs (no bias), their BatchNorms' weight and bias, the 1x1 projection with bias
    stem_params = (
        9 * (96 + 96 * 96 + 96 * 192 + 192 * 192) + 2 * (2 * 96 + 2 * 192) + 64 * (192 + 1)
    )
    assert report["params"]["patch_embed"] == stem_params == 594_976
    plain = cost_report("vit_nano_patch4_28")  # the same encoder behind a patchify layer
    assert report["macs_by_part"]["blocks"] == plain["macs_by_part"]["blocks"]
    assert report["params"]["blocks"] == plain["params"]["blocks"]
    assert report["params"]["head"] == 64 * 10 + 10

    run = tmp_path / "run"  # before its first checkpoint: the config vitlab train saved
    run.mkdir()
    (run / "config.yaml").write_text(preset.read_text())
    assert main(["cost", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {**report, "model": str(run)}
    # its checkpoint, trained on 7 classes (data.name=...): the checkpoint's model counts
    cfg = get_config("vit_nano_patch4_28", stem="conv", stem_width=96, stem_depths=(2, 2))
    save_pretrained(build_model(cfg.replace(num_classes=7)), run / "checkpoints" / "best")
    assert main(["cost", str(run), "--json"]) == 0
    from_run = json.loads(capsys.readouterr().out)
    assert from_run["params"]["head"] == 64 * 7 + 7 and from_run["model"] == str(run)
    assert from_run["params"]["patch_embed"] == stem_params
    weights = run / "checkpoints" / "best" / "model.safetensors"
    assert main(["cost", str(weights)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{weights}: 28x28 image")
    assert "a conv stem, 3x3 convs per stride-2 stage [2, 2] from width 96" in text

    # a fine-tuning run's config: its source's model (model.name is not used), keys on top; the
    # config.yaml of a run folder before its first checkpoint says the same
    tune = tmp_path / "tune.yaml"
    tune.write_text(f"model: {{name: vit_micro_patch4_28, img_size: 56}}\n"
                    f"finetune: {{from: {run}}}\n")  # fmt: skip
    assert main(["cost", str(tune), "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["embed_dim"] == 64 and tuned["depth"] == 4 and tuned["img_size"] == [56, 56]
    assert tuned["params"]["patch_embed"] == stem_params and tuned["params"]["head"] == 7 * 65
    tune.write_text("model: {name: vit_micro_patch4_28}\nfinetune: {from: no-such-run}\n")
    assert main(["cost", str(tune), "--json"]) == 0  # a preset's source, not trained yet
    out, err = capsys.readouterr()
    assert "finetune.from cannot be read" in err and json.loads(out)["embed_dim"] == 128

    png = tmp_path / "s.png"
    assert main(["cost", str(preset), "--scaling", "--vs", str(run), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"{preset} beside {run}" in out and png.is_file()

    assert main(["cost", str(tmp_path / "fashion-mnist-96.yaml")]) == 2
    assert "no file" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["cost", str(tmp_path / "notes.txt")]) == 2
    assert "holds no model vitlab reads" in capsys.readouterr().err
    (tmp_path / "B").mkdir()  # a folder that is also a registered alias's path: the name wins
    (tmp_path / "B" / "16").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["cost", "B/16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "vit_base_patch16_224"


def test_scaling_plot_is_written_where_the_printed_path_says(tmp_path, capsys) -> None:
    """--out without a suffix once printed PATH while matplotlib wrote PATH.png, and an existing
    folder was printed as the plot; a path under a file was a traceback."""
    args = ["cost", "B/16", "--scaling", "--sides", "224,448", "--out"]
    for given, written in [
        (tmp_path / "plot", tmp_path / "plot.png"),
        (tmp_path, tmp_path / "attention_scaling.png"),
        (tmp_path / "new" / "p.png", tmp_path / "new" / "p.png"),
        (f"{tmp_path / 'made'}/", tmp_path / "made" / "attention_scaling.png"),  # was made.png
    ]:
        assert main([*args, str(given), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["plot"] == str(written)
        assert written.is_file() and written.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "plot").exists()
    assert main([*args, str(tmp_path / "plot")]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"Plot (log-log): {tmp_path / 'plot.png'}")
    (tmp_path / "file").write_text("")
    assert main([*args, str(tmp_path / "file" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'file'} is a file, not a folder" in err and len(err.splitlines()) == 1


def test_an_os_error_is_one_line_and_v_shows_the_traceback(capsys) -> None:
    """An OSError the commands do not name (here /proc refusing a folder) was a traceback: one
    line, exit code 1; -v raises it, for the traceback."""
    args = ["cost", "vit_nano_patch4_28", "--scaling", "--out", "/proc/nonexistent/x.png"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("vitlab cost: error: [Errno 2]") and "(-v shows where)" in err
    with pytest.raises(FileNotFoundError):
        main(["-v", *args])
