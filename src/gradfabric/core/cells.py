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

import ast
import hashlib
import inspect
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
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
    store: str | None = None  # a ``CellStore`` file: finished cells are kept and reused

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
    processes); ``tick(label(cell))`` as each cell starts (serially) or finishes.
    With ``where.store``, cells that file already holds (computed by the same
    code) are taken from it and each new one is added as it finishes."""
    ex = where if isinstance(where, Executor) else Executor(processes=where)
    store = CellStore(Path(ex.store), fn) if ex.store else None
    done: dict[int, R] = {}
    todo: list[int] = []
    for i, c in enumerate(cells):
        if store is not None and store.has(c):
            done[i] = store.get(c)
            if tick is not None:
                tick(label(c) + " (stored)")
        else:
            todo.append(i)
    serial = ex.kind == "local" and (ex.processes <= 1 or len(todo) <= 1)
    run: _Run = {"dask": _on_dask, "ray": _on_ray}.get(ex.kind, _serially if serial else _on_pool)
    for k, r in (
        run(fn, [cells[i] for i in todo], ex, tick if serial else None, label) if todo else ()
    ):
        i = todo[k]
        done[i] = r
        if store is not None:
            store.put(cells[i], r)
        if tick is not None and not serial:
            tick(label(cells[i]))
    return [done[i] for i in range(len(cells))]


# (fn, cells, executor, tick, label) -> (index, record) as each cell finishes
_Run = Callable[..., Iterator[tuple[int, Any]]]


def _serially(
    fn: Callable[[C], R], cells: Sequence[C], _ex: Executor,
    tick: Callable[[str], None] | None, label: Callable[[C], str],
) -> Iterator[tuple[int, R]]:  # fmt: skip
    for i, c in enumerate(cells):
        if tick is not None:
            tick(label(c))  # as it starts: a long cell shows what is running
        yield i, fn(c)


def _on_pool(
    fn: Callable[[C], R], cells: Sequence[C], ex: Executor, *_: Any
) -> Iterator[tuple[int, R]]:
    """(index, record) as each cell finishes in a local process pool."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(ex.processes, len(cells)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, c): i for i, c in enumerate(cells)}
        for f in as_completed(futures):
            yield futures[f], f.result()


# What a simulated cell's record can depend on: the layers below the
# experiments (the layer rule keeps the rest out) and the cell function's own module.
_SIMULATION = ("core", "wire", "workloads", "proto", "sim")


def code_digest(fn: Callable[..., Any]) -> str:
    """A digest of the sources ``fn``'s records can depend on: its own module
    and every ``gradfabric`` module that module imports, directly or through
    others (``imported``; the package's root ``__init__`` and loader aside),
    with the C sources in their folders. A cell whose module does not import
    the flow level keeps its records across an edit of the flow level, and
    the other way round. A function from outside the package (a script's,
    a builtin) is held to every simulation source and its own file. Code a
    cell runs from a string in a child interpreter is not read: its module
    must import what that code does."""
    pkg = Path(__file__).resolve().parent.parent
    own = pkg.joinpath(*fn.__module__.split(".")[1:]).with_suffix(".py")
    if fn.__module__.split(".")[0] == "gradfabric" and own.is_file():
        root = {pkg / "__init__.py", pkg / "_build.py"}
        files = imported(fn.__module__, pkg) - root
    else:
        files = {p for d in _SIMULATION for p in (pkg / d).rglob("*.py")}
        source = inspect.getsourcefile(fn) if not inspect.isbuiltin(fn) else None
        files |= {Path(source)} if source and Path(source).is_file() else set()
    files |= {c for f in files for c in f.parent.glob("*.[ch]")}
    h = hashlib.sha256()
    for f in sorted(files):
        name = f.relative_to(pkg).as_posix() if f.is_relative_to(pkg) else f.name
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def imported(module: str, pkg: Path) -> set[Path]:
    """The source files of ``module`` (``gradfabric.x.y``) and of every
    ``gradfabric`` module it imports, at any depth, the packages around each
    included; read from the sources (an import inside a function counts), so
    a module that is never imported cannot change what it computes."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or name.split(".")[0] != "gradfabric":
            continue
        here = pkg.joinpath(*name.split(".")[1:])
        path = here / "__init__.py" if here.is_dir() else here.with_suffix(".py")
        if not path.is_file():
            continue  # a name imported from a module, not a module
        seen[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:k]) for k in range(1, len(parts))]
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                todo += [source, *(f"{source}.{a.name}" for a in node.names)]
    return set(seen.values())


class CellStore:
    """Finished cells of a grid, one JSON line each, so that a grid that takes
    hours survives an interrupted run and grows across runs: the same command
    again computes only the cells the file lacks.

    A line holds the cell's key (a digest of the cell function's name and the
    cell's ``repr``, which for the grids' frozen dataclasses is every field,
    seed included), the ``code_digest`` of the sources that computed it, the
    cell as text, and its record. Only lines from the current code are used;
    lines from other code stay in the file (``stale`` counts them), and a line
    that does not parse (a run killed mid-write) is skipped and counted in
    ``unreadable``. Records must be JSON values that read back equal (plain
    dicts of numbers and strings), so a stored record is the computed one."""

    def __init__(self, path: Path, fn: Callable[..., Any]) -> None:
        self.path = path
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.code = code_digest(fn)
        self.records: dict[str, Any] = {}
        self.stale = self.unreadable = 0
        text = path.read_text() if path.exists() else ""
        self.cut = bool(text) and not text.endswith("\n")  # the next line starts a line of its own
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                key, code, record = entry["key"], entry["code"], entry["record"]
            except (ValueError, KeyError, TypeError):
                self.unreadable += 1
                continue
            if code == self.code:
                self.records[key] = record
            else:
                self.stale += 1

    def key(self, cell: object) -> str:
        return hashlib.sha256(f"{self.name}\n{cell!r}".encode()).hexdigest()[:32]

    def has(self, cell: object) -> bool:
        return self.key(cell) in self.records

    def get(self, cell: object) -> Any:
        return self.records[self.key(cell)]

    def put(self, cell: object, record: Any) -> None:
        text = json.dumps(record)
        if json.loads(text) != record:
            raise ConfigError("store", f"{self.name}'s records do not read back from JSON")
        key = self.key(cell)
        line = json.dumps({"key": key, "code": self.code, "cell": repr(cell), "record": record})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(("\n" if self.cut else "") + line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.cut = False
        self.records[key] = record


def _needs(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ConfigError(
            "executor", f"{module} is not installed: pip install 'gradfabric[cluster]'"
        ) from e


def _on_dask(
    fn: Callable[[C], R], cells: Sequence[C], ex: Executor, *_: Any
) -> Iterator[tuple[int, R]]:
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


def _on_ray(
    fn: Callable[[C], R], cells: Sequence[C], ex: Executor, *_: Any
) -> Iterator[tuple[int, R]]:
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
