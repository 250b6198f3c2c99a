"""The suite tests the CPU: its expectations are computed on the CPU, and training's exact resume
and batch_threads are CPU promises. On a machine with a GPU, `train.device=auto` would put the
runs there (17 of the suite's first 350 tests failed on an H200 for that and for its older
packages), so CUDA is hidden from this process and the commands it starts, before torch is
imported. The GPU paths are measured by benchmarks/gpu/.

`make test` runs one pytest-xdist worker a CPU (`-n logical`): most tests are single-threaded
Python (the serial suite kept 1.1 of 2 cores busy), so each worker's PyTorch gets its share of the
CPUs (OMP_NUM_THREADS, also for the commands it starts) rather than all of them; the tests of
threaded paths set their thread counts themselves."""

import os
import sys

import pytest


def _cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share), as
    vitlab.data.decode.available_cores counts them; not imported, as that would import torch
    before OMP_NUM_THREADS is set."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # plain pytest, without xdist, knows no such hook
def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n logical` / `-n auto`: one worker for each CPU this process may use (xdist would count
    every CPU of the host where psutil is installed); PYTEST_XDIST_AUTO_NUM_WORKERS still rules."""
    return None if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else _cpus()


os.environ["CUDA_VISIBLE_DEVICES"] = ""
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cpus() // _workers)))
    if "torch" in sys.modules:  # a plugin imported it: its threads were counted already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The files that took longest (serial seconds on a 2-core Zen 1 EPYC, 2026-12-04), first: under
# `make test` (--dist loadfile --no-loadscope-reorder) each worker takes whole files in collection
# order, so the long ones start early and none is left running alone at the end.
SLOWEST_FIRST = (
    "test_train.py",  # 134 s
    "test_cnn.py",  # 119
    "test_distributed.py",  # 119
    "test_backends.py",  # 119
    "test_checkpoint.py",  # 114
    "test_convert_cli.py",  # 69
    "test_rank_failure.py",  # 57
    "test_faults.py",  # 55
    "test_pos_embed.py",  # 52
    "test_distill.py",  # 51
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


@pytest.fixture(autouse=True)
def _no_dataset_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test downloads a dataset, online or not: the sites are a refused local port (a test
    serving files itself points them at its own server)."""
    from vitlab.data import cifar, download

    monkeypatch.setattr(cifar, "MIRROR", "http://127.0.0.1:9/")
    monkeypatch.setattr(download, "FASHION_MIRROR", "http://127.0.0.1:9/")


@pytest.fixture
def served(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """(a folder, the URL of a loopback HTTP server serving it): a dataset's site, offline."""
    import http.server
    import threading

    folder = tmp_path / "served"
    folder.mkdir()
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **k)  # noqa: E731
    monkeypatch.setattr(http.server.SimpleHTTPRequestHandler, "log_message", lambda *a: None)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()
