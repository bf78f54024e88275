"""What every command shares: consoles, the results directory, progress
bars, tables, and ``report``, the one way a command writes and shows its
numbers (``config.yaml`` + ``results.json`` next to each other, then one JSON
object per row with ``--json`` or rich tables)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from gradfabric.core.cells import EXECUTORS, Executor, default_processes
from gradfabric.core.config import type_hints

T = TypeVar("T")
err = Console(stderr=True)
out = Console()

Rows = list[dict[str, Any]]
Tick = Callable[[str], None]
# One table of a report: (results key, title, columns)
TableSpec = tuple[str, str, Sequence[str]]
Sub = Any  # argparse's _SubParsersAction (private)


def results_dir(given: str | None, command: str) -> Path:
    path = Path(given) if given else Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_output(p: argparse.ArgumentParser, command: str, json_help: str = "") -> None:
    """``--out`` and ``--json``, alike for every command that reports numbers."""
    p.add_argument("--out", help=f"results directory (default: results/{command}-<time>)")
    p.add_argument("--json", action="store_true", help=json_help or "one JSON object per row")


def add_executor(p: argparse.ArgumentParser) -> None:
    """Where a grid's cells run (``core.cells.Executor``), alike for every grid."""
    p.add_argument("-p", "--processes", type=int, help="cells run at once (default: one per core)")
    p.add_argument(
        "--executor", choices=EXECUTORS, default="local",
        help="where the grid's cells run: a local process pool (default), or a Dask or Ray "
        "cluster (pip install 'gradfabric[cluster]'); the rows are the same",
    )  # fmt: skip
    p.add_argument("--address", help="the cluster's scheduler (dask) or head (ray); "
                   "default: start a local one with --processes workers")  # fmt: skip
    p.add_argument(
        "--store", metavar="FILE",
        help="keep each finished cell in FILE (JSON lines) and take from it the cells it "
        "already holds from the same code: a long grid resumes where it stopped",
    )  # fmt: skip


def executor(args: argparse.Namespace) -> Executor:
    return Executor(args.executor, args.processes or default_processes(), args.address, args.store)


@contextmanager
def progress(total: int, quiet: bool) -> Iterator[Tick]:
    bar = Progress(
        TextColumn("{task.description:<32}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=quiet or not err.is_terminal,
    )
    with bar:
        task = bar.add_task("starting", total=total)
        first = [True]

        def tick(label: str) -> None:
            if not first[0]:
                bar.advance(task)
            first[0] = False
            bar.update(task, description=label)

        yield tick
        bar.update(task, completed=total)


def table(rows: Rows, title: str, cols: Sequence[str]) -> Table:
    t = Table(title=title)
    for c in cols:
        t.add_column(
            c, justify="right" if c not in ("model", "scheme", "check", "subject") else "left"
        )
    for r in rows:  # (a column a row does not have: "-", as an option a point did not run)
        cells = [r.get(c, "-") for c in cols]
        t.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in cells])
    return t


def csv(text: str | None, kind: type) -> tuple[Any, ...] | None:
    return None if not text else tuple(kind(x) for x in text.split(","))


# Fields kept in ns inside, given on the command line in a larger unit:
# field -> (flag name, ns per unit).
UNITS: dict[str, tuple[str, float]] = {
    "rto_ns": ("rto_ms", 1e6),
    "delay_ns": ("delay_us", 1e3),
    "jitter_ns": ("jitter_us", 1e3),
}


def dataclass_options(p: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """One ``--flag`` per field of the config dataclass ``cls`` (nested
    dataclasses flattened), with the field's default and ``help`` metadata."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            dataclass_options(p, cast(type, kind), skip)
            continue
        default: Any = f.default
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        flag, scale = UNITS.get(f.name, (f.name, 1.0))
        if scale != 1.0:
            default, base = default / scale, float
        if base is bool:  # --flag / --no-flag
            p.add_argument("--" + flag.replace("_", "-"), action=argparse.BooleanOptionalAction,
                           default=default, help=f.metadata.get("help", ""))  # fmt: skip
            continue
        p.add_argument(
            "--" + flag.replace("_", "-"), type=base, default=default,
            help=f"{f.metadata.get('help', '')} (default: %(default)s)",
            choices=f.metadata.get("choices"),
        )  # fmt: skip


def dataclass_from(cls: type[T], args: argparse.Namespace, **fixed: Any) -> T:
    """The config ``dataclass_options`` describes, from parsed ``args``."""
    hints = type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in fixed:
            values[f.name] = fixed[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = dataclass_from(hints[f.name], args)
        else:
            flag, scale = UNITS.get(f.name, (f.name, 1.0))
            v = getattr(args, flag)
            values[f.name] = round(v * scale) if scale != 1.0 else v
    return cls(**values)


def _plain(config: Any) -> Any:
    """A config as YAML-safe data (dataclasses field by field, tuples as lists)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        from gradfabric.core.config import dump

        return dump(config)
    return json.loads(json.dumps(config, default=str))


def report(
    args: argparse.Namespace,
    command: str,
    config: Any,
    results: Mapping[str, Any],
    tables: Sequence[TableSpec] = (),
    json_keys: Sequence[str] | None = ("rows",),
    footer: str = "",
) -> Path:
    """Write ``config.yaml`` (the resolved config) and ``results.json`` into
    the command's results directory, then print: with ``--json`` one object
    per row of each of ``json_keys`` (``None``: the results as one object),
    else each table whose rows exist, ``footer`` and where the files are."""
    dest = results_dir(getattr(args, "out", None), command)
    (dest / "config.yaml").write_text(yaml.safe_dump(_plain(config), sort_keys=False))
    (dest / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.json and json_keys is None:
        print(json.dumps(results, default=str))
        return dest
    if args.json:
        for key in json_keys or ():
            data = results.get(key)
            for r in data if isinstance(data, list) else [data] if data is not None else []:
                print(json.dumps(r, default=str))
        return dest
    for key, title, cols in tables:
        if results.get(key):
            out.print(table(results[key], title, cols))
    if footer:
        out.print(footer, markup=False)
    out.print(f"results and resolved config: {dest}")
    return dest
