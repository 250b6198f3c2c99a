"""`vitlab eval` on another dataset than the run's: labels follow the checkpoint's class names,
names that do not match are an error, and the run's own confusion matrix is left alone."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL
from vitlab import load_checkpoint
from vitlab.cli.main import main
from vitlab.data import load_split
from vitlab.data.datasets import DatasetError
from vitlab.data.writer import write_shards
from vitlab.eval.run import evaluate_checkpoint
from vitlab.models.checkpoint import save_pretrained

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny ViT trained 12 epochs on digits (about 2 s), classes numbered 0-9."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["train", "--out", str(out), *TINY_MODEL, "train.epochs=12"]) == 0
    return out


def digits_folder(root: Path, names: list[str]) -> Path:
    """digits' test images as PNGs in root/{train,test}/NAME/, class i in folder names[i]."""
    test = load_split("digits", "test")
    for part in ("train", "test"):
        for i, (image, label) in enumerate(zip(test.images, test.labels.tolist(), strict=True)):
            folder = root / part / names[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0].numpy().astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_another_datasets_labels_follow_the_checkpoints_class_names(run, tmp_path, caplog):
    """The folder's classes come sorted by name (eight, five, four, ...), the checkpoint's in
    digit order: the same images score as on digits itself, class by class."""
    model, _ = load_checkpoint(run)
    model.classes = WORDS
    save_pretrained(model, tmp_path / "named")
    folder = digits_folder(tmp_path / "words", WORDS)
    assert load_split(f"imagefolder:{folder}", "test").classes[:3] == ["eight", "five", "four"]
    own = evaluate_checkpoint(str(run))
    other = evaluate_checkpoint(
        str(tmp_path / "named"), data=f"imagefolder:{folder}", out=tmp_path / "out"
    )
    assert other["classes"] == WORDS and other["num_images"] == own["num_images"] == 359
    assert other["confusion"] == own["confusion"]  # rows and columns in the checkpoint's order
    assert other["top1"] == own["top1"] > 0.5
    # the folder's shards (in the folder's class order): refused, naming both orders (it named
    # neither) and the way out
    write_shards(f"imagefolder:{folder}", tmp_path / "shards", progress=False, workers=0)
    with pytest.raises(DatasetError, match=r"another order \(eight, five, four, nine, one, \.\.\.; "
                                           r"the checkpoint's: zero, one, two, three, four, "
                                           r"\.\.\.\), .*evaluate their source"):  # fmt: skip
        evaluate_checkpoint(str(tmp_path / "named"), data=f"wds:{tmp_path / 'shards'}")

    # no name shared (another naming of the same classes): by index, with a warning
    letters = digits_folder(tmp_path / "letters", list("abcdefghij"))
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        by_index = evaluate_checkpoint(
            str(tmp_path / "named"), data=f"imagefolder:{letters}", out=tmp_path / "out"
        )
    assert by_index["confusion"] == own["confusion"] and "share no class name" in caplog.text
    # some names shared, some not: no way to tell which class is which
    mixed = digits_folder(tmp_path / "mixed", [*WORDS[:5], *"fghij"])
    with pytest.raises(DatasetError, match=r"some names are shared, some not"):
        evaluate_checkpoint(str(tmp_path / "named"), data=f"imagefolder:{mixed}", out=tmp_path)
    with pytest.raises(DatasetError, match="has 10 classes, the checkpoint's model has 3"):
        model.reset_classifier(3)
        model.classes = ["a", "b", "c"]
        save_pretrained(model, tmp_path / "three")
        evaluate_checkpoint(str(tmp_path / "three"), data=f"imagefolder:{letters}")


def test_class_names_are_matched_by_name_before_numbers_by_index() -> None:
    """A folder of classes 0..11 lists them as text sorts ("10" before "2"): matched by name to a
    checkpoint's 0..11, not taken by index."""
    from vitlab.data.classes import name_order

    numbers = [str(i) for i in range(12)]
    folder = sorted(numbers)  # 0, 1, 10, 11, 2, ...
    order, note = name_order(folder, numbers, "x")
    assert [numbers[k] for k in order] == folder and note is None
    assert name_order(["0", "1"], ["cat", "dog"], "x") == (None, None)  # numbered: by index
    with pytest.raises(DatasetError, match="repeated"):
        name_order(["crane", "crane", "ant"], ["crane", "ant", "crane2"], "x")


