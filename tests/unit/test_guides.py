"""The tutorials run as written: each ``python title="FILE"`` block is
written to an empty directory, each line of each ``bash`` block runs there
(``gradfabric`` and ``python`` from this environment) and must exit 0."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r'```(python|bash)(?: title="([^"]+)")?\n(.*?)```', re.S)


def steps(page: Path) -> list[tuple[str, str | None, str]]:
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(page.read_text())]


def command(line: str) -> list[str]:
    argv = shlex.split(line)
    if argv[0] == "gradfabric":
        return [sys.executable, "-m", "gradfabric.cli", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"a tutorial line runs gradfabric or python: {line}")


@pytest.mark.long  # ~17 s: past the default suite's budget; CI's second pass runs it
@pytest.mark.parametrize("page", ["simulate.md"])
def test_the_tutorial_runs_as_written(page: str, tmp_path: Path) -> None:
    blocks = steps(ROOT / "docs" / "guide" / page)
    assert any(kind == "bash" for kind, _, _ in blocks)
    for kind, title, body in blocks:
        if kind == "python":
            assert title, "a python block names the file it is"
            (tmp_path / title).write_text(body)
            continue
        for line in filter(None, map(str.strip, body.splitlines())):
            done = subprocess.run(command(line), cwd=tmp_path, capture_output=True, text=True,
                                  timeout=600)  # fmt: skip
            assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
