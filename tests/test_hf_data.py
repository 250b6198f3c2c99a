"""Hugging Face datasets offline: save_to_disk folders and parquet files the test writes, their
columns found or named, and `vitlab train` from a parquet file end to end."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import TINY_MODEL
from vitlab.config import load_run_config
from vitlab.data import load_split
from vitlab.data.datasets import DatasetError
from vitlab.train.run import train


def table(n: int, image: str = "image", label: str = "label", class_label: bool = True):
    """n 8x8 RGB images, 3 classes of noise around a colour."""
    import datasets

    rng = np.random.default_rng(n)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]
    labels = [i % 3 for i in range(n)]
    images = [
        Image.fromarray(np.clip(rng.normal(colours[y], 50, (8, 8, 3)), 0, 255).astype(np.uint8))
        for y in labels
    ]
    kind = datasets.ClassLabel(names=["red", "green", "blue"]) if class_label else None
    features = datasets.Features({image: datasets.Image(), label: kind or datasets.Value("int64")})
    return datasets.Dataset.from_dict({image: images, label: labels}, features=features)


def test_save_to_disk_and_parquet_columns_found_or_named(tmp_path: Path) -> None:
    table(50).save_to_disk(str(tmp_path / "saved"))
    train = load_split(f"hf:{tmp_path / 'saved'}", "train")
    test = load_split(f"hf:{tmp_path / 'saved'}", "test")  # one split: a seeded 20% carved
    assert (len(train), len(test)) == (40, 10) and train.classes == ["red", "green", "blue"]
    assert set(train.rows.tolist()).isdisjoint(test.rows.tolist()) and train.in_chans == 3
    assert train.read(0)[:8] == b"\x89PNG\r\n\x1a\n"
    table(12, "picture", "y", class_label=False).to_parquet(str(tmp_path / "odd.parquet"))
    with pytest.raises(DatasetError, match="no label column found .* set data.label_key"):
        load_split(f"hf:{tmp_path / 'odd.parquet'}", "all")
    odd = load_split(f"hf:{tmp_path / 'odd.parquet'}", "all", keys=(None, "y"))  # image: by type
    assert len(odd) == 12 and odd.classes == ["0", "1", "2"]
    with pytest.raises(DatasetError, match=r"image_key=photo \(data shard: --image-key\): no such"):
        load_split(f"hf:{tmp_path / 'odd.parquet'}", "all", keys=("photo", "y"))
    with pytest.raises(DatasetError, match="cannot load the Hugging Face dataset"):
        load_split(f"hf:{tmp_path / 'missing.parquet'}", "train")


def test_splits_chosen_labels_checked_greyscale_stats(tmp_path: Path) -> None:
    """An unlabelled test split (labels -1, as imagenet-1k's) is passed over for validation;
    hf:NAME#SPLIT reads one split; labels that are no class indices are named; greyscale data
    has one channel's statistics, which the run repeats for no other channel."""
    import datasets

    from vitlab.config import load_run_config
    from vitlab.data import dataset_info
    from vitlab.train.build import normalization

    unlabelled = table(6).cast_column("label", datasets.Value("int64")).map(lambda r: {"label": -1})
    datasets.DatasetDict({"train": table(20), "test": unlabelled, "validation": table(9)}
                         ).save_to_disk(str(tmp_path / "dd"))  # fmt: skip
    assert len(load_split(f"hf:{tmp_path / 'dd'}", "test")) == 9
    # each table names its rows: train's row 0 and validation's row 0 are two images (an image
    # named once as undecodable in one hid the other's: a set of names shared by both splits)
    wheres = {load_split(f"hf:{tmp_path / 'dd'}", s).where(0) for s in ("train", "test")}
    assert wheres == {f"row 0 of hf:{tmp_path / 'dd'}#{t}" for t in ("train", "validation")}
    assert len(load_split(f"hf:{tmp_path / 'dd'}#validation", "all")) == 9
    # one split, named validation: carved into training and test, not both the whole split
    one = f"hf:{tmp_path / 'dd'}#validation"
    fit, held = load_split(one, "train"), load_split(one, "test")
    assert len(fit) + len(held) == 9 and len(held) >= 1
    assert set(fit.rows.tolist()).isdisjoint(held.rows.tolist())
    with pytest.raises(DatasetError, match="no split 'nope': it has \\['test', 'train'"):
        load_split(f"hf:{tmp_path / 'dd'}#nope", "all")
    with pytest.raises(DatasetError, match="6 labels are not class indices .row 0: -1; negative"):
        load_split(f"hf:{tmp_path / 'dd'}#test", "all")
    named = datasets.Dataset.from_dict({"image": table(2)["image"], "label": ["cat", "dog"]})
    named.cast_column("image", datasets.Image()).to_parquet(str(tmp_path / "str.parquet"))
    with pytest.raises(DatasetError, match="'label' holds str values .such as 'cat'"):
        load_split(f"hf:{tmp_path / 'str.parquet'}", "all")
    grey = table(4).map(lambda r: {"image": r["image"].convert("L")})
    grey.to_parquet(str(tmp_path / "grey.parquet"))
    split = load_split(f"hf:{tmp_path / 'grey.parquet'}", "all")
    info = dataset_info("hf:grey", split)
    assert info.in_chans == 1 and info.mean == (0.449,) and info.std == (0.226,)
    cfg = load_run_config(None, [])
    assert normalization(cfg, info, 1) == ((0.449,), (0.226,))
    # a colour dataset whose first image happens to be grey is read in colour
    mixed = table(20).map(lambda r, i: {"image": r["image"].convert("L")} if i == 0 else {},
                          with_indices=True)  # fmt: skip
    mixed.to_parquet(str(tmp_path / "mixed.parquet"))
    split = load_split(f"hf:{tmp_path / 'mixed.parquet'}", "all")
    assert split.in_chans == 3 and Image.open(io.BytesIO(split.read(0))).mode == "L"


def test_stray_and_missing_labels_are_named_not_taken(tmp_path: Path, caplog) -> None:
    """A label of 10**12 among three classes (no ClassLabel) made a list of 10**12 class names:
    the process was killed for memory (20 GB). A label past the rows' count is refused; a stray
    50 (51 classes, 47 without a row) is warned; a missing label (None) is named, not a
    TypeError from torch."""
    import datasets

    def parquet(name: str, labels: list) -> str:
        features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
        images = table(len(labels))["image"]
        data = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        data.to_parquet(str(tmp_path / name))
        return f"hf:{tmp_path / name}"

    huge = parquet("huge.parquet", [0, 1, 2] * 19 + [0, 1, 10**12])
    with pytest.raises(DatasetError, match=r"label 1000000000000 in a column of 60 rows"):
        load_split(huge, "all")
    few = load_split(parquet("few.parquet", [0, 99, 5]), "all")  # a small split of 100 classes
    assert len(few.classes) == 100
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        source = parquet("stray.parquet", [0, 1, 2] * 19 + [0, 1, 50])
        stray = load_split(source, "all")
        load_split(source, "train"), load_split(source, "test")  # the same table: said once
    assert len(stray.classes) == 51
    assert caplog.text.count("labels 0..50 number 51 classes, 47 of them with no row") == 1
    with pytest.raises(DatasetError, match=r"holds NoneType values \(such as None\)"):
        load_split(parquet("none.parquet", [0, 1, None] * 4), "all")
    # data.label_key naming a column of names, or the images, in a dataset with a test split:
    # a TypeError ("'>=' not supported between 'str' and 'int'") where the test split was sought
    named = datasets.Dataset.from_dict({"image": table(6)["image"], "name": list("abcabc")})
    datasets.DatasetDict({"train": named, "test": named}).save_to_disk(str(tmp_path / "named"))
    for key, kind in (("name", "str"), ("image", "dict|PngImageFile")):
        with pytest.raises(DatasetError, match=rf"label column '{key}' holds ({kind}) values"):
            load_split(f"hf:{tmp_path / 'named'}", "train", keys=(None, key))


def test_data_test_classes_must_be_the_training_splits(tmp_path: Path) -> None:
    """data.test's classes are checked against the training split's: other names are an error
    naming both lists (hf, and image folders whose sub-folders differ)."""
    import datasets

    from tests.test_trainer_state import write_image_folder
    from vitlab.config import DataConfig
    from vitlab.data.datasets import load_run_split

    table(12).to_parquet(str(tmp_path / "train.parquet"))
    other = table(6).cast_column("label", datasets.ClassLabel(names=["r", "g", "b"]))
    other.to_parquet(str(tmp_path / "other.parquet"))
    cfg = DataConfig(
        name=f"hf:{tmp_path / 'train.parquet'}", test=f"hf:{tmp_path / 'other.parquet'}"
    )
    assert len(load_run_split(cfg, "train")) == 12  # whole: the test split is another source
    with pytest.raises(DatasetError, match="classes \\['r', 'g', 'b'\\], the training split "
                                           "\\['red', 'green', 'blue'\\]"):  # fmt: skip
        load_run_split(cfg, "test")
    images, test = write_image_folder(tmp_path / "a", 2), write_image_folder(tmp_path / "b", 1)
    (test / "class2").rename(test / "class9")
    folders = DataConfig(name=f"imagefolder:{images}", test=f"imagefolder:{test}")
    assert len(load_run_split(folders, "train")) == 6
    with pytest.raises(DatasetError, match="class9.*the training split .*class2"):
        load_run_split(folders, "test")


def test_a_datasets_own_test_split_is_labelled_as_its_training_split(tmp_path: Path) -> None:
    """A dataset's own test split took its classes from its own table: a ClassLabel listing the
    names in another order scored a run's test 0% (eval, relabelling by name, 100%), fewer
    numbered labels left the run's own data refused by eval, a label past training's crashed at
    the run's end. Now its labels are training's, told here by each image's colour."""
    import datasets

    train = table(30)
    names = ["blue", "red", "green"]  # the test split's ClassLabel, in another order
    test = table(9).cast_column("label", datasets.Value("int64"))
    test = test.map(lambda row: {"label": names.index(["red", "green", "blue"][row["label"]])})
    test = test.cast_column("label", datasets.ClassLabel(names=names))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "order"))
    split = load_split(f"hf:{tmp_path / 'order'}", "test")
    assert split.classes == ["red", "green", "blue"]
    colour = [int(np.asarray(Image.open(io.BytesIO(split.read(i)))).mean((0, 1)).argmax())
              for i in range(len(split))]  # fmt: skip
    assert split.labels.tolist() == colour and len(set(colour)) == 3

    def numbered(test_labels: list[int], name: str) -> str:
        ints = datasets.Value("int64")
        parts = {"train": table(30).cast_column("label", ints), "test": table(len(test_labels))}
        parts["test"] = (
            parts["test"]
            .cast_column("label", ints)
            .map(lambda row, i: {"label": test_labels[i]}, with_indices=True)
        )
        datasets.DatasetDict(parts).save_to_disk(str(tmp_path / name))
        return f"hf:{tmp_path / name}"

    fewer = load_split(numbered([0, 1, 0, 1], "fewer"), "test")  # training's 3 classes, not 2
    assert fewer.classes == ["0", "1", "2"] and fewer.labels.tolist() == [0, 1, 0, 1]
    with pytest.raises(DatasetError, match="#test has label 3, past the training split train's "
                                           "classes 0..2"):  # fmt: skip
        load_split(numbered([0, 3, 1], "more"), "test")
    other = table(6).cast_column("label", datasets.ClassLabel(names=["red", "green", "teal"]))
    datasets.DatasetDict({"train": train, "test": other}).save_to_disk(str(tmp_path / "teal"))
    with pytest.raises(DatasetError, match="has classes the training split train has not: "
                                           r"\['teal'\]"):  # fmt: skip
        load_split(f"hf:{tmp_path / 'teal'}", "test")
    for names, fine in ((["cat", "dog", "cow"], False), (["red", "blue"], True)):  # none shared:
        other = table(6).cast_column("label", datasets.Value("int64"))  # refused, not by index;
        k = len(names)  # fewer: mapped
        other = other.map(lambda row, k=k: {"label": row["label"] % k})
        other = other.cast_column("label", datasets.ClassLabel(names=names))
        folder = tmp_path / "-".join(names)
        datasets.DatasetDict({"train": train, "test": other}).save_to_disk(str(folder))
        if fine:
            got = load_split(f"hf:{folder}", "test")
            assert got.labels.tolist() == [[0, 2][y % 3 % 2] for y in range(6)]  # red, blue
            continue
        with pytest.raises(DatasetError, match="has classes the training split train has not"):
            load_split(f"hf:{folder}", "test")
    ints = table(6).cast_column("label", datasets.Value("int64"))  # training's names, by index
    datasets.DatasetDict({"train": train, "test": ints}).save_to_disk(str(tmp_path / "ints"))
    by_index = load_split(f"hf:{tmp_path / 'ints'}", "test")
    assert (
        by_index.classes == ["red", "green", "blue"] and by_index.labels.tolist() == [0, 1, 2] * 2
    )


