"""The layer rule: imports point down only, never in a circle.

Each package may import the packages listed for it here and nothing above.
The table is the team's design (core and wire at the bottom, the engines,
then the drivers (the simulator, and the UDP emulator over net), then torch
integration and the planner, then experiments and the CLI), written where a
test can hold the code to it. Imports inside functions count too: a lazy
import upward is still upward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradfabric

ROOT = Path(gradfabric.__file__).parent
BELOW = {"_build": set(), "core": set(), "wire": {"core"}, "workloads": {"core"}}
BELOW["proto"] = {"core", "wire", "workloads"}
BELOW["sim"] = BELOW["proto"] | {"proto"}
BELOW["net"] = BELOW["proto"] | {"proto"}
BELOW["emu"] = BELOW["net"] | {"net"}
BELOW["collectives"] = BELOW["emu"] | {"emu"}
BELOW["planner"] = BELOW["collectives"] | {"collectives", "sim"}
BELOW["experiments"] = BELOW["planner"] | {"planner"}
BELOW["cli"] = BELOW["experiments"] | {"experiments"}


def _imports(path: Path) -> set[str]:
    """The gradfabric packages a module imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("gradfabric.") and n.count(".")}
    return out


def test_every_import_points_down() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0].removesuffix(".py")
        if package in ("__init__", "__main__"):
            continue
        assert package in BELOW, f"{rel}: a package the layer table does not place"
        # ``gradfabric._build`` (which path runs: compiled or sources) sits
        # beside the root ``__init__`` and any layer may ask it
        wrong += [f"{rel} imports gradfabric.{p}" for p in _imports(path) - BELOW[package]
                  if p not in (package, "_build")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_table_has_no_cycle() -> None:
    for pkg, below in BELOW.items():
        assert all(pkg not in BELOW[b] for b in below), pkg


def test_no_module_of_the_training_integration_runs_past_600_lines() -> None:
    """``collectives`` is where users read how their gradients move: a module
    past 600 lines is split where its parts are separate ideas."""
    long = {p.name: n for p in sorted((ROOT / "collectives").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}  # fmt: skip
    assert not long, long
