"""The ``gradfabric`` command line: one module per command, listed here in
the order ``--help`` shows them.

Exit codes: 0 success; 1 the run finished but a check it makes failed (an
analytic bound missed, an experiment raised); 2 bad usage or config.

Output: the ranks a command launches inherit quiet library logging (c10d's
and torchrun's warnings, such as gloo's "hostname of the client socket
cannot be retrieved" inside a network namespace, are nothing a user can act
on); their errors still show. ``--verbose`` lets everything through.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from gradfabric import __version__
from gradfabric._build import compiled_path
from gradfabric.cli import bench, daemon, experiment, models, plan, reproduce, simulate
from gradfabric.cli.common import err
from gradfabric.core.errors import ConfigError
from gradfabric.net.launch import QUIET

# In help order: the main job first, then studies, tools, daemons, reference.
COMMANDS = (reproduce, simulate, experiment, plan, bench, daemon, models)


def version() -> str:
    """The version and which implementation serves each part with native
    code: ``compiled`` (built by pip; the DDP hook by ``scripts/compile.py``)
    or ``python`` (the reference, with the reason it serves), and the
    simulator's hot path (``mypyc`` or ``python``)."""
    from gradfabric.collectives import fast
    from gradfabric.net import datapath, hostpath, switchpath
    from gradfabric.wire import fastquant

    parts = (
        ("switch engine", switchpath.PATH, switchpath.WHY_NOT),
        ("worker engine", datapath.PATH, datapath.WHY_NOT),
        ("helped host (SA-ATP)", hostpath.PATH, hostpath.WHY_NOT),
        ("client quantiser", fastquant.PATH, fastquant.WHY_NOT),
        ("DDP hook", fast.PYTHON if (hook := fast.why_not()) else fast.COMPILED, hook),
        ("simulator hot path", compiled_path(), None),
    )
    lines = [f"  {name}: {path}" + ("" if why is None or path != "python" else f" ({why})")
             for name, path, why in parts]  # fmt: skip
    return "\n".join([f"gradfabric {__version__}", *lines])


class _Version(argparse.Action):
    """``--version``, computed only when asked (it loads every native part)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show which paths run, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradfabric",
        description="Distributed DNN training that communicates less and waits less.",
    )
    p.add_argument("--version", action=_Version)
    p.add_argument(
        "-v", "--verbose", action="store_true",
        help="let the libraries' warnings through (c10d, gloo, torchrun)",
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:  # read by the ranks' libtorch and torchrun at their start
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("LOGLEVEL", "ERROR")
        os.environ.setdefault(QUIET, "1")  # (net.launch: one torchrun agent a node)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        err.print(f"[red]config error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        return 130