def test_train_from_parquet_files(tmp_path: Path, monkeypatch, capsys) -> None:
    """Trains from a parquet file with data.test another; every loader's workers are ended
    (train's after training, validation's after each evaluation, test's after testing)."""
    import datasets

    from vitlab.data.loader import FolderLoader

    closed, close = [], FolderLoader.close
    monkeypatch.setattr(FolderLoader, "close", lambda self: closed.append(self) or close(self))
    table(90).to_parquet(str(tmp_path / "train.parquet"))
    table(30).to_parquet(str(tmp_path / "test.parquet"))
    cfg = load_run_config(None, [*TINY_MODEL, f"data.name=hf:{tmp_path / 'train.parquet'}",
                                 f"data.test=hf:{tmp_path / 'test.parquet'}", "data.workers=1",
                                 "train.batch_size=16", "train.epochs=1"])  # fmt: skip
    run = train(cfg, out=tmp_path / "run")
    assert "81 train / 9 val / 30 test" in capsys.readouterr().err  # train.parquet whole
    result = json.loads((run / "results.json").read_text())
    assert result["top1"] is not None and result["num_images"] == 30
    assert len({id(x) for x in closed}) == 3 and all(x._loader is None for x in closed)
    from vitlab.eval.run import evaluate_checkpoint  # the run's data.test, as train reported

    again = evaluate_checkpoint(str(run / "checkpoints" / "best"), device="cpu")
    assert again["num_images"] == 30 and again["top1"] == result["top1"]
    assert again["data"] == f"hf:{tmp_path / 'test.parquet'}"  # it named train.parquet
    # --data names a source of one split, or one split of a dataset: all of it is the test
    # split, as for an image folder without train/ (a seeded fifth of it was scored, 6 of 30)
    splits = datasets.DatasetDict({"train": table(90), "test": table(30)})
    splits.save_to_disk(str(tmp_path / "dict"))
    for source in (tmp_path / "test.parquet", f"{tmp_path / 'dict'}#test"):
        other = evaluate_checkpoint(str(run), data=f"hf:{source}", device="cpu")
        assert other["num_images"] == 30, source
    assert evaluate_checkpoint(str(run), data=f"hf:{tmp_path / 'dict'}")["num_images"] == 30


