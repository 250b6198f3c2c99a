"""Few-shot linear evaluation (paper §4.1, big_vision fewshot_lsr): the closed-form ridge against
scikit-learn, a case worked by hand, the k-shot draw, and `vitlab fewshot` end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge

from tests.helpers import clusters, tiny_checkpoint
from vitlab.cli.main import main
from vitlab.data import DatasetError
from vitlab.eval.feature_cache import Features
from vitlab.eval.fewshot import (
    BIAS_CONSTANT,
    design,
    drawable,
    fewshot,
    fewshot_checkpoint,
    fit_ridge,
    kshot_indices,
)
from vitlab.formats.base import load_weights


@pytest.mark.parametrize("n, d", [(12, 30), (80, 30)], ids=["N<D", "N>=D"])
def test_ridge_weights_equal_sklearn_ridge_on_the_same_design(n: int, d: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 10, size=d) + rng.normal(size=d)
    y = np.arange(n) % 4
    fit = fit_ridge(x, y, 4, l2=1024.0)
    a = design(x, fit.mean, fit.std)
    assert a.shape == (n, d + 1) and np.all(a[:, -1] == BIAS_CONSTANT)
    np.testing.assert_allclose(a[:, :-1].mean(axis=0), 0, atol=1e-9)  # the subset's own mean
    np.testing.assert_allclose(a[:, :-1].std(axis=0), 1, atol=1e-4)  # ... and std (+1e-5)
    targets = 2.0 * np.eye(4)[y] - 1.0
    ref = Ridge(alpha=1024.0, fit_intercept=False).fit(a, targets)
    assert fit.weights.shape == (d + 1, 4)
    np.testing.assert_allclose(fit.weights, ref.coef_.T, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(fit.predict(x), ref.predict(a).argmax(axis=1))


def test_ridge_by_hand() -> None:
    # one shot of each of two classes at x = 0 and x = 2: standardised to -a and a (mean 1,
    # std 1 + 1e-5, a = 1 / (1 + 1e-5)), bias column 100; A^T A = diag(2a², 2·100²) and A^T T has
    # no bias part (the classes balance), so W = [[-2a, 2a] / (2a² + λ), [0, 0]]
    fit = fit_ridge(np.array([[0.0], [2.0]]), np.array([0, 1]), 2, l2=2.0)
    a = 1 / (1 + 1e-5)
    np.testing.assert_allclose(fit.mean, [1.0])
    np.testing.assert_allclose(fit.std, [1.0 + 1e-5])
    w = 2 * a / (2 * a * a + 2.0)  # ~0.5
    np.testing.assert_allclose(fit.weights, [[-w, w], [0.0, 0.0]], atol=1e-12)
    np.testing.assert_allclose(fit.scores(np.array([[3.0]])), [[-2 * a * w, 2 * a * w]])
    assert fit.predict(np.array([[-5.0], [0.9], [1.1], [7.0]])).tolist() == [0, 0, 1, 1]


def test_kshot_draw_takes_exactly_k_per_class_and_differs_across_seeds() -> None:
    labels = np.array([0] * 30 + [1] * 12 + [2] * 7)
    np.random.default_rng(5).shuffle(labels)
    classes = ["a", "b", "c"]
    draws = {seed: kshot_indices(labels, 5, seed, classes) for seed in range(3)}
    for idx in draws.values():
        assert len(idx) == len(set(idx.tolist())) == 15
        assert np.bincount(labels[idx]).tolist() == [5, 5, 5]
    assert len({tuple(sorted(d.tolist())) for d in draws.values()}) == 3  # the seeds differ
    np.testing.assert_array_equal(kshot_indices(labels, 5, 1, classes), draws[1])  # repeatable
    # the draw of k shots is the start of each class's permutation: 2 shots are within 5
    two = kshot_indices(labels, 2, 1, classes)
    assert set(two.tolist()) <= set(draws[1].tolist())
    # the first class's draw is numpy's default_rng(seed).permutation of its indices
    ref = np.random.default_rng(1).permutation(np.flatnonzero(labels == 0))[:5]
    np.testing.assert_array_equal(draws[1][:5], ref)
    with pytest.raises(DatasetError, match=r"class 2 \('c'\) has 7 training image\(s\), fewer"):
        kshot_indices(labels, 8, 0, classes)


def test_fewshot_on_separable_features_is_near_perfect_and_reports_every_seed() -> None:
    centres = np.random.default_rng(0).normal(size=(5, 24)) * 3
    train, test = clusters(30, centres, 1), clusters(20, centres, 2)
    results = fewshot(train, test, shots=[1, 10], seeds=3, l2=1024.0)
    assert [r["shots"] for r in results] == [1, 10]
    for r in results:
        assert len(r["per_seed"]) == 3
        assert r["mean"] == pytest.approx(np.mean(r["per_seed"]))
        assert r["std"] == pytest.approx(np.std(r["per_seed"]))
    assert results[1]["mean"] > 0.98
    with pytest.raises(DatasetError, match="31 shots need 31 training images of every class"):
        fewshot(train, test, shots=[1, 31])
    ten = clusters(3, np.random.default_rng(0).normal(size=(10, 24)), 1)
    with pytest.raises(DatasetError, match=r"10 class\(es\) have fewer: .*'7' \(3\), \.\.\.$"):
        fewshot(ten, ten, shots=[5], seeds=1, l2=1.0)  # eight named, the rest said to be there


@pytest.mark.parametrize(
    "overrides", [{}, {"img_size": 16, "patch_size": 4, "in_chans": 3}], ids=["grey8", "rgb16"]
)
def test_fewshot_cli_on_digits_with_a_random_model(overrides, tmp_path: Path, capsys) -> None:
    ckpt = tiny_checkpoint(tmp_path / "tiny", **overrides)
    args = ["fewshot", str(ckpt), "--data", "digits", "--device", "cpu", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    p = report["protocol"]
    assert p["shots"] == [1, 5, 10, 25] and p["seeds"] == [0, 1, 2] and p["l2"] == 1024.0
    assert p["bias_constant"] == 100.0 and p["features"] == "prelogits"
    assert "k-shot subset" in p["standardisation"]
    assert report["data"] == "digits" and report["feature_dim"] == 16
    assert (report["num_train_images"], report["num_test_images"]) == (1438, 359)
    assert report["cache"] == {"train": None, "test": None}  # not a run, no --cache-dir
    by_shots = {r["shots"]: r for r in report["results"]}
    assert by_shots[25]["mean"] > 0.2  # random features still carry the digits: chance is 10%
    assert all(len(r["per_seed"]) == 3 for r in report["results"])

    assert main(["fewshot", str(ckpt), "--data", "digits", "--shots", "5", "--seeds", "2"]) == 0
    table = capsys.readouterr().out
    assert "few-shot linear" in table and "    5 " in table
    drawn = re.search(r"1,438 train \((\d+) drawn\) / 359 test images", table)
    assert drawn and 50 <= int(drawn[1]) <= 100, table  # 5 shots of 10 classes, 2 seeds


def test_fewshot_cli_errors(tmp_path: Path, capsys) -> None:
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    assert main(["fewshot", str(ckpt), "--data", "digits", "--shots", "1,500"]) == 2
    err = capsys.readouterr().err
    assert "vitlab fewshot: error: 500 shots need 500 training images" in err
    assert main(["fewshot", str(ckpt)]) == 2
    assert "--data is needed" in capsys.readouterr().err
    for l2 in ("0", "nan", "inf"):  # NaN once fitted chance-level weights, exit code 0
        assert main(["fewshot", str(ckpt), "--data", "digits", "--l2", l2]) == 2
        assert "l2 must be a positive finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fewshot", str(ckpt), "--data", "digits", "--shots", "1,x"])
    assert "comma-separated whole numbers >= 1 like 1,5,10" in capsys.readouterr().err
    for bad, said in (("5,5,1", "5 given twice in '5,5,1'"), ("1,,5", "got '1,,5'")):
        with pytest.raises(SystemExit):  # the 5-shot row twice, an entry dropped silently
            main(["fewshot", str(ckpt), "--data", "digits", "--shots", bad])
        assert said in capsys.readouterr().err


def test_a_data_dir_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    """`--data-dir FILE` was ignored silently (digits read as without it; a feature cache was
    even written under its name); it is refused, naming the file, as `train data.dir=FILE` is."""
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    file = tmp_path / "afile"
    file.write_text("")
    cache = tmp_path / "cache"
    args = ["fewshot", str(ckpt), "--data", "digits", "--shots", "1", "--seeds", "1"]
    assert main([*args, "--data-dir", str(file), "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab fewshot: error: the data folder") and str(file) in err
    assert "is a file, not a folder" in err and not cache.exists()


def test_fewshot_extracts_only_the_drawn_training_images(tmp_path: Path) -> None:
    """`vitlab fewshot` extracted every training image's features to use k per class and seed
    (ImageNet's 1.28 million for 25 shots of 1,000 classes): now only the images some draw
    takes, with the same draws and accuracies as from the whole split's features."""
    from vitlab.eval.features import Extractor
    from vitlab.eval.fewshot import fewshot_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "tiny")
    args = dict(data="digits", shots=(1, 5), seeds=2, device="cpu", progress=False)
    drawn = fewshot_checkpoint(str(ckpt), cache_dir=tmp_path / "drawn", **args)
    assert drawn["num_train_images"] == 1438  # the split's, as before
    assert 10 <= drawn["train_images_extracted"] <= 2 * 5 * 10  # two draws of 5 shots, 10 classes
    whole_cache = tmp_path / "whole"
    whole = Extractor(str(ckpt), device="cpu", cache_dir=whole_cache, progress=False)
    assert len(whole.features("digits", None, "train")) == 1438  # the whole split, cached
    full = fewshot_checkpoint(str(ckpt), cache_dir=whole_cache, **args)
    assert full["cached"]["train"] and full["train_images_extracted"] == 1438
    for a, b in zip(drawn["results"], full["results"], strict=True):  # one image at most apart
        assert np.allclose(a["per_seed"], b["per_seed"], atol=1.5 / 359), (a, b)
    again = fewshot_checkpoint(str(ckpt), cache_dir=tmp_path / "drawn", **args)
    assert again["cached"]["train"] and again["results"] == drawn["results"]

    def two_draws(labels: np.ndarray, classes: list[str]) -> np.ndarray:
        return np.concatenate([kshot_indices(labels, 5, s, classes) for s in range(2)])

    every = whole.features("digits", None, "train")
    picked = Extractor(str(ckpt), device="cpu", progress=False)
    part = picked.features("digits", None, "train", two_draws)
    assert picked.forward_batches == 1 and len(part) <= 100 and torch.equal(part.labels, every.y)
    for seed in range(2):  # the same images' features as in the whole split's
        idx = kshot_indices(every.y.numpy(), 5, seed, every.classes)
        torch.testing.assert_close(part.at(idx), every.x[idx], atol=1e-5, rtol=1e-5)


