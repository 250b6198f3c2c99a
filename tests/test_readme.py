"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
    assert "632045800" in capsys.readouterr().out


def test_readme_quick_start_has_exactly_the_two_commands() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^make \w+", quick, flags=re.M)
    assert commands == ["make demo", "make test"]
