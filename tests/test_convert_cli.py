"""`vitlab convert`, `vitlab export`, hub names through the offline cache, and predict / fine-tune
from converted weights, end to end through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import VITLAB, run_together
from vitlab import create_model, load_pretrained
from vitlab.cli.main import main
from vitlab.models.checkpoint import save_pretrained
from vitlab.preprocessing import Preprocessing

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def randomized(name: str, **kw) -> torch.nn.Module:
    model = create_model(name, **kw)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def vitlab(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*VITLAB, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_convert_timm_file_to_vitlab_hf_and_back(tmp_path: Path, capsys) -> None:
    ref = timm.create_model("vit_tiny_patch16_224", depth=2, num_classes=5).eval()
    torch.save(ref.state_dict(), tmp_path / "timm.pth")
    assert main(["convert", str(tmp_path / "timm.pth"), str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "read" in out and "(timm)" in out and "2 blocks" in out
    model = load_pretrained(tmp_path / "ck")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-4
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "(vitlab, converted from timm)" in capsys.readouterr().out  # what was read: vitlab's
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - ref(x)).abs().max() <= 1e-4


def test_convert_with_overrides_and_bad_input(tmp_path: Path, capsys) -> None:
    ref = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=5)
    torch.save(ref.state_dict(), tmp_path / "t.pth")
    args = ["convert", str(tmp_path / "t.pth"), str(tmp_path / "o.safetensors")]
    assert main([*args, "num_classes=3", "img_size=160"]) == 0
    model = load_pretrained(tmp_path / "o.safetensors")
    assert model.config.num_classes == 3 and model.config.img_hw == (160, 160)
    args.append("--overwrite")  # o.safetensors is there now
    # after an option too, as the README's synopsis puts them (argparse once refused them)
    assert main([*args, "--to", "vitlab", "num_classes=4", "--from", "timm", "img_size=96"]) == 0
    model = load_pretrained(tmp_path / "o.safetensors")
    assert model.config.num_classes == 4 and model.config.img_hw == (96, 96)
    with pytest.raises(SystemExit):
        main([*args, "--to", "vitlab", "--bogus"])
    err = capsys.readouterr().err  # said by the command's parser, with its usage
    assert "vitlab convert: error: unrecognized arguments: --bogus" in err and "--to" in err, err
    with pytest.raises(SystemExit):
        main(["data", "shard", "--bogus", "1", "digits", str(tmp_path / "d")])  # a subcommand's
    assert "vitlab data shard: error: unrecognized arguments: --bogus" in capsys.readouterr().err
    assert main([*args, "depth_of_field=3"]) == 2
    assert "depth_of_field" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing.pth"), str(tmp_path / "x")]) == 2
    assert "no file or folder" in capsys.readouterr().err
    # a file where the Hugging Face folder would go: said, not a traceback
    (tmp_path / "taken").write_text("a file")
    assert main(["convert", str(tmp_path / "t.pth"), str(tmp_path / "taken"), "--to", "hf"]) == 2
    assert f"{tmp_path / 'taken'} is a file: expected a folder" in capsys.readouterr().err
    # a file name the format does not write as a file (it once became a folder of that name)
    for to, dst in (("hf", "t.pth"), ("vitlab", "x.pth"), ("hf", "h.safetensors")):
        assert main(["convert", str(tmp_path / "t.pth"), str(tmp_path / dst), "--to", to]) == 2
        assert f"names a {Path(dst).suffix} file" in capsys.readouterr().err
    assert not (tmp_path / "x.pth").exists() and not (tmp_path / "h.safetensors").exists()
    for bad in ("num_classes=2.5", "num_classes=true", "in_chans=abc", "in_chans=0"):
        assert main([*args, bad]) == 2  # once 2 classes, 1 class, a ValueError without the key
        assert f"{bad.partition('=')[0]} must be a whole number" in capsys.readouterr().err


def test_a_file_where_the_destination_folder_goes_is_named(tmp_path: Path, capsys) -> None:
    """DST a file (a format writing a folder), or under one: convert said `cannot write DST:
    [Errno 17] File exists` (or `[Errno 20] Not a directory`) naming no file; now which path is
    a file and that a folder was expected, exit 2, and the file is left as it was."""
    from tests.helpers import tiny_checkpoint

    src = str(tiny_checkpoint(tmp_path / "tiny"))
    file = tmp_path / "afile"
    file.write_text("mine")
    cases = (
        ([str(file)], f"{file} is a file: expected a folder (new or existing) for the converted"),
        ([str(file), "--to", "hf"], f"{file} is a file: expected a folder"),
        ([str(file / "x"), "--to", "hf"],
         f"{file / 'x'} cannot be made: {file} is a file, not a folder; expected a folder"),
        ([str(file / "x.safetensors")], f"{file} is a file: expected a folder (new or existing) "
                                        "for x.safetensors"),
    )  # fmt: skip
    for dst, said in cases:
        assert main(["convert", src, *dst]) == 2, dst
        err = capsys.readouterr().err
        assert err.startswith("vitlab convert: error: ") and said in err, err
        assert "Errno" not in err
    assert file.read_text() == "mine"


def test_convert_refuses_to_overwrite_its_source(tmp_path: Path, capsys) -> None:
    """`vitlab convert A A` of a Hugging Face folder wrote vitlab-named weights beside HF's
    config.json (transformers then loaded a half-initialised model); DST the source, or one of
    its files, is refused before anything is read or written, and a DST beside it is fine. The
    refusal of a DeiT-3 for --to hf names what is missing (its table is learned: it said
    'position tables other than learned')."""
    from tests.helpers import tiny_checkpoint

    src = tmp_path / "hf"
    save_pretrained(load_pretrained(tiny_checkpoint(tmp_path / "tiny")), src, "hf")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    weights = src / "model.safetensors"  # the folder, a file in it, a new file in it; the file
    cases = [(src, src), (src, weights), (src, src / "new.safetensors"), (weights, src)]  # its
    for source, dst in cases:  # folder (the review found the last two written)
        assert main(["convert", str(source), str(dst)]) == 2, dst
        assert f"{dst} is " in (err := capsys.readouterr().err) and "name another DST" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert main(["convert", str(src), str(tmp_path / "beside")]) == 0
    assert main(["convert", str(weights), str(tmp_path / "beside2")]) == 0  # a folder beside
    assert main(["convert", str(src), str(src / "sub"), "--to", "timm"]) == 0  # a folder in it
    import timm
    from safetensors.torch import save_file

    deit3 = tmp_path / "deit3.safetensors"
    save_file(timm.create_model("deit3_small_patch16_224", img_size=32, depth=1).state_dict(),
              deit3)  # fmt: skip
    assert main(["convert", str(deit3), str(tmp_path / "d"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "no_embed_class" in err and "other than learned" not in err


def test_convert_replaces_an_existing_dst_only_with_overwrite(tmp_path: Path, capsys) -> None:
    """A DST file or a DST folder holding files was replaced without a word (a timm folder
    written --to hf over kept the old pytorch_model.bin beside the new weights: two models in one
    folder). Now it is refused, nothing touched, unless --overwrite, which leaves the folder
    holding the new model alone (its own other files kept) and transformers loads it."""
    from tests.helpers import tiny_checkpoint

    a = tiny_checkpoint(tmp_path / "a", seed=0, num_classes=3)
    b = tiny_checkpoint(tmp_path / "b", seed=1, num_classes=5)
    file = tmp_path / "out.safetensors"
    assert main(["convert", str(a), str(file)]) == 0
    first = file.read_bytes()
    assert main(["convert", str(b), str(file)]) == 2
    assert f"{file} exists: pass --overwrite" in capsys.readouterr().err
    assert file.read_bytes() == first
    assert main(["convert", str(b), str(file), "--overwrite"]) == 0
    assert load_pretrained(file).config.num_classes == 5

    folder = tmp_path / "timm"
    assert main(["convert", str(a), str(folder), "--to", "timm"]) == 0
    torch.save(load_pretrained(a).state_dict(), folder / "pytorch_model.bin")  # a second model
    (folder / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main(["convert", str(b), str(folder), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{folder} holds config.json, model.safetensors, notes.txt" in err and "--overwrite" in err
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert main(["convert", str(b), str(folder), "--to", "hf", "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"removed {folder / 'pytorch_model.bin'}" in out
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "model.safetensors", "notes.txt", "preprocessor_config.json"]
    assert (folder / "notes.txt").read_text() == "mine"
    hf = transformers.ViTForImageClassification.from_pretrained(folder).eval()
    ref = load_pretrained(b)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - ref(x)).abs().max() <= 1e-5
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder holds nothing to replace
    assert main(["convert", str(a), str(empty)]) == 0


def test_convert_refuses_to_write_into_a_runs_checkpoints(tmp_path: Path, capsys) -> None:
    """Writing timm's layout over a run's checkpoints/best once left a run that eval called
    weightless and --resume failed on with a traceback."""
    from tests.helpers import TINY_MODEL

    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY_MODEL, "train.epochs=1"]) == 0
    best = run / "checkpoints" / "best"
    before = {p: p.read_bytes() for p in best.iterdir()}
    assert main(["convert", str(run), str(best), "--to", "timm"]) == 2
    assert "inside the checkpoints of the run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in best.iterdir()} == before
    assert main(["convert", str(run), str(run / "timm"), "--to", "timm"]) == 0  # beside them: fine
    for extra in ([], ["--overwrite"]):  # the run folder itself: read as its checkpoints/best
        assert main(["convert", str(run / "timm"), str(run), *extra]) == 2  # (a review found
        assert f"{run} is a vitlab run" in capsys.readouterr().err  # RUN/model.safetensors
    assert not (run / "model.safetensors").exists()  # written, and shadowed by best)
    notes = tmp_path / "notes"  # a folder whose config.yaml is comments only is no run
    notes.mkdir()
    (notes / "config.yaml").write_text("# my own notes\n")
    assert main(["convert", str(run / "timm"), str(notes), "--overwrite"]) == 0
    other = tmp_path / "proj"  # another project's checkpoints/ beside its own config.yaml
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("lr: 0.1\n")
    assert main(["convert", str(run), str(other / "checkpoints" / "vit"), "--to", "timm"]) == 0


def test_convert_to_timm_at_another_resolution_builds_in_timm(tmp_path: Path) -> None:
    """`--to timm` with img_size=256 writes an architecture timm registers (there is no
    vit_tiny_patch16_256) and timm's own loader gives vitlab's logits."""
    ref = timm.create_model("vit_tiny_patch16_224", num_classes=5)  # all 12 blocks: a Ti/16
    torch.save(ref.state_dict(), tmp_path / "t.pth")
    args = ["convert", str(tmp_path / "t.pth"), str(tmp_path / "out"), "img_size=256"]
    assert main([*args, "--to", "timm"]) == 0
    again = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    model = load_pretrained(tmp_path / "out")
    x = torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        assert (again(x) - model(x)).abs().max() <= 1e-4


def test_hub_names_use_the_offline_cache(tmp_path: Path) -> None:
    """A hub name resolves through huggingface_hub's cache with the network off; a name that is
    not cached is a clear error."""
    from timm.models._hub import save_for_hf

    ref = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=4).eval()
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--timm--vit_tiny_test"
    save_for_hf(ref, repo / "snapshots" / revision, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    cli = [*VITLAB, "convert"]
    r, missing = run_together(  # at once
        ([*cli, "timm/vit_tiny_test", str(tmp_path / "out")], env),
        ([*cli, "google/vit-not-cached", str(tmp_path / "o2")], env),
    )
    assert r.returncode == 0, r.stderr
    model = load_pretrained(tmp_path / "out")
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-4
    assert missing.returncode == 2
    assert "cannot get google/vit-not-cached" in missing.stderr and "cache" in missing.stderr


def fill_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str) -> None:
    """Lay `folder`'s files out in a hub cache as huggingface_hub writes them: the content in
    blobs/<sha256>, snapshots/<revision>/<name> symlinks to it, refs/main naming the revision."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / revision).mkdir(parents=True)
    for f in folder.iterdir() if folder.is_dir() else []:
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        link = repo / "snapshots" / revision / f.name
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_hub_names_read_the_preprocessor_config_as_the_folder_does(tmp_path: Path) -> None:
    """google/vit-* repos state their resize in preprocessor_config.json (bilinear): a hub name
    gives the preprocessing the same folder on disk gives, through the offline cache."""
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
        image_size=32, patch_size=8, num_labels=3,
    )  # fmt: skip
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "repo")
    processor = transformers.ViTImageProcessor(
        size={"height": 32, "width": 32}, resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(tmp_path / "repo")
    revision = "89abcdef0123456789abcdef0123456789abcdef"
    fill_hub_cache(tmp_path / "cache", "google/vit-tiny-test", tmp_path / "repo", revision)
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    r = vitlab("convert", "google/vit-tiny-test", str(tmp_path / "from_hub"), env=env)
    assert r.returncode == 0, r.stderr
    hub = load_pretrained(tmp_path / "from_hub").preprocessing
    disk = load_pretrained(tmp_path / "repo").preprocessing
    assert hub == disk
    assert hub.interpolation == "bilinear"  # resample=2 is PIL's BILINEAR


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_a_hub_download_fetches_the_preprocessor_config(shard, tmp_path: Path, monkeypatch) -> None:
    """Online, only the files a loader asks for land in the cache: a stand-in hub serves a
    google/vit-* repo into an empty cache file by file, through huggingface_hub's own cache code,
    and the model must come with the resize its preprocessor_config.json states; a sharded
    repo's index and shards all come."""
    import fnmatch

    import huggingface_hub
    from huggingface_hub import constants

    remote = tmp_path / "remote"
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
        image_size=32, patch_size=8, num_labels=3,
    )  # fmt: skip
    kw = {"max_shard_size": shard} if shard else {}
    transformers.ViTForImageClassification(config).save_pretrained(remote, **kw)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=2).save_pretrained(
        remote
    )
    cache, revision = tmp_path / "cache", "fedcba9876543210fedcba9876543210fedcba98"
    fill_hub_cache(cache, "google/vit-tiny-test", tmp_path / "empty", revision)
    served = []

    def serve(patterns: list[str]) -> None:
        snapshot = cache / "models--google--vit-tiny-test" / "snapshots" / revision
        for f in remote.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in patterns) and f.name not in served:
                served.append(f.name)
                (snapshot / f.name).symlink_to(f)

    real_file, real_snapshot = huggingface_hub.hf_hub_download, huggingface_hub.snapshot_download

    def hf_hub_download(repo_id, filename, **kw):
        serve([filename])
        return real_file(repo_id, filename, **{**kw, "local_files_only": True})

    def snapshot_download(repo_id, allow_patterns=None, **kw):
        serve(allow_patterns or ["*"])
        kw.update(allow_patterns=allow_patterns, local_files_only=True)
        return real_snapshot(repo_id, **kw)

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load_pretrained("google/vit-tiny-test")
    weights = sorted(f.name for f in remote.glob("model*"))
    assert len(weights) == (6 if shard else 1)  # five shards and their index
    assert "preprocessor_config.json" in served and set(weights) <= set(served)
    assert model.preprocessing == load_pretrained(remote).preprocessing
    assert model.preprocessing.interpolation == "bilinear"  # resample=2 is PIL's BILINEAR


