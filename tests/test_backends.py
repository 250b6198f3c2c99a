"""Inference backends (vitlab.eval.backends): each gives eager PyTorch's logits within its stated
tolerance, `vitlab eval` / `predict` run them, and what cannot run says why."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL, randomize_head
from vitlab import load_checkpoint
from vitlab.cli.main import main
from vitlab.config import ModelSection
from vitlab.data import load_split, make_loader
from vitlab.eval.backends import BackendError, backend_device, prepare
from vitlab.eval.classification import evaluate
from vitlab.formats.vitlab import CheckpointMeta
from vitlab.models.registry import build_model, config_of
from vitlab.preprocessing import Preprocessing

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ORT_FP32_TOLERANCE = 1e-4  # what `vitlab export` promises
# int8 (per-tensor weights, per-batch activations) on the tiny D=32 model trained below: max
# |logit diff| relative to the largest |logit| (about 4) measured 0.12 (torch) and 0.08
# (onnxruntime) on one and on two threads, top-1 agreement 98.0% and 99.4% (2026-12-02; with 4
# epochs of training, logits about 1.4 at most, 0.15-0.28 and 94.4-97.5%); the agreement is
# the check users rely on
INT8_TOLERANCE = 0.5
INT8_AGREEMENT = 0.95  # share of the test images whose top-1 class is unchanged


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny ViT (8x8 digits, D=32, 2 layers) trained 12 epochs (about 2 s): real logits, a
    test accuracy (78-81% measured) whose margins do not hang on float rounding."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["train", "--out", str(out), *TINY_MODEL, "train.epochs=12"]) == 0
    return out


@pytest.fixture(scope="module")
def digits(trained) -> torch.Tensor:
    """The digits test images as the tiny run's preprocessing makes them: (359, 1, 8, 8)."""
    _, meta = load_checkpoint(trained)
    loader = make_loader(load_split("digits", "test"), 512, meta.preprocessing)
    return torch.cat([x for x, _ in loader])


@pytest.mark.parametrize("wide", [True, False])
def test_onnxruntime_int8_weights_fit_the_cpus_int8_products(trained, monkeypatch, wide) -> None:
    """7-bit weights where onnxruntime's x86 kernels add uint8 x int8 pairs in int16 (no VNNI:
    full-range weights overflowed there and moved a tiny model's logits by up to 1.9 on an
    AVX2-only EPYC), the full int8 range elsewhere; which CPUs are which."""
    import onnx
    from onnx import numpy_helper

    from vitlab.eval import backends

    monkeypatch.setattr(backends, "_int8_dot_products", lambda: wide)
    model, meta = load_checkpoint(trained)
    runner = prepare(model, meta, "onnxruntime", int8=True, threads=1)
    weights = [numpy_helper.to_array(t) for t in onnx.load(runner.path).graph.initializer
               if t.data_type == onnx.TensorProto.INT8]  # fmt: skip
    assert len(weights) >= 2 * 4  # the qkv, proj, fc1 and fc2 weights of both blocks
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) == (127 if wide else 64)
    monkeypatch.undo()
    x86 = {"architecture": "x86_64", "sse2": True, "avx2": True, "avx512_vnni": False}
    assert not backends._int8_dot_products(x86)  # AVX2 only (the EPYC above)
    assert not backends._int8_dot_products({**x86, "avx512_f": True})  # AVX-512 without VNNI
    assert backends._int8_dot_products({**x86, "avx_vnni": True})
    assert backends._int8_dot_products({**x86, "avx512_vnni": True})
    assert backends._int8_dot_products({"architecture": "arm64", "neon": True, "dot": True})


@pytest.mark.parametrize(("backend", "int8"), [("onnxruntime", False), ("torch", True),
                                               ("onnxruntime", True)])  # fmt: skip
def test_each_backend_gives_eager_torchs_logits(trained, digits, backend, int8) -> None:
    model, meta = load_checkpoint(trained)
    with torch.no_grad():
        want = model.eval()(digits)
        got = prepare(model, meta, backend, int8, threads=1)(digits)
    assert got.shape == want.shape == (359, 10) and got.dtype == torch.float32
    diff = (got - want).abs().max().item()
    if not int8:
        assert diff <= ORT_FP32_TOLERANCE
        return
    assert 0 < diff <= INT8_TOLERANCE * want.abs().max().item()  # quantised, not a copy
    agree = (got.argmax(1) == want.argmax(1)).float().mean().item()
    assert agree >= INT8_AGREEMENT


