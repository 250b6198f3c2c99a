"""`vitlab analyze` end to end on tiny trained models, and index.html in a real headless browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlab.cli.main import main
from vitlab.config import load_run_config
from vitlab.train.run import train

TINY = [
    "model.img_size=8",
    "model.patch_size=2",
    "model.embed_dim=32",
    "model.depth=3",
    "model.num_heads=2",
    "model.mlp_dim=64",
    "train.epochs=2",
]
FIGURES = ["mean_attention_distance.png", "pos_embed_similarity.png", "embedding_filters.png"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("analyze")
    token = train(load_run_config(None, TINY), out=root / "token")
    gap_rel = train(
        load_run_config(
            None, [*TINY, "model.pos_embed=relative", "model.pool=gap", "model.class_token=false"]
        ),
        out=root / "gap",
    )
    return {"token": token, "gap": gap_rel}


def referenced(index: Path) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', index.read_text())


def test_analyze_writes_every_file_and_the_page_references_only_those(runs, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["analyze", str(runs["token"]), "--num-images", "3", "--out", str(out)]) == 0
    index = Path(capsys.readouterr().out.strip())
    assert index == out / "index.html"
    for name in [*FIGURES, "rollout_000.png", "rollout_002.png", "analysis.json"]:
        assert (out / name).is_file(), name
    refs = referenced(index)
    assert set(FIGURES) <= set(refs)
    assert all((out / r).is_file() for r in refs), refs
    data = json.loads((out / "analysis.json").read_text())
    assert data["image_size"] == [8, 8] and data["patch_size"] == 2 and data["num_images"] == 3
    distances = np.array(data["mean_attention_distance"])
    assert distances.shape == (3, 2)  # layers x heads
    max_distance = (6**2 + 6**2) ** 0.5  # corner patch centres of a 4x4 grid of 2-px patches
    assert (distances > 0).all() and (distances <= max_distance).all()
    assert len(data["rollout"]) == 3


def test_gap_model_with_relative_positions_skips_what_does_not_apply(runs, tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["analyze", str(runs["gap"]), "--num-images", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads((out / "analysis.json").read_text())
    assert not (out / "pos_embed_similarity.png").exists()
    assert any("no per-patch vectors" in n for n in data["notes"])
    assert any("mean over patch queries" in n for n in data["notes"])
    assert "position-embedding similarity skipped" in (out / "index.html").read_text()
    assert all((out / r).is_file() for r in referenced(out / "index.html"))


def test_analyze_image_files_of_any_size_and_mode(runs, tmp_path, capsys) -> None:
    files = []
    for i, (mode, size) in enumerate([("RGB", (40, 30)), ("RGBA", (9, 9)), ("L", (64, 64))]):
        shape = (size[1], size[0], len(mode)) if mode != "L" else (size[1], size[0])
        path = tmp_path / f"img{i}.png"
        Image.fromarray(
            np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8), mode
        ).save(path)
        files.append(str(path))
    out = tmp_path / "f"
    args = ["analyze", str(runs["token"]), "--images", *files, "--out", str(out)]
    assert main([*args, "--head-fusion", "max"]) == 0
    capsys.readouterr()
    data = json.loads((out / "analysis.json").read_text())
    assert data["num_images"] == 3 and data["head_fusion"] == "max"
    assert (out / "rollout_002.png").is_file()
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    assert main(["analyze", str(runs["token"]), "--images", str(bad), "--out", str(out)]) == 2
    assert "cannot read image" in capsys.readouterr().err
    # two files of one name in two folders: both analysed, under two names
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / "img0.png"
    Image.fromarray(np.full((8, 8), 255, dtype=np.uint8)).save(twin)
    assert main([*args[:3], files[0], str(twin), "--out", str(out)]) == 0
    capsys.readouterr()
    rollout = json.loads((out / "analysis.json").read_text())["rollout"]
    assert list(rollout) == ["img0.png", "img0-2.png"]
    assert rollout["img0.png"] != rollout["img0-2.png"]
    assert main([*args, "--num-images", "2"]) == 2  # a count it cannot use is refused
    assert "--num-images counts a dataset's test images" in capsys.readouterr().err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def images_loaded(index: Path, profile: Path) -> str:
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--dump-dom",
            index.as_uri(),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    found = re.search(r'data-images-loaded="(\d+/\d+)"', dom)
    assert found, dom[-2000:]
    return found.group(1)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_index_html_renders_in_headless_chromium_with_every_image(runs, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["analyze", str(runs["token"]), "--num-images", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    count = len(re.findall(r"<img ", (out / "index.html").read_text()))
    assert images_loaded(out / "index.html", tmp_path / "p1") == f"{count}/{count}"
    (out / "rollout_001.png").unlink()  # the check can fail: a missing image is seen as missing
    assert images_loaded(out / "index.html", tmp_path / "p2") == f"{count - 1}/{count}"


def test_image_files_are_cropped_once_for_weights_with_a_crop_pct(tmp_path) -> None:
    """Weights with timm's crop_pct (resize to img_size / crop_pct, centre crop): the model sees
    the image the page shows under its rollout map, which is what timm's evaluation transform
    (Preprocessing.pil, PIL's resize) gives; the input was once cropped a second time, a 1.14x
    zoom that moved the map off the image."""
    import torch

    from vitlab.analysis.report import load_images
    from vitlab.preprocessing import Preprocessing

    pre = Preprocessing((32, 32), 3, (0.5,) * 3, (0.5,) * 3, crop_pct=0.875)
    ramp = np.linspace(0, 255, 48, dtype=np.float32)  # smooth: the resizers agree to a level
    pixels = np.stack([np.add.outer(ramp[:40], ramp) / 2] * 3, axis=-1).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "ramp.png")
    images = load_images(pre, [str(tmp_path / "ramp.png")], None, None, 1)
    torch.testing.assert_close(images.inputs, pre.normalize(images.display))
    with Image.open(tmp_path / "ramp.png") as im:
        reference = pre.pil(im)
    assert (images.inputs[0] - reference).abs().max().item() < 0.04


@pytest.mark.parametrize("pool", ["token", "gap"])
@pytest.mark.parametrize("kind", ["learned", "learned_2d", "relative", "sincos2d", "none"])
def test_every_position_kind_and_pooling_at_another_resolution(tmp_path, kind, pool) -> None:
    import torch

    from tests.helpers import tiny_config
    from vitlab.analysis.report import Images, analyze
    from vitlab.data.transforms import Preprocessing
    from vitlab.models.vit import VisionTransformer

    model = VisionTransformer(tiny_config(pos_embed=kind, pool=pool, img_size=16)).eval()
    model.set_image_size((12, 20))  # any resolution, rectangular too
    pre = Preprocessing((12, 20), 3, (0.5,) * 3, (0.5,) * 3)
    display = torch.randint(0, 256, (2, 3, 12, 20), dtype=torch.uint8)
    index = analyze(model, pre, Images(["a", "b"], display, pre.batch(display)), tmp_path, "t")
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert np.array(data["mean_attention_distance"]).shape == (2, 4)
    assert data["grid"] == [3, 5] and len(data["rollout"]["a"]) == 15
    # a gap head with a class token: the maps are that token's row, and the page says so
    assert any("class token's row" in n for n in data["notes"]) == (pool == "gap")
    assert not any("mean over patch queries" in n for n in data["notes"])
    has_vectors = kind in ("learned", "learned_2d", "sincos2d")
    assert (tmp_path / "pos_embed_similarity.png").exists() == has_vectors
    assert all((tmp_path / r).is_file() for r in referenced(index))


@pytest.mark.parametrize(
    "variant", [{"stem": "conv"}, {"distilled": True}, {"no_embed_class": True}]
)
def test_checkpoint_variants_are_analysed(tmp_path, variant) -> None:
    """A conv stem (no linear filters: skipped with a note), a distillation token (two prefix
    tokens) and positions without the class row all give a complete page."""
    import torch

    from tests.helpers import tiny_config
    from vitlab.analysis.report import Images, analyze
    from vitlab.data.transforms import Preprocessing
    from vitlab.models.vit import VisionTransformer

    model = VisionTransformer(tiny_config(img_size=16, **variant)).eval()
    pre = Preprocessing((16, 16), 3, (0.5,) * 3, (0.5,) * 3)
    display = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    index = analyze(model, pre, Images(["a", "b"], display, pre.batch(display)), tmp_path, "t")
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert len(data["rollout"]["a"]) == model.config.num_patches
    assert (tmp_path / "embedding_filters.png").exists() == (variant.get("stem") != "conv")
    assert all((tmp_path / r).is_file() for r in referenced(index))
    # the map is the class token's: the page says the distillation head reads another row
    said = any("distillation token's head" in n for n in data["notes"])
    assert said == bool(variant.get("distilled")), data["notes"]


@pytest.fixture
def rgb_checkpoint(tmp_path) -> Path:
    """A tiny RGB ViT for 8x8 images in timm's format: a checkpoint that is no vitlab run."""
    import torch

    from tests.helpers import tiny_config
    from vitlab.models.checkpoint import save_pretrained
    from vitlab.models.vit import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(img_size=8, patch_size=2, num_classes=10))
    save_pretrained(model, tmp_path / "timm", format="timm")
    return tmp_path / "timm"