def test_a_drawn_image_that_does_not_decode_falls_back_to_every_image(tmp_path: Path, caplog):
    """A picked image that does not decode: every image's features are extracted (with the rows
    that decoded), and the draw is from the labels of the images that decode."""
    from PIL import Image

    from vitlab.eval.features import Extractor

    root = tmp_path / "images"
    for split, c in ((s, c) for s in ("train", "test") for c in ("a", "b")):
        (root / split / c).mkdir(parents=True)
        for i in range(4):
            Image.new("L", (8, 8), 40 * i + 100 * (c == "b")).save(root / split / c / f"{i}.png")
    (root / "train" / "a" / "0.png").write_bytes(b"not a png")  # row 0: drawn below
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    cache = tmp_path / "cache"
    ex = Extractor(str(ckpt), device="cpu", cache_dir=cache, progress=False)
    got = ex.features(f"imagefolder:{root}", None, "train", lambda labels, classes: [0, 4])
    assert got.rows.tolist() == list(range(1, 8)) and len(got) == 7  # every one that decodes
    assert len(got.labels) == 8  # the split's listed labels
    bad = Features(got.x, got.labels[1:], got.classes)  # drawn by the decoded images' labels
    drawn = drawable(got, 4, 1)  # (row 0, which 4 shots draw, did not decode)
    assert 0 in kshot_indices(got.labels.numpy(), 4, 0, got.classes)  # all four of class a
    assert drawn.rows is None and torch.equal(drawn.labels, bad.y) and torch.equal(drawn.x, got.x)
    assert "1 of the images picked did not decode" in caplog.text
    named = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(named) == 1, [r.getMessage() for r in named]  # not again by the second loader
    (kept,) = cache.glob("*.safetensors")  # the whole split's, not the two rows' (one short)
    assert kept == got.cache and len(load_weights(kept)["labels"]) == 7
    assert load_weights(kept)["rows"].tolist() == list(range(1, 8))
    caplog.clear()  # read from the cache, the image is not decoded again: said from the file
    again = Extractor(str(ckpt), device="cpu", cache_dir=cache, progress=False)
    assert len(again.features(f"imagefolder:{root}", None, "train")) == 7 and not again.loaded
    assert f"1 of the imagefolder:{root} train images did not decode" in caplog.text
    fine = Extractor(str(ckpt), device="cpu", progress=False)
    two = fine.features(f"imagefolder:{root}", None, "train", lambda labels, classes: [1, 4])
    assert two.rows.tolist() == [1, 4] and len(two) == 2 and two.y.tolist() == [0, 1]