def test_another_folder_without_train_is_evaluated_whole(run, tmp_path):
    """`--data imagefolder:TEST` (class folders, no train/): eval scored a seeded fifth of it
    (72 of digits' 359 test images), the share a run trained on that folder leaves out. Named
    as another dataset, every image is a test image now; the run's own folder keeps its fifth."""
    test_only = digits_folder(tmp_path / "imgs", [str(i) for i in range(10)]) / "test"
    own = evaluate_checkpoint(str(run))
    other = evaluate_checkpoint(str(run), data=f"imagefolder:{test_only}", out=tmp_path / "o")
    assert other["num_images"] == own["num_images"] == 359
    assert other["confusion"] == own["confusion"]  # the same images, every one
    model, _ = load_checkpoint(run)  # class names in another order than the folder's (sorted
    model.classes = WORDS  # as text): relabelled by name, as for any other dataset
    save_pretrained(model, tmp_path / "named")
    words = digits_folder(tmp_path / "words", WORDS) / "test"
    named = evaluate_checkpoint(
        str(tmp_path / "named"), data=f"imagefolder:{words}", out=tmp_path / "o"
    )
    assert named["num_images"] == 359 and named["confusion"] == own["confusion"]
    overrides = [*TINY_MODEL, f"data.name=imagefolder:{test_only}", "train.epochs=1"]
    assert main(["train", "--out", str(tmp_path / "r"), *overrides]) == 0
    (tmp_path / "link").symlink_to(test_only)  # the run's own folder, however it is named
    for name in (test_only, tmp_path / "link", test_only / ".." / "test"):
        restated = evaluate_checkpoint(str(tmp_path / "r"), data=f"imagefolder:{name}")
        assert restated["num_images"] == 72, name  # the fifth its training left out
    assert evaluate_checkpoint(str(tmp_path / "r"))["num_images"] == 72
    with_test = [*overrides, f"data.test=imagefolder:{test_only}"]  # trained on all of it: a
    assert main(["train", "--out", str(tmp_path / "r2"), *with_test]) == 0  # link to it is the
    linked = evaluate_checkpoint(str(tmp_path / "r2"), data=f"imagefolder:{tmp_path / 'link'}")
    assert linked["num_images"] == 359  # run's data, its data.test read (not a fifth of it)
    lacking = digits_folder(tmp_path / "lacking", [str(i) for i in range(10)]) / "test"
    shutil.rmtree(lacking / "9")  # a test folder without one of the classes: labelled by name
    part = evaluate_checkpoint(str(run), data=f"imagefolder:{lacking}")
    nines = sum(own["confusion"][9])
    assert part["num_images"] == 359 - nines and part["confusion"][:9] == own["confusion"][:9]


def test_another_datasets_confusion_png_does_not_replace_the_runs(run, tmp_path, capsys):
    assert main(["eval", str(run), "--json"]) == 0
    own = Path(json.loads(capsys.readouterr().out)["confusion_png"])
    assert own == run / "confusion_matrix_test.png"
    before = own.read_bytes()
    folder = digits_folder(tmp_path / "imgs", [str(i) for i in range(10)])
    assert main(["eval", str(run), "--data", f"imagefolder:{folder}", "--json"]) == 0
    other = Path(json.loads(capsys.readouterr().out)["confusion_png"])
    assert other.parent == run and other.is_file() and other != own
    assert other.name.startswith("confusion_matrix_imagefolder-") and "_test" in other.name
    assert own.read_bytes() == before
    last = run / "checkpoints" / "last"  # the last checkpoint's matrix beside the best one's
    assert main(["eval", str(last), "--json"]) == 0  # (it replaced it)
    assert json.loads(capsys.readouterr().out)["confusion_png"] == str(
        run / "confusion_matrix_test_last.png"
    )
    assert own.read_bytes() == before
    assert main(["eval", str(run / "checkpoints" / "best"), "--json"]) == 0  # best: the run's
    assert json.loads(capsys.readouterr().out)["confusion_png"] == str(own)