def test_export_onnx_and_torch_export_match_pytorch(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    model = randomized("vit_nano_patch4_28")
    pre = Preprocessing((28, 28), 1, (0.3,), (0.4,))
    model.preprocessing, model.classes = pre, list("abcdefghij")
    save_pretrained(model, tmp_path / "ck")
    cli = [*VITLAB, "export", str(tmp_path / "ck")]
    r, nothing_asked = run_together(  # at once; the second names no format
        ([*cli, "--onnx", str(tmp_path / "m.onnx"), "--dynamic-batch",
          "--torch-export", str(tmp_path / "m.pt2")], dict(os.environ)),
        (cli, dict(os.environ)),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert nothing_asked.returncode == 2, nothing_asked.stderr
    assert "onnxruntime matches PyTorch" in r.stdout
    x = torch.randn(7, 1, 28, 28)  # a batch size the export never saw
    with torch.no_grad():
        want = model(x)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": x.numpy()})[0]
    assert np.abs(got - want.numpy()).max() <= 1e-4
    props = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(props["vitlab_preprocessing"])["mean"] == [0.3]
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    with torch.no_grad():
        assert (program(x) - want).abs().max() <= 1e-4


def test_predict_applies_the_weights_preprocessing_like_transformers(
    tmp_path: Path, capsys
) -> None:
    model = randomized("vit_nano_patch4_32", num_classes=4)
    model.preprocessing = Preprocessing((32, 32), 3, (0.2, 0.3, 0.4), (0.5, 0.6, 0.7))
    model.classes = ["a", "b", "c", "d"]
    save_pretrained(model, tmp_path / "hf", "hf")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    args = ["predict", str(tmp_path / "hf"), str(tmp_path / "x.png"), "--json", "--topk", "4"]
    assert main(args) == 0
    ours = {t["class"]: t["probability"] for t in json.loads(capsys.readouterr().out)[0]["top"]}
    processor = transformers.ViTImageProcessor.from_pretrained(tmp_path / "hf")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    pixels = processor(Image.open(tmp_path / "x.png"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        probs = ref(pixel_values=pixels).logits.softmax(-1)[0]
    for i, name in enumerate("abcd"):
        assert abs(ours[name] - probs[i].item()) <= 1e-4


def test_centre_crop_preprocessing_matches_timm_eval_transform(tmp_path: Path) -> None:
    """crop_pct (timm / torchvision weights): shorter side to size / crop_pct, centre crop."""
    from timm.data import create_transform, resolve_data_config

    ref = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=3).eval()
    torch.save(ref.state_dict(), tmp_path / "t.pth")
    model = load_pretrained(tmp_path / "t.pth")
    assert model.preprocessing.crop_pct == 0.9
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    cfg = resolve_data_config(
        {"mean": model.preprocessing.mean, "std": model.preprocessing.std, "crop_pct": 0.9,
         "interpolation": "bicubic"}, model=ref)  # fmt: skip
    want = create_transform(**cfg)(image)
    got = model.preprocessing.pil(image)
    assert got.shape == want.shape == (3, 224, 224)
    assert (got - want).abs().max() <= 1e-5  # both resize with PIL: the same pixels


def test_finetune_from_a_timm_checkpoint(tmp_path: Path) -> None:
    """finetune.from= takes other formats: the architecture is the checkpoint's, RGB patch
    kernels are summed for greyscale digits, positions resampled to 8x8, a new 10-class head."""
    ref = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=64, depth=1, num_heads=2,
        num_classes=1000,
    )  # fmt: skip
    torch.save(ref.state_dict(), tmp_path / "pre.pth")
    r = vitlab(
        "train", "--out", str(tmp_path / "run"), f"finetune.from={tmp_path / 'pre.pth'}",
        "model.img_size=8", "model.patch_size=4", "model.num_heads=2", "train.epochs=1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # model.num_heads=2 is the source's count (no guess: it guessed 1, then took 2); the source
    # is read (and its preprocessing note said) once
    assert "assuming num_heads" not in r.stderr
    assert r.stderr.count("timm weights without timm's config.json") == 1, r.stderr
    model = load_pretrained(tmp_path / "run")
    assert model.config.embed_dim == 64 and model.config.in_chans == 1
    assert model.config.num_classes == 10 and model.pos_embed.weight.shape == (1, 5, 64)


def test_cli_notes_are_log_lines_that_q_hides_and_python_warnings_filters_do_not(tmp_path) -> None:
    """Loading notes reach the CLI user as one `vitlab: warning:` line each: no Python source
    line after it (as warnings.warn printed), still shown under PYTHONWARNINGS=ignore, hidden by
    -q; -v adds the logger's name."""
    ref = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=64, depth=1, num_heads=2
    )
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    dst = str(tmp_path / "out")
    ignore = {**os.environ, "PYTHONWARNINGS": "ignore"}
    src = str(tmp_path / "w.pth")
    r, quiet, verbose = run_together(  # three independent commands at once
        ([*VITLAB, "convert", src, dst], ignore),
        ([*VITLAB, "-q", "convert", src, dst + "q"], dict(os.environ)),
        ([*VITLAB, "convert", "-v", src, dst + "v"], dict(os.environ)),
    )
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "assuming num_heads=1" in x]
    assert len(notes) == 1 and notes[0].startswith("vitlab: warning: "), r.stderr
    assert "log.warning" not in r.stderr and ".py:" not in r.stderr
    assert quiet.returncode == 0 and "assuming num_heads" not in quiet.stderr, quiet.stderr
    assert "[vitlab.models.checkpoint]" in verbose.stderr, verbose.stderr


def test_convert_says_each_loading_note_once_and_q_hides_it(tmp_path: Path, capsys) -> None:
    """convert printed the loading notes a second time on stdout (`note: ...`), past -q."""
    from torchvision.models.vision_transformer import VisionTransformer as TV

    kw = dict(patch_size=16, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=3)
    torch.save(TV(image_size=64, **kw).state_dict(), tmp_path / "tv.pth")
    said = "is none of torchvision's weights"
    assert main(["convert", str(tmp_path / "tv.pth"), str(tmp_path / "a"), "num_heads=2"]) == 0
    both = capsys.readouterr()
    assert (both.out + both.err).count(said) == 1 and said in both.err
    assert (
        main(["-q", "convert", str(tmp_path / "tv.pth"), str(tmp_path / "b"), "num_heads=2"]) == 0
    )
    both = capsys.readouterr()
    assert said not in both.out + both.err and "wrote" in both.out