def test_a_subset_file_serves_fewer_rows_and_gives_way_to_one_holding_it(tmp_path: Path):
    """Subset caches accumulated, one file per set of drawn rows (another `--shots` or
    `--seeds`: up to 230 MB each for ImageNet's 75,000 default draws). Now a file holding every
    row asked for serves them (the model does not run), writing one that holds an older file's
    rows removes the older, and writing the whole split's removes them all; the features served
    are the images' own (against an extraction without a cache)."""
    from PIL import Image

    from vitlab.eval.features import Extractor

    root = tmp_path / "images"
    for split, c in ((s, c) for s in ("train", "test") for c in ("a", "b")):
        (root / split / c).mkdir(parents=True)
        for i in range(4):
            Image.new("L", (8, 8), 30 * i + 100 * (c == "b")).save(root / split / c / f"{i}.png")
    name, ckpt, cache = f"imagefolder:{root}", tiny_checkpoint(tmp_path / "tiny"), tmp_path / "c"
    every = Extractor(str(ckpt), device="cpu", progress=False).features(name, None, "train").x

    def rows(picked: list[int]) -> tuple[Extractor, object]:
        ex = Extractor(str(ckpt), device="cpu", cache_dir=cache, progress=False)
        got = ex.features(name, None, "train", lambda labels, classes: np.array(picked))
        torch.testing.assert_close(got.at(np.array(picked)), every[picked])
        return ex, got

    def files() -> list[Path]:
        return sorted(cache.glob("*.safetensors"))

    ex, three = rows([1, 2, 5])
    assert ex.forward_batches == 1 and len(files()) == 1
    ex, two = rows([5, 1])  # fewer rows: from the file of three
    assert ex.forward_batches == 0 and two.cached and two.rows.tolist() == [1, 5]  # those only
    ex, five = rows([1, 2, 3, 5, 6])  # more: extracted, and the file of three removed
    assert ex.forward_batches == 1 and files() == [five.cache] != [three.cache]
    ex, other = rows([0, 7])  # neither holds the other: both kept
    assert ex.forward_batches == 1 and files() == sorted([five.cache, other.cache])
    whole = Extractor(str(ckpt), device="cpu", cache_dir=cache, progress=False)
    assert len(whole.features(name, None, "train")) == 8 and len(files()) == 1
    ex, _ = rows([0, 3])  # from the whole split's file, found before any subset's
    assert ex.forward_batches == 0 and len(files()) == 1


