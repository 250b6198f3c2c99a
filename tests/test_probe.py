"""Linear and k-NN probes, feature extraction (kinds, channels) and the feature cache, and
`vitlab probe` end to end."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import clusters, tiny_checkpoint
from vitlab.cli.main import main
from vitlab.config import load_run_config
from vitlab.data import ArraySplit, DatasetError, make_loader
from vitlab.eval.features import Extractor, extract, match_channels, represent
from vitlab.eval.probe import C_GRID, knn_probe, knn_scores, linear_probe
from vitlab.formats.base import preprocessing_of, safetensors_metadata
from vitlab.models.checkpoint import save_pretrained
from vitlab.models.vit import VisionTransformer, ViTConfig

# --- k-NN ----------------------------------------------------------------------------------------


def test_knn_on_separated_clusters_is_near_perfect() -> None:
    centres = np.random.default_rng(0).normal(size=(6, 32)) * 2
    train, test = clusters(40, centres, 1), clusters(25, centres, 2)
    r = knn_probe(train, test, k=20, temperature=0.07)
    assert r["top1"] > 0.98 and r["k"] == 20
    # chunks of test rows give the same votes as one pass
    one = knn_scores(train.x, train.y, test.x, 6, chunk=10_000)
    # up to rounding: a product over other row blocks may round sim differently by an ulp (the
    # BLAS picks kernels by shape; seen on an AMD EPYC), which exp(sim / T) scales by 1 / T
    torch.testing.assert_close(
        knn_scores(train.x, train.y, test.x, 6, chunk=7), one, rtol=1e-5, atol=1e-5
    )


def test_knn_temperature_weighting_can_overrule_the_majority() -> None:
    # the query's nearest neighbour (cosine 1.0) is class 0; the next two (cosine 0.9) class 1
    s = np.sqrt(1 - 0.9**2)
    train_x = torch.tensor([[1.0, 0.0, 0.0], [0.9, s, 0.0], [0.9, 0.0, s], [-1.0, 0.0, 0.0]])
    train_y = torch.tensor([0, 1, 1, 1])
    query = torch.tensor([[2.0, 0.0, 0.0]])  # the length does not matter: cosine
    sharp = knn_scores(train_x, train_y, query, 2, k=3, temperature=0.07)
    # exp(1/T) against 2 exp(0.9/T): class 0 wins by exp(0.1/T)/2 ~ 2.09
    assert sharp.argmax().item() == 0
    torch.testing.assert_close(
        sharp[0, 0] / sharp[0, 1], torch.tensor(np.exp(0.1 / 0.07) / 2).float()
    )
    majority = torch.bincount(train_y[:3], minlength=2)  # a plain vote of the 3 nearest
    assert majority.argmax().item() == 1
    flat = knn_scores(train_x, train_y, query, 2, k=3, temperature=100.0)
    assert flat.argmax().item() == 1  # a high temperature is almost a plain vote
    for bad in (0.0, float("nan"), float("inf")):  # NaN once scored every class NaN, silently
        with pytest.raises(ValueError, match="k >= 1 and a temperature > 0"):
            knn_scores(train_x, train_y, query, 2, k=3, temperature=bad)


# --- linear --------------------------------------------------------------------------------------


def test_linear_probe_on_separable_features_picks_c_on_held_out_data() -> None:
    centres = np.random.default_rng(0).normal(size=(4, 20))
    train, test = clusters(50, centres, 1), clusters(30, centres, 2)
    r = linear_probe(train.x.numpy(), train.y.numpy(), test.x.numpy(), test.y.numpy())
    assert r["top1"] > 0.97
    assert r["C"] in C_GRID and [g["C"] for g in r["grid"]] == list(C_GRID)
    assert r["num_val_images"] == 20  # 10% of 200
    best = max(g["val_top1"] for g in r["grid"])
    assert next(g for g in r["grid"] if g["C"] == r["C"])["val_top1"] == best
    assert all(0.0 <= g["val_top1"] <= 1.0 for g in r["grid"])
    # the test split plays no part in the choice: other test labels, the same grid and C
    scrambled = np.random.default_rng(3).permutation(test.y.numpy())
    other = linear_probe(train.x.numpy(), train.y.numpy(), test.x.numpy(), scrambled)
    assert other["grid"] == r["grid"] and other["C"] == r["C"] and other["top1"] < 0.5


# --- extraction ----------------------------------------------------------------------------------


def test_feature_kinds_and_channel_conversion() -> None:
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=32, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    model = VisionTransformer(cfg.replace(distilled=True)).eval()  # two prefix tokens
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)
    torch.testing.assert_close(represent(model, x, "gap"), tokens[:, 2:].mean(dim=1))
    torch.testing.assert_close(represent(model, x, "prelogits"), (tokens[:, 0] + tokens[:, 1]) / 2)
    # extraction runs the model in eval mode (no dropout, no drop-path) and gives it back as it was
    noisy = VisionTransformer(cfg.replace(dropout=0.5, drop_path=0.5)).train()
    labels = torch.arange(2)
    first, _ = extract(noisy, [(x, labels)], "prelogits", torch.device("cpu"), progress=False)
    again, _ = extract(noisy, [(x, labels)], "prelogits", torch.device("cpu"), progress=False)
    assert noisy.training and torch.equal(first, again)
    with torch.no_grad():
        torch.testing.assert_close(first, represent(noisy.eval(), x, "prelogits"))
    # timm's avg-pooled layout (fc_norm): the final norm comes after pooling, for gap too
    avg = VisionTransformer(cfg.replace(pool="gap", fc_norm=True)).eval()
    with torch.no_grad():
        avg.fc_norm.weight.uniform_(0.5, 2.0)  # not the identity's
        tokens = avg.forward_features(x)
        by_hand = torch.nn.functional.layer_norm(
            tokens[:, 1:].mean(dim=1), (16,), avg.fc_norm.weight, avg.fc_norm.bias, 1e-6
        )
    torch.testing.assert_close(represent(avg, x, "gap"), by_hand)
    # 28x28 grey images for a 32x32 RGB model: repeated to three channels and resized
    grey = ArraySplit(torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8), torch.arange(5), [])
    pre = preprocessing_of(model)
    feats, labels = extract(
        model, make_loader(match_channels(grey, pre, "g"), 2, pre), "gap", torch.device("cpu")
    )
    assert (
        feats.shape == (5, 16)
        and feats.dtype == torch.float32
        and labels.tolist() == [0, 1, 2, 3, 4]
    )
    # RGB images for a grey model: converted to grey as the same pixels stored as PNG files are
    # decoded grey (CIFAR's arrays and a folder of its images agree within a grey level)
    import io

    from PIL import Image

    from vitlab.data.decode import decode_image

    pixels = torch.randint(0, 256, (2, 3, 28, 28), dtype=torch.uint8)
    rgb = ArraySplit(pixels, torch.arange(2), [])
    grey = match_channels(rgb, pre.__class__((8, 8), 1, (0.5,), (0.5,)), "c").images
    files = []
    for p in pixels:
        out = io.BytesIO()
        Image.fromarray(p.permute(1, 2, 0).numpy()).save(out, format="PNG")
        files.append(decode_image(out.getvalue(), 1, "p.png"))
    diff = (grey.int() - torch.stack(files).int()).abs()
    assert grey.shape == (2, 1, 28, 28) and diff.max() <= 1
    assert (diff == 0).float().mean() > 0.9  # PIL's integer luma: half the pixels a level off
    with pytest.raises(
        DatasetError, match="c has 3-channel images and the model's preprocessing takes 2"
    ):
        match_channels(rgb, pre.__class__((8, 8), 2, (0.5,) * 2, (0.5,) * 2), "c")


def test_eval_repeats_grey_images_for_an_rgb_model(tmp_path: Path) -> None:
    """`vitlab eval CKPT --data digits` with a 3-channel model: the grey images are repeated to
    RGB (it once failed in normalisation with a traceback), and it scores exactly as the 1-channel
    model whose patch weights are the RGB model's summed over the channels (repeated input,
    per-channel normalisation alike) scores on the grey images themselves."""
    from vitlab.eval.run import evaluate_checkpoint

    rgb = VisionTransformer(ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=10,
                                      embed_dim=16, depth=1, num_heads=2, mlp_dim=32))  # fmt: skip
    torch.nn.init.normal_(rgb.head.weight, std=0.5)
    grey = VisionTransformer(rgb.config.replace(in_chans=1))
    state = rgb.state_dict()
    state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"].sum(1, keepdim=True)
    grey.load_state_dict(state)
    save_pretrained(rgb, tmp_path / "rgb")
    save_pretrained(grey, tmp_path / "grey")
    got, want = (
        evaluate_checkpoint(str(tmp_path / name), data="digits", out=tmp_path, device="cpu")
        for name in ("rgb", "grey")
    )
    assert got["num_images"] == want["num_images"] == 359
    assert got["top1"] == want["top1"] and got["confusion"] == want["confusion"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


# --- the cache -----------------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A vitlab run folder: config.yaml and checkpoints/best, without training."""
    run = tmp_path / "run"
    tiny_checkpoint(run / "checkpoints" / "best")
    cfg = load_run_config(None, ["data.name=digits"])
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_tree()))
    return run