def test_a_checkpoint_of_another_library_is_evaluated(run, tmp_path, capsys):
    """eval ran the whole split of a timm / HF / .pth source, then failed naming its matrix
    (AttributeError, exit 1): it gives the metrics of the same weights in vitlab's format."""
    assert main(["eval", str(run), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    for fmt in ("timm", "hf"):
        assert main(["convert", str(run), str(tmp_path / fmt), "--to", fmt]) == 0
        capsys.readouterr()
        args = ["eval", str(tmp_path / fmt), "--data", "digits", "--out", str(tmp_path / "o")]
        assert main([*args, "--json"]) == 0, capsys.readouterr().err
        other = json.loads(capsys.readouterr().out)
        assert other["top1"] == own["top1"] and other["loss"] == pytest.approx(own["loss"], 1e-5)
        assert Path(other["confusion_png"]).parent == tmp_path / "o"


def test_weights_holding_nan_are_warned_of_and_the_json_stays_json(run, tmp_path, capsys):
    """A checkpoint with a NaN weight was evaluated without a word (loss nan), and `--json` wrote
    `"loss": NaN`, which JSON does not have (strict readers refuse the whole output): the load
    names the tensor, and the JSON says null."""
    model, _ = load_checkpoint(run)
    with torch.no_grad():
        model.head.weight[3, 5] = float("nan")
    save_pretrained(model, tmp_path / "nan")
    args = ["--data", "digits", "--json", "--out", str(tmp_path)]  # a checkpoint outside a run
    assert main(["eval", str(tmp_path / "nan"), *args]) == 0
    out, err = capsys.readouterr()
    assert err.count("NaN or infinite values in 1 of its") == 1 and "(head.weight)" in err, err

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out, parse_constant=refuse)
    assert report["loss"] is None and 0 <= report["top1"] <= 1  # NaN rows argmax to class 0
    assert main(["eval", str(run), *args]) == 0  # finite: no word
    out, err = capsys.readouterr()
    assert "NaN" not in err and json.loads(out)["loss"] > 0


def test_curves_take_null_epochs_as_gaps(tmp_path, monkeypatch) -> None:
    """metrics.jsonl holds null for a NaN loss since JSON has no NaN: the curves' figure failed
    on a null validation accuracy (100 * None) and left out the whole validation curve when the
    first epoch's loss was null. A null is a gap; every value drawn is the record's."""
    from matplotlib.figure import Figure

    from vitlab.train import log as log_mod

    rows = ((1, None, 0.6), (2, 0.7, None), (3, 0.6, 0.8))  # epoch, val_loss, val_acc
    records = [{"epoch": e, "train_loss": 1.0 / e, "train_acc": 0.5, "val_loss": loss,
                "val_acc": acc} for e, loss, acc in rows]  # fmt: skip
    drawn, savefig = {}, Figure.savefig

    def keep(fig, path, **kwargs):  # the lines drawn, by (plot, label)
        for ax in fig.axes:
            for line in ax.get_lines():
                drawn[(ax.get_title(), line.get_label())] = list(line.get_ydata())
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    log_mod.save_curves(records, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
    val_loss, val_acc = drawn[("loss", "validation")], drawn[("accuracy", "validation")]
    assert np.isnan(val_loss[0]) and val_loss[1:] == [0.7, 0.6]
    assert val_acc[0] == 60.0 and np.isnan(val_acc[1]) and val_acc[2] == 80.0
    assert drawn[("loss", "train")] == [1.0, 0.5, 1 / 3]


def test_a_class_without_test_images_is_not_scored_zero(run, tmp_path, capsys):
    """A test split lacking a class once reported that class at 0.00% (0 of 0 read as all
    wrong); and with 3 classes "top-5" was top-3, always 100%. Checked against scikit-learn."""
    from sklearn.metrics import recall_score

    model, _ = load_checkpoint(run)
    model.reset_classifier(3)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.head.weight)  # a head that gets some right, some wrong
    save_pretrained(model, tmp_path / "three")
    test = load_split("digits", "test")
    root = tmp_path / "012"
    for part in ("train", "test"):
        for i, (image, label) in enumerate(zip(test.images, test.labels.tolist(), strict=True)):
            if label < 3 and not (part == "test" and label == 1):  # no test image of class 1
                folder = root / part / str(label)
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image[0].numpy().astype(np.uint8)).save(folder / f"{i}.png")
    args = ["eval", str(tmp_path / "three"), "--data", f"imagefolder:{root}", "--out", str(root)]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    truth = [t for t, row in enumerate(r["confusion"]) for p, n in enumerate(row) for _ in range(n)]
    preds = [p for t, row in enumerate(r["confusion"]) for p, n in enumerate(row) for _ in range(n)]
    assert set(truth) == {0, 2} and 0 < r["top1"] < 1
    want = recall_score(truth, preds, labels=[0, 2], average=None)
    assert r["per_class"][1] is None
    assert [r["per_class"][0], r["per_class"][2]] == pytest.approx(list(want))
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "top-3 100.00%" in text and "top-5" not in text
    assert [x.split()[0] for x in text.splitlines() if "n/a (no images)" in x] == ["1"]