def test_eval_with_onnxruntime_gives_torchs_accuracy(trained, capsys) -> None:
    reports = {}
    for extra in ([], ["--backend", "onnxruntime"], ["--backend", "onnxruntime", "--int8"]):
        assert main(["eval", str(trained), "--json", *extra]) == 0
        r = json.loads(capsys.readouterr().out)
        reports[r["backend"]] = r
    assert set(reports) == {"torch", "onnxruntime", "onnxruntime int8"}
    torch_, ort = reports["torch"], reports["onnxruntime"]
    assert ort["top1"] == torch_["top1"] and ort["confusion"] == torch_["confusion"]
    assert ort["loss"] == pytest.approx(torch_["loss"], abs=1e-5)
    assert abs(reports["onnxruntime int8"]["top1"] - torch_["top1"]) <= 0.03
    pngs = {b: Path(r["confusion_png"]).name for b, r in reports.items()}  # one replaced another
    assert pngs == {"torch": "confusion_matrix_test.png",
                    "onnxruntime": "confusion_matrix_test_backend-onnxruntime.png",
                    "onnxruntime int8": "confusion_matrix_test_backend-onnxruntime_int8.png",
                    }  # fmt: skip
    assert all((trained / name).is_file() for name in pngs.values())
    assert main(["eval", str(trained), "--int8"]) == 0
    assert "backend torch int8" in capsys.readouterr().out


def test_predict_with_each_backend(trained, tmp_path, capsys) -> None:
    test = load_split("digits", "test")
    path = tmp_path / "digit.png"
    Image.fromarray(test.images[0, 0].numpy().astype(np.uint8)).save(path)
    tops = []
    for extra in ([], ["--backend", "onnxruntime"], ["--int8"]):
        assert main(["predict", str(trained), str(path), "--json", *extra]) == 0
        tops.append(json.loads(capsys.readouterr().out)[0]["top"])
    assert tops[1][0]["index"] == tops[0][0]["index"] == tops[2][0]["index"]
    assert tops[1][0]["probability"] == pytest.approx(tops[0][0]["probability"], abs=1e-5)


