"""Independent cells of an experiment grid, run serially or in a local
process pool.

A cell is a picklable value that carries everything its run needs, its seed
included, and a cell function (defined at module level, so a worker process
can import it) turns it into a plain record. Nothing flows between cells, so
the records are the same whichever way they run and in whatever order they
finish; ``run_cells`` returns them in the cells' order.

Workers are started with ``spawn``: the simulator needs no state from the
parent, and a forked copy of a process that has started threads (torch,
gloo) can deadlock.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypeVar

C = TypeVar("C")
R = TypeVar("R")


def default_processes() -> int:
    """One per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_cells(
    fn: Callable[[C], R],
    cells: Sequence[C],
    processes: int = 1,
    tick: Callable[[str], None] | None = None,
    label: Callable[[C], str] = str,
) -> list[R]:
    """``[fn(c) for c in cells]``, with ``processes > 1`` in a local pool;
    ``tick(label(cell))`` as each cell starts (serially) or finishes (in a pool)."""
    if processes <= 1 or len(cells) <= 1:
        out = []
        for c in cells:
            if tick is not None:
                tick(label(c))
            out.append(fn(c))
        return out
    results: dict[int, R] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(processes, len(cells)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, c): i for i, c in enumerate(cells)}
        for f in as_completed(futures):
            i = futures[f]
            results[i] = f.result()
            if tick is not None:
                tick(label(cells[i]))
    return [results[i] for i in range(len(cells))]
