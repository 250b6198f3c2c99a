"""The format registry: every format module has the same interface, detection names the format of
each library's files, a new format is one module plus one registry line, and writing keeps what
a user relies on (provenance in vitlab's metadata, the old keyword)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.test_checkpoint import google_arrays, images, randomize
from vitlab import create_model, formats, load_checkpoint, save_pretrained
from vitlab.cli.main import main
from vitlab.formats.base import Files, Source, preprocessing_of


def test_every_format_has_the_interface_and_vitlab_writes_four() -> None:
    for name, module in formats.FORMATS.items():
        for function in ("detect", "read", "write"):
            assert callable(getattr(module, function, None)), f"{name}.{function}"
    assert set(formats.WRITABLE) == {"vitlab", "timm", "hf", "torchvision"}
    model = create_model("vit_nano_patch4_28")
    for name in set(formats.FORMATS) - set(formats.WRITABLE):  # read-only formats say so
        with pytest.raises(formats.CheckpointError, match="does not write"):
            formats.get(name).write(model, Path("unused"))
    with pytest.raises(formats.CheckpointError, match="for CNNs \\(ResNets\\) only"):
        formats.get("torchvision").write(model, Path("unused"))  # tests/test_cnn.py: ResNets


def library_files(tmp_path: Path) -> dict[str, Files]:
    """One checkpoint per format, written as its own library (or vitlab's writer) writes it."""
    from torchvision.models.vision_transformer import VisionTransformer as TV

    model = randomize(create_model("vit_nano_patch4_32", num_classes=3))
    save_pretrained(model, tmp_path / "v")
    save_pretrained(model, tmp_path / "t", "timm")
    save_pretrained(model, tmp_path / "h", "hf")
    tv = TV(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)
    torch.save(tv.state_dict(), tmp_path / "tv.pth")
    rng = np.random.default_rng(0)
    arrays = google_arrays(rng, 16, 1, 2, 32, 8, 4, 3, linen=False, stacked=False, cls=True)
    np.savez(tmp_path / "g.npz", **arrays)
    torch.save(model.state_dict(), tmp_path / "plain.pt")  # vitlab's names, no metadata
    return {
        "vitlab": Files(tmp_path / "v" / "model.safetensors"),
        "timm": Files(tmp_path / "t" / "model.safetensors", tmp_path / "t"),
        "hf": Files(tmp_path / "h" / "model.safetensors", tmp_path / "h"),
        "torchvision": Files(tmp_path / "tv.pth"),
        "npz": Files(tmp_path / "g.npz"),
        "plain vitlab": Files(tmp_path / "plain.pt"),
    }


def test_detection_names_each_librarys_format(tmp_path: Path) -> None:
    for expected, files in library_files(tmp_path).items():
        assert formats.detect(files) == expected.removeprefix("plain "), files
    save_file({"conv1.weight": torch.zeros(2, 3, 3, 3)}, tmp_path / "resnet.safetensors")
    with pytest.raises(formats.CheckpointError, match="not a ViT checkpoint.*conv1.weight"):
        formats.detect(Files(tmp_path / "resnet.safetensors"))


def test_a_new_format_is_one_module_and_one_registry_line(tmp_path: Path, monkeypatch) -> None:
    """A made-up library that prefixes every key with `mine/` and stores no metadata."""
    model = randomize(create_model("vit_nano_patch4_28", num_classes=4))
    save_file({f"mine/{k}": v for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")

    def read(files: Files) -> Source:
        state = {k.removeprefix("mine/"): v for k, v in files.tensors().items()}
        return Source(state, "mine", files.where, hints={"num_heads": model.config.num_heads})

    mine = SimpleNamespace(
        detect=lambda files: all(re.match("mine/", k) for k in files.names()),
        read=read,
        write=lambda model, dst: [],
    )
    monkeypatch.setitem(formats.FORMATS, "mine", mine)
    loaded, meta = load_checkpoint(tmp_path / "m.safetensors")
    assert meta.info["source_format"] == "mine" and loaded.config == model.config
    x = images(28, chans=1)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    named, _ = load_checkpoint(tmp_path / "m.safetensors", format="mine")  # and by its name
    assert torch.equal(named.head.weight, model.head.weight)


def test_suffixes_in_capitals_are_the_same_formats(tmp_path: Path) -> None:
    library_files(tmp_path)
    (tmp_path / "g.npz").rename(tmp_path / "G.NPZ")
    (tmp_path / "v" / "model.safetensors").rename(tmp_path / "W.SAFETENSORS")
    assert load_checkpoint(tmp_path / "G.NPZ")[1].info["source_format"] == "npz"
    (tmp_path / "folder").mkdir()
    (tmp_path / "G.NPZ").rename(tmp_path / "folder" / "G.NPZ")  # found in its folder too
    assert load_checkpoint(tmp_path / "folder")[1].info["source_format"] == "npz"
    _, meta = load_checkpoint(tmp_path / "W.SAFETENSORS")  # vitlab's, with its metadata
    assert meta.config.num_classes == 3 and meta.preprocessing.mean == (0.5,) * 3


def test_a_folders_config_files_apply_whatever_format_its_weights_are_in(tmp_path: Path) -> None:
    """Hub folders carry config.json (timm's or transformers') and preprocessor_config.json
    beside weights of any format: their class names, statistics and sizes are used."""
    import json

    library_files(tmp_path)
    folder = tmp_path / "npz_folder"
    folder.mkdir()
    (tmp_path / "g.npz").rename(folder / "g.npz")
    timm_cfg = {"label_names": ["a", "b", "c"], "pretrained_cfg": {"mean": [0.1] * 3,
                "std": [0.2] * 3, "crop_pct": 0.8}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(timm_cfg))
    _, meta = load_checkpoint(folder)
    assert meta.classes == ["a", "b", "c"] and meta.preprocessing.mean == (0.1,) * 3
    assert meta.preprocessing.crop_pct == 0.8
    processor = {"image_mean": [0.3] * 3, "image_std": [0.4] * 3, "resample": 3}
    (tmp_path / "t" / "preprocessor_config.json").write_text(json.dumps(processor))
    _, meta = load_checkpoint(tmp_path / "t")  # timm weights, transformers' preprocessing
    assert meta.preprocessing.mean == (0.3,) * 3 and meta.preprocessing.interpolation == "bicubic"


def shape(model) -> tuple:
    c = model.config
    return c.img_hw, c.patch_size, c.embed_dim, c.depth, c.num_heads, c.mlp_dim, c.pool, c.act


def test_a_hub_folders_weights_named_by_path_read_as_the_folder(tmp_path: Path) -> None:
    """DIR/model.safetensors gives DIR's model: its config.json and preprocessor_config.json."""
    model = randomize(create_model("vit_micro_patch4_32", num_classes=3))
    model.preprocessing = dataclasses.replace(
        preprocessing_of(model), mean=(0.2,) * 3, std=(0.3,) * 3
    )
    model.classes = ["a", "b", "c"]
    for fmt in ("timm", "hf"):
        save_pretrained(model, tmp_path / fmt, fmt)
        by_folder, folder_meta = load_checkpoint(tmp_path / fmt)
        by_file, file_meta = load_checkpoint(tmp_path / fmt / "model.safetensors")
        assert file_meta.preprocessing == folder_meta.preprocessing, fmt
        assert file_meta.preprocessing.mean == (0.2,) * 3 and file_meta.classes == model.classes
        assert shape(by_file) == shape(by_folder) == shape(model), fmt


def test_timms_bare_state_dict_reads_back_the_model_vitlab_wrote(tmp_path: Path) -> None:
    """vit_micro's 4 heads of 32 (not the 64-wide heads a guess would give), its size, pooling
    and classes survive a bare timm .safetensors, which timm's own load_state_dict still takes."""
    import timm

    model = randomize(create_model("vit_micro_patch4_32", num_classes=3, pool="gap"))
    model.classes = ["a", "b", "c"]
    save_pretrained(model, tmp_path / "m.safetensors", "timm")
    back, meta = load_checkpoint(tmp_path / "m.safetensors")
    assert shape(back) == shape(model) and meta.classes == ["a", "b", "c"]
    x = images(32)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    twin = timm.create_model(
        "vit_base_patch16_224", img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4,
        num_classes=3, global_pool="avg", fc_norm=False, class_token=True, mlp_ratio=2.0,
    )  # fmt: skip
    from safetensors.torch import load_file

    twin.load_state_dict(load_file(tmp_path / "m.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(twin.eval()(x), model(x), atol=1e-5, rtol=1e-5)
    # written over the weights of an earlier Hugging Face folder, its header wins over the
    # config.json left beside it
    save_pretrained(create_model("vit_nano_patch4_32", num_classes=5), tmp_path / "d", "hf")
    save_pretrained(model, tmp_path / "d" / "model.safetensors", "timm")
    back, meta = load_checkpoint(tmp_path / "d" / "model.safetensors")
    assert shape(back) == shape(model) and meta.classes == ["a", "b", "c"]


def test_a_bare_load_state_dict_takes_timms_state_dict_and_its_own() -> None:
    """timm's tensor `pos_embed` is the module `pos_embed` here (`pos_embed.weight`): a ViT's and a
    hybrid's load_state_dict, strict, takes timm's state dict as it is, with timm's logits, and the
    caller's dict is left as it was; vitlab's own names load too, and a model without a learned
    table still reports timm's `pos_embed` as unexpected."""
    import timm

    for name in ("vit_base_patch16_224", "vit_small_r26_s32_224"):
        theirs = randomize(timm.create_model(name, img_size=64, num_classes=3, depth=1).eval())
        ours = create_model(name, img_size=64, num_classes=3, depth=1).eval()
        state = theirs.state_dict()
        ours.load_state_dict(state)
        assert "pos_embed" in state and "pos_embed.weight" not in state
        x = images(64)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
        twin = create_model(name, img_size=64, num_classes=3, depth=1).eval()
        twin.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert torch.equal(twin(x), ours(x))
    sincos = create_model("vit_small_r26_s32_224", img_size=64, num_classes=3, depth=1,
                          pos_embed="sincos2d")  # fmt: skip
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "pos_embed"'):
        sincos.load_state_dict(state)


def test_a_timm_write_over_a_hugging_face_folder_leaves_no_stale_preprocessing(tmp_path) -> None:
    model = randomize(create_model("vit_nano_patch4_32", num_classes=3))
    save_pretrained(model, tmp_path / "same", "hf")
    model.preprocessing = dataclasses.replace(
        preprocessing_of(model), mean=(0.2,) * 3, interpolation="bilinear"
    )
    save_pretrained(model, tmp_path / "same", "timm")
    assert not (tmp_path / "same" / "preprocessor_config.json").exists()
    _, meta = load_checkpoint(tmp_path / "same")
    assert meta.preprocessing.mean == (0.2,) * 3 and meta.preprocessing.interpolation == "bilinear"


def test_malformed_hub_files_are_named_not_tracebacks(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    model = randomize(create_model("vit_nano_patch4_32", num_classes=3))
    save_pretrained(model, tmp_path / "h", "hf")
    processor = tmp_path / "h" / "preprocessor_config.json"
    kept = json.loads(processor.read_text())
    processor.write_text(json.dumps({**kept, "image_mean": [0.5] * 3, "image_std": None}))
    with pytest.raises(formats.CheckpointError, match="image_mean .* and image_std None are not"):
        load_checkpoint(tmp_path / "h")
    # one number for every channel, as transformers allows; PIL's other resample codes are named
    processor.write_text(json.dumps({**kept, "image_mean": 0.25, "image_std": 0.5, "resample": 1}))
    _, meta = load_checkpoint(tmp_path / "h")
    assert meta.preprocessing.mean == (0.25,) * 3 and meta.preprocessing.std == (0.5,) * 3
    assert any("resample 1" in n for n in meta.info["notes"])
    processor.write_text(json.dumps(kept))
    state = load_file(tmp_path / "h" / "model.safetensors")
    key = next(k for k in state if k.endswith("attention.attention.key.weight"))
    state[key] = state[key][:, :-1].contiguous()  # a key projection one input column short
    save_file(state, tmp_path / "h" / "model.safetensors")
    with pytest.raises(formats.CheckpointError, match=r"h: layer 0: query/key/value weights of"):
        load_checkpoint(tmp_path / "h")
    flat = dict(model.state_dict())
    flat["patch_embed.proj.weight"] = flat["patch_embed.proj.weight"].flatten(1)
    save_file(flat, tmp_path / "flat.safetensors")
    with pytest.raises(formats.CheckpointError, match=r"flat.safetensors: patch_embed.proj.weight"):
        load_checkpoint(tmp_path / "flat.safetensors")


def test_convert_to_vitlab_keeps_where_the_weights_came_from(tmp_path: Path) -> None:
    model = randomize(create_model("vit_nano_patch4_32", num_classes=3))
    save_pretrained(model, tmp_path / "t", "timm")
    assert main(["convert", str(tmp_path / "t"), str(tmp_path / "v")]) == 0
    _, meta = load_checkpoint(tmp_path / "v")
    assert meta.info["source_format"] == "timm" and meta.info["source"] == str(tmp_path / "t")


def test_save_pretrained_still_takes_the_old_layout_keyword(tmp_path: Path) -> None:
    model = create_model("vit_nano_patch4_32", num_classes=3)
    with pytest.warns(DeprecationWarning, match="format="):
        written = save_pretrained(model, tmp_path / "t", layout="timm")
    assert (tmp_path / "t" / "config.json") in written
    with (
        pytest.raises(TypeError, match="both format= and layout="),
        pytest.warns(DeprecationWarning),
    ):
        save_pretrained(model, tmp_path / "y", "hf", layout="timm")
    with pytest.raises(ValueError, match="format must be one of vitlab, timm, hf"):
        save_pretrained(model, tmp_path / "x", "npz")
    # a file name the format does not write as a file: refused as `vitlab convert` refuses it
    # (it became a folder of that name, x.pth/model.safetensors: a QA pass)
    for fmt, name in (("vitlab", "x.pth"), ("hf", "z.safetensors"), ("timm", "w.npz")):
        with pytest.raises(ValueError, match=f"format={fmt} writes .*a folder DST; .*{name} names"):
            save_pretrained(model, tmp_path / name, fmt)
        assert not (tmp_path / name).exists()
    assert save_pretrained(model, tmp_path / "v.safetensors") == [tmp_path / "v.safetensors"]
    with pytest.raises(ValueError, match=r"a folder DST \(in lower case\); .*a.SAFETENSORS names"):
        save_pretrained(model, tmp_path / "a.SAFETENSORS")


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from vitlab.formats.base import write_safetensors, write_text

    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": torch.ones(2)}, {})
    with pytest.raises(ValueError, match="non contiguous"):
        write_safetensors(path, {"a": torch.ones(4, 4)[:, :2]}, {})
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    assert load_file(path)["a"].shape == (2,)
    write_text(tmp_path / "t.txt", "old")
    with pytest.raises(TypeError):
        write_text(tmp_path / "t.txt", None)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt", "w.safetensors"]
    assert (tmp_path / "t.txt").read_text() == "old"


def test_a_file_named_for_another_format_gets_the_name_that_reads_it(tmp_path: Path) -> None:
    """Readers go by suffix, and each library's own error misleads on another format's bytes
    (numpy calls anything not a zip 'pickled data'; torch.load says 'invalid load key'). Each of
    the four kinds under each wrong name says what the file is and what to call it, and under that
    name it loads."""
    from tests.test_checkpoint import google_arrays
    from vitlab import load_pretrained
    from vitlab.formats.base import CheckpointError, holds

    weights = {
        k: v.contiguous() for k, v in create_model("vit_nano_patch4_28").state_dict().items()
    }
    arrays = google_arrays(np.random.default_rng(0), 64, 1, 2, 128, 8, 4, 3, False, False, True)
    write = {
        "safetensors": lambda p: save_file(weights, p),
        "torch": lambda p: torch.save(weights, p),
        "pickle": lambda p: torch.save(weights, p, _use_new_zipfile_serialization=False),
        "npz": lambda p: np.savez(p.open("wb"), **arrays),
    }
    reads = {"safetensors": ".safetensors", "torch": ".pt", "pickle": ".pt", "npz": ".npz"}
    what = {".safetensors": "a safetensors file", ".pt": "a PyTorch file", ".npz": "a numpy .npz"}
    for kind, right in reads.items():
        for suffix in sorted({".safetensors", ".pt", ".npz"} - {right}):
            path = tmp_path / f"{kind}{suffix}"
            write[kind](path)
            it_is = re.escape({"pickle": "a Python pickle"}.get(kind, what[right]))
            advice = rf"is not {re.escape(what[suffix])}.*: it is {it_is}.*name it \*\{right}"
            with pytest.raises(CheckpointError, match=advice):
                load_pretrained(path)
        write[kind](tmp_path / f"{kind}{right}")  # as the errors advise
        loaded = load_pretrained(tmp_path / f"{kind}{right}").state_dict()
        if kind == "npz":
            assert np.array_equal(loaded["cls_token"].numpy(), arrays["cls"])
        else:
            assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    (tmp_path / "t.npz").write_bytes(b"PK\x03\x04 cut short")  # a zip's start: numpy's words
    with pytest.raises(CheckpointError, match="truncated or not a numpy .npz"):
        load_pretrained(tmp_path / "t.npz")
    (tmp_path / "t.pt").write_bytes(b"\x80\x02 cut short")  # a pickle's start, then no opcode
    with pytest.raises(CheckpointError, match="t.pt is damaged, or holds Python objects"):
        load_pretrained(tmp_path / "t.pt")
    whole = (tmp_path / "torch.pt").read_bytes()  # a zip cut short: torch's first sentence,
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])  # not its advice cut off at 200
    with pytest.raises(CheckpointError, match=r"cut.pt is truncated or not a PyTorch file "
                       r"\(PytorchStreamReader failed [^.()]*\)$"):  # fmt: skip
        load_pretrained(tmp_path / "cut.pt")
    # an empty file said so (torch's EOFError has no text: "()"); random bytes in an .npz are
    # no zip, which numpy calls pickled data with its advice to load it unsafely (left out)
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.pth is truncated or not a PyTorch file "
                       r"\(an empty file, 0 bytes\)$"):  # fmt: skip
        load_pretrained(tmp_path / "empty.pth")
    (tmp_path / "noise.npz").write_bytes(bytes(range(7, 256)) * 16)
    with pytest.raises(
        CheckpointError, match=r"noise.npz is .*: not a zip archive of .npy arrays$"
    ):
        load_pretrained(tmp_path / "noise.npz")
    # a damaged zip directory makes zipfile raise beyond BadZipFile (a member name that is not
    # UTF-8, an unknown zip version): the reader's error still names the file
    for kind, suffix, at in (("torch", ".pt", 46), ("npz", ".npz", 6)):
        write[kind](tmp_path / f"d{suffix}")
        raw = bytearray((tmp_path / f"d{suffix}").read_bytes())
        raw[raw.find(b"PK\x01\x02") + at] = 0xFF  # torch.save's first name byte; npz's version
        (tmp_path / f"d{suffix}").write_bytes(bytes(raw))
        assert holds(tmp_path / f"d{suffix}") is None  # zipfile raised, and the sniff said unknown
        with pytest.raises(CheckpointError, match=f"d{re.escape(suffix)}"):
            load_pretrained(tmp_path / f"d{suffix}")


@pytest.mark.parametrize("fmt", ["timm", "hf"])
def test_a_config_json_that_describes_other_weights_is_refused(tmp_path: Path, fmt: str) -> None:
    """The architecture comes from the tensors: a folder whose config.json says another depth,
    width, patch or class count (which timm and transformers refuse to load, or build as that
    other model) was read and converted without a word, and DST got a config of the tensors."""
    import json

    from vitlab.formats.base import CheckpointError

    model = create_model("vit_nano_patch4_28", num_classes=7, in_chans=3)
    save_pretrained(model, tmp_path / "ok", format=fmt)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    load_checkpoint(tmp_path / "ok")  # as written: read
    args = config["model_args"] if fmt == "timm" else config
    depth, width = ("depth", "embed_dim") if fmt == "timm" else ("num_hidden_layers", "hidden_size")
    args[depth] += 1
    args[width] *= 2
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json describes another model than its "
                                              r"weights: depth=5 \(the weights: 4\); embed_dim="
                                              r"128 \(the weights: 64\)"):  # fmt: skip
        load_checkpoint(tmp_path / "ok")
    assert main(["convert", str(tmp_path / "ok"), str(tmp_path / "dst")]) == 2
    assert not (tmp_path / "dst").exists()


def test_a_config_json_naming_another_family_is_refused(tmp_path: Path) -> None:
    """A ViT's tensors under a config.json naming a Swin (timm's architecture, transformers'
    model_type) were read by their tensors without a word; timm or transformers would build a
    Swin for them and fail."""
    import json

    from vitlab.formats.base import CheckpointError

    vit = create_model("vit_nano_patch4_28", num_classes=7, in_chans=3)
    for fmt, key, swin in (("timm", "architecture", "swin_tiny_patch4_window7_224"),
                           ("hf", "model_type", "swin")):  # fmt: skip
        save_pretrained(vit, tmp_path / fmt, format=fmt)
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        named = config[key]
        assert load_checkpoint(tmp_path / fmt)[1].config.depth == 4  # as written: read
        config[key] = swin
        (tmp_path / fmt / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=f"config.json describes another model than its "
                                                  f"weights: {swin}, a swin \\(the weights: a "
                                                  f"vit\\)"):  # fmt: skip
            load_checkpoint(tmp_path / fmt)
        assert named.lower().startswith(("vit", "deit"))
    # transformers' ResNetConfig (no hidden_size: read as timm's) names its family by model_type
    (tmp_path / "timm" / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    with pytest.raises(CheckpointError, match="resnet, a cnn \\(the weights: a vit\\)"):
        load_checkpoint(tmp_path / "timm")


def test_a_swins_class_count_is_checked_and_timms_top_level_count_is_the_weights(tmp_path) -> None:
    """A Swin's head is head.fc: its class count went unchecked. timm's model_args.num_classes
    says what to build (timm then leaves the head out); the top-level count is the weights'."""
    import json

    from vitlab.formats.base import CheckpointError

    swin = create_model("swin_nano_patch2_window7_28", num_classes=7)
    for fmt in ("hf", "timm"):
        save_pretrained(swin, tmp_path / fmt, format=fmt)
        config = json.loads((tmp_path / fmt / "config.json").read_text())
        if fmt == "hf":
            config["id2label"] = {str(i): f"c{i}" for i in range(9)}
        else:
            config["num_classes"] = 9
        (tmp_path / fmt / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"num_classes=9 \(the weights: 7\)"):
            load_checkpoint(tmp_path / fmt)
    vit = create_model("vit_nano_patch4_28", num_classes=7, in_chans=3)
    save_pretrained(vit, tmp_path / "vit", format="timm")
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    config.setdefault("model_args", {})["num_classes"] = 3  # build 3, the weights 7
    (tmp_path / "vit" / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(tmp_path / "vit")[1].config.num_classes == 7
