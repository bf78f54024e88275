"""A grid's cells give the same records serially and in a process pool."""

from __future__ import annotations

import math

from gradfabric.core.cells import run_cells
from gradfabric.sim.dlcp import VARIANTS, DlcpConfig, run_grid


def test_pool_returns_records_in_cell_order() -> None:
    cells = list(range(30, 0, -1))  # the big ones (slow) first, so they finish last
    seen: list[str] = []
    got = run_cells(math.factorial, cells, processes=2, tick=seen.append)
    assert got == [math.factorial(c) for c in cells]
    assert sorted(seen) == sorted(str(c) for c in cells)


def test_dlcp_grid_is_the_same_serially_and_in_a_pool() -> None:
    """Every scheme on two seeds: each cell carries its seed, so the pool's
    records equal the serial run's, field for field."""
    base = DlcpConfig(collective="allreduce", tensors=(16_384,), iterations=1)
    serial = run_grid([base], (0.5,), (0, 1), processes=1)
    pooled = run_grid([base], (0.5,), (0, 1), processes=2)
    assert len(serial) == 2 * len(VARIANTS)
    assert serial == pooled


def test_saatp_grid_is_the_same_serially_and_in_a_pool() -> None:
    """SA-ATP's training cells are seeded too: the pool gives the serial rows
    (simulated times and help counts; only the wall clock differs)."""
    from gradfabric.experiments.saatp import SaatpGrid
    from gradfabric.experiments.saatp import run_grid as saatp_grid

    grid = SaatpGrid(models=("resnet50",), workers=(8,), stragglers=(1,), slowdowns=(2.0,),
                     schemes=("saatp", "atp"), iterations=2)  # fmt: skip

    def timeless(rows: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]

    serial = saatp_grid(grid, lambda _label: None, processes=1)
    pooled = saatp_grid(grid, lambda _label: None, processes=2)
    assert [r["scheme"] for r in serial] == ["saatp", "atp"]
    assert timeless(serial) == timeless(pooled)