def test_a_runs_features_are_cached_in_the_run_and_reused(run: Path) -> None:
    first = Extractor(str(run), device="cpu", progress=False)
    a = first.features(None, None, "test")  # the run's dataset: digits
    assert not a.cached and first.forward_batches == 2
    files = list((run / "features").glob("*.safetensors"))
    assert files == [a.cache] and a.cache.name.startswith("digits_test_prelogits_")
    key = json.loads(safetensors_metadata(a.cache)["key"])
    assert key["data"] == "digits" and key["split"] == "test" and key["features"] == "prelogits"
    assert key["weights"]["path"] == str((run / "checkpoints/best/model.safetensors").resolve())
    mtime = a.cache.stat().st_mtime_ns

    again = Extractor(str(run / "checkpoints" / "best"), device="cpu", progress=False)
    b = again.features("digits", None, "test")
    assert b.cached and again.forward_batches == 0 and not again.loaded  # never loaded
    assert a.cache.stat().st_mtime_ns == mtime
    torch.testing.assert_close(b.x, a.x)
    assert torch.equal(b.y, a.y) and b.classes == a.classes

    gap = Extractor(str(run), kind="gap", device="cpu", progress=False)
    assert not gap.features("digits", None, "test").cached  # another kind, another file
    assert len(list((run / "features").glob("*.safetensors"))) == 2

    weights = run / "checkpoints" / "best" / "model.safetensors"
    os.utime(weights, ns=(mtime + 10**9, mtime + 10**9))  # new weights: extracted again
    fresh = Extractor(str(run), device="cpu", progress=False)
    assert not fresh.features("digits", None, "test").cached and fresh.forward_batches == 2

    # an image folder as data.test: its files are part of the key, as data.name's are
    folder = run.parent / "test-images" / "cls"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(b"one")
    cfg = dataclasses.replace(fresh.dataset(None, None), test=f"imagefolder:{folder.parent}")
    before = fresh.key(cfg, "test")
    (folder / "b.png").write_bytes(b"two")  # an image added
    after = fresh.key(cfg, "test")
    assert before["test_files"] != after["test_files"]
    assert after["test"] == f"imagefolder:{folder.parent.resolve()}"

    # a Hugging Face dataset on disk, too: it was keyed by its name alone, so features of a
    # rewritten dataset were served from the cache
    from tests.test_hf_data import table

    saved, parquet = run.parent / "saved", run.parent / "rows.parquet"
    names = (f"hf:{saved}", f"hf:{saved}#train", f"hf:{parquet}")
    keys = []
    for rows in (6, 9):  # written, then rewritten in place
        table(rows).save_to_disk(str(saved))
        table(rows).to_parquet(str(parquet))
        keys.append(
            [fresh.key(dataclasses.replace(cfg, name=n, test=None), "train") for n in names]
        )
    for name, before, after in zip(names, *keys, strict=True):
        assert before["data"].startswith(f"hf:{run.parent.resolve()}/") and before["files"], name
        assert before["files"] != after["files"], name
    cfg = dataclasses.replace(cfg, name="hf:some-org/some-dataset")  # a hub name: as it is
    assert fresh.key(cfg, "train")["data"] == "hf:some-org/some-dataset"