def test_a_test_split_with_no_readable_image_is_an_error_not_zero(run, tmp_path, capsys):
    """Every test file truncated: eval once printed top-1 0.00%, loss 0.0000 and exit code 0 (and
    wrote a confusion matrix of nothing); now the command stops, naming the split, exit code 2."""
    root = digits_folder(tmp_path / "words", WORDS)
    for png in sorted((root / "test").rglob("*.png")):
        png.write_bytes(png.read_bytes()[:20])  # a PNG header and nothing after it
    args = ["eval", str(run), "--data", f"imagefolder:{root}", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no image could be evaluated (each of its 359 skipped as unreadable)" in err
    assert "(test)" in err and not list((tmp_path / "out").glob("*.png"))
    # training on it: results.json said top-1 0.00%, loss 0 on 0 images (a QA pass); now none
    out = tmp_path / "trained"
    args = ["train", f"data.name=imagefolder:{root}", "data.val_fraction=0", "train.max_steps=2",
            "train.batch_size=32", "model.depth=1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "test: no image could be evaluated" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["num_images"] == 0 and results["top1"] is results["loss"] is None
    # nor does `vitlab data shard` write a split of no shards (training then said to write more)
    dst = tmp_path / "shards"
    assert main(["data", "shard", f"imagefolder:{root}", str(dst), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "the test split: none of its 359 images decodes" in err and not dst.exists()


def test_an_image_folder_that_is_a_file_is_said_to_be_one(run, tmp_path, capsys) -> None:
    """`--data imagefolder:FILE` said the folder "does not exist"; it says the path is a file."""
    file = tmp_path / "afile"
    file.write_text("")
    assert main(["eval", str(run), "--data", f"imagefolder:{file}"]) == 2
    err = capsys.readouterr().err
    assert f"image folder {file} is a file, not a folder: expected a folder of images" in err
    assert "does not exist" not in err
    assert main(["eval", str(run), "--data", f"imagefolder:{tmp_path / 'none'}"]) == 2
    assert f"image folder {tmp_path / 'none'} does not exist" in capsys.readouterr().err


def test_a_damaged_run_config_is_named_by_every_command(run, tmp_path, capsys) -> None:
    """A run folder's config.yaml cut short, emptied or made a list: eval, fewshot, probe and
    analyze stopped with a traceback (exit 1), and train --resume said an override "cannot
    change" the empty one; each now says which file is damaged (exit 2), and none of them reads
    an empty file as the defaults."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    text = (copy / "config.yaml").read_text()
    commands = (
        ["eval", str(copy)],
        ["fewshot", str(copy), "--shots", "1", "--seeds", "1"],
        ["probe", str(copy), "--kind", "knn"],
        ["analyze", str(copy), "--out", str(tmp_path / "a")],
        ["train", "--resume", str(copy), "model.depth=2"],
    )
    for damage, said in ((text[: len(text) // 2] + ": [", "cannot be read"), ("", "empty"),
                         ("- 1\n- 2\n", "a list, not a mapping")):  # fmt: skip
        (copy / "config.yaml").write_text(damage)
        for command in commands:
            assert main(command) == 2, (damage[:20], command)
            err = capsys.readouterr().err
            assert f"{copy / 'config.yaml'}, the run's settings, " in err and said in err, err


def test_a_run_folder_that_cannot_be_written_still_gets_its_results(
    run, tmp_path, capsys, monkeypatch
) -> None:
    """A read-only run folder: eval computed the whole split, then stopped on the confusion
    matrix's PNG with no result (exit 1); fewshot and probe on their feature cache. The results
    come, with a warning naming what was not written and --out / --cache-dir."""
    import errno

    from vitlab.eval import features as features_mod
    from vitlab.eval import run as run_mod

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(run))

    monkeypatch.setattr(run_mod, "save_confusion_png", read_only)
    monkeypatch.setattr(features_mod, "write_cache", read_only)
    assert main(["eval", str(run), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["confusion_png"] is None and 0 < result["top1"] <= 1
    assert "cannot write" in err and "--out DIR writes it elsewhere" in err
    args = ["fewshot", str(run), "--shots", "1", "--seeds", "1", "--cache-dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["results"] and "cannot cache the" in err and "--cache-dir" in err
    assert not list(tmp_path.glob("*.safetensors"))  # nothing cached: the writes failed
    from vitlab.cli import models as models_cmd  # elsewhere: input the command cannot take (2)

    monkeypatch.setattr(models_cmd, "run", read_only)
    assert main(["models"]) == 2
    assert f"error: cannot write or read {run}: Read-only file system\n" in capsys.readouterr().err
    monkeypatch.undo()
    (tmp_path / "afile").write_text("")  # a cache place that is a file: still an error (2)
    assert main([*args[:-1], str(tmp_path / "afile")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_evaluation_and_features_leave_the_callers_model_as_it_was() -> None:
    """evaluate, evaluate_mpp and extract set every submodule to the top-level mode after (a head
    the caller froze in eval mode trained again), and extract converted a bf16 model to float32
    in place. Their numbers are eval mode's and float32's; the model comes back as it came, also
    when the forward fails."""
    import vitlab
    from vitlab.config import MPPConfig
    from vitlab.eval.classification import evaluate
    from vitlab.eval.features import extract
    from vitlab.eval.mpp import evaluate_mpp
    from vitlab.models.mpp import MaskedPatchViT

    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_28", in_chans=1, num_classes=3, depth=2,
                                dropout=0.3, drop_path=0.3)  # fmt: skip
    torch.nn.init.normal_(model.head.weight, std=0.5)
    x, y = torch.rand(6, 1, 28, 28), torch.tensor([0, 1, 2, 0, 1, -1])  # -1: loader padding
    with torch.no_grad():
        logits = model.eval()(x[:5])
    expected = torch.nn.functional.cross_entropy(logits, y[:5]).item()
    pre = model.forward_head(model.forward_features(x), pre_logits=True)
    cpu = torch.device("cpu")

    def as_caller_left(m):
        m.train()
        m.blocks[0].eval()  # a part the caller keeps in eval mode
        return {name: sub.training for name, sub in m.named_modules()}

    modes = as_caller_left(model)
    got = evaluate(model, [(x, y)], 3, cpu)
    assert got["loss"] == pytest.approx(expected, rel=1e-5) and got["num_images"] == 5
    assert {name: m.training for name, m in model.named_modules()} == modes
    feats, labels = extract(model.bfloat16(), [(x, y)], "prelogits", cpu, progress=False)
    assert model.head.weight.dtype == torch.bfloat16 and feats.dtype == torch.float32
    torch.testing.assert_close(feats, pre[:5], atol=0.1, rtol=0.05)  # bf16 weights: 3 digits
    assert labels.tolist() == [0, 1, 2, 0, 1]
    assert {name: m.training for name, m in model.named_modules()} == modes
    with pytest.raises(ValueError, match="multiples of the patch size"):
        evaluate(model.float(), [(torch.rand(2, 1, 9, 9), y[:2])], 3, cpu)
    assert {name: m.training for name, m in model.named_modules()} == modes
    vit = vitlab.ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=0, embed_dim=16,
                           depth=2, num_heads=2, mlp_dim=32, drop_path=0.3)  # fmt: skip
    mpp = MaskedPatchViT(vit, MPPConfig(), (0.5,), (0.5,))
    modes = as_caller_left(mpp)
    assert evaluate_mpp(mpp, [(x, y)], cpu)["num_images"] == 5
    assert {name: m.training for name, m in mpp.named_modules()} == modes


def test_a_one_class_report_states_its_top_1_once():
    """With one class the top-k figure is the top-1 figure: the report printed 'top-1 100.00%
    top-1 100.00%'. Two classes still show top-2."""
    from vitlab.eval.run import format_report

    r = {"checkpoint": "c", "data": "d", "split": "test", "num_images": 3, "top1": 1.0,
         "top5": 1.0, "loss": 0.0, "confusion": [[3]], "confusion_png": None}  # fmt: skip
    one = format_report({**r, "classes": ["cat"], "per_class": [1.0]})
    assert one.splitlines()[1] == "top-1 100.00%   loss 0.0000"
    two = {**r, "classes": ["cat", "dog"], "per_class": [1.0, None], "confusion": [[3, 0], [0, 0]]}
    assert format_report(two).splitlines()[1] == "top-1 100.00%   top-2 100.00%   loss 0.0000"


def test_the_python_functions_check_what_the_command_line_checks(run, tmp_path) -> None:
    """evaluate_checkpoint(split="validation") (or "train", or a typo) evaluated the test split
    and labelled it so, writing confusion_matrix_validation.png; batch_size=0 and topk=-1 failed
    inside torch; fewshot_checkpoint(shots=5) was "'int' object is not iterable". The command
    line refuses those in words: the functions now too, and one shot count is a list of one."""
    from vitlab.eval.fewshot import fewshot_checkpoint
    from vitlab.eval.run import predict_files

    for split in ("validation", "train", "Test"):
        with pytest.raises(ValueError, match=f"split must be 'test' or 'val'.*got '{split}'"):
            evaluate_checkpoint(str(run), split=split, out=tmp_path / "e")
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        evaluate_checkpoint(str(run), batch_size=0)
    image = tmp_path / "seven.png"
    Image.fromarray(load_split("digits", "test").images[0, 0].numpy().astype(np.uint8)).save(image)
    for k in (0, -1):
        with pytest.raises(ValueError, match=f"topk must be a whole number >= 1, got {k}"):
            predict_files(str(run), [str(image)], topk=k)
    one = fewshot_checkpoint(str(run), shots=np.int64(2), seeds=1, progress=False)  # numpy's too
    listed = fewshot_checkpoint(str(run), shots=[np.int64(2)], seeds=1, progress=False)
    assert [r["shots"] for r in one["results"]] == [2] and one["results"] == listed["results"]
    assert json.dumps(listed["results"])  # Python ints (numpy's made the JSON fail)
    numpy_sized = evaluate_checkpoint(str(run), batch_size=np.int64(100))
    assert numpy_sized["top1"] == evaluate_checkpoint(str(run))["top1"]
    top = predict_files(str(run), [str(image)], topk=np.int64(3))[0]["top"]
    assert len(top) == 3


def test_predict_decodes_a_colour_jpeg_for_a_grey_model_as_training_does(tmp_path) -> None:
    """Training decodes a colour JPEG for a grey model as libjpeg's luma plane (torchvision's
    GRAY mode); predict took PIL's convert('L') of the upsampled RGB, several grey levels away
    (a QA pass: 11 on an EXIF-tagged photo), so a file was classified differently by `vitlab
    predict` than in `vitlab eval`. Now predict's input is training's decode."""
    from tests.helpers import tiny_checkpoint
    from vitlab.data.decode import decode_image
    from vitlab.eval.run import predict_files

    model, meta = load_checkpoint(tiny_checkpoint(tmp_path / "tiny", img_size=16))  # grey
    with torch.no_grad():  # a head that is not zero: the probabilities follow the pixels
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    checkpoint = tmp_path / "grey"
    save_pretrained(model, checkpoint)
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)  # pixel noise: chroma differs
    path = tmp_path / "colour.jpg"
    Image.fromarray(colours).save(path, quality=90)  # 4:2:0 chroma: PIL's luma is not libjpeg's
    model, meta = load_checkpoint(checkpoint)
    pre = meta.preprocessing
    trained = pre.batch(decode_image(path.read_bytes(), 1, str(path))[None])
    by_pil = pre.pil(Image.open(path).convert("L"))[None]
    assert (trained - by_pil).abs().max() * 255 * pre.std[0] > 2  # the two decodes differ here
    with torch.no_grad():
        expected = model(trained).softmax(dim=1)[0]
        assert (model(by_pil).softmax(dim=1)[0] - expected).abs().max() > 1e-4  # and so would
        # the probabilities
    top = predict_files(str(checkpoint), [str(path)], topk=10)[0]["top"]
    got = torch.tensor([t["probability"] for t in sorted(top, key=lambda t: t["index"])])
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
