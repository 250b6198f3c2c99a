"""The package's layering: no import cycles (lazy imports included), lower layers never import
higher ones, and no module grows past the size the style guide allows."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 450
HIGH = ("vitlab.train", "vitlab.eval", "vitlab.experiments", "vitlab.cli")
# module (or package) -> layers it must not import, directly or through other modules
FORBIDDEN = {
    "vitlab.data": ("vitlab.models", *HIGH),
    "vitlab.models": HIGH,
    # the experiments run training and evaluation; only the command line runs them
    "vitlab.train": ("vitlab.experiments", "vitlab.cli"),
    "vitlab.eval": ("vitlab.experiments", "vitlab.cli"),
    "vitlab.analysis": ("vitlab.experiments", "vitlab.cli"),
    "vitlab.experiments": ("vitlab.cli",),
    "vitlab.config": ("vitlab.models", "vitlab.data", *HIGH),
    "vitlab.overrides": ("vitlab.config", "vitlab.models", "vitlab.data", *HIGH),
    # formats know models' configs, not how loading is orchestrated, data, analysis or above
    "vitlab.formats": ("vitlab.models.checkpoint", "vitlab.data", "vitlab.analysis", *HIGH),
    "vitlab.hub": ("vitlab.models.checkpoint", "vitlab.data", "vitlab.analysis", *HIGH),
}
LEAVES = ("vitlab.runtime", "vitlab.preprocessing", "vitlab.duration", "vitlab.validation")

Edge = tuple[str, str]  # (importer, imported)


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src (a package is its __init__.py)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported_names(node: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str]]:
    """(imported module, name imported from it or '') for one import statement."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, ""
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against the importing module's package
            package = module.split(".")
            package = package if is_package else package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            yield base, alias.name


def import_graph(src: Path, root: str = "vitlab") -> dict[Edge, tuple[Path, int]]:
    """Every import of a `root` module by a `root` module, wherever it stands (module level, inside
    functions, under `if TYPE_CHECKING:`), as edges -> (file, line) of the first such import.

    `from a.b import c` is an edge to a.b.c when that is a module, else to a.b. Importing a.b.c
    also runs a/__init__.py and a/b/__init__.py first, so the edge is repeated to each enclosing
    package, except the root (whose __init__ re-exports the public API) and the importer's own
    packages (always initialised before any of their modules)."""
    files = module_files(src)
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    edges: dict[Edge, tuple[Path, int]] = {}
    for module, path in files.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            for base, name in _imported_names(node, module, module in packages):
                if base != root and not base.startswith(root + "."):
                    continue
                target = f"{base}.{name}" if f"{base}.{name}" in files else base
                parts = target.split(".")
                enclosing = [".".join(parts[:i]) for i in range(2, len(parts))]
                for dest in [target, *(p for p in enclosing if p not in own)]:
                    if dest != module:
                        edges.setdefault((module, dest), (path, node.lineno))
    return edges


def find_cycles(edges: dict[Edge, tuple[Path, int]]) -> list[list[str]]:
    """Cycles (a -> ... -> a), at least one through every group of modules that import each
    other: one for each import that leads back to a module still being imported."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    seen: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in seen:
            continue
        # depth-first search from `start`, with the current path as an explicit stack
        stack, on_path, path = [(start, iter(graph.get(start, [])))], {start}, [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(path.pop())
                seen.add(node)
            elif child in on_path:
                cycles.append(path[path.index(child) :] + [child])
            elif child not in seen:
                stack.append((child, iter(graph.get(child, []))))
                on_path.add(child)
                path.append(child)
    return cycles


def reachable(edges: dict[Edge, tuple[Path, int]], start: str) -> dict[str, list[str]]:
    """Modules `start` imports, directly or not -> the shortest chain of imports from start."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    chains = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in graph.get(node, []):
                if child not in chains:
                    chains[child] = chains[node] + [child]
                    nxt.append(child)
        frontier = nxt
    del chains[start]
    return chains


def _within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _chain(chain: list[str], edges: dict[Edge, tuple[Path, int]]) -> str:
    steps = [chain[0]]
    for a, b in zip(chain, chain[1:]):
        path, line = edges[(a, b)]
        steps.append(f"-> {b} ({path.relative_to(SRC.parent)}:{line})")
    return " ".join(steps)


# --- the package ---------------------------------------------------------------------------------

EDGES = import_graph(SRC)


def test_no_import_cycles() -> None:
    cycles = find_cycles(EDGES)
    assert not cycles, "import cycles:\n" + "\n".join(_chain(c, EDGES) for c in cycles)


