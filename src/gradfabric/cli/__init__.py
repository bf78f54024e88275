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

from gradfabric import __version__
from gradfabric._build import compiled_path
from gradfabric.cli import bench, daemon, experiment, models, plan, reproduce, simulate
from gradfabric.cli.common import err
from gradfabric.core.errors import ConfigError

# In help order: the main job first, then studies, tools, daemons, reference.
COMMANDS = (reproduce, simulate, experiment, plan, bench, daemon, models)


def version() -> str:
    """The version and which paths run: the simulator's (``mypyc``: the
    compiled hot path; ``python``: the sources, where nothing was compiled),
    the switch clients' quantiser (``compiled`` C, or ``python``: numpy) and
    the datapaths of the workers and of the switch daemon's SwitchML, ATP and
    ESA pools (``compiled`` C, or ``python``: the reference engines)."""
    from gradfabric.net import datapath, switchpath
    from gradfabric.wire import fastquant

    return (f"gradfabric {__version__} (simulator hot path: {compiled_path()}; "
            f"client quantiser: {fastquant.PATH}; worker datapath: {datapath.PATH}; "
            f"switch datapath: {switchpath.PATH})")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradfabric",
        description="Distributed DNN training that communicates less and waits less.",
    )
    p.add_argument("--version", action="version", version=version())
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
    try:
        return int(args.fn(args))
    except ConfigError as e:
        err.print(f"[red]config error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        return 130
