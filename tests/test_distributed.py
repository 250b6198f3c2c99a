"""Two ranks under torchrun (gloo on CPU): compiled DDP skips the gradient all-reduce while it
accumulates, evaluation ends on every rank with each sample counted once (DDP and FSDP), and each
rank draws its own augmentation and dropout, reproducibly and across a resume.

The test functions start this file under torchrun; `worker` (below) is what each rank runs."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL, TORCHRUN, kill_tree, one_thread_env
from vitlab.config import load_run_config
from vitlab.data import load_split, make_loader
from vitlab.data.loader import BatchPlan
from vitlab.models.registry import config_of
from vitlab.models.vit import VisionTransformer
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import all_reduce_
from vitlab.train import distributed
from vitlab.train.run import Run, train
from vitlab.train.state import load_weights

FAST = [*TINY_MODEL, "train.precision=fp32"]
ROOT = Path(__file__).resolve().parents[1]  # the workers run as `-m tests.test_distributed` here
# SGD: Adam would turn float noise in a mathematically zero gradient into full-size steps
SGD = ["optim.name=sgd", "optim.lr=0.05", "data.val_fraction=0"]
TRAIN_IMAGES = 1438  # digits' training split (1,797 less the seeded 359 test images)


def torchrun(command: str, spec: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `worker(command, spec)` on 2 ranks (standalone: a free port of its own)."""
    return finish(start(command, spec), command, timeout)


