"""DeiT distillation (the `distill` section): the hard and soft losses against hand computations, a
student learning its teacher's predictions with its distillation head (and the labels with its
class head), a teacher that stays frozen and out of the student's checkpoint, exact resume,
teachers of another input size, refusals, accumulation and torchrun."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F

from tests.helpers import TINY_MODEL, resume, tiny_checkpoint, torchrun_train, weights_of
from vitlab import load_checkpoint
from vitlab.cli.main import main
from vitlab.config import ConfigError, DistillConfig, load_run_config
from vitlab.data import load_split, make_loader
from vitlab.eval.classification import distilled_heads
from vitlab.formats.base import CheckpointError
from vitlab.models.checkpoint import save_pretrained
from vitlab.models.vit import VisionTransformer
from vitlab.train import distill
from vitlab.train.distill import distillation_loss
from vitlab.train.run import train

FAST = [*TINY_MODEL, "train.batch_size=64"]
STUDENT = [*FAST, "model.distilled=true"]


def cfg(*overrides: str):
    return load_run_config(None, [*STUDENT, *overrides])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A tiny ViT trained on digits (about 85% on the test split)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train(load_run_config(None, [*FAST, "train.epochs=15", "optim.lr=0.004"]), out=out)
    return out


@pytest.fixture()
def teachers(monkeypatch) -> list[distill.Teacher]:
    """Every Teacher the runs of a test load, to look at after the run."""
    loaded: list[distill.Teacher] = []
    real = distill.load_teacher
    monkeypatch.setattr(distill, "load_teacher", lambda *a: loaded.append(real(*a)) or loaded[-1])
    return loaded


# --- the loss, by hand ---------------------------------------------------------------------------

CLS = [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]]
DIST = [[0.0, 1.0, 0.0], [1.0, 0.0, 2.0]]
TEACHER = [[0.0, 3.0, 1.0], [2.0, 0.0, 0.5]]  # argmax: 1, 0
LABELS = [0, 1]


def _log_softmax(row: list[float]) -> list[float]:
    z = math.log(sum(math.exp(v) for v in row))
    return [v - z for v in row]


def _ce(row: list[float], target: list[float]) -> float:
    """Cross-entropy of logits `row` against a distribution `target`."""
    return -sum(t * lp for t, lp in zip(target, _log_softmax(row)))


def _one_hot(i: int, smoothing: float = 0.0) -> list[float]:
    return [(1 - smoothing) * (j == i) + smoothing / 3 for j in range(3)]


def _loss(kind: str, alpha: float, tau: float = 1.0, teacher=TEACHER, labels=LABELS, ls=0.0):
    t = torch.tensor(teacher) if teacher is not None else None
    y = torch.tensor(labels)
    args = torch.tensor(CLS), torch.tensor(DIST), y, t
    return distillation_loss(*args, DistillConfig("a teacher", kind, alpha, tau), ls).item()


def test_hard_distillation_loss_equals_a_hand_computation() -> None:
    base = (_ce(CLS[0], _one_hot(0)) + _ce(CLS[1], _one_hot(1))) / 2
    hard = (_ce(DIST[0], _one_hot(1)) + _ce(DIST[1], _one_hot(0))) / 2  # the teacher's argmax
    assert _loss("hard", 0.25) == pytest.approx(0.75 * base + 0.25 * hard, rel=1e-6)
    assert _loss("hard", 0.0) == pytest.approx(base, rel=1e-6)
    assert _loss("hard", 1.0) == pytest.approx(hard, rel=1e-6)
    # label smoothing is the class head's; the teacher's argmax is a hard target
    smooth = (_ce(CLS[0], _one_hot(0, 0.3)) + _ce(CLS[1], _one_hot(1, 0.3))) / 2
    assert _loss("hard", 0.5, ls=0.3) == pytest.approx(0.5 * smooth + 0.5 * hard, rel=1e-6)
    # mixed labels (mixup / cutmix rows) for the class head
    rows = [[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]]
    mixed = (_ce(CLS[0], rows[0]) + _ce(CLS[1], rows[1])) / 2
    assert _loss("hard", 0.5, labels=rows) == pytest.approx(0.5 * mixed + 0.5 * hard, rel=1e-6)
    # no teacher: the distillation head learns the labels too
    both = (_ce(DIST[0], _one_hot(0)) + _ce(DIST[1], _one_hot(1))) / 2
    assert _loss("hard", 0.5, teacher=None) == pytest.approx(0.5 * base + 0.5 * both, rel=1e-6)


def test_soft_distillation_loss_equals_a_hand_computation() -> None:
    base = (_ce(CLS[0], _one_hot(0)) + _ce(CLS[1], _one_hot(1))) / 2
    for tau in (1.0, 2.0, 0.5):
        kl = 0.0  # KL(p_teacher || p_student) at temperature tau, summed, then / batch
        for s_row, t_row in zip(DIST, TEACHER):
            log_q = _log_softmax([v / tau for v in s_row])
            log_p = _log_softmax([v / tau for v in t_row])
            kl += sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q))
        soft = tau * tau * kl / 2
        assert _loss("soft", 0.3, tau) == pytest.approx(0.7 * base + 0.3 * soft, rel=1e-6)
    assert _loss("soft", 1.0, 1.0, teacher=DIST) == pytest.approx(0.0, abs=1e-7)


def test_the_distill_section_is_checked() -> None:
    for bad, match in [
        ("distill.alpha=1.5", "alpha must be in"),
        ("distill.alpha=-0.1", "alpha must be in"),
        ("distill.tau=0", "tau must be > 0"),
        ("distill.type=soft", "set distill.teacher .and model.distilled=true"),
        ("distill.tau=2", "soft only"),
        ("distill.type=medium", "expected 'hard' | 'soft'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            cfg(bad)
    saved = cfg("distill.teacher=runs/t", "distill.type=soft", "distill.tau=3").to_tree()
    assert saved["distill"] == {"teacher": "runs/t", "type": "soft", "alpha": 0.5, "tau": 3.0}


# --- training ------------------------------------------------------------------------------------


def _predictions(model, split, pre) -> tuple[torch.Tensor, ...]:
    """Each head's (or the model's) predicted classes on `split`."""
    out = []
    with torch.no_grad():
        for x, _ in make_loader(split, 512, pre):
            heads = distilled_heads(model, x) if model.head_dist is not None else (model(x),)
            out.append(torch.stack([h.argmax(dim=1) for h in heads]))
    return tuple(torch.cat(out, dim=1))


def test_the_distillation_head_learns_the_teacher_and_the_class_head_the_labels(
    teacher: Path, tmp_path: Path, teachers, capsys
) -> None:
    """A teacher that predicts class c+1 where it sees c: the student's distillation head learns
    to say c+1, its class head c. The teacher is frozen, in eval mode, and not saved."""
    model, _ = load_checkpoint(teacher)
    with torch.no_grad():  # logits'[c] = logits[c - 1]: the argmax moves one class up
        model.head.weight.copy_(model.head.weight.roll(1, dims=0))
        model.head.bias.copy_(model.head.bias.roll(1, dims=0))
    shifted = tmp_path / "shifted"
    save_pretrained(model, shifted)
    original = {k: v.clone() for k, v in model.state_dict().items()}

    run = train(cfg("train.epochs=15", "optim.lr=0.004", f"distill.teacher={shifted}"),
                out=tmp_path / "student")  # fmt: skip
    err = capsys.readouterr().err
    assert f"distill: teacher {shifted}" in err and "hard, alpha 0.5" in err
    (loaded,) = teachers
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v.cpu(), original[k]), k  # never updated

    saved = weights_of(run)
    assert {"dist_token", "head_dist.weight", "head.weight"} <= saved.keys()
    assert not any(k.startswith(("student.", "teacher", "module.")) for k in saved)
    student_keys = VisionTransformer(load_checkpoint(run)[1].config).state_dict().keys()
    assert saved.keys() == student_keys  # the student alone, nothing of the teacher or wrapper

    student, meta = load_checkpoint(run)
    test = load_split("digits", "test")
    cls, dist = _predictions(student, test, meta.preprocessing)
    (teacher_says,) = _predictions(model.eval(), test, meta.preprocessing)
    agree_dist = (dist == teacher_says).float().mean().item()
    agree_cls = (cls == teacher_says).float().mean().item()
    assert agree_dist > 0.6 and agree_cls < 0.2, (agree_dist, agree_cls)  # chance: 0.1

    results = json.loads((run / "results.json").read_text())
    assert results["top1_cls"] > 0.6 and results["top1_dist"] < 0.2, results
    assert main(["eval", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for k in ("top1", "top1_cls", "top1_dist"):
        assert report[k] == pytest.approx(results[k]), k
    assert report["top1_cls"] == pytest.approx((cls == test.labels).float().mean().item())
    assert main(["eval", str(run)]) == 0
    assert "class head alone" in capsys.readouterr().out
    assert "(class head" in err  # the run's own test report names both heads


def test_resume_with_a_teacher_is_exact(teacher: Path, tmp_path: Path, capsys, caplog) -> None:
    extra = [f"distill.teacher={teacher}", "train.epochs=3", "data.mixup=0.5",
             "data.crop_padding=1", "model.drop_path=0.1", "train.ema=0.9"]  # fmt: skip
    straight = train(cfg(*extra), out=tmp_path / "straight")
    half = train(cfg(*extra, "train.stop_at_epoch=1"), out=tmp_path / "half")
    assert "teacher: " in (half / "config.yaml").read_text()
    copy = tmp_path / "copy"
    shutil.copytree(half, copy)
    resumed = resume(half)
    for which in ("last", "best"):  # best: the EMA weights
        a, b = weights_of(straight, which), weights_of(resumed, which)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (which, k)
    assert "other weights" not in capsys.readouterr().err

    # a teacher that changed meanwhile: said, since the continuation cannot be exact
    moved = tiny_checkpoint(tmp_path / "other", embed_dim=32, depth=2, num_heads=2)
    tree = yaml.safe_load((copy / "config.yaml").read_text())
    tree["distill"]["teacher"] = str(moved)
    (copy / "config.yaml").write_text(yaml.safe_dump(tree))
    with caplog.at_level(logging.WARNING, logger="vitlab"):  # a warning: -q hides it
        resume(copy)
    assert "holds other weights than when the run started" in caplog.text


def test_a_teacher_of_another_size_sees_the_batch_resized(
    tmp_path: Path, teachers, monkeypatch, capsys
) -> None:
    """The teacher takes 16x16 inputs normalised to [-1, 1]; the student 8x8 ones normalised by
    the dataset's statistics. The teacher gets the student's own (mixed) batch, resized and
    renormalised: the same pixels."""
    big = tiny_checkpoint(tmp_path / "big", img_size=16)
    seen: dict[str, list[torch.Tensor]] = {"student": [], "teacher": []}

    def record(where: str):
        return lambda module, args: seen[where].append(args[0].detach().float().clone())

    loader = distill.load_teacher  # the `teachers` fixture's

    def hooked(*args):
        t = loader(*args)
        t.model.patch_embed.register_forward_pre_hook(record("teacher"))
        return t

    class Hooked(distill.TwoHeads):
        def __init__(self, student) -> None:
            super().__init__(student)
            student.patch_embed.register_forward_pre_hook(record("student"))

    monkeypatch.setattr(distill, "load_teacher", hooked)
    monkeypatch.setattr(distill, "TwoHeads", Hooked)
    run = train(
        cfg(
            f"distill.teacher={big}",
            "train.epochs=1",
            "data.mixup=0.8",
            "data.val_fraction=0",
            "train.precision=fp32",
        ),  # fmt: skip
        out=tmp_path / "r",
    )
    err = capsys.readouterr().err
    assert "resized 8x8 -> 16x16" in err and "renormalised" in err
    (t,) = teachers
    # one per training batch (1,437 // 64); the student also runs on the test split after
    assert len(seen["teacher"]) == 22 and len(seen["student"]) == 22 + 2
    pre = load_checkpoint(run)[1].preprocessing
    own = load_checkpoint(big)[1].preprocessing
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (pre.mean, pre.std))
    t_mean, t_std = (torch.tensor(v).view(1, -1, 1, 1) for v in (own.mean, own.std))
    for x, xt in zip(seen["student"][:22], seen["teacher"]):
        assert xt.shape == (64, 1, 16, 16) and x.shape == (64, 1, 8, 8)
        pixels = F.interpolate(x, (16, 16), mode=t.mode, antialias=True) * std + mean
        torch.testing.assert_close(xt * t_std + t_mean, pixels, atol=1e-4, rtol=1e-4)
    assert len({round(x.sum().item(), 3) for x in seen["teacher"]}) == 22  # batches differ


def test_teachers_that_cannot_teach_the_student_are_refused(teacher: Path, tmp_path: Path) -> None:
    five = tiny_checkpoint(tmp_path / "five", num_classes=5)
    with pytest.raises(ConfigError, match="predicts 5 classes, the student 10"):
        train(cfg(f"distill.teacher={five}"), out=tmp_path / "a")
    rgb = tiny_checkpoint(tmp_path / "rgb", in_chans=3)
    with pytest.raises(ConfigError, match="takes 3-channel images, the student's data has 1"):
        train(cfg(f"distill.teacher={rgb}"), out=tmp_path / "b")
    with pytest.raises(ConfigError, match="set model.distilled=true"):
        train(load_run_config(None, [*FAST, f"distill.teacher={teacher}"]), out=tmp_path / "c")
    with pytest.raises(ConfigError, match="set model.distilled=true"):
        train(load_run_config(None, [*FAST, "distill.alpha=0.2"]), out=tmp_path / "d")
    with pytest.raises(CheckpointError, match="distill.teacher: no file or folder"):
        train(cfg(f"distill.teacher={tmp_path / 'nothing'}"), out=tmp_path / "e")
    with pytest.raises(ConfigError, match="not train.objective=mpp"):
        train(cfg("train.objective=mpp", "model.num_classes=0"), out=tmp_path / "f")
    assert not any((tmp_path / x).exists() for x in "abcdef")


def test_a_teacher_with_the_classes_in_another_order_is_reordered(tmp_path: Path) -> None:
    """The teacher names cat, dog, bird; the student's data bird, cat, dog (an image folder's
    sorted order): the teacher's logits come in the data's order. Names partly shared are
    refused; numbered classes, and names none of which are shared, are taken by index."""
    model, meta = load_checkpoint(tiny_checkpoint(tmp_path / "t", num_classes=3))
    model.classes = ["cat", "dog", "bird"]
    save_pretrained(model, tmp_path / "named")
    pre, cpu = meta.preprocessing, torch.device("cpu")
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        own = model.eval()(x)
    t = distill.load_teacher(str(tmp_path / "named"), 3, ["bird", "cat", "dog"], pre, cpu)
    assert torch.equal(t(x), own[:, [2, 0, 1]])
    assert any("reordered to the data's classes" in n for n in t.notes)
    same = distill.load_teacher(str(tmp_path / "named"), 3, ["cat", "dog", "bird"], pre, cpu)
    assert torch.equal(same(x), own) and same.notes == []
    numbered = distill.load_teacher(str(tmp_path / "named"), 3, ["0", "1", "2"], pre, cpu)
    assert torch.equal(numbered(x), own)
    other = distill.load_teacher(str(tmp_path / "named"), 3, ["ant", "bee", "cow"], pre, cpu)
    assert torch.equal(other(x), own) and "share no class name" in other.notes[0]  # by index
    with pytest.raises(ConfigError, match=r"teacher .*: some names are shared, some not"):
        distill.load_teacher(str(tmp_path / "named"), 3, ["cat", "bee", "cow"], pre, cpu)


def test_soft_distillation_accumulates_like_the_larger_batch(teacher: Path, tmp_path) -> None:
    """2 x 32 accumulated == one batch of 64 with a soft teacher (SGD, float32)."""
    common = [f"distill.teacher={teacher}", "distill.type=soft", "distill.tau=2",
              "train.epochs=1", "data.val_fraction=0", "optim.name=sgd", "optim.lr=0.05",
              "train.precision=fp32"]  # fmt: skip
    big = train(cfg(*common), out=tmp_path / "big")
    accum = train(cfg(*common, "train.batch_size=32", "train.accum_steps=2"), out=tmp_path / "acc")
    a, b = weights_of(big), weights_of(accum)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
    assert a["head_dist.weight"].abs().sum() > 0  # the distillation head learned


def test_without_a_teacher_both_heads_learn_the_labels(tmp_path: Path, capsys) -> None:
    run = train(cfg("train.epochs=4"), out=tmp_path / "r")
    assert "no teacher, both heads learn the labels" in capsys.readouterr().err
    results = json.loads((run / "results.json").read_text())
    assert results["top1_cls"] > 0.3 and results["top1_dist"] > 0.3, results


def test_two_processes_with_a_teacher_equal_one(teacher: Path, tmp_path: Path) -> None:
    """torchrun with 2 CPU processes (gloo): the teacher on each rank, the student under DDP,
    the same weights as one process with the same global batch, every test image counted once."""
    common = [*STUDENT, f"distill.teacher={teacher}", "train.epochs=1", "data.val_fraction=0",
              "train.precision=fp32", "optim.name=sgd", "optim.lr=0.05"]  # fmt: skip
    single = train(load_run_config(None, common), out=tmp_path / "single")
    multi = tmp_path / "ddp"
    proc = torchrun_train(multi, *common, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stderr and "distill: teacher" in proc.stderr
    a, b = weights_of(single), weights_of(multi)
    for k in a:  # summation order: up to 2e-5 apart after 22 steps; unsynced ranks: ~1e-2
        torch.testing.assert_close(b[k], a[k], atol=5e-5, rtol=1e-4, msg=k)
    result = json.loads((multi / "results.json").read_text())
    assert result["num_images"] == 359 and {"top1_cls", "top1_dist"} <= result.keys()
    refused = torchrun_train(tmp_path / "fsdp", *common, "train.strategy=fsdp", timeout=240)
    assert refused.returncode != 0  # a setting every rank refuses: said once, by rank 0
    assert refused.stderr.count("vitlab train: error:") == 1, refused.stderr[-3000:]
    assert "train.strategy=fsdp" in refused.stderr


def test_a_nearest_teacher_sees_pils_nearest_pixels() -> None:
    """A teacher whose preprocessing resizes by "nearest" got F.interpolate's legacy nearest (a
    grid shifted from PIL's pixel centres); it gets PIL's NEAREST pixels of the same image."""
    import numpy as np
    from PIL import Image

    from vitlab.preprocessing import Preprocessing

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    # 6 -> 16: no output pixel centre falls on a source pixel's edge (those ties PIL and PyTorch
    # round apart, by their scales' float error)
    student = Preprocessing((6, 6), 1, (0.0,), (1.0,))
    own = Preprocessing((16, 16), 1, (0.0,), (1.0,), "nearest")
    seen = []
    model = Identity()
    model.register_forward_hook(lambda m, a, out: seen.append(out))
    teacher = distill.Teacher(model, "t", student, own, torch.device("cpu"))
    pixels = torch.randint(0, 256, (6, 6), generator=torch.Generator().manual_seed(0))
    teacher(pixels.float().view(1, 1, 6, 6))
    pil = Image.fromarray(pixels.numpy().astype("uint8")).resize((16, 16), Image.NEAREST)
    assert torch.equal(seen[0][0, 0], torch.tensor(np.asarray(pil), dtype=torch.float32))
