"""A grid's cells give the same records serially, in a process pool and on a
cluster engine (a local Dask cluster; Ray where it is installed)."""

from __future__ import annotations

import math

import pytest

from gradfabric.core.cells import Executor, run_cells
from gradfabric.core.errors import ConfigError
from gradfabric.sim.dlcp import VARIANTS, DlcpConfig, run_grid


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