def test_exports_leave_the_callers_model_as_it_was(tmp_path, capfd) -> None:
    """export_onnx and export_program once turned the caller's model to float32, CPU and eval
    mode in place: a bf16 model in training came back changed."""
    from vitlab.models.export import export_onnx, export_program

    cfg = config_of(ModelSection("vit_nano_patch4_28", {"depth": 1}))
    model = build_model(cfg).to(torch.bfloat16).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    meta = CheckpointMeta(cfg, Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij"))
    export_onnx(model, meta, tmp_path / "m.onnx")
    capfd.readouterr()
    export_program(model, meta, tmp_path / "m.pt2")
    assert "Unable to load package" not in capfd.readouterr().err  # torch's, for a temp name
    export_program(model, meta, tmp_path / "m.bin")  # torch warned of the temporary .tmp.bin
    assert "ending in .pt2" not in capfd.readouterr().err
    assert torch.export.load(str(tmp_path / "m.bin")).module() is not None
    assert model.training and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_model_without_a_classifier_exports_its_features(tmp_path) -> None:
    """A masked-patch-prediction encoder (num_classes=0) exported its pooled features as an
    output named `logits`, which eval and predict refuse to call them."""
    ort = pytest.importorskip("onnxruntime")
    from vitlab.models.export import export_onnx

    cfg = config_of(ModelSection("vit_nano_patch4_28", {"depth": 1, "num_classes": 0}))
    headless = build_model(cfg).eval()
    pre = Preprocessing((28, 28), 1, (0.5,), (0.5,))
    export_onnx(headless, CheckpointMeta(cfg, pre, []), tmp_path / "f.onnx")
    session = ort.InferenceSession(str(tmp_path / "f.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["features"]
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        want = headless(x)
    assert want.shape == (2, cfg.embed_dim)
    assert abs(session.run(None, {"images": x.numpy()})[0] - want.numpy()).max() < 1e-4


def test_relative_positions_export_and_a_failed_check_leaves_no_file(tmp_path, monkeypatch) -> None:
    """A relative-position ViT's attention (PyTorch's with a bias) once failed the ONNX exporter,
    so --backend onnxruntime and vitlab export --onnx refused it; and a file that failed its
    check against PyTorch stayed on disk beside the error."""
    from vitlab.models import export

    cfg = config_of(ModelSection("vit_nano_patch4_28", {"depth": 2, "pos_embed": "relative"}))
    model = build_model(cfg).eval()
    meta = CheckpointMeta(cfg, Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij"))
    r = export.export_onnx(model, meta, tmp_path / "m.onnx", dynamic_batch=True)
    assert r["batches_checked"] == [2, 5] and r["max_abs_diff"] <= export.TOLERANCE
    monkeypatch.setattr(export, "TOLERANCE", -1.0)  # every check fails
    for write, name in ((export.export_onnx, "bad.onnx"), (export.export_program, "bad.pt2")):
        with pytest.raises(export.ExportError, match="differs from PyTorch"):
            write(model, meta, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    monkeypatch.undo()
    for name, write in (("folder.onnx", export.export_onnx), ("folder.pt2", export.export_program)):
        (tmp_path / name).mkdir()
        with pytest.raises(export.ExportError, match=f"{name} is a folder: name the file"):
            write(torch.nn.Identity(), meta, tmp_path / name)  # refused before any export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.onnx", "folder.pt2", "m.onnx"]


def test_a_model_over_protobufs_2gb_exports_its_weights_beside_the_file(tmp_path, monkeypatch):
    """ViT-H/14's ONNX export failed past protobuf's 2 GB ("Failed to serialize proto", a
    traceback) and left its 2.5 GB .data behind. A model that large now writes OUT.onnx and its
    weights in a file OUT names, OUT.onnx.<id>.data: checked, read from any folder, metadata kept;
    a failed check leaves the earlier pair as it was, and a new export replaces its weights file
    (a nano ViT stands in, the limit set to 0)."""
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from vitlab.models import export

    cfg = config_of(ModelSection("vit_nano_patch4_28", {"depth": 1}))
    model = build_model(cfg).eval()
    randomize_head(model)
    meta = CheckpointMeta(cfg, Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij"))
    monkeypatch.setattr(export, "PROTOBUF_LIMIT", 0)
    out = tmp_path / "out" / "m.onnx"
    data = Path(export.export_onnx(model, meta, out, dynamic_batch=True)["data"])
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx", data.name]
    assert re.fullmatch(r"m\.onnx\.[0-9a-f]{8}\.data", data.name)
    proto = onnx.load(str(out), load_external_data=False)
    assert {p.key for p in proto.metadata_props} == {"vitlab_preprocessing", "vitlab_classes"}
    assert out.stat().st_size < 100_000 < data.stat().st_size
    monkeypatch.chdir(tmp_path)  # the weights found beside the file, not in the working folder
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        want = model(x).numpy()
    assert abs(session.run(None, {"images": x.numpy()})[0] - want).max() < 1e-4 < abs(want).max()
    pair = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    with monkeypatch.context() as m:
        m.setattr(export, "TOLERANCE", -1.0)
        with pytest.raises(export.ExportError, match="differs from PyTorch"):
            export.export_onnx(build_model(cfg).eval(), meta, out)
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == pair
    real = os.replace  # stopped between the weights' rename and OUT's: the old pair stays whole

    def stop_at_out(src, dst):
        if str(dst) == str(out):
            raise KeyboardInterrupt
        real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(export.os, "replace", stop_at_out)
        with pytest.raises(KeyboardInterrupt):
            export.export_onnx(model, meta, out)
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == pair
    with monkeypatch.context() as m:  # stopped after OUT's rename: its new weights stay
        m.setattr(export, "fsync", lambda p: (_ for _ in ()).throw(KeyboardInterrupt)
                  if Path(p) == out.parent else None)  # fmt: skip
        with pytest.raises(KeyboardInterrupt):
            export.export_onnx(model, meta, out)
    datas = [p for p in out.parent.iterdir() if p.suffix == ".data"]  # the old one kept too
    assert sum(p.name.encode() in out.read_bytes() for p in datas) == 1
    again = Path(export.export_onnx(model, meta, out)["data"])
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["m.onnx", again.name])
    monkeypatch.setattr(export, "PROTOBUF_LIMIT", 2**40)  # a small model over a large one's
    assert "data" not in export.export_onnx(model, meta, out)
    assert [p.name for p in out.parent.iterdir()] == ["m.onnx"]


def test_the_export_check_scales_with_the_outputs() -> None:
    """float32's rounding grows with the logits: a BiT ResNet-v2 with logits up to 12.5 came out
    of onnxruntime 4.2e-4 from PyTorch (PyTorch itself 2.2e-4 from float64) and was refused as
    'exported wrongly' by a fixed 1e-4; the tolerance is 1e-4 of each image's largest |logit|
    above 1."""
    from vitlab.models.export import ExportError, _check

    want = torch.tensor([[12.5, -3.0, 0.5], [0.2, 0.1, -0.3]])
    assert _check(want + torch.tensor([[4.2e-4], [0.0]]), want, "x") == pytest.approx(4.2e-4, 1e-3)
    with pytest.raises(ExportError, match=r"by 2\.00e-03 in an image whose largest \|output\| "
                       r"is 12\.5 \(tolerance 0\.0001 x that"):  # fmt: skip
        _check(want + torch.tensor([[2e-3], [0.0]]), want, "x")
    small = r"by 2\.00e-04 in an image whose largest \|output\| is 0\.3"  # its own: 1e-4 itself
    with pytest.raises(ExportError, match=small):
        _check(want + torch.tensor([[0.0], [2e-4]]), want, "x")


def test_an_unsupported_export_is_one_clean_line(tmp_path, capsys) -> None:
    """The exporter's own failure (here a model whose forward branches on its input's values)
    was a 100-line traceback from `vitlab export`: now one UnsupportedExport line, exit code 2."""
    from vitlab.models import export

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    meta = CheckpointMeta(
        config_of(ModelSection("vit_nano_patch4_28", {})),
        Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij"),
    )  # fmt: skip
    Branchy.config = meta.config
    with pytest.raises(export.UnsupportedExport, match="this Branchy cannot be exported to ONNX"):
        export.export_onnx(Branchy(), meta, tmp_path / "b.onnx")
    with pytest.raises(export.UnsupportedExport, match="with torch.export"):
        export.export_program(Branchy(), meta, tmp_path / "b.pt2")
    assert not list(tmp_path.iterdir())
    assert isinstance(export.UnsupportedExport("x"), ValueError)  # the CLI's one-line errors

    from vitlab.runtime import Terminated

    for signal in (KeyboardInterrupt, Terminated):  # Ctrl-C, or SIGTERM as the command raises it

        def interrupted(signal=signal):  # inside the exporter, which wraps what it meets in its
            try:  # own error
                raise signal
            except signal as e:
                raise RuntimeError("Failed to export the model with torch.export") from e

        with pytest.raises(signal):  # it said the model cannot be exported (exit 2, not 130 / 143)
            export._exported("to ONNX", Branchy(), interrupted)

    def closed():  # any other BaseException in the chain (a generator the exporter closed) is not
        try:  # an interruption: the export's failure, one line
            raise GeneratorExit
        except GeneratorExit as e:
            raise RuntimeError("Failed to export the model with torch.export") from e

    with pytest.raises(export.UnsupportedExport):
        export._exported("to ONNX", Branchy(), closed)


@pytest.mark.parametrize("device", ["foo", "CPU", "meta", "cuda:x", "cuda:7"])
def test_device_names_and_output_paths_are_one_line_errors(trained, device, tmp_path, capsys):
    """A device torch cannot name (or this machine lacks), and an --out that is a file, once
    ended in tracebacks (RuntimeError, FileExistsError after the whole evaluation)."""
    assert main(["eval", str(trained), "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab eval: error: --device") and "Traceback" not in err
    assert ("expected auto, cpu, cuda" in err) == (device != "cuda:7")
    assert main(["train", "--out", str(tmp_path / "r"), f"train.device={device}"]) == 2
    assert "train.device" in capsys.readouterr().err and not (tmp_path / "r").exists()
    if device == "foo":
        (tmp_path / "afile").write_text("mine")
        assert main(["eval", str(trained), "--out", str(tmp_path / "afile")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitlab eval: error:") and "afile is a file: expected a folder" in err
        assert (tmp_path / "afile").read_text() == "mine"
        both = str(tmp_path / "same.onnx")  # the program once replaced the ONNX model, exit 0
        assert main(["export", str(trained), "--onnx", both, "--torch-export", both]) == 2
        assert "--torch-export writes OUT.pt2, got " in capsys.readouterr().err
        assert not (tmp_path / "same.onnx").exists()
        # a swapped pair (an ONNX model named .pt2, each written without a word) and an output
        # under a file, found only after the ONNX model was written: each refused before either
        for args, said in [
            (["--onnx", "m.pt2"], "--onnx writes OUT.onnx, got "),
            (["--onnx", "m.txt"], "name it m.onnx"),
            (["--onnx", "m.onnx", "--torch-export", "afile/x.pt2"], "afile is a file"),
        ]:
            outs = [str(tmp_path / a) if a.startswith(("m.", "afile")) else a for a in args]
            assert main(["export", str(trained), *outs]) == 2
            assert said in capsys.readouterr().err
            assert not list(tmp_path.glob("m.*")) and not list(tmp_path.glob(".m*"))
        tmp_path.joinpath("m.onnx").write_bytes(b"")  # an exported file given as a checkpoint
        assert main(["predict", str(tmp_path / "m.onnx"), str(tmp_path / "afile")]) == 2
        assert "an exported model is no checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["eval", "RUN", "--batch-size", "0"], ["eval", "RUN", "--batch-threads", "0"],
     ["predict", "RUN", "x.png", "--topk", "-1"]],
)  # fmt: skip
def test_counts_below_one_are_refused_by_name(argv, capsys) -> None:
    """A batch size of 0 once ended in a ZeroDivisionError traceback, a negative --topk in an
    IndexError: now argparse's usage error, naming the option and the value."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {argv[-2]}: expected a whole number >= 1" in err
    assert f"got '{argv[-1]}'" in err


def test_flip_tta_averages_each_image_with_its_mirror_image(trained, digits, tmp_path,
                                                            capsys) -> None:  # fmt: skip
    model, meta = load_checkpoint(trained)
    model.eval()
    labels = load_split("digits", "test").labels
    with torch.no_grad():
        got = prepare(model, meta, tta="flip")(digits)
        # by hand, image by image: the two views' class probabilities, averaged
        want = torch.stack(
            [((model(x[None]).softmax(1) + model(x[None].flip(-1)).softmax(1)) / 2)[0].log()
             for x in digits]
        )  # fmt: skip
        mirrored = prepare(model, meta, "onnxruntime", tta="flip", threads=1)(digits.flip(-1))
        plain = model(digits)
    assert got.shape == (359, 10) and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.exp().sum(1), torch.ones(359), atol=1e-5)  # log-probabilities
    assert torch.allclose(mirrored, got, atol=1e-4)  # the same two views, the other way round
    assert (got.argmax(1) != plain.argmax(1)).any()  # the mirror image changes some predictions
    assert main(["eval", str(trained), "--tta", "flip", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tta"] == "flip" and r["num_images"] == 359
    assert r["top1"] == pytest.approx((want.argmax(1) == labels).double().mean().item(), abs=1e-9)
    path = tmp_path / "digit.png"
    Image.fromarray(load_split("digits", "test").images[0, 0].numpy().astype(np.uint8)).save(path)
    assert main(["predict", str(trained), str(path), "--tta", "flip", "--json"]) == 0
    top = json.loads(capsys.readouterr().out)[0]["top"][0]
    assert top["index"] == want[0].argmax().item()
    assert top["probability"] == pytest.approx(want[0].exp().max().item(), abs=1e-5)
    with pytest.raises(BackendError, match="unknown test-time augmentation 'crop'"):
        prepare(model, meta, tta="crop")


def test_flip_shift_tta_averages_ten_views_with_black_shifted_in(trained, digits, capsys):
    """--tta flip-shift against torchvision's pad + crop, view by view: the image and its mirror
    image, each as it is and moved a pixel up, down, left and right with black (as normalised)
    moved in; their class probabilities averaged."""
    from torchvision.transforms.v2 import functional as TF

    model, meta = load_checkpoint(trained)
    model.eval()
    pre = meta.preprocessing
    black = (0 - pre.mean[0]) / pre.std[0]  # one channel: the value a 0 pixel normalises to
    x = digits[:60]
    with torch.no_grad():
        got = prepare(model, meta, tta="flip-shift")(x)
        probs = []
        for img in (x, x.flip(-1)):
            padded = TF.pad(img, [1], fill=black)
            for top, left in ((1, 1), (0, 1), (2, 1), (1, 0), (1, 2)):
                probs.append(model(TF.crop(padded, top, left, 8, 8)).softmax(1))
        want = torch.stack(probs).mean(0).log()  # (60, 10)
        flip_only = prepare(model, meta, tta="flip")(x)
    assert got.shape == (60, 10) and torch.allclose(got, want, atol=1e-5)
    assert (got - flip_only).abs().max() > 1e-2  # the shifted views count
    assert main(["eval", str(trained), "--tta", "flip-shift", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tta"] == "flip-shift" and r["num_images"] == 359
    assert r["confusion_png"].endswith("confusion_matrix_test_tta-flip-shift.png")


def test_shifted_images_take_each_channels_fill_by_hand() -> None:
    """shift_images by hand: one shift for all images with each channel's fill (TTA's views), and
    a shift per image (training's random shifts)."""
    from vitlab.data.transforms import shift_images

    x = torch.rand(2, 3, 5, 6)
    fill = torch.tensor([-1.0, -2.0, -3.0])
    edge = fill.view(1, 3, 1)
    down, up = shift_images(x, 1, 0, fill), shift_images(x, -1, 0, fill)
    right, left = shift_images(x, 0, 1, fill), shift_images(x, 0, -1, fill)
    assert torch.equal(down[:, :, 1:], x[:, :, :-1]) and (down[:, :, 0] == edge).all()
    assert torch.equal(up[:, :, :-1], x[:, :, 1:]) and (up[:, :, -1] == edge).all()
    assert torch.equal(right[..., 1:], x[..., :-1]) and (right[..., 0] == edge).all()
    assert torch.equal(left[..., :-1], x[..., 1:]) and (left[..., -1] == edge).all()
    assert shift_images(x.double(), 1, 0, fill).dtype == torch.float64
    per_image = shift_images(x, torch.tensor([1, -2]), torch.tensor([0, 1]), fill)
    assert torch.equal(per_image[0], down[0])  # each image its own shift
    assert torch.equal(per_image[1, :, :-2, 1:], x[1, :, 2:, :-1])
    assert (per_image[1, :, -2:] == fill.view(3, 1, 1)).all()
    assert (per_image[1, ..., 0] == edge[0]).all()


def test_flip_tta_on_a_distilled_model_reports_its_averaged_heads_only() -> None:
    """With --tta flip a DeiT model's prediction is its two heads' average, averaged over the two
    views; the per-head top-1 (top1_cls, top1_dist) is left out rather than misreported."""
    torch.manual_seed(0)
    cfg = config_of(ModelSection("vit_nano_patch4_28", {"distilled": True, "depth": 1}))
    model = build_model(cfg).eval()
    randomize_head(model)
    torch.nn.init.normal_(model.head_dist.weight, std=0.5)
    meta = CheckpointMeta(cfg, Preprocessing((28, 28), 1, (0.5,), (0.5,)), list("abcdefghij"))
    x, y = torch.randn(16, 1, 28, 28), torch.arange(16) % 10
    r = evaluate(prepare(model, meta, tta="flip"), [(x, y)], 10, torch.device("cpu"))
    with torch.no_grad():
        views = torch.stack([model(x).log_softmax(1), model(x.flip(-1)).log_softmax(1)])
    probs = views.exp().mean(0)  # (16, 10): the two views' class probabilities, averaged
    assert "top1_cls" not in r and "top1_dist" not in r
    assert r["top1"] == pytest.approx((probs.argmax(1) == y).double().mean().item(), abs=1e-9)
    assert r["loss"] == pytest.approx(-probs[torch.arange(16), y].log().mean().item(), rel=1e-5)
    plain = evaluate(model, [(x, y)], 10, torch.device("cpu"))
    assert "top1_cls" in plain and plain["loss"] != pytest.approx(r["loss"], rel=1e-5)


def tiny_cnn():
    cfg = config_of(ModelSection("resnet18_28", {"num_classes": 3}))
    pre = Preprocessing((28, 28), 3, (0.5,) * 3, (0.5,) * 3)
    return build_model(cfg), CheckpointMeta(cfg, pre, ["a", "b", "c"])


def test_batch_threads_give_the_whole_batchs_outputs(trained, digits, capsys) -> None:
    """--batch-threads 2: the parts' logits in order (an odd batch of 359), under the caller's
    modes (inference, bf16 autocast: thread-local), one PyTorch thread each; with TTA and int8
    too (whose activations are quantised per call: against its calls on each half); `vitlab
    eval` reports the same accuracy and loss."""
    model, meta = load_checkpoint(trained)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = set()
    model.register_forward_pre_hook(lambda *_: seen.add(torch.get_num_threads()))
    try:
        for kw in ({}, {"tta": "flip-shift"}, {"int8": True}):
            with torch.inference_mode():
                whole = prepare(model, meta, "torch", **kw)
                halves = [whole(half) for half in digits.tensor_split(2)]
                want = torch.cat(halves) if kw.get("int8") else whole(digits)
                got = prepare(model, meta, "torch", batch_threads=2, **kw)(digits)
            assert got.is_inference() and torch.allclose(got, want, atol=1e-5), kw
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            assert prepare(model, meta, "torch", batch_threads=2)(digits).dtype == torch.bfloat16
        with torch.inference_mode():  # one image, and none (torch.cat of no parts once raised)
            parts, one = prepare(model, meta, "torch", batch_threads=2), digits[:1]
            assert torch.allclose(parts(one), prepare(model, meta, "torch")(one), atol=1e-5)
            assert parts(digits[:0]).shape == (0, 10)
    finally:
        torch.set_num_threads(before)
    assert seen == {2, 1}  # the caller's call ran on two threads, the parts on one each
    reports = []
    for extra in ([], ["--batch-threads", "2"]):
        assert main(["eval", str(trained), "--json", *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[1]["top1"] == reports[0]["top1"] and reports[1]["top1"] > 0.5
    assert reports[1]["loss"] == pytest.approx(reports[0]["loss"], abs=1e-5)


def test_what_cannot_run_says_why(trained, monkeypatch) -> None:
    model, meta = load_checkpoint(trained)
    with pytest.raises(BackendError, match="for --backend torch on the CPU"):
        prepare(model, meta, "onnxruntime", batch_threads=2)
    with pytest.raises(BackendError, match="none outside its classifier"):
        prepare(*tiny_cnn(), "torch", int8=True)
    with pytest.raises(BackendError, match="runs on the CPU"):
        backend_device(torch.device("cuda"), "onnxruntime", False)
    with pytest.raises(BackendError, match="unknown backend 'tvm'"):
        prepare(model, meta, "tvm")

    def unsupported(*args, **kwargs):
        raise RuntimeError("an op the exporter lacks\nmore detail")

    with monkeypatch.context() as m:
        m.setattr(torch.onnx, "export", unsupported)
        with pytest.raises(BackendError, match=r"cannot be exported to ONNX \(an op the expo"):
            prepare(model, meta, "onnxruntime")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(BackendError, match=r"pip install 'vitlab\[export\]'"):
        prepare(model, meta, "onnxruntime")


def test_two_exports_to_one_file_at_once_do_not_share_a_temporary(tmp_path) -> None:
    """Every export wrote `.OUT.tmp.onnx` beside OUT: a second export to the same OUT while the
    first ran overwrote (or, failing, removed) the first's half-written file, which was then
    checked and renamed. Each now has its own temporary; the last one renamed is OUT."""
    from vitlab.models.export import _checked_file

    out = tmp_path / "m.onnx"
    with _checked_file(out) as first, _checked_file(out) as second:
        assert first != second and first.parent == second.parent == tmp_path
        assert first.suffix == second.suffix == ".onnx" and first.name.startswith(".m.")
        first.write_text("first")
        second.write_text("second")
    assert out.read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_int8_onnx_leaves_the_root_logger_without_a_handler(trained) -> None:
    """onnxruntime's quantiser calls logging.warning, whose basicConfig() gave the root logger a
    stderr handler of its own: every library's warnings then printed, and a notebook's later
    logging.basicConfig(...) did nothing. The root logger's handlers and level are kept."""
    import logging

    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    saved, root.handlers = root.handlers, []  # as in a fresh notebook (pytest's are put back)
    try:
        model, meta = load_checkpoint(trained)
        prepare(model, meta, "onnxruntime", int8=True, threads=1)
        assert root.handlers == []
    finally:
        root.handlers = saved
    assert (list(root.handlers), root.level) == before