def test_the_cache_key_sees_linked_folders_and_local_shards(
    run: Path, tmp_path: Path, monkeypatch
) -> None:
    """Features of a changed dataset are not served from the cache: an image folder's files
    behind a link to a folder (which its scan follows, as torchvision's does) and local
    WebDataset shards (keyed by their pattern alone before) are part of the key."""
    ex = Extractor(str(run), device="cpu", progress=False)
    cfg = ex.dataset(None, None)
    outside = tmp_path / "elsewhere" / "cat"
    outside.mkdir(parents=True)
    (outside / "a.png").write_bytes(b"one")
    root = tmp_path / "images"
    (root / "dog").mkdir(parents=True)
    (root / "dog" / "b.png").write_bytes(b"two")
    (root / "cat").symlink_to(outside)
    images = dataclasses.replace(cfg, name=f"imagefolder:{root}")
    before = ex.key(images, "train")
    (outside / "c.png").write_bytes(b"three")  # an image added behind the link
    assert ex.key(images, "train")["files"] != before["files"]
    ext = tmp_path / "ext"  # class A links to ext/X, class B to all of ext: each class's scan
    for sub in ("X", "Y"):  # follows its own link, so ext/Y's files are read through B
        (ext / sub).mkdir(parents=True)
        (ext / sub / "a.png").write_bytes(b"one")
    nested = tmp_path / "nested"
    for cls, target in (("A", ext / "X"), ("B", ext)):
        (nested / cls).mkdir(parents=True)
        (nested / cls / "link").symlink_to(target)
    nested_cfg = dataclasses.replace(cfg, name=f"imagefolder:{nested}")
    before = ex.key(nested_cfg, "train")
    (ext / "Y" / "a.png").write_bytes(b"rewritten")
    assert ex.key(nested_cfg, "train")["files"] != before["files"]
    # data.test's folder is read whole, every sub-folder a class, train/ or not
    as_test = dataclasses.replace(cfg, test=f"imagefolder:{nested}")
    (nested / "train" / "cls").mkdir(parents=True)
    (nested / "train" / "cls" / "t.png").write_bytes(b"t")
    before = ex.key(as_test, "test")
    (ext / "X" / "a.png").write_bytes(b"rewritten")  # read through class A
    assert ex.key(as_test, "test")["test_files"] != before["test_files"]
    assert ex.key(images, "train")["files"] == ex.key(images, "train")["files"]  # stable

    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"train-{i}.tar").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    pattern = dataclasses.replace(cfg, name="wds:shards/train-{0..1}.tar")
    first = ex.key(pattern, "train")
    assert first["data"] == f"wds:{shards.resolve()}/train-{{0..1}}.tar" and first["files"]
    (shards / "train-1.tar").write_bytes(b"rewritten")  # a shard written again
    second = ex.key(pattern, "train")
    assert second["files"] != first["files"]
    (shards / "index.json").write_text("{}")  # an index beside them: counts and classes
    assert ex.key(pattern, "train")["files"] != second["files"]
    indexed = dataclasses.replace(cfg, name=f"wds:{shards}")  # an index's folder
    before = ex.key(indexed, "train")
    (shards / "train-0.tar").write_bytes(b"rewritten")
    assert ex.key(indexed, "train")["files"] != before["files"]
    (shards / "part").mkdir()  # a hand-written index naming shards in a sub-folder: keyed by
    (shards / "part" / "a.tar").write_bytes(b"x")  # them too (the top level alone before)
    (shards / "index.json").write_text(json.dumps(
        {"splits": {"train": {"shards": [{"name": "part/a.tar", "count": 1}]}}}))  # fmt: skip
    before = ex.key(indexed, "train")
    (shards / "part" / "a.tar").write_bytes(b"rewritten")
    assert ex.key(indexed, "train")["files"] != before["files"]
    url = dataclasses.replace(cfg, name="wds:https://example.com/train-{0..1}.tar")
    assert ex.key(url, "train")["files"] is None  # a URL: by its name


