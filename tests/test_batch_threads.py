"""train.batch_threads: a batch's parts trained on their own threads give the whole batch's
gradient (BatchNorm: the parts' statistics, as under DDP), draw their random numbers from their own
streams (reproducible, resumable), and refuse what they cannot do."""

from __future__ import annotations

import copy
import threading
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import vitlab
from tests.helpers import TINY_MODEL, resume, weights_of
from vitlab.config import ConfigError, load_run_config
from vitlab.runtime import drawing_from
from vitlab.train.engine import classification
from vitlab.train.run import train
from vitlab.train.threads import BatchThreads


def cfg(*overrides: str):
    return load_run_config(None, [*TINY_MODEL, "data.val_fraction=0", *overrides])


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def model(**overrides):
    torch.manual_seed(0)
    m = vitlab.create_model("vit_nano_patch4_28", num_classes=10, in_chans=1, **overrides)
    torch.nn.init.normal_(m.head.weight, std=0.1)  # a zero head passes no gradient back
    return m.train()


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in m.named_parameters()}


def test_the_parts_give_the_whole_batchs_loss_and_gradient_on_one_thread_each(two_threads):
    """An odd batch (37 = 19 + 18: the parts weigh by their size) against one backward over it,
    accumulation included; each part runs on a worker thread with one PyTorch thread, and the
    caller keeps its two."""
    ours, ref = model(), model()
    x, y = torch.randn(37, 1, 28, 28), torch.randint(0, 10, (37,))
    seen = set()
    ours.register_forward_pre_hook(
        lambda *_: seen.add((threading.current_thread().name[:11], torch.get_num_threads()))
    )
    threads = BatchThreads(ours, 2)
    loss, right, made = threads.forward_backward(classification(), x, y, nullcontext, 2, seed=0)
    assert ours.head.weight.grad is None  # held until add_gradients (a NaN loss applies none)
    threads.add_gradients()
    logits = ref(x)
    whole = F.cross_entropy(logits, y)
    (whole / 2).backward()
    assert seen == {("vitlab-part", 1)} and torch.get_num_threads() == 2
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert made == 37 and right.item() == (logits.argmax(1) == y).sum().item()
    a, b = grads(ours), grads(ref)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-4, msg=k)
    threads.forward_backward(classification(), x, y, nullcontext, 2, seed=0)
    threads.add_gradients()  # the second of two accumulated batches: the sum
    for k, g in grads(ours).items():
        torch.testing.assert_close(g, 2 * b[k], atol=1e-6, rtol=1e-4, msg=k)


def test_batchnorm_normalises_each_part_and_keeps_their_mean_statistics(two_threads):
    """A conv stem's BatchNorm: gradients are the sum of each half's alone (as DDP's ranks), the
    running statistics the mean of the halves' updates (the first BatchNorm's running mean, before
    any normalisation differs, is then the whole batch's)."""
    ours = model(stem="conv")
    halves = [copy.deepcopy(ours) for _ in range(2)]
    whole = copy.deepcopy(ours)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    threads = BatchThreads(ours, 2)
    threads.forward_backward(classification(), x, y, nullcontext, 1, seed=0)
    threads.add_gradients()
    for half, part, part_y in zip(halves, x.chunk(2), y.chunk(2)):
        (F.cross_entropy(half(part), part_y) / 2).backward()
    F.cross_entropy(whole(x), y).backward()
    a, h0, h1, w = (grads(m) for m in (ours, *halves, whole))
    for k in a:
        torch.testing.assert_close(a[k], h0[k] + h1[k], atol=1e-6, rtol=1e-4, msg=k)
    assert not torch.allclose(a["patch_embed.stem.0.weight"], w["patch_embed.stem.0.weight"])
    stats = dict(ours.named_buffers())
    for k, v in stats.items():
        if "running" in k:
            expected = (dict(halves[0].named_buffers())[k] + dict(halves[1].named_buffers())[k]) / 2
            torch.testing.assert_close(v, expected, msg=k)
    first = "patch_embed.stem.1.running_mean"
    torch.testing.assert_close(stats[first], dict(whole.named_buffers())[first])


def test_drop_path_draws_from_the_threads_own_stream() -> None:
    m = model(drop_path=0.5)
    x = torch.randn(8, 1, 28, 28)
    before = torch.get_rng_state()
    with drawing_from(torch.Generator().manual_seed(1)):
        a = m(x)
    with drawing_from(torch.Generator().manual_seed(1)):
        b = m(x)
    with drawing_from(torch.Generator().manual_seed(2)):
        c = m(x)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream untouched
    assert torch.equal(a, b) and not torch.equal(a, c)
    m(x)
    assert not torch.equal(torch.get_rng_state(), before)  # outside: the default stream


