"""``gradfabric reproduce``: every experiment, its claims and the report."""

from __future__ import annotations

import argparse
import json
import time

from rich.table import Table

from gradfabric.cli.common import Sub, add_executor, err, executor, out, progress, results_dir
from gradfabric.core.cells import choose


def add(sub: Sub) -> None:
    r = sub.add_parser("reproduce", help="run the reproduction suite and write its report")
    r.add_argument("--quick", action="store_true", help="minutes, not hours")
    r.add_argument("--only", help="comma-separated experiment names")
    r.add_argument("--out", help="results directory (default: results/reproduce-<time>)")
    r.add_argument("--json", action="store_true", help="the claims as one JSON object")
    add_executor(r)
    r.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from gradfabric.experiments import (  # noqa: F401
        baselines,
        ddp,
        dlcp,
        dlcp_train,
        emulator,
        esa,
        esa_scale,
        esa_train,
        flowlevel,
        granularity,
        omnireduce,
        plan_exec,
        planner,
        saatp,
        saatp_train,
        simspeed,
        sparse_train,
    )
    from gradfabric.experiments.registry import EXPERIMENTS
    from gradfabric.experiments.report import CLAIM_COLUMNS, claim_rows, write_report

    choose(executor(args))  # the grids' cells (SA-ATP, ESA, DLCP) run there
    names = args.only.split(",") if args.only else EXPERIMENTS.names()
    exps = [EXPERIMENTS.get(n) for n in names]
    left = [] if args.only or not args.quick else \
        [e.name for e in exps if not getattr(e, "main_job", True)]  # fmt: skip
    exps = [e for e in exps if e.name not in left]
    for name in left:
        err.print(f"{name}: left to its own run (gradfabric reproduce --quick --only {name})")
    dest = results_dir(args.out, "reproduce")
    results = []
    failed = []
    for exp in exps:
        err.print(f"[bold]{exp.title}[/bold]")
        with progress(8, args.json) as tick:
            try:
                began = time.monotonic()
                results.append(exp.run(args.quick, dest, tick))
                results[-1].seconds = time.monotonic() - began
            except Exception as e:  # one broken experiment must not hide the others
                failed.append(f"{exp.name}: {e!r}")
                err.print(f"[red]{exp.name} failed: {e!r}[/red]")
    report = write_report(results, dest, args.quick, left)
    if args.json:
        print(
            json.dumps(
                {
                    "report": str(report),
                    "failed": failed,
                    "claims": [c.__dict__ for r in results for c in r.claims],
                }
            )
        )
    else:
        t = Table(title="claims (speed-ups: above 1 is better)")
        for col in CLAIM_COLUMNS:
            t.add_column(col)
        for row in claim_rows([c for r in results for c in r.claims]):
            t.add_row(*row)
        out.print(t)
        out.print(f"report: {report}")
    return 1 if failed else 0