def test_one_command_digests_an_image_folder_once(run: Path, tmp_path: Path, monkeypatch):
    """vitlab fewshot / probe listed and stat-ed an image folder's files once for each split's
    key (a million-image folder: seconds each); now once for both, while a key asked for alone
    still lists them anew (a changed folder counts)."""
    from PIL import Image

    from vitlab.eval import feature_cache
    from vitlab.eval.features import train_and_test

    root = tmp_path / "images"
    for split, c in ((s, c) for s in ("train", "test") for c in ("a", "b")):
        (root / split / c).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (8, 8), 30 * i + 100 * (c == "b")).save(root / split / c / f"{i}.png")
    listed = []

    def counted(folder, whole=False):
        listed.append(folder)
        return real(folder, whole)

    real = feature_cache.folder_files
    monkeypatch.setattr(feature_cache, "folder_files", counted)
    ex = Extractor(str(run), device="cpu", progress=False)
    train, test, _ = train_and_test(ex, f"imagefolder:{root}", None)
    assert len(train) == len(test) == 6 and len(listed) == 1
    cfg = ex.dataset(f"imagefolder:{root}", None)
    ex.key(cfg, "train"), ex.key(cfg, "test")
    assert len(listed) == 3  # outside one command's reading: each key anew


def test_damaged_cache_is_extracted_again(run: Path, caplog) -> None:
    a = Extractor(str(run), device="cpu", progress=False).features(None, None, "test")
    a.cache.write_bytes(a.cache.read_bytes()[:100])  # truncated
    again = Extractor(str(run), device="cpu", progress=False)
    b = again.features(None, None, "test")
    assert not b.cached and again.forward_batches == 2 and "unreadable" in caplog.text
    torch.testing.assert_close(b.x, a.x)
    # damage inside the data, the header whole: features from it were used, and wrong
    data = bytearray(b.cache.read_bytes())
    data[-40:] = bytes(40)  # the last features' bytes
    b.cache.write_bytes(bytes(data))
    caplog.clear()
    third = Extractor(str(run), device="cpu", progress=False)
    c = third.features(None, None, "test")
    assert not c.cached and third.forward_batches == 2 and "match the checksum" in caplog.text
    torch.testing.assert_close(c.x, a.x)
    assert Extractor(str(run), device="cpu", progress=False).features(None, None, "test").cached