def test_training_with_batch_threads(tmp_path) -> None:
    """Without random draws in the model, two threads learn the one thread's weights and EMA (to
    float noise; mixed labels and label smoothing on the way); with drop_path a run is
    reproducible and resumes exactly."""
    common = ["train.precision=fp32", "train.epochs=2", "train.batch_size=32"]
    mixing = ["data.mixup=0.5", "optim.label_smoothing=0.1", "train.ema=0.9"]
    one = train(cfg(*common, *mixing), out=tmp_path / "one")
    two = train(cfg(*common, *mixing, "train.batch_threads=2"), out=tmp_path / "two")
    a, b = weights_of(one), weights_of(two)
    a.update({f"ema.{k}": v for k, v in weights_of(one, "best").items()})
    b.update({f"ema.{k}": v for k, v in weights_of(two, "best").items()})
    for k in a:
        if k.endswith("qkv.bias"):  # without the key's third: its gradient is 0 in exact
            # arithmetic (softmax ignores what is added to all of a query's scores), and AdamW
            # scales float noise up to steps of lr
            a[k], b[k] = (t.reshape(3, -1)[0::2] for t in (a[k], b[k]))
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3, msg=k)
    dropping = [*common, "train.batch_threads=2", "model.drop_path=0.2"]
    straight = train(cfg(*dropping), out=tmp_path / "straight")
    again = train(cfg(*dropping), out=tmp_path / "again")
    half = train(cfg(*dropping, "train.stop_at_epoch=1"), out=tmp_path / "half")
    resumed = resume(half)
    s, g, r = weights_of(straight), weights_of(again), weights_of(resumed)
    for k in s:
        assert torch.equal(s[k], g[k]) and torch.equal(s[k], r[k]), k
    assert not all(torch.allclose(s[k], a[k], atol=1e-3) for k in s)  # the masks took effect


def test_train_threads_hold_for_the_run_and_the_callers_count_comes_back(
    tmp_path, two_threads, monkeypatch
) -> None:
    """train.threads set PyTorch's thread count for the whole process: a notebook's next cell
    ran on the run's one thread. The run trains on its count; the caller's comes back, after a
    refused run too."""
    from vitlab.train import run as run_mod

    seen, real = [], run_mod.train_epoch
    counted = lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(run_mod, "train_epoch", counted)
    train(cfg("train.epochs=1", "train.threads=1"), out=tmp_path / "run")
    assert seen == [1] and torch.get_num_threads() == 2
    with pytest.raises(ConfigError, match="already holds a run"):  # refused after the count's set
        train(cfg("train.epochs=1", "train.threads=1"), out=tmp_path / "run")
    assert seen == [1] and torch.get_num_threads() == 2


def test_each_batch_draws_from_its_own_seed_again_on_resume(tmp_path, monkeypatch) -> None:
    """The seed the parts' streams derive from: one per batch (accumulated batches included),
    never repeated over the epochs, and the same batches' seeds after a resume."""
    seeds: list[int] = []
    real = BatchThreads.forward_backward

    def recording(self, objective, x, y, autocast, accum, seed):
        seeds.append(seed)
        return real(self, objective, x, y, autocast, accum, seed)

    monkeypatch.setattr(BatchThreads, "forward_backward", recording)
    common = ["train.epochs=2", "train.batch_size=64", "train.accum_steps=2",
              "train.batch_threads=2", "model.drop_path=0.1"]  # fmt: skip
    train(cfg(*common), out=tmp_path / "straight")
    straight = list(seeds)
    assert len(straight) == 2 * 22 and len(set(straight)) == len(straight)  # 1,438 images
    seeds.clear()
    half = train(cfg(*common, "train.stop_at_epoch=1"), out=tmp_path / "half")
    resume(half)
    assert seeds == straight


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.dropout=0.1"], "model.dropout=0.1: dropout draws from PyTorch's one random"),
        (["model.attn_dropout=0.1"], "use model.drop_path"),
        (["train.compile=true"], "runs the model eagerly"),
        (["train.grad_checkpointing=true"], "with train.grad_checkpointing is not supported"),
        (["train.batch_threads=0"], "^train.batch_threads must be >= 1, got 0$"),
    ],
)
def test_batch_threads_refuse_what_they_cannot_do(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        train(cfg("train.batch_threads=2", *overrides), out=tmp_path / "run")
