"""Small shared helpers for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from vitlab.cli.main import main
from vitlab.models.vit import VisionTransformer, ViTConfig
from vitlab.train.folder import resume_config
from vitlab.train.run import train
from vitlab.train.state import load_weights

VITLAB = (sys.executable, "-m", "vitlab")  # the command line's start: this Python's vitlab

# training overrides for a model small and fast enough for the suite: 8x8 digits at their own
# size, patch 2, D=32, 2 layers
TINY_MODEL = [
    "model.img_size=8",
    "model.patch_size=2",
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=2",
    "model.mlp_dim=64",
]


def weights_of(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    """The weights of run folder `run`'s checkpoint `which` (last | best)."""
    return load_weights(run / "checkpoints" / which / "model.safetensors")


# two CPU processes under torchrun; --standalone: a free port of their own, so runs side by side
# (pytest -n) never meet
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def one_thread_env() -> dict[str, str]:
    """This process's environment with PyTorch on one thread (each of two ranks shares the CPUs)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun_train(
    out: Path, *overrides: str, timeout: float | None = 300
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m vitlab train --out OUT OVERRIDES` on CPU
    (gloo), one thread a process, its output captured as text; the caller checks the return code."""
    cmd = [*TORCHRUN, "-m", "vitlab", "train", "--out", str(out), *overrides]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=one_thread_env(), timeout=timeout
    )


def resume(run: Path, *overrides: str) -> Path:
    """Continue `run` in this process as `vitlab train --resume RUN [overrides]` does: the run's
    own config.yaml plus the overrides, which may change only its length."""
    return train(resume_config(run, list(overrides)), resume=run)


def help_of(capsys: pytest.CaptureFixture, *command: str) -> str:
    """`vitlab COMMAND --help`'s text, in this process (argparse prints it, then exits 0), its
    whitespace collapsed: argparse wraps at the terminal's width, which `pytest -s` lets through."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0, capsys.readouterr().err
    return " ".join(capsys.readouterr().out.split())


def check_eval_and_predict(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`vitlab eval RUN` gives the top-1 the run recorded, and `vitlab predict RUN` answers an
    8x8 grey image (digits' size) with its top 5 classes."""
    expected = json.loads((run / "results.json").read_text())["top1"]
    assert main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top1"] == pytest.approx(expected, abs=1e-9)
    image = tmp_path / "digit.png"
    Image.fromarray(np.full((8, 8), 200, dtype=np.uint8)).save(image)
    assert main(["predict", str(run), str(image), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["top"]) == 5


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, *names: str) -> list[str]:
    """Wrap the functions `names` of `owner` (a module) for the test: each call appends its name
    to the returned list, then runs the function."""
    calls: list[str] = []
    for name in names:
        real = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, real=real, name=name: calls.append(name) or real(*a)
        )
    return calls


def tiny_config(**overrides: object) -> ViTConfig:
    """A 16x16, patch-4 ViT small enough to run in milliseconds."""
    base: dict[str, object] = dict(
        img_size=16,
        patch_size=4,
        in_chans=3,
        num_classes=7,
        embed_dim=32,
        depth=2,
        num_heads=4,
        mlp_dim=64,
    )
    base.update(overrides)
    return ViTConfig(**base)


def fresh_kernel_cache(cache: Path, **env: str) -> dict[str, str]:
    """The environment of a fresh Python whose home and cache folder are `cache` (so vitlab's CPU
    kernels are built anew there), with `env` added."""
    base = {**os.environ, "HOME": str(cache), "XDG_CACHE_HOME": str(cache)}
    base.pop("VITLAB_CPU_KERNELS", None)
    return {**base, **env}


def run_with_fresh_kernel_cache(script: str, cache: Path, **env: str) -> list[str]:
    """`script`'s stdout lines, run by a fresh Python in fresh_kernel_cache(cache, **env)."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=fresh_kernel_cache(cache, **env),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def randomize_head(model: VisionTransformer) -> None:
    """The head is zero-initialised, which would stop every gradient before it."""
    nn.init.normal_(model.head.weight, std=0.1)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first, read from /proc (children of every
    thread)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:  # the thread or the process is gone
            continue
        for kid in map(int, kids):
            out += process_tree(kid)
    return out


def kill_tree(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL a torchrun agent and every process below it, then reap it. torchrun starts each rank
    in a session of its own, so killing the agent's process group would leave the ranks running,
    holding the agent's pipes open (and a `communicate()` waiting for them forever). Returns its
    stdout and stderr."""
    for pid in process_tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return proc.communicate()  # what it wrote before


def seconds_to(deadline: float) -> float:
    """Seconds from now to `deadline` (time.monotonic), 0 once it has passed."""
    return max(0.0, deadline - time.monotonic())


def run_together(
    *jobs: tuple[list[str], dict[str, str] | None], timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Independent commands (argv, environment or None: this one's) started at once and waited
    for, their output captured as text. A fresh Python spends seconds importing torch on one core,
    so a second core takes the next one meanwhile (the suite's wall time, not its work, is what CI
    limits). `timeout` seconds for all of them together, from the start. Whatever is still running
    when this returns or raises is killed, with every process it started."""
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    try:
        for argv, env in jobs:
            procs.append(
                subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
        outputs = [  # one that has ended is read whatever the time
            p.communicate(timeout=None if p.poll() is not None else seconds_to(deadline))
            for p in procs
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outputs)
    ]


def tiny_checkpoint(dst: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-weights ViT small enough for digits, saved in vitlab's format."""
    from vitlab.models.checkpoint import save_pretrained

    torch.manual_seed(seed)
    base: dict[str, object] = dict(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=1, num_heads=2
    )
    base.update(overrides)
    model = VisionTransformer(ViTConfig(mlp_dim=32, **base))
    save_pretrained(model, dst)
    return dst


def clusters(n: int, centres, seed: int):  # (K, D) ndarray -> vitlab.eval.features.Features
    """`n` features per class around the rows of `centres`."""
    import numpy as np

    from vitlab.eval.features import Features

    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(len(centres)), n)
    x = centres[y] + 0.3 * rng.normal(size=(len(y), centres.shape[1]))
    classes = [str(i) for i in range(len(centres))]
    return Features(torch.from_numpy(x).float(), torch.from_numpy(y), classes)
