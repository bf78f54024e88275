"""The compiled hot path and the sources: one behaviour, and never a stale build.

The extensions ``scripts/compile.py`` builds must compute exactly what the
sources compute (same events, same simulated times, same counters), and a
build whose sources changed since must not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gradfabric
from gradfabric import _build
from tests.native import require

PKG = Path(gradfabric.__file__).parent

RUN = """
import json
from gradfabric._build import compiled_path
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig, run_collective
from gradfabric.sim.network import LinkSpec
out = {"path": compiled_path()}
for scheme in ("switchml", "atp", "esa", "ps", "ring"):
    lossy = scheme != "ring"  # the ring assumes a lossless network
    fabric = FabricConfig(link=LinkSpec(loss=0.01 if lossy else 0.0, jitter_ns=300))
    r = run_collective(scheme, 6, [Bucket(0, 40_000), Bucket(5_000, 25_000)], fabric,
                       InaConfig(atp_pool_slots=64, switchml_slots=16), seed=3, values=True)
    out[scheme] = [r.events, r.end_ns, r.bucket_done_ns, r.counters,
                   [float(x.astype("float64").sum()) for x in r.results or []]]
print(json.dumps(out))
"""


def _run(pure: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "GRADFABRIC_PURE"}
    if pure:
        env["GRADFABRIC_PURE"] = "1"
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_the_sources_run_where_asked() -> None:
    assert _run(pure=True)["path"] == "python"


def test_compiled_and_pure_paths_compute_the_same_run() -> None:
    """Seeded runs with loss and jitter, values on: every event count, time,
    counter and result sum is equal on both paths."""
    require("the simulator's hot path", _build.compiled_path(), "no mypyc build")
    compiled, pure = _run(pure=False), _run(pure=True)
    assert compiled.pop("path") == "mypyc" and pure.pop("path") == "python"
    assert compiled == pure


def test_a_changed_source_makes_the_build_stale(tmp_path: Path) -> None:
    """A manifest is judged by content: an edit anywhere in a compiled module
    marks it stale (and only it), and a missing source counts as changed."""
    for m in _build.HOT:
        src = tmp_path.joinpath(*m.split(".")).with_suffix(".py")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {m}\n")
    assert _build.stale_modules(tmp_path) == []  # no build, nothing stale
    _build.write_manifest(tmp_path, _build.digests(tmp_path))
    assert _build.fresh(tmp_path)
    tmp_path.joinpath("sim", "loop.py").write_text("# sim.loop, edited\n")
    tmp_path.joinpath("wire", "packet.py").unlink()
    assert _build.stale_modules(tmp_path) == ["wire.packet", "sim.loop"]
    assert not _build.fresh(tmp_path)
    # a source edited while a build runs: the manifest holds the hashes taken
    # when the compiler read the sources, so the edit is stale once it is done
    tmp_path.joinpath("wire", "packet.py").write_text("# wire.packet\n")
    read = _build.digests(tmp_path)
    tmp_path.joinpath("proto", "ring.py").write_text("# proto.ring, edited mid-build\n")
    _build.write_manifest(tmp_path, read)
    assert _build.stale_modules(tmp_path) == ["proto.ring"]


def test_a_stale_build_warns_and_runs_the_sources(tmp_path: Path) -> None:
    """Importing gradfabric with a stale manifest: a warning naming the module,
    and the event loop comes from its ``.py`` file."""
    manifest = PKG / _build.MANIFEST
    require("the simulator's hot path", _build.compiled_path(), "no mypyc build")
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import gradfabric.sim.loop as loop; print(loop.__file__)\n"
    )
    saved = manifest.read_text()
    try:
        data = json.loads(saved)
        data["sim.loop"] = "0" * 64
        manifest.write_text(json.dumps(data))
        env = {k: v for k, v in os.environ.items() if k != "GRADFABRIC_PURE"}
        with warnings.catch_warnings():
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=env, check=True)  # fmt: skip
    finally:
        manifest.write_text(saved)
    assert done.stdout.strip().endswith("loop.py")
    assert "older than their sources (sim.loop)" in done.stderr


def test_compiled_frozen_dataclasses_are_left_interpreted() -> None:
    """A frozen dataclass compiled by mypyc cannot be unpickled (its state is
    set through the frozen ``__setattr__``), and configs cross to pool and
    cluster workers pickled: each one in a compiled module is marked
    ``native_class=False``. The routes are the exception: built inside an
    engine, never pickled, and read on every packet."""
    unmarked = []
    for m in _build.HOT:
        if m == "proto.routes":
            continue
        lines = PKG.joinpath(*m.split(".")).with_suffix(".py").read_text().splitlines()
        unmarked += [
            f"{m}:{i + 1}" for i, line in enumerate(lines)
            if line.startswith("@dataclass(frozen=True")
            and not lines[i - 1].startswith("@mypyc_attr(native_class=False)")
        ]  # fmt: skip
    assert not unmarked, unmarked