def test_an_rgb_checkpoint_is_shown_grey_digits_repeated_to_rgb(rgb_checkpoint, tmp_path, capsys):
    """The default data of a checkpoint that is no run is digits, grey: it was refused for every
    RGB model ('digits has 1 channels, the model takes 3'); it is repeated to RGB, as vitlab
    eval does."""
    import torch

    from vitlab.analysis.report import load_images
    from vitlab.data.datasets import load_split
    from vitlab.preprocessing import Preprocessing

    out = tmp_path / "page"
    assert main(["analyze", str(rgb_checkpoint), "--num-images", "2", "--out", str(out)]) == 0
    assert Path(capsys.readouterr().out.strip()) == out / "index.html"
    data = json.loads((out / "analysis.json").read_text())
    assert data["num_images"] == 2 and list(data["rollout"])[0].startswith("digits-test-0-")
    assert (out / "rollout_001.png").is_file()
    pre = Preprocessing((8, 8), 3, (0.5,) * 3, (0.5,) * 3)
    images = load_images(pre, None, "digits", None, 3)
    grey = load_split("digits", "test").images[:3]  # (3, 1, 8, 8)
    assert torch.equal(images.display, grey.expand(-1, 3, -1, -1))


def test_data_the_model_cannot_take_names_the_way_out(tmp_path) -> None:
    """CIFAR's RGB images for a 2-channel model: no conversion exists; the error says what to
    pass instead."""
    from tests.test_data import make_cifar10
    from vitlab.analysis.report import load_images
    from vitlab.data.datasets import DatasetError
    from vitlab.preprocessing import Preprocessing

    make_cifar10(tmp_path / "cifar-10-batches-py")
    two = Preprocessing((32, 32), 2, (0.5,) * 2, (0.5,) * 2)
    with pytest.raises(
        DatasetError, match=r"3-channel images .*pass --images FILE\.\.\. or --data"
    ):
        load_images(two, None, "cifar10", str(tmp_path), 2)


