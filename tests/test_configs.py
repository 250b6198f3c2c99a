"""Presets: each parses strictly, states its command and smoke size; the CLI documents options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import help_of
from vitlab.cli.main import main
from vitlab.config import ConfigError, RunConfig, given_twice, load_run_config
from vitlab.models.registry import config_of

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_the_presets_the_issue_names_exist() -> None:
    names = {p.stem for p in CONFIGS}
    assert {
        "digits",
        "fashion-mnist-quick",
        "fashion-mnist",
        "cifar10",
        "imagenet-pretrain",
        "imagenet-finetune-384",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_preset_parses_and_states_its_commands(path: Path) -> None:
    cfg = load_run_config(str(path))
    config_of(cfg.model)
    text = path.read_text()
    assert "# run:" in text and "# smoke:" in text
    assert RunConfig.from_tree(cfg.to_tree()) == cfg


def test_digits_preset_smoke(tmp_path: Path) -> None:
    assert main(["train", "--config", "configs/digits.yaml", "--out", str(tmp_path / "r"),
                 "train.time_budget=null", "train.epochs=1"]) == 0  # fmt: skip
    assert (tmp_path / "r" / "results.json").is_file()


def test_another_model_name_says_which_of_the_files_model_keys_still_apply(
    tmp_path: Path, capsys
) -> None:
    """digits.yaml's patch_size=7 applied to `model.name=S/16` too (1,024 tokens an image: out
    of memory), and a ResNet refused it as an unknown key without saying where it came from."""
    assert main(["train", "--config", "configs/digits.yaml", "model.name=resnet18_28"]) == 2
    err = capsys.readouterr().err
    assert ("model.name=resnet18_28 replaces configs/digits.yaml's vit_nano_patch4_28, whose "
            "model keys still apply to it: patch_size=7") in err  # fmt: skip
    assert "unknown key 'patch_size' for section 'model' (CNNConfig)" in err
    assert main(["train", "model.naem=S/16"]) == 2  # model.name is a key the section takes too
    assert "did you mean name? (valid keys: name, img_size," in capsys.readouterr().err
    assert main(["train", "model.foo=1"]) == 2  # nothing near it: no guess (it offered pool)
    assert "did you mean" not in capsys.readouterr().err
    quiet = [  # the file's model in other letters, a restated key, a fine-tune (no model.name)
        ["model.name=VIT_NANO_PATCH4_28"],
        ["model.name=S/16", "model.patch_size=16"],
        ["model.name=S/16", "finetune.from=" + str(tmp_path / "none")],
    ]
    missing = f"data.name=imagefolder:{tmp_path / 'none'}"  # fails after the check, fast
    for overrides in quiet:
        assert main(["train", "--config", "configs/digits.yaml", missing, *overrides]) == 2
        err = capsys.readouterr().err
        assert "does not exist" in err and "replaces configs/digits.yaml" not in err, err
    # the file is read once: a value of its that the command line replaces is not read again
    # on its own (the check had re-read it, and refused train.epochs: many, which 1 replaced)
    (tmp_path / "fixed.yaml").write_text("train: {epochs: many}\nmodel: {patch_size: 7}\n")
    fixed = ["--config", str(tmp_path / "fixed.yaml"), "train.epochs=1", "model.name=S/16"]
    assert main(["train", *fixed, missing]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "epochs" not in err and "patch_size=7" in err, err
    (tmp_path / "fixed.yaml").write_text("model: {name: 5, patch_size: 7}\n")  # its name too,
    assert main(["train", *fixed, missing]) == 2  # and its keys still said to apply
    err = capsys.readouterr().err
    assert "does not exist" in err and "replaces" in err and "patch_size=7" in err, err


def test_a_preset_named_without_its_path_is_pointed_to(tmp_path: Path, capsys, monkeypatch) -> None:
    """The README lists presets by name (`digits`, ...); `--config digits` said only "No such file
    or directory", from anywhere but the repository too: now where the preset is."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "digits"]) == 2
    preset = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
    assert f"No such file or directory (the preset 'digits' is {preset})" in capsys.readouterr().err
    assert main(["train", "--config", "nothing.yaml"]) == 2
    assert "the preset" not in capsys.readouterr().err
    (tmp_path / "digits").mkdir()  # a folder of that name (data, say): still no such file
    assert main(["train", "--config", "digits"]) == 2
    assert f"(the preset 'digits' is {preset})" in capsys.readouterr().err
    (tmp_path / "digits.yaml").write_text("train: {epochs: many}\n")  # the user's own file
    assert main(["train", "--config", "digits.yaml"]) == 2
    assert "the preset" not in capsys.readouterr().err


