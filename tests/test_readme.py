"""The README's Python example runs as written."""

from __future__ import annotations

import ast
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def run_checking_comments(code: str) -> int:
    """Run `code` a statement at a time, checking each comment that states a result: a shape
    `# (2, 10)` against the assigned tensor's (or the expression's) shape, a module's repr
    `# StdConv2d(...)` against the expression's. The number of comments checked."""
    namespace: dict = {}
    lines = code.splitlines()
    checked = 0
    for node in ast.parse(code).body:
        exec(compile(ast.Module([node], []), str(README), "exec"), namespace)
        comment = lines[node.end_lineno - 1].partition("  # ")[2].strip()
        shape = re.match(r"\((\d+(?:, \d+)*)\)", comment)
        module = re.match(r"[A-Z]\w*\(.*\)$", comment)
        if not (shape or module) or not isinstance(node, ast.Assign | ast.Expr):
            continue
        if isinstance(node, ast.Assign):  # name = ...
            value = namespace[node.targets[0].id]
        else:
            value = eval(compile(ast.Expression(node.value), str(README), "eval"), namespace)
        if shape:
            expected = tuple(int(n) for n in shape[1].split(", "))
            assert tuple(getattr(value, "shape", value)) == expected, (ast.unparse(node), comment)
        else:
            assert repr(value) == comment, (ast.unparse(node), repr(value))
        checked += 1
    return checked


def test_readme_python_examples_run_and_their_comments_hold(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 6, "README.md lost python examples (ViT, hybrid, Swin, CNN, hub, train)"
    checked = [run_checking_comments(code) for code in blocks]
    assert "632045800" in capsys.readouterr().out
    assert checked[:4] == [4, 1, 1, 2], checked  # ViT's shapes, hybrid's conv, Swin's, CNN's
    assert checked[5] == 1, checked  # training and evaluation: the test split's size


def test_readme_quick_start_has_exactly_the_two_commands() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^make \w+", quick, flags=re.M)
    assert commands == ["make demo", "make test"]