def test_other_sources_cache_only_with_a_cache_dir(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(
        ViTConfig(
            img_size=8, patch_size=2, in_chans=1, num_classes=0, embed_dim=16, depth=1, num_heads=2
        )
    )
    save_pretrained(model, tmp_path / "timm", format="timm")  # a folder with timm's config.json
    src = tmp_path / "timm"
    assert Extractor(str(src), device="cpu", progress=False).cache_dir is None
    cache = tmp_path / "cache"
    first = Extractor(str(src), device="cpu", cache_dir=cache, progress=False)
    assert not first.features("digits", None, "test").cached
    again = Extractor(str(src), device="cpu", cache_dir=cache, progress=False)
    assert again.features("digits", None, "test").cached and again.forward_batches == 0


def test_cifar_from_another_folder_or_rewritten_is_extracted_again(tmp_path, monkeypatch):
    """cifar10 read through $VITLAB_DATA (or data.dir) from another folder, or with a batch
    written again, is not served the first folder's features (keyed by its name alone before);
    the same files are."""
    from tests.test_data import cifar_batch, make_cifar10

    torch.manual_seed(0)
    config = ViTConfig(img_size=8, patch_size=2, in_chans=1, num_classes=0, embed_dim=16, depth=1,
                       num_heads=2)  # fmt: skip
    save_pretrained(VisionTransformer(config), tmp_path / "m.safetensors")
    for name, seed in (("a", 9), ("b", 10)):
        make_cifar10(tmp_path / name / "cifar-10-batches-py")
        (tmp_path / name / "cifar-10-batches-py" / "test_batch").write_bytes(cifar_batch(3, seed))

    def features(folder: str, data_dir: str | None = None):
        monkeypatch.setenv("VITLAB_DATA", str(tmp_path / folder))
        ex = Extractor(str(tmp_path / "m.safetensors"), device="cpu", cache_dir=tmp_path / "cache",
                       progress=False)  # fmt: skip
        return ex.features("cifar10", data_dir, "test")

    a = features("a")
    assert not a.cached and features("a").cached
    b = features("b")
    assert not b.cached and not torch.equal(a.x, b.x)
    assert torch.equal(features("b", str(tmp_path / "a")).x, a.x)  # data.dir before $VITLAB_DATA
    (tmp_path / "a" / "cifar-10-batches-py" / "test_batch").write_bytes(cifar_batch(4, 10))
    again = features("a")
    assert not again.cached and len(again.x) == 4


# --- the command ---------------------------------------------------------------------------------


def test_probe_cli_on_a_run_uses_the_cache_the_second_time(run: Path, capsys) -> None:
    assert main(["probe", str(run), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"] == "digits" and report["features"] == "prelogits"
    assert report["cached"] == {"train": False, "test": False}
    assert Path(report["cache"]["train"]).parent == run / "features"
    assert report["linear"]["top1"] > 0.2 and report["knn"]["top1"] > 0.2  # chance: 10%
    assert report["linear"]["C"] in C_GRID and len(report["linear"]["grid"]) == len(C_GRID)
    assert report["knn"]["k"] == 20 and report["knn"]["temperature"] == 0.07

    assert main(["probe", str(run), "--kind", "knn", "--k", "5", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cached"] == {"train": True, "test": True} and "linear" not in second
    assert second["knn"]["k"] == 5

    assert main(["probe", str(run), "--kind", "linear"]) == 0
    out = capsys.readouterr().out
    assert "linear  top-1" in out and "k-NN" not in out
    for bad in (["--k", "0"], ["--temperature", "nan"]):  # NaN once reported T=nan, exit 0
        assert main(["probe", str(run), *bad]) == 2
        assert "vitlab probe: error: k-NN needs --k >= 1" in capsys.readouterr().err