def start(command: str, spec: dict) -> subprocess.Popen:
    """`worker(command, spec)` started on 2 ranks; finish() waits for it."""
    return subprocess.Popen(
        [*TORCHRUN, "-m", "tests.test_distributed", command, json.dumps(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=one_thread_env(),
    )


def finish(
    proc: subprocess.Popen, command: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Wait for a start()ed run: its output, or a failed test (its processes killed) if it hung
    or failed."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = kill_tree(proc)
        pytest.fail(f"{command} hung for {timeout} s: {stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def weights_of(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / which / "model.safetensors")


def read_ranks(out: Path, name: str) -> list:
    return [json.loads((out / f"{name}{r}.json").read_text()) for r in range(2)]


# --- compile + DDP + accumulation -----------------------------------------------------------------


def test_compiled_ddp_accumulation_all_reduces_once_a_step(tmp_path: Path) -> None:
    """torch.compile over DDP with accum_steps=2: gradients are all-reduced once an optimizer step
    (no_sync on the other micro-batch; the compiled wrapper once hid the DDP module, so every
    micro-batch was all-reduced), and the weights equal one process on the larger batch."""
    epochs = 1
    common = [*FAST, *SGD, f"train.epochs={epochs}"]
    out = tmp_path / "ddp"
    overrides = [*common, "train.batch_size=64", "train.accum_steps=2", "train.compile=true"]
    torchrun("count", {"out": str(out), "overrides": overrides}, timeout=600)
    steps = epochs * (TRAIN_IMAGES // 128)  # 64 a micro-batch (32 a rank), 2 a step: 11 an epoch
    for rank in read_ranks(out, "allreduce"):
        assert rank["backward_passes"] == 2 * steps
        assert rank["synced_backward_passes"] == steps
    single = train(load_run_config(None, [*common, "train.batch_size=128"]), out=tmp_path / "one")
    a, b = weights_of(single), weights_of(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4, msg=k)


# --- evaluation with unequal batch counts ---------------------------------------------------------


def test_eval_plan_gives_every_rank_the_same_batch_count() -> None:
    """513 samples, batch 256, 2 ranks: 257 against 256 samples, 2 batches against 1; the short
    rank gets an empty batch so both step together, and every sample is in exactly one batch."""
    plans = [BatchPlan(513, 256, False, 0, rank, 2) for rank in (0, 1)]
    batches = [list(p.batches()) for p in plans]
    assert [len(p) for p in plans] == [len(b) for b in batches] == [2, 2]
    assert [len(b) for b in batches[1]] == [256, 0]
    seen = torch.cat([torch.cat(b) for b in batches]).tolist()
    assert sorted(seen) == list(range(513))
    assert len(BatchPlan(513, 256, False, 0)) == 3  # one process: unchanged
    # fewer samples than ranks: the ranks without one still step, on a padding batch
    tiny = [list(BatchPlan(1, 4, False, 0, rank, 3).batches()) for rank in range(3)]
    assert [[b.tolist() for b in t] for t in tiny] == [[[0]], [[]], [[]]]


def test_padding_batches_carry_no_labels(tmp_path: Path) -> None:
    """A padding batch holds one real image (the model runs as on any batch) labelled -1: in
    memory, and from an image folder read by a DataLoader worker."""
    pre = Preprocessing((8, 8), 1, (0.3,), (0.4,))
    digits = load_split("digits", "train").subset(torch.arange(513))
    (x1, y1), (x2, y2) = list(make_loader(digits, 256, pre, rank=1, world=2))
    assert len(y1) == 256 and (y1 >= 0).all()
    assert x2.shape == (1, 1, 8, 8) and y2.tolist() == [-1]
    for name in "abcde":  # 4 training files (1 is test); 3 of them over 2 ranks, batches of 1
        (tmp_path / "images" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8), "white").save(tmp_path / "images" / name / "x.png")
    folder = load_split(f"imagefolder:{tmp_path / 'images'}", "train").subset(torch.arange(3))
    pre = Preprocessing((8, 8), 3, (0.5,) * 3, (0.5,) * 3)
    rank0 = list(make_loader(folder, 1, pre, rank=0, world=2, workers=1))
    rank1 = list(make_loader(folder, 1, pre, rank=1, world=2, workers=1))
    labels = folder.labels.tolist()
    assert [y.tolist() for _, y in rank0] == [[labels[0]], [labels[2]]]
    assert [y.tolist() for _, y in rank1] == [[labels[1]], [-1]]
    assert rank1[1][0].shape == (1, 3, 8, 8)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_evaluation_with_unequal_batch_counts_counts_each_image_once(
    tmp_path: Path, strategy: str
) -> None:
    """513 images over 2 ranks in batches of 256: rank 0 has 2 batches, rank 1 one. Under FSDP the
    forward is a collective, so rank 0's second forward once waited forever for rank 1. Both ranks
    must run 2 forwards, count 513 images, and report what one model computes on all of them."""
    cfg = load_run_config(None, [*FAST, "train.batch_size=64"])
    torch.manual_seed(cfg.train.seed)
    expected_init = VisionTransformer(config_of(cfg.model).replace(in_chans=1, num_classes=10))
    model = VisionTransformer(expected_init.config)
    torch.manual_seed(1)
    for p in model.parameters():  # a model whose predictions vary (the head starts at zero)
        torch.nn.init.normal_(p, std=0.3)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    out = tmp_path / strategy
    spec = {
        "out": str(out),
        "overrides": [*FAST, "train.batch_size=64", f"train.strategy={strategy}"],
        "weights": str(tmp_path / "weights.pt"),
        "images": 513,
    }
    torchrun("evaluate", spec, timeout=180)
    ranks = read_ranks(out, "evaluate")
    assert [r["forwards"] for r in ranks] == [2, 2]
    # by hand: the model on all 513 images at once
    split = load_split("digits", "train")
    images, labels = split.images[:513], split.labels[:513]
    pre = Preprocessing((8, 8), 1, (0.3061,), (0.3954,))
    with torch.no_grad():
        logits = model.eval()(pre.batch(images))
    top1 = (logits.argmax(dim=1) == labels).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert 0.05 < top1 < 0.9  # not a degenerate model
    for r in ranks:
        metrics = r["metrics"]
        assert metrics["num_images"] == 513
        assert sum(map(sum, metrics["confusion"])) == 513
        assert metrics["top1"] == pytest.approx(top1, abs=1e-9)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    # every rank initialised the model as one process does (FSDP never broadcasts weights)
    init = torch.load(out / "init.pt", weights_only=True)
    for k, v in expected_init.state_dict().items():
        assert torch.equal(init[k], v), k


# --- leaving the process group --------------------------------------------------------------------


def test_a_finished_run_frees_its_process_group_before_exit(tmp_path: Path) -> None:
    """train() under torchrun (DDP) frees its process group, joining gloo's threads, before it
    returns, and vitlab's sums return only once gloo has let go of their tensors. A gloo thread
    still dropping a collective's tensor at the interpreter's exit aborted finished runs
    ("terminate called without an active exception") now and then; the group outlived train()
    in reference cycles and in torch.distributed.nn.functional's default arguments."""
    out = tmp_path / "run"
    overrides = [*FAST, "train.epochs=1", "train.batch_size=64", "train.strategy=ddp"]
    torchrun("train", {"out": str(out), "overrides": overrides})
    for rank in read_ranks(out, "threads"):
        assert rank["during"]  # gloo's threads are there while the group is
        assert rank["after"] == []
        # each sum over the 2 ranks returned with nothing of its tensor left to a gloo thread
        assert rank["held"] == [[[3.0] * 3, 1, 0]] * 50


# --- per-rank random streams ----------------------------------------------------------------------

RANDOM = [
    "data.crop_padding=1",
    "data.hflip=0.5",
    "data.random_erasing=0.25",
    "data.mixup=0.5",
    "model.dropout=0.1",
    "model.drop_path=0.1",
]


def probe(run: Run) -> dict[str, torch.Tensor]:
    """This rank's next random draws (augmentation, mixup, dropout) on fixed inputs, leaving the
    run's random stream where it was."""
    split = load_split("digits", "train")
    with torch.random.fork_rng(devices=[]):
        x, y = run.loader.transform(split.images[:16], split.labels[:16])
        run.model.train()
        with torch.no_grad():
            features = run.model.forward_features(run.pre.batch(split.images[:16]))
    return {"x": x, "y": y, "features": features}  # features: the head starts at zero


def test_ranks_draw_their_own_randomness_reproducibly_and_resume_exactly(tmp_path: Path) -> None:
    """Augmentation, mixup and dropout draw differently on each rank (they were identical), a rerun
    draws the same again, rank 0 draws what one process draws, and a run stopped after epoch 1
    and resumed on 2 ranks ends with the weights of the straight run (each rank's stream saved)."""
    common = [*FAST, *SGD, *RANDOM, "train.batch_size=64", "train.epochs=2"]
    straight, halted = tmp_path / "straight", tmp_path / "halted"
    both = [  # at once: their start-ups are most of their time
        start("probe", {"out": str(straight), "overrides": common}),
        start("probe", {"out": str(halted), "overrides": [*common, "train.stop_at_epoch=1"]}),
    ]
    try:
        for proc in both:
            finish(proc, "probe")
    finally:
        for proc in both:
            if proc.poll() is None:
                kill_tree(proc)
    torchrun("probe", {"out": str(halted), "overrides": common, "resume": True})
    a = [torch.load(straight / f"probe{r}.pt", weights_only=True) for r in (0, 1)]
    b = [torch.load(halted / f"probe{r}.pt", weights_only=True) for r in (0, 1)]
    for key in ("x", "y", "features"):
        assert not torch.allclose(a[0][key], a[1][key]), key  # the ranks differ
        for r in (0, 1):
            assert torch.equal(a[r][key], b[r][key]), (key, r)  # a rerun reproduces them
    single = Run(
        load_run_config(None, common),
        tmp_path / "one",
        None,
        torch.device("cpu"),
        distributed.Dist(),
    )
    one = probe(single)
    assert torch.equal(one["x"], a[0]["x"]) and torch.equal(one["y"], a[0]["y"])
    # the same dropout masks (thread counts differ: float sums may differ in the last bits)
    torch.testing.assert_close(
        one["features"], a[0]["features"]
    )  # rank 0's stream is one process's
    x, y = weights_of(straight), weights_of(halted)
    for k in x:
        assert torch.equal(x[k], y[k]), k


# --- what each rank runs --------------------------------------------------------------------------


def worker(command: str, spec: dict) -> None:
    device = torch.device("cpu")
    d = distributed.init(device)
    out = Path(spec["out"])
    cfg = load_run_config(None, spec["overrides"])
    if command == "train":  # as `vitlab train` does: train() joins and leaves the group itself
        threads, held = gloo_threads(), []
        for _ in range(50):  # what gloo still holds of a summed tensor when the sum returns
            t = torch.full((3,), 1.5, dtype=torch.float64)
            base = sys.getrefcount(t)
            all_reduce_(t)
            held.append([t.tolist(), t._use_count(), sys.getrefcount(t) - base])
        train(cfg, out)
        report = {"during": threads, "after": gloo_threads(), "held": held}
        write(out / f"threads{d.rank}.json", report)
        return
    run = None
    try:
        resume = out if spec.get("resume") else None
        run = Run(cfg, out, resume, device, d)
        if command == "count":
            report = count_allreduces(run)
            run.fit()
            write(out / f"allreduce{d.rank}.json", report)
        elif command == "evaluate":
            init = distributed.full_model_state(run.model, d, run.strategy)
            if d.is_main:
                torch.save(init, out / "init.pt")
            state = torch.load(spec["weights"], weights_only=True)
            distributed.load_full_state(run.model, None, state, None, d, run.strategy)
            forwards = [0]
            run.model.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
            split = load_split("digits", "train").subset(torch.arange(spec["images"]))
            metrics = run.evaluate(split)
            write(out / f"evaluate{d.rank}.json", {"forwards": forwards[0], "metrics": metrics})
        elif command == "probe":
            if resume is None:  # rank 0 makes the run folder: another rank may get here first
                out.mkdir(parents=True, exist_ok=True)
                torch.save(probe(run), out / f"probe{d.rank}.pt")
            if run.fit():
                run.test()
    finally:
        run = None  # its model holds the process group, which shutdown frees
        distributed.shutdown(d, device)


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (Linux)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            names.append(comm.read_text().strip())
    return sorted(n for n in names if "gloo" in n)


def count_allreduces(run: Run) -> dict:
    """Register a DDP communication hook that all-reduces as DDP does and counts the backward
    passes that reached it (its last bucket) and all backward passes (a tensor hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = getattr(run.train_model, "_orig_mod", run.train_model)  # under torch.compile
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    report = {"backward_passes": 0, "synced_backward_passes": 0}

    def hook(group, bucket):
        report["synced_backward_passes"] += bucket.is_last()
        return default_hooks.allreduce_hook(group, bucket)

    def counted(grad):
        report["backward_passes"] += 1
        return grad

    ddp.register_comm_hook(None, hook)
    run.model.head.weight.register_hook(counted)
    return report


def write(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