def test_lower_layers_do_not_import_higher_ones() -> None:
    breaks: dict[tuple[str, str], list[str]] = {}  # import crossing a line -> one chain through it
    for module in module_files(SRC):
        for layer, banned in FORBIDDEN.items():
            if not _within(module, layer):
                continue
            for chain in reachable(EDGES, module).values():
                i = next((i for i, m in enumerate(chain) if any(_within(m, b) for b in banned)), 0)
                if i:
                    breaks.setdefault((chain[i - 1], chain[i]), chain[: i + 1])
        if module in LEAVES:
            for a, b in EDGES:
                if a == module:
                    breaks.setdefault((a, b), [a, b])
    chains = sorted(_chain(c, EDGES) for c in breaks.values())
    assert not breaks, "imports across the layers:\n" + "\n".join(chains)


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {
        str(path.relative_to(SRC.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for path in module_files(SRC).values()
    }
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{path} ({n})" for path, n in sorted(over.items())
    )


def test_the_package_and_the_cli_import_cleanly() -> None:
    """...and without torchvision, which takes about a second to import (it loads torch's
    compiler): `vitlab --help` started in 2.5 s with it, 1.4 s without."""
    paths = [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    imported = "sorted(m for m in sys.modules if m.startswith('torchvision'))"
    code = f"import sys, vitlab, vitlab.cli.main; print({imported})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_package_imports_torch_on_first_use_and_keeps_its_names() -> None:
    """`import vitlab` is light (PEP 562): each name of `__all__` comes from its module on first
    use, the same object, and an unknown one is an AttributeError; a submodule is an attribute
    after `import vitlab` alone, as it was when the package imported them all."""
    code = (
        "import sys, importlib, vitlab; light = 'torch' not in sys.modules; "
        "import vitlab.models, vitlab.formats.base, vitlab.models.checkpoint; "
        "same = all(getattr(vitlab, n) is getattr(importlib.import_module(vitlab._HOMES[n]), n) "
        "for n in vitlab.__all__ if n != '__version__'); "
        "print(light, same, sorted(vitlab.__all__) == sorted(['__version__', *vitlab._HOMES]), "
        "hasattr(vitlab, 'nope') or hasattr(vitlab, 'nope.x'), vitlab.config.RunConfig is not None)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.split() == ["True", "True", "True", "False", "True"], done.stderr


def test_a_ctrl_c_while_the_command_imports_torch_is_one_line() -> None:
    """A Ctrl-C in a command's first seconds (PyTorch's import) printed a traceback from inside
    `import torch`. `-X importtime` lists each module as its import ends: vitlab.cli.main's
    before any of torch's, and the signal comes as the first of torch's ends."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, "-X", "importtime", "-m", "vitlab", "models"]
    out = subprocess.DEVNULL
    with subprocess.Popen(args, stderr=subprocess.PIPE, stdout=out, text=True, env=env) as proc:
        assert proc.stderr is not None
        names = []
        for line in proc.stderr:
            names.append(line.split("|")[-1].strip())
            if names[-1].startswith("torch"):
                proc.send_signal(signal.SIGINT)
                break
        said = [x for x in proc.stderr if not x.startswith("import time:")]
        assert proc.wait(timeout=60) == 130, "".join(said)
    assert "vitlab.cli.main" in names, names
    assert said == ["vitlab: interrupted\n"], "".join(said)


# --- the checker itself, on a made-up package ----------------------------------------------------


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    files = {
        "pkg/__init__.py": "from pkg.low import x\n",
        "pkg/low.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.high import y\n"
        ),
        "pkg/sub/__init__.py": "",
        "pkg/sub/high.py": "def f():\n    from . import other\n",
        "pkg/sub/other.py": "import pkg.low\nfrom pkg import low\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_checker_sees_lazy_relative_and_type_checking_imports(toy: Path) -> None:
    edges = import_graph(toy, root="pkg")
    assert set(edges) == {
        ("pkg", "pkg.low"),
        ("pkg.low", "pkg.sub.high"),  # under TYPE_CHECKING
        ("pkg.low", "pkg.sub"),  # the enclosing package runs first
        ("pkg.sub.high", "pkg.sub.other"),  # inside a function, relative
        ("pkg.sub.other", "pkg.low"),  # `from pkg import low` names a module
    }
    assert find_cycles(edges) == [["pkg.low", "pkg.sub.high", "pkg.sub.other", "pkg.low"]]
    chains = reachable(edges, "pkg.low")
    assert chains["pkg.sub.other"] == ["pkg.low", "pkg.sub.high", "pkg.sub.other"]