def test_yaml_errors_name_the_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_run_config(str(bad))
    assert "\n" not in str(e.value) and "line 3, column 1" in str(e.value), e.value  # one line
    bad.write_text("train:\n  epocs: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'epocs' for section 'train'"):
        load_run_config(str(bad))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_run_config(str(tmp_path / "missing.yaml"))
    bad.write_text("train:\n  epochs: 3\n  batch_size: 32\n  epochs: 4\n")
    with pytest.raises(ConfigError, match="'epochs' is given twice at line 4, column 3 \\("):
        load_run_config(str(bad))  # (YAML keeps the last: 4 epochs), said on one line
    twice = ["optim.lr=0.1", "optim.lr=0.2", "train.seed=1", "optim.lr=0.3"]  # the last is used,
    assert given_twice(twice) == [  # as argparse takes an option's: now said
        "optim.lr is given 3 times on the command line (0.1, 0.2, 0.3): the last, 0.3, is used"
    ]
    assert load_run_config(None, twice).optim.lr == 0.3 and given_twice(twice[:3]) != []
    assert main(["convert", "no-such", "b", "num_classes=3", "num_classes=4"]) == 2
    assert "num_classes is given 2 times on the command line (3, 4)" in capsys.readouterr().err
    missing = f"data.name=imagefolder:{tmp_path / 'none'}"  # fails after the warning, fast
    assert main(["train", *twice[:2], missing, "--out", str(tmp_path / "r")]) == 2
    assert "optim.lr is given 2 times on the command line" in capsys.readouterr().err
    bad.write_text("train: {epochs: 3}\noptim: {lr: 0.1}\ntrain: {epochs: 4}\n")
    with pytest.raises(ConfigError, match="'train' is given twice"):
        load_run_config(str(bad))
    bad.write_text("train: {epochs: 3}\noptim: {epochs: 4}\n")  # two sections: not given twice
    with pytest.raises(ConfigError, match="unknown key 'epochs' for section 'optim'"):
        load_run_config(str(bad))
    good = tmp_path / "merged.yaml"  # anchors and merge keys, overridden where given: no
    good.write_text("optim: &base {lr: 0.1, momentum: 0.8}\nmodel:\n  <<: {name: vit_nano_pat"
                    "ch4_28, depth: 2}\n  depth: 3\n")  # fmt: skip
    merged = load_run_config(str(good))  # duplicate (a key given twice in one mapping)
    assert merged.model.name == "vit_nano_patch4_28" and merged.model.overrides == {"depth": 3}
    assert merged.optim.lr == 0.1
    for text in ("", "# only a comment\n"):  # the defaults, as before, now said (`train` reads
        (tmp_path / "empty.yaml").write_text(text)  # the file once: said once)
        assert main(["train", "--config", str(tmp_path / "empty.yaml"), missing]) == 2
        said = capsys.readouterr().err.count("empty.yaml sets nothing: the defaults are used")
        assert said == 1 and load_run_config(str(tmp_path / "empty.yaml")) == RunConfig()
    bad.write_text("[]\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_run_config(str(bad))
    bad.write_text("train: 5\n")  # with an override: "'train' is not a config section"
    for overrides in ([], ["train.epochs=2"]):
        with pytest.raises(ConfigError, match="config section 'train' must be a mapping, got 5"):
            load_run_config(str(bad), overrides)


def test_a_value_that_yaml_reads_as_a_mapping_stays_text(tmp_path: Path) -> None:
    """data.name=imagefolder: was YAML's {'imagefolder': None} ('expected str, got ... (dict)');
    it is the text now, and an image folder without a path is an error, where it once read the
    working folder (every file in it) as the dataset."""
    from vitlab.config import parse_value
    from vitlab.data import load_split
    from vitlab.data.datasets import DatasetError

    assert load_run_config(None, ["data.name=imagefolder:"]).data.name == "imagefolder:"
    assert parse_value("a: 1") == "a: 1" and parse_value("{a: 1}") == {"a": 1}  # braces: a map
    with pytest.raises(DatasetError, match="'imagefolder:' names no folder"):
        load_split("imagefolder:", "train")
    from vitlab.data.download import absolute_source
    from vitlab.data.folders import folder_root

    spaced = load_run_config(None, [f"data.name=imagefolder: {tmp_path}"]).data.name
    assert folder_root(spaced) == tmp_path and absolute_source(spaced) == f"imagefolder:{tmp_path}"


def test_values_the_command_line_gives_as_a_user_means_them(tmp_path: Path, capsys) -> None:
    """Found by a QA pass: a quoted number was made a float ('2024' for data.dir: "expected str,
    got 2024.0"); an empty value (an unset shell variable) was YAML's null, turning gradient
    clipping off without a word; a seed past 64 bits failed in torch ("Overflow when unpacking
    long long"); a second --config replaced the first; 323 bytes of YAML aliases made a 56 MB
    error line."""
    assert load_run_config(None, ["data.dir='2024'"]).data.dir == "2024"
    assert load_run_config(None, ['train.device="cpu"', "optim.lr=1e-3"]).optim.lr == 0.001
    for key in ("optim.clip_grad", "data.dir"):
        with pytest.raises(ConfigError, match=f"{key}= has no value .*: give one, or {key}=null"):
            load_run_config(None, [f"{key}= "])
    assert load_run_config(None, ["optim.clip_grad=null"]).optim.clip_grad is None
    with pytest.raises(ConfigError, match="unknown key 'lr' for section 'train'.*; another "
                                          "section has it: optim.lr$"):  # fmt: skip
        load_run_config(None, ["train.lr=0.1"])
    for item in ("train.seed=123456789012345678901234567890", "data.split_seed=-8796093022209"):
        with pytest.raises(ConfigError, match="seed must be in -2\\^43 .. 2\\^43 - 1, got"):
            load_run_config(None, [item])
    ms = "train.seed=1764985000000"  # a seed from the time in milliseconds, or a negative one:
    assert load_run_config(None, [ms, "data.split_seed=-1"]).train.seed == 1764985000000  # kept
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("optim: {betas: [0.9, 0.95]}\n")
    b.write_text("optim: {lr: 0.001}\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(a), "--config", str(b)])
    assert f"--config is given twice ({a}, {b}): name one file" in capsys.readouterr().err
    levels = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    bomb = tmp_path / "bomb.yaml"  # 10^7 items once expanded
    bomb.write_text(f"data: {{dir: [{', '.join(levels)}]}}\n")
    assert len(bomb.read_bytes()) < 500
    with pytest.raises(ConfigError, match="data.dir: expected str | None, got") as e:
        load_run_config(str(bomb))
    assert len(str(e.value)) < 500


@pytest.mark.parametrize(
    "command,words",
    [
        (
            "train",
            ["--config", "--out", "--resume", "key=value", "finetune.from", "fsdp", "time_budget"],
        ),
        (
            "eval",
            [
                "--data",
                "--split",
                "--json",
                "--out",
                "--backend",
                "onnxruntime",
                "--int8",
                "--tta",
                "flip",
            ],
        ),
        ("predict", ["--topk", "--json", "IMAGE", "--backend", "onnxruntime", "--int8", "--tta"]),
    ],
)
def test_help_explains_the_options(command: str, words: list[str], capsys) -> None:
    out = help_of(capsys, command)
    for word in words:
        assert word in out, word


def test_train_help_names_every_key_of_every_section(capsys) -> None:
    """README says `vitlab train --help` lists the keys: it left out eight (data.split_seed,
    optim.betas, ...); held here to the sections' dataclass fields."""
    import dataclasses

    from vitlab.config import DataConfig, DistillConfig, MPPConfig, OptimConfig, TrainConfig

    text = help_of(capsys, "train")
    sections = {"data": DataConfig, "optim": OptimConfig, "train": TrainConfig,
                "mpp": MPPConfig, "distill": DistillConfig}  # fmt: skip
    starts = sorted((text.index(f"{name}.* ("), name) for name in sections)
    ends = [start for start, _ in starts[1:]] + [text.index("finetune.from=RUN_OR_CKPT")]
    for (start, name), end in zip(starts, ends, strict=True):  # each key in its own section
        part = text[start:end]
        for field in dataclasses.fields(sections[name]):
            assert re.search(rf"\b{field.name}\b", part), f"{name}.{field.name}"
    assert "train.threads, data.workers" in text  # what --resume may change


def test_a_wrong_type_is_named_by_the_key_the_user_wrote() -> None:
    """Type errors named the Python class (`DataConfig.hflip`, `ViTConfig.depth`) where every
    other message names the key as typed (`data.hflip`, `model.depth`)."""
    import vitlab

    for override, message in [
        ("data.hflip=true", "^data.hflip: expected float, got True \\(bool\\)$"),
        ("train.ema=true", "^train.ema: expected float \\| None, got True"),
        ("distill.alpha=x", "^distill.alpha: expected float, got 'x'"),
        ("finetune.new_head=3", "^finetune.new_head: expected bool, got 3"),  # was taken as true
        ("finetune.from=5", "^finetune.from: expected str \\| None, got 5"),  # its key, not from_
    ]:
        with pytest.raises(ConfigError, match=message):
            load_run_config(None, [override])
    for overrides, message in [
        (["model.depth=abc"], "^model.depth: expected int, got 'abc' \\(str\\)$"),
        (["model.name=Swin-T", "model.depths=3"], "^model.depths: expected tuple\\[int, ...\\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_of(load_run_config(None, overrides).model)
    with pytest.raises(ConfigError, match="^ViTConfig.depth: expected int"):  # the Python API's
        vitlab.create_model("Ti/16", depth="abc")


def test_paths_from_python_are_text_and_a_quoted_number_is_said_to_be_text(tmp_path) -> None:
    """A pathlib.Path for a text setting (finetune.from, distill.teacher, data.dir) is the text
    it names (the finetune section, type-checked now, would have refused one). A number in
    quotes for a number setting is text, and the error says to drop the quotes; for a setting
    of another type (a bool) that would not help, and it is not said."""
    from vitlab.config import DataConfig, DistillConfig, FinetuneConfig

    assert FinetuneConfig(from_=tmp_path / "run").from_ == str(tmp_path / "run")
    assert DistillConfig(teacher=tmp_path / "t").teacher == str(tmp_path / "t")
    assert DataConfig(dir=tmp_path).dir == str(tmp_path)
    hint = ": a number in quotes is text; write it without them"
    for override in ("train.seed='0x10'", "train.ema='.5'", "optim.lr='1e-3'"):
        with pytest.raises(ConfigError, match=f"got '.*' \\(str\\){hint}$"):
            load_run_config(None, [override])
    with pytest.raises(ConfigError, match="^train.compile: expected bool, got '1' \\(str\\)$"):
        load_run_config(None, ["train.compile='1'"])