def test_draws_do_not_depend_on_where_the_features_come_from(tmp_path: Path) -> None:
    """A training image no draw takes does not decode: drawn from the picked rows, the draws
    followed every listed label; from the whole split's features (cached by `vitlab probe`),
    the labels of the images that decode, so the same seed drew other images. Now both draw
    by the listed labels (kshot_indices on the folder's labels, by hand), cached or not."""
    from PIL import Image

    from vitlab.eval.features import Extractor

    root = tmp_path / "images"
    for split, c in ((s, c) for s in ("train", "test") for c in ("a", "b")):
        (root / split / c).mkdir(parents=True)
        for i in range(4):
            Image.new("L", (8, 8), 40 * i + 100 * (c == "b")).save(root / split / c / f"{i}.png")
    listed = np.array([0] * 4 + [1] * 4)  # a/0-3, b/0-3: the scan's order
    drawn = kshot_indices(listed, 2, 0, ["a", "b"])
    bad = next(i for i in range(8) if i not in drawn)  # an image no draw takes
    (root / "train" / ("a" if bad < 4 else "b") / f"{bad % 4}.png").write_bytes(b"broken")
    name, ckpt = f"imagefolder:{root}", tiny_checkpoint(tmp_path / "tiny")
    args = dict(data=name, shots=(2,), seeds=1, device="cpu", progress=False)
    picked = fewshot_checkpoint(str(ckpt), cache_dir=tmp_path / "picked", **args)
    assert picked["train_images_extracted"] == 4  # the drawn rows alone
    whole = Extractor(str(ckpt), device="cpu", cache_dir=tmp_path / "whole", progress=False)
    every = whole.features(name, None, "train")  # as `vitlab probe` caches it
    assert len(every) == 7 and bad not in every.rows.tolist()
    assert drawable(every, 2, 1) is every  # by the listed labels
    cached = fewshot_checkpoint(str(ckpt), cache_dir=tmp_path / "whole", **args)
    assert cached["cached"]["train"] and cached["results"] == picked["results"]
    assert cached["num_train_images"] == cached["train_images_extracted"] == 7  # that decode
    assert picked["num_train_images"] == 8  # listed (no image but the drawn was decoded)
    again = Extractor(str(ckpt), device="cpu", cache_dir=tmp_path / "whole", progress=False)
    read = again.features(name, None, "train")
    assert (
        read.cached
        and torch.equal(read.rows, every.rows)
        and torch.equal(read.labels, every.labels)
    )
    torch.testing.assert_close(read.at(drawn), every.at(drawn))
