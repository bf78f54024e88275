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
