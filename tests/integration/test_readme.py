"""The front door keeps its promises: every Python example in the README and
on the docs site's home page runs as it stands (the DDP one under torchrun
on 2 ranks), every relative link of the README names a file that exists, and
the README stays short."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/index.md")


def _examples() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for k, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            out.append((page, k, block))
    return out


@pytest.mark.parametrize(("page", "k", "code"), _examples(), ids=lambda v: str(v)[:20])
def test_the_example_runs(page: str, k: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    if code.startswith("# train.py"):  # under torchrun, as the page says
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(script)]  # fmt: skip
    else:
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"{page} example {k}:\n{done.stderr[-3000:]}"
    if "run_collective" in code:  # one line per scheme, the ring the slowest
        times = dict(re.findall(r"(\w+): ([\d.]+) ms", done.stdout))
        assert set(times) == {"ring", "switchml", "atp"}
        assert float(times["ring"]) > max(float(times["switchml"]), float(times["atp"]))


def test_the_examples_are_there() -> None:
    kinds = ["torchrun" if c.startswith("# train.py") else "python" for _, _, c in _examples()]
    assert kinds.count("torchrun") == len(PAGES) and kinds.count("python") == len(PAGES)


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
