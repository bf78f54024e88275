"""A grid's cells give the same records serially, in a process pool and on a
cluster engine (a local Dask cluster; Ray where it is installed), and a store
of finished cells lets a grid resume without trusting another code's records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradfabric.core.cells import CellStore, Executor, run_cells
from gradfabric.core.errors import ConfigError
from gradfabric.sim.dlcp import VARIANTS, DlcpConfig, run_grid
from gradfabric.sim.dlcp import run_cell as dlcp_cell


def test_pool_returns_records_in_cell_order() -> None:
    cells = list(range(30, 0, -1))  # the big ones (slow) first, so they finish last
    seen: list[str] = []
    got = run_cells(math.factorial, cells, 2, tick=seen.append)
    assert got == [math.factorial(c) for c in cells]
    assert sorted(seen) == sorted(str(c) for c in cells)


def test_dlcp_grid_is_the_same_serially_and_in_a_pool() -> None:
    """Every scheme on two seeds: each cell carries its seed, so the pool's
    records equal the serial run's, field for field."""
    base = DlcpConfig(collective="allreduce", tensors=(16_384,), iterations=1)
    serial = run_grid([base], (0.5,), (0, 1), where=1)
    pooled = run_grid([base], (0.5,), (0, 1), where=2)
    assert len(serial) == 2 * len(VARIANTS)
    assert serial == pooled


@pytest.mark.long
def test_saatp_grid_is_the_same_serially_in_a_pool_and_on_dask() -> None:
    """SA-ATP's training cells are seeded too: the pool and a local Dask
    cluster give the serial rows (simulated times and help counts; only the
    wall clock differs)."""
    from gradfabric.experiments.saatp import SaatpGrid
    from gradfabric.experiments.saatp import run_grid as saatp_grid

    grid = SaatpGrid(models=("resnet50",), workers=(8,), stragglers=(1,), slowdowns=(2.0,),
                     schemes=("saatp", "atp"), iterations=2)  # fmt: skip

    def timeless(rows: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]

    serial = saatp_grid(grid, lambda _label: None, where=1)
    pooled = saatp_grid(grid, lambda _label: None, where=2)
    dasked = saatp_grid(grid, lambda _label: None, where=Executor("dask", 2))
    assert [r["scheme"] for r in serial] == ["saatp", "atp"]
    assert timeless(serial) == timeless(pooled) == timeless(dasked)


def test_cluster_engines_return_records_in_cell_order() -> None:
    cells = list(range(12, 0, -1))
    seen: list[str] = []
    assert run_cells(math.factorial, cells, Executor("dask", 2), seen.append) == [
        math.factorial(c) for c in cells
    ]
    assert sorted(seen) == sorted(str(c) for c in cells)


def test_ray_gives_the_serial_records() -> None:
    pytest.importorskip("ray", reason="ray (a dev and cluster extra) is not installed")
    cells = list(range(12, 0, -1))
    assert run_cells(math.factorial, cells, Executor("ray", 2)) == [
        math.factorial(c) for c in cells
    ]


def test_executor_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="executor"):
        Executor("spark")
    with pytest.raises(ConfigError, match="address"):
        Executor("local", 2, "tcp://head:8786")


_calls: list[int] = []


def _square(c: int) -> int:
    _calls.append(c)
    return c * c


def test_a_stored_grid_resumes_with_only_the_missing_cells(tmp_path: Path) -> None:
    """A grid stopped after some cells: the same grid again computes only the
    cells the store lacks, and returns what a run without a store returns."""
    store = str(tmp_path / "cells.jsonl")
    _calls.clear()
    assert run_cells(_square, [3, 1, 4], Executor(store=store)) == [9, 1, 16]
    seen: list[str] = []
    got = run_cells(_square, [3, 1, 4, 1, 5, 9], Executor(store=store), seen.append)
    assert got == [c * c for c in (3, 1, 4, 1, 5, 9)]
    assert _calls == [3, 1, 4, 5, 9]  # 1 twice in the grid, computed once, and reused
    assert seen == ["3 (stored)", "1 (stored)", "4 (stored)", "1 (stored)", "5", "9"]
    assert len(Path(store).read_text().splitlines()) == 5


def test_a_store_from_other_code_or_cut_short_is_not_trusted(tmp_path: Path) -> None:
    """Lines written by other code (another digest) are kept but not used, and
    a line cut short by a killed run is skipped; both cells are computed again."""
    path = tmp_path / "cells.jsonl"
    run_cells(_square, [2, 7], Executor(store=str(path)))
    first, second = path.read_text().splitlines()
    entry = json.loads(first)
    entry["code"] = "0" * 16
    path.write_text(json.dumps(entry) + "\n" + second[: len(second) // 2])
    _calls.clear()
    assert run_cells(_square, [2, 7], Executor(store=str(path))) == [4, 49]
    assert _calls == [2, 7]
    store = CellStore(path, _square)
    assert (store.stale, store.unreadable) == (1, 1) and store.has(2) and store.has(7)


def test_a_store_keeps_only_records_that_read_back_equal(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read back"):
        run_cells(_pair, [1], Executor(store=str(tmp_path / "cells.jsonl")))


def _pair(c: int) -> tuple[int, int]:
    return c, c  # JSON reads a tuple back as a list


def test_a_stored_simulated_grid_equals_the_computed_one(tmp_path: Path) -> None:
    """Simulated records (DLCP's grid: floats, counts, names) read back from
    the store equal to the run that computed them."""
    base = DlcpConfig(collective="allreduce", tensors=(16_384,), iterations=1)
    where = Executor(store=str(tmp_path / "cells.jsonl"))
    computed = run_grid([base], (0.5,), (0,), where=where)
    assert run_grid([base], (0.5,), (0,), where=where) == computed
    assert CellStore(tmp_path / "cells.jsonl", dlcp_cell).records


def test_a_cells_digest_covers_what_its_module_imports_and_nothing_it_does_not() -> None:
    """``code_digest`` hashes the import closure read from the sources: every
    simulation module a fresh interpreter loads with the cell's module (the
    reference) is in it, and the packet level's cell does not depend on the
    flow level, which the flow level's own cell does."""
    import subprocess
    import sys

    import gradfabric
    from gradfabric.core.cells import _SIMULATION, imported

    pkg = Path(gradfabric.__file__).resolve().parent
    for module in ("gradfabric.lab.levels", "gradfabric.lab.flowcell", "gradfabric.sim.dlcp",
                   "gradfabric.experiments.esa"):  # fmt: skip
        code = (f"import sys, {module}; print(' '.join(m.__file__ for m in list(sys.modules"
                f".values()) if m.__name__.startswith('gradfabric') and m.__file__))")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
        loaded = {Path(f).resolve() for f in out}
        loaded = {f.with_name(f.name.split(".")[0] + ".py") for f in loaded}  # compiled: its source
        static = imported(module, pkg)
        sim = {f for f in loaded if f.relative_to(pkg).parts[0] in _SIMULATION}
        assert sim and sim <= static, sorted(str(f) for f in sim - static)
    flow = pkg / "sim" / "flow.py"
    assert flow not in imported("gradfabric.lab.levels", pkg)
    assert flow in imported("gradfabric.lab.flowcell", pkg)


def test_a_function_from_outside_the_package_is_held_to_the_simulation_sources() -> None:
    """A builtin or a script's function has no closure in the package: its
    digest is every simulation source's, not the digest of nothing."""
    import hashlib

    from gradfabric.core.cells import code_digest

    assert code_digest(abs) == code_digest(len) != hashlib.sha256(b"").hexdigest()[:16]
