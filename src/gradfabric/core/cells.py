"""Independent cells of an experiment grid, run serially, in a local process
pool, or on a cluster (Dask or Ray).

A cell is a picklable value that carries everything its run needs, its seed
included, and a cell function (defined at module level, so a worker process
can import it) turns it into a plain record. Nothing flows between cells, so
the records are the same whichever way they run and in whatever order they
finish; ``run_cells`` returns them in the cells' order.

Workers are started with ``spawn``: the simulator needs no state from the
parent, and a forked copy of a process that has started threads (torch,
gloo) can deadlock.

``Executor`` says where: ``local`` (the pool, ``processes`` at a time), or an
existing distributed engine a lab already runs, ``dask`` (a
``dask.distributed`` scheduler at ``address``, or a local cluster of
``processes`` workers) or ``ray`` (``ray.init(address)``; without one, a
local instance). Both are optional extras (``pip install 'gradfabric[cluster]'``)
and are imported only when asked for. The cluster's workers must be able to
import ``gradfabric`` (the same version), as with any task they run.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, TypeVar

from gradfabric.core.errors import ConfigError

C = TypeVar("C")
R = TypeVar("R")


def default_processes() -> int:
    """One per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


EXECUTORS = ("local", "dask", "ray")


@dataclass(frozen=True)
class Executor:
    """Where the cells run (see the module doc)."""

    kind: str = "local"
    processes: int = 1
    address: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ConfigError("executor", f"unknown {self.kind!r}; valid: {', '.join(EXECUTORS)}")
        if self.processes < 1:
            raise ConfigError("processes", f"must be >= 1, got {self.processes}")
        if self.address and self.kind == "local":
            raise ConfigError("address", "an address needs --executor dask or ray")


_chosen: list[Executor] = []


def choose(ex: Executor) -> None:
    """Make ``ex`` where the suite's experiments run their grids (``reproduce
    --executor``); a grid run directly is given its executor instead."""
    _chosen[:] = [ex]


def chosen() -> Executor:
    """What ``choose`` set, else a local pool of one process per core."""
    return _chosen[0] if _chosen else Executor(processes=default_processes())


def run_cells(
    fn: Callable[[C], R],
    cells: Sequence[C],
    where: Executor | int = 1,
    tick: Callable[[str], None] | None = None,
    label: Callable[[C], str] = str,
) -> list[R]:
    """``[fn(c) for c in cells]``, run ``where`` says (an int: that many local
    processes); ``tick(label(cell))`` as each cell starts (serially) or finishes."""
    ex = where if isinstance(where, Executor) else Executor(processes=where)
    if ex.kind != "local":
        results: dict[int, R] = {}
        run = _on_dask if ex.kind == "dask" else _on_ray
        for i, r in run(fn, cells, ex):
            results[i] = r
            if tick is not None:
                tick(label(cells[i]))
        return [results[i] for i in range(len(cells))]
    processes = ex.processes
    if processes <= 1 or len(cells) <= 1:
        out = []
        for c in cells:
            if tick is not None:
                tick(label(c))
            out.append(fn(c))
        return out
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(processes, len(cells)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, c): i for i, c in enumerate(cells)}
        done: dict[int, R] = {}
        for f in as_completed(futures):
            i = futures[f]
            done[i] = f.result()
            if tick is not None:
                tick(label(cells[i]))
    return [done[i] for i in range(len(cells))]


def _needs(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ConfigError(
            "executor", f"{module} is not installed: pip install 'gradfabric[cluster]'"
        ) from e


def _on_dask(fn: Callable[[C], R], cells: Sequence[C], ex: Executor) -> Iterator[tuple[int, R]]:
    """(index, record) as each cell finishes on a Dask cluster."""
    distributed = _needs("dask.distributed")
    if ex.address:
        client = distributed.Client(ex.address)
    else:  # a local cluster: one single-threaded worker process per slot
        client = distributed.Client(
            n_workers=ex.processes, threads_per_worker=1, processes=True,
            dashboard_address=None,
        )  # fmt: skip
    with client:
        # pure=False: two equal cells are still two runs (and two seeds' worth of records)
        futures = client.map(fn, list(cells), pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        for f in distributed.as_completed(futures):
            yield index[f.key], f.result()


def _apply(fn: Callable[[C], R], cell: C) -> R:
    return fn(cell)


def _on_ray(fn: Callable[[C], R], cells: Sequence[C], ex: Executor) -> Iterator[tuple[int, R]]:
    """(index, record) as each cell finishes on a Ray cluster."""
    ray = _needs("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address=ex.address, num_cpus=None if ex.address else ex.processes,
                 include_dashboard=False, log_to_driver=False)  # fmt: skip
    try:
        task = ray.remote(num_cpus=1)(_apply)  # a Python function: fn may be a builtin
        pending = {task.remote(fn, c): i for i, c in enumerate(cells)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                yield pending.pop(ref), ray.get(ref)
    finally:
        if started:
            ray.shutdown()