def test_quiet_hides_the_datasets_librarys_progress_bars(tmp_path: Path, capfd) -> None:
    """`vitlab -q` hid vitlab's messages, but `datasets` still drew its own bars on stderr
    ("Generating train split"), as `data shard --no-progress` did; now either hides them too, and
    a run without either still shows them."""
    import datasets

    from vitlab.cli.main import main

    for i, (before, after) in enumerate(((["-q"], []), ([], ["--no-progress"]), ([], []))):
        table(12 + i).to_parquet(str(tmp_path / f"t{i}.parquet"))  # a new file: not cached
        args = ["data", "shard", f"hf:{tmp_path / f't{i}.parquet'}", str(tmp_path / f"s{i}")]
        assert main([*before, *args, *after]) == 0
        err = capfd.readouterr().err
        assert ("Generating train split" in err) == (i == 2), (before, after, err)
    assert datasets.utils.logging.is_progress_bar_enabled()  # restored after -q


def test_a_split_with_some_unlabelled_rows_says_how_to_keep_the_others(tmp_path: Path) -> None:
    """Rows labelled -1 among labelled ones were explained ("negative labels mark unlabelled
    rows"), then refused, without the way to train on the rest: the message gives it, and
    doing what it says reads the labelled rows."""
    import datasets

    some = table(8).cast_column("label", datasets.Value("int64"))
    some = some.map(lambda r, i: {"label": [0, 1, -1, 2, 0, -1, 1, 2][i]}, with_indices=True)
    some.save_to_disk(str(tmp_path / "some"))
    with pytest.raises(DatasetError, match=r"2 labels are not class indices 0..2 .row 2: -1;") as e:
        load_split(f"hf:{tmp_path / 'some'}", "all")
    advice = str(e.value).partition("e.g. `")[2].partition("`")[0]
    assert advice == "ds.filter(lambda r: r['label'] >= 0).save_to_disk(PATH)"
    kept_at = tmp_path / "kept"
    scope = {"ds": datasets.load_from_disk(str(tmp_path / "some")), "PATH": str(kept_at)}
    eval(advice, scope)
    kept = load_split(f"hf:{kept_at}", "all")
    assert len(kept) == 6 and sorted(kept.labels.tolist()) == [0, 0, 1, 1, 2, 2]
    # not where filtering would leave nothing: every row unlabelled
    none = table(8).cast_column("label", datasets.Value("int64"))
    none.map(lambda r: {"label": -1}).save_to_disk(str(tmp_path / "none"))
    with pytest.raises(DatasetError, match="8 labels are not class indices .*unlabelled rows\\)$"):
        load_split(f"hf:{tmp_path / 'none'}", "all")