def test_out_that_cannot_be_a_folder_is_refused_first(rgb_checkpoint, tmp_path, capsys) -> None:
    """--out naming a file, or a path under one, was a FileExistsError / NotADirectoryError
    traceback after the analysis ran; it is one line, before the checkpoint is read."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    for out, said in [
        (file, f"{file} is a file: expected a folder"),
        (file / "x", f"{file / 'x'} cannot be made: {file} is a file, not a folder"),
    ]:
        for checkpoint in (rgb_checkpoint, tmp_path / "missing"):
            args = ["analyze", str(checkpoint), "--images", str(image), "--out", str(out)]
            assert main(args) == 2
            err = capsys.readouterr().err
            assert said in err and len(err.splitlines()) == 1, err
    assert file.read_text() == "mine"


def test_analyze_a_run_on_an_image_folder_and_other_indexable_data(tmp_path, capsys) -> None:
    """A run trained on imagefolder: failed on its own default data ('analyze --data takes
    in-memory datasets'); its test split's first files are decoded. A Hugging Face dataset is read
    the same way; shards, which cannot be indexed, are an error that says what to pass."""
    from tests.test_hf_data import table

    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]
    rng = np.random.default_rng(0)
    for c, colour in enumerate(colours):
        (tmp_path / "imgs" / f"class{c}").mkdir(parents=True)
        for i in range(10):
            pixels = np.clip(rng.normal(colour, 50, (8, 8, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "imgs" / f"class{c}" / f"{i}.png")
    folder = f"imagefolder:{tmp_path / 'imgs'}"
    overrides = [*TINY[:-1], f"data.name={folder}", "train.epochs=1", "train.batch_size=8"]
    run = train(load_run_config(None, overrides), out=tmp_path / "run")
    out = tmp_path / "page"
    assert main(["analyze", str(run), "--num-images", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads((out / "analysis.json").read_text())
    assert data["num_images"] == 2 and all(n.startswith(f"{folder}-test-") for n in data["rollout"])
    assert (out / "rollout_001.png").is_file()
    table(20).to_parquet(str(tmp_path / "t.parquet"))
    hf = f"hf:{tmp_path / 't.parquet'}"
    assert main(["analyze", str(run), "--data", hf, "--num-images", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    names = list(json.loads((out / "analysis.json").read_text())["rollout"])
    assert len(names) == 3 and names[0].startswith(f"{hf}-test-0-")
    shards = f"wds:{tmp_path}/part-{{0..1}}.tar"
    assert main(["analyze", str(run), "--data", shards, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{shards} streams WebDataset shards" in err and "pass --images FILE..." in err


def test_a_run_with_a_test_folder_is_analysed_without_its_training_images(tmp_path, capsys):
    """With data.test, analyze's default data read the training source too, for its class names
    (vitlab eval takes the checkpoint's): with the training images gone, analyze failed."""
    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        for c, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
            (tmp_path / part / f"class{c}").mkdir(parents=True)
            for i in range(8):
                pixels = np.clip(rng.normal(colour, 50, (8, 8, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / part / f"class{c}" / f"{i}.png")
    data = [
        f"data.name=imagefolder:{tmp_path / 'train'}",
        f"data.test=imagefolder:{tmp_path / 'test'}",
    ]
    overrides = [*TINY[:-1], *data, "train.epochs=1", "train.batch_size=8"]
    run = train(load_run_config(None, overrides), out=tmp_path / "run")
    shutil.rmtree(tmp_path / "train")  # moved away, or on another machine
    out = tmp_path / "page"
    assert main(["analyze", str(run), "--num-images", "2", "--out", str(out)]) == 0
    names = list(json.loads((out / "analysis.json").read_text())["rollout"])
    assert names == [f"imagefolder:{tmp_path / 'test'}-test-{i}-class0" for i in range(2)]
    capsys.readouterr()
    # an image that does not decode stopped analyze; now it is named, and the next one taken
    (tmp_path / "test" / "class0" / "0.png").write_bytes(b"not a png")
    assert main(["analyze", str(run), "--num-images", "2", "--out", str(out)]) == 0
    names = list(json.loads((out / "analysis.json").read_text())["rollout"])
    assert names == [f"imagefolder:{tmp_path / 'test'}-test-{i}-class0" for i in (1, 2)]
    assert "skipping an image that does not decode" in capsys.readouterr().err
    # a folder without class sub-folders (a masked-patch-prediction run's) raised IndexError
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(5):
        shutil.copy(tmp_path / "test" / "class1" / f"{i}.png", flat / f"{i}.png")
    args = ["analyze", str(run), "--data", f"imagefolder:{flat}", "--out", str(out)]
    assert main([*args, "--num-images", "1"]) == 0
    names = list(json.loads((out / "analysis.json").read_text())["rollout"])
    assert names == [f"imagefolder:{flat}-test-0"]  # no class (another folder: read whole)
    figures = sorted(p.name for p in out.glob("rollout_*.png"))
    assert figures == ["rollout_000.png"]  # the earlier analysis's second image's is removed
    for i in range(5):
        (flat / f"{i}.png").write_bytes(b"broken")
    capsys.readouterr()
    assert main(args) == 2
    assert "none of the 5 test images decodes" in capsys.readouterr().err
    assert main(["analyze", str(run), "--data", "imagefolder:", "--out", str(out)]) == 2
    err = capsys.readouterr().err  # no folder named: the error says what to pass instead
    assert "'imagefolder:' names no folder" in err and "--images FILE" in err
