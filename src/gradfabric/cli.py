"""The ``gradfabric`` command line.

Exit codes: 0 success; 1 the run finished but a check it makes failed (an
analytic bound missed, an experiment raised); 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

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

from gradfabric.core.cells import default_processes
from gradfabric.core.errors import ConfigError

err = Console(stderr=True)
out = Console()


def _results_dir(given: str | None, command: str) -> Path:
    path = Path(given) if given else Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[str], None]]:
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


def _table(rows: list[dict[str, Any]], title: str, cols: Sequence[str]) -> Table:
    t = Table(title=title)
    for c in cols:
        t.add_column(
            c, justify="right" if c not in ("model", "scheme", "check", "subject") else "left"
        )
    for r in rows:
        t.add_row(*[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    return t


def cmd_simulate(args: argparse.Namespace) -> int:
    from gradfabric.core.config import dump, load_yaml
    from gradfabric.experiments.baselines import builtin_config
    from gradfabric.experiments.simulate import SimulateConfig, run_simulate

    cfg = load_yaml(SimulateConfig, Path(args.config)) if args.config else builtin_config()
    if args.train_packets:
        cfg = replace(cfg, ina=replace(cfg.ina, train_packets=args.train_packets))
    dest = _results_dir(args.out, "simulate")
    (dest / "config.yaml").write_text(yaml.safe_dump(dump(cfg), sort_keys=False))
    steps = len(cfg.models) * len(cfg.schemes) + 1
    with _progress(steps, args.json) as tick:
        res = run_simulate(cfg, tick)
    (dest / "results.json").write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res))
    else:
        out.print(
            _table(
                res["rows"],
                f"{cfg.name}: {cfg.workers} workers, "
                f"{cfg.fabric.link.link_gbps:g} Gbit/s, train={cfg.ina.train_packets}",
                [
                    "model",
                    "scheme",
                    "iteration_ms",
                    "comm_only_ms",
                    "goodput_gbps",
                    "mem_util",
                    "mem_held",
                    "ps_fallback",
                    "wall_s",
                ],
            )
        )
        if res["checks"]:
            out.print(
                _table(
                    res["checks"],
                    "analytic checks",
                    ["subject", "check", "measured", "bound", "ratio", "within_5pct"],
                )
            )
        out.print(f"results and resolved config: {dest}")
    return 0 if all(c["within_5pct"] for c in res["checks"]) else 1


def cmd_bench_sim(args: argparse.Namespace) -> int:
    from gradfabric.proto.schemes import InaConfig
    from gradfabric.sim.collective import Bucket, run_collective
    from gradfabric.workloads.catalog import model_spec
    from gradfabric.workloads.compute import device, timeline

    spec = model_spec(args.model)
    tl = timeline(spec, 32, device("v100"))
    buckets = [Bucket(b.ready_ns, b.values) for b in tl.buckets]
    runs = []
    with _progress(args.repeats, args.json) as tick:
        for i in range(args.repeats):
            tick(f"run {i + 1}")
            r = run_collective(args.scheme, args.workers, buckets, ina=InaConfig(train_packets=1))
            runs.append(
                {"events": r.events, "wall_s": r.wall_s, "events_per_s": r.events / r.wall_s}
            )
    res = {
        "scheme": args.scheme,
        "model": args.model,
        "workers": args.workers,
        "granularity": "packet",
        "repeats": args.repeats,
        "events_per_s": statistics.median(x["events_per_s"] for x in runs),
        "events": runs[0]["events"],
        "wall_s": [x["wall_s"] for x in runs],
    }
    if args.json:
        print(json.dumps(res))
    else:
        out.print(
            f"{args.scheme} {args.model}, {args.workers} workers, packet granularity: "
            f"{res['events']} events; median {res['events_per_s']:,.0f} events/s over "
            f"{args.repeats} runs (wall s: {', '.join(f'{w:.2f}' for w in res['wall_s'])})"
        )
    return 0


OMNI_FLOOR = (
    "floor = max over ranks r of max(|N_r|, |U_-r|) * B * 8 / link rate, where N_r "
    "are the non-zero blocks of rank r, U_-r the blocks non-zero at some rank other "
    "than r, and B the bytes of a block: whatever the exchange, every rank sends each "
    "of its non-zero blocks at least once and receives, for each block another rank "
    "holds, at least one block of their sum (with 2 ranks the gather path moves "
    "exactly this). path_ratio: bytes on the busiest link of the paths taken (gather, "
    "sharded or dense, chosen per chunk) over the floor's bytes"
)


def cmd_bench_omnireduce(args: argparse.Namespace) -> int:
    from gradfabric.collectives.bench import DENSITIES, run_bench

    densities = list(_csv(args.densities, float) or DENSITIES)
    if args.ranks < 2 or args.iters < 1 or args.size_mb <= 0:
        raise ConfigError("ranks", "need --ranks >= 2, --iters >= 1 and --size-mb > 0")
    rows = run_bench(args.ranks, args.size_mb, densities, args.iters, args.link_gbps)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        out.print(
            _table(
                rows,
                f"sparse vs dense all-reduce, {args.size_mb:g} MB, {args.ranks} gloo ranks, "
                + (f"{args.link_gbps:g} Gbit/s shaped links" if args.link_gbps else "loopback")
                + f" (medians of {args.iters})",
                [
                    "density",
                    "gradfabric_ms",
                    "dense_ms",
                    "speedup",
                    "bytes_ratio",
                    "path_ratio",
                    "floor_ratio",
                    "max_abs_diff",
                ],
            )
        )
    return 0 if all(r["max_abs_diff"] < 1e-3 for r in rows) else 1


def cmd_bench_switch(args: argparse.Namespace) -> int:
    from gradfabric.emu.bench import SwitchBenchConfig, run_switch_bench

    cfgs = [
        SwitchBenchConfig(workers=w, tensor_mb=args.tensor_mb, iters=args.iters,
                          policy=args.policy, job_slots=args.job_slots,
                          values_per_packet=args.values_per_packet)
        for w in _csv(args.workers, int) or (2, 4)
    ]  # fmt: skip
    rows = []
    with _progress(len(cfgs), args.json) as tick:
        for c in cfgs:
            tick(f"{c.workers} workers")
            rows.append(run_switch_bench(c))
    if args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "switch_counters"}))
    else:
        out.print(
            _table(rows, f"software switch ({args.policy}) vs gloo all-reduce, loopback "
                   f"(medians of {args.iters})",
                   ["workers", "tensor_mb", "switch_ms", "gloo_ms", "goodput_gbps",
                    "switch_cpu_gbps", "max_error"])
        )  # fmt: skip
    # both sum float32; the switch adds only block quantisation (~1e-8 of a block's peak)
    return 0 if all(r["max_error"] < 1e-4 for r in rows) else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from gradfabric.experiments import plots
    from gradfabric.planner.baselines import BASELINES, best_subset
    from gradfabric.planner.cost import Device, Workload
    from gradfabric.planner.online import load_trace, random_trace, run_online
    from gradfabric.planner.search import plan
    from gradfabric.planner.spec import example_cluster, load_cluster
    from gradfabric.workloads.catalog import model_spec

    cluster = load_cluster(Path(args.cluster)) if args.cluster else example_cluster()
    if args.batch < 1:
        raise ConfigError("batch", "must be >= 1")
    w = Workload.of(model_spec(args.model), args.batch)
    types = cluster.expand()
    devs = [Device(i, t) for i, t in enumerate(types)]
    lat = cluster.link_latency_us * 1e-6
    res = plan(w, devs, lat)
    est = res.estimate
    out_obj: dict[str, Any] = {
        "model": args.model,
        "batch": args.batch,
        "devices": len(devs),
        "batch_time_s": est.batch_time_s,
        "cost_per_hour": est.cost_per_hour,
        "plan_time_s": res.plan_time_s,
        "devices_used": len(res.plan.devices()),
        "groups": [
            {"batch": g.batch, "stages": [[s.device, s.first, s.end] for s in g.stages]}
            for g in res.plan.groups
        ],
        "baselines": [],
    }
    for name in BASELINES.names():  # each rule on its own best device subset
        bp, e = best_subset(BASELINES.get(name), w, devs, lat)
        out_obj["baselines"].append(
            {
                "name": name,
                "batch_time_s": e.batch_time_s,
                "cost_per_hour": e.cost_per_hour,
                "devices_used": len(bp.devices()),
            }
        )
    if args.trace or args.slots:
        trace = (
            load_trace(Path(args.trace), len(types))
            if args.trace
            else random_trace(len(types), args.slots, args.seed)
        )
        budget = args.budget if args.budget is not None else est.cost_per_hour
        with _progress(len(trace), args.json) as tick:
            on = run_online(w, types, trace, budget, args.v, tick=tick)
        dest = _results_dir(args.out, "plan")
        slots = [float(r.slot) for r in on.slots]
        plots.lines(
            slots,
            {"gradfabric": [r.batch_time_s * 1e3 for r in on.slots]}
            | {n: [t * 1e3 for t in ts] for n, ts in on.baselines.items()},
            "slot",
            "batch time (ms)",
            f"{args.model}, batch {args.batch}: batch time per slot",
            dest / "plan_batch_time.png",
        )
        plots.lines(
            slots,
            {"price": [r.price_per_hour for r in on.slots], "budget": [budget] * len(slots)},
            "slot",
            "$ per hour",
            f"price per slot (V = {args.v:g})",
            dest / "plan_cost.png",
        )
        out_obj["online"] = {
            "slots": len(trace),
            "budget_per_hour": budget,
            "v": args.v,
            "mean_batch_time_s": on.mean_batch_time_s,
            "mean_cost_per_hour": on.mean_price,
            "max_plan_time_s": on.max_plan_time_s,
            "baselines": [
                {"name": n, "mean_batch_time_s": statistics.fmean(ts)}
                for n, ts in on.baselines.items()
            ],
            "plots": str(dest),
        }
    if args.json:
        print(json.dumps(out_obj))
        return 0
    out.print(res.explain(devs, w), markup=False)
    out.print(
        _table(
            out_obj["baselines"],
            "baselines (same cost model, each on its best device subset)",
            ["name", "batch_time_s", "cost_per_hour", "devices_used"],
        )
    )
    if "online" in out_obj:
        on_obj = out_obj["online"]
        out.print(
            f"online over {on_obj['slots']} slots: mean batch time "
            f"{on_obj['mean_batch_time_s'] * 1e3:.1f} ms at ${on_obj['mean_cost_per_hour']:.2f}/h "
            f"(budget ${on_obj['budget_per_hour']:.2f}/h); plots in {on_obj['plots']}"
        )
        out.print(
            _table(
                on_obj["baselines"], "baselines under the same trace", ["name", "mean_batch_time_s"]
            )
        )
    return 0


def cmd_experiment_dlcp(args: argparse.Namespace) -> int:
    from gradfabric.experiments.dlcp import LOADS, QUICK_SEEDS, SEEDS, gains, summarise
    from gradfabric.experiments.dlcp_convergence import ConvergenceConfig, run_convergence
    from gradfabric.sim.dlcp import SCHEMES, experiment_configs, run_grid

    cfg = ConvergenceConfig.quick() if args.quick else ConvergenceConfig()
    if args.policies:
        cfg = replace(cfg, policies=tuple(args.policies.split(",")))
    if args.bounds:
        cfg = replace(cfg, bounds=tuple(float(b) for b in args.bounds.split(",")))
    if args.seeds:
        cfg = replace(cfg, seeds=tuple(range(args.seeds)))
    seeds = tuple(range(args.seeds)) if args.seeds else QUICK_SEEDS if args.quick else SEEDS
    loads = tuple(float(x) for x in args.loads.split(",")) if args.loads else LOADS
    wanted = args.collectives.split(",") if args.collectives else []
    nets = [n for n in experiment_configs(args.quick) if n.collective in wanted]
    if len(nets) != len(wanted):
        raise ConfigError("collectives", f"each of ps, allreduce; got {args.collectives!r}")
    convergence = not args.no_convergence
    steps = len(nets) * len(loads) * len(seeds) * len(SCHEMES)
    steps += (1 + len(cfg.policies) * len(cfg.bounds)) if convergence else 0
    with _progress(steps, args.json) as tick:
        transport = run_grid(nets, loads, seeds, tick, args.processes or default_processes())
        rows = run_convergence(cfg, tick) if convergence else []
    summary = summarise(transport)
    headline = [g for n in nets for ld in loads for g in gains(transport, n.collective, ld)]
    dest = _results_dir(args.out, "dlcp")
    resolved = {"transport": [asdict(n) for n in nets], "loads": loads, "seeds": seeds,
                "convergence": asdict(cfg) if convergence else None}  # fmt: skip
    (dest / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(resolved))))
    results = {"rows": transport, "summary": summary, "gains": headline, "convergence": rows}
    (dest / "results.json").write_text(json.dumps(results, indent=1))
    if args.json:
        for r in [*transport, *headline, *rows]:
            print(json.dumps(r))
        return 0
    if transport:
        out.print(
            _table(summary, f"DLCP vs reliable transports on a leaf-spine (simulated), "
                   f"mean ± 95% interval over {len(seeds)} seeds",
                   ["scheme", "baseline", "load", "iter_time_ms", "iter_ci_ms", "p99_comm_ms",
                    "p99_ci_ms", "lost"])
        )  # fmt: skip
        out.print(
            _table(headline, "DLCP's gain in iteration time over the best reliable transport "
                   "under the same routing (paired by seed)",
                   ["baseline", "load", "routing", "dlcp", "best", "gain", "gain_ci"])
        )  # fmt: skip
    if rows:
        out.print(
            _table(rows, f"DLCP convergence (teacher task, 4 workers, {len(cfg.seeds)} seeds; "
                   "delta paired by seed; steps to the target accuracy)",
                   ["policy", "loss_bound", "accuracy", "accuracy_ci", "delta_pp", "delta_ci_pp",
                    "steps_to_target", "steps_to_target_ci", "reached"])
        )  # fmt: skip
    out.print(f"results and resolved config: {dest}")
    return 0


def cmd_experiment_saatp_udp(args: argparse.Namespace) -> int:
    from gradfabric.emu.saatp import SaatpEmuConfig, run_emu_saatp

    cfg = SaatpEmuConfig(
        workers=args.workers, iterations=args.iterations, compute_ms=args.compute_ms,
        slowdown=args.slowdown,
    )  # fmt: skip
    rows = []
    with _progress(2, args.json) as tick:
        for helped in (False, True):
            tick("SA-ATP" if helped else "ATP")
            r = run_emu_saatp(cfg, helped)
            rows.append(
                {"scheme": "saatp" if helped else "atp", "workers": cfg.workers,
                 "slowdown": cfg.slowdown, "iter_time_ms": r["median_iteration_ms"],
                 "helps": r["helps_sent"], "abandoned": r["abandoned"], "exact": r["exact"]}
            )  # fmt: skip
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        out.print(
            _table(rows, f"ATP vs SA-ATP over UDP, worker {cfg.straggler} {cfg.slowdown:g}x "
                   f"slower (median of {cfg.iterations - 1} iterations)",
                   ["scheme", "iter_time_ms", "helps", "abandoned", "exact"])
        )  # fmt: skip
    return 0 if all(r["exact"] for r in rows) else 1


def cmd_experiment_dlcp_udp(args: argparse.Namespace) -> int:
    from gradfabric.emu.dlcp import DlcpEmuConfig, run_emu_dlcp, summary_row

    cfg = DlcpEmuConfig(
        workers=args.workers, rounds=args.rounds, port_mbps=args.port_mbps,
        background_mbps=args.background_mbps,
    )  # fmt: skip
    rows = []
    with _progress(2, args.json) as tick:
        for reliable in (True, False):
            tick("reliable" if reliable else "DLCP")
            rows.append(summary_row(run_emu_dlcp(cfg, reliable)))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        out.print(
            _table(rows, f"DLCP over UDP: {cfg.workers} workers, {cfg.port_mbps:g} Mbit/s port, "
                   f"{cfg.background_mbps:g} Mbit/s background (median of {cfg.rounds} rounds)",
                   ["scheme", "round_ms", "lost_push", "lost_pull", "drop_rate_p0",
                    "drop_rate_p1", "drop_rate_p2", "drop_rate_p3"])
        )  # fmt: skip
    ok = rows[0]["wrong_share"] == 0 and rows[1]["lost_push"] <= cfg.push_bound
    return 0 if ok and rows[1]["lost_pull"] <= cfg.pull_bound else 1


def cmd_reproduce(args: argparse.Namespace) -> int:
    from gradfabric.experiments import (  # noqa: F401
        baselines,
        dlcp,
        emulator,
        esa,
        granularity,
        omnireduce,
        planner,
        saatp,
    )
    from gradfabric.experiments.registry import EXPERIMENTS
    from gradfabric.experiments.report import write_report

    names = args.only.split(",") if args.only else EXPERIMENTS.names()
    exps = [EXPERIMENTS.get(n) for n in names]
    dest = _results_dir(args.out, "reproduce")
    results = []
    failed = []
    for exp in exps:
        err.print(f"[bold]{exp.title}[/bold]")
        with _progress(8, args.json) as tick:
            try:
                results.append(exp.run(args.quick, dest, tick))
            except Exception as e:  # one broken experiment must not hide the others
                failed.append(f"{exp.name}: {e!r}")
                err.print(f"[red]{exp.name} failed: {e!r}[/red]")
    report = write_report(results, dest, args.quick)
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
        t = Table(title="claims")
        for col in ("system", "claim", "paper", "ours", "ratio"):
            t.add_column(col)
        for r in results:
            for c in r.claims:
                t.add_row(
                    c.system, c.claim, c.paper, c.ours, "" if c.ratio is None else f"{c.ratio:.3f}"
                )
        out.print(t)
        out.print(f"report: {report}")
    return 1 if failed else 0


def _csv(text: str | None, kind: type) -> tuple[Any, ...] | None:
    return None if not text else tuple(kind(x) for x in text.split(","))


def _grid_command(
    args: argparse.Namespace,
    name: str,
    grid: Any,
    steps: int,
    run: Callable[[Any, Callable[[str], None]], list[dict[str, Any]]],
    compare: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
    tables: list[tuple[str, str, list[str]]],
    extra: dict[str, Callable[[Any, Callable[[str], None]], list[dict[str, Any]]]] | None = None,
) -> int:
    """Run an experiment grid (and any ``extra`` studies, each a named set of
    rows); write results next to the resolved grid; print one JSON object per
    row (``--json``) or the tables (``rows``/``cmp``/an extra's name)."""
    from gradfabric.core.config import dump

    dest = _results_dir(args.out, name)
    (dest / "config.yaml").write_text(yaml.safe_dump(dump(grid), sort_keys=False))
    with _progress(steps, args.json) as tick:
        rows = run(grid, tick)
        data = {"rows": rows, "cmp": compare(rows)}
        for key, study in (extra or {}).items():
            data[key] = study(grid, tick)
    (dest / "results.json").write_text(json.dumps(data, indent=1))
    if args.json:
        for r in [*rows, *(r for key in extra or {} for r in data[key])]:
            print(json.dumps(r))
        return 0
    for key, title, cols in tables:
        if data.get(key):
            out.print(_table(data[key], title, cols))
    out.print(f"results and resolved config: {dest}")
    return 0


def cmd_experiment_saatp(args: argparse.Namespace) -> int:
    from gradfabric.experiments.saatp import SaatpGrid, compare, run_grid

    grid = SaatpGrid.quick() if args.quick else SaatpGrid()
    given = {
        "models": _csv(args.models, str),
        "workers": _csv(args.workers, int),
        "slowdowns": _csv(args.slowdowns, float),
        "stragglers": _csv(args.stragglers, int),
        "iterations": args.iterations,
    }
    grid = replace(grid, **{k: v for k, v in given.items() if v})
    steps = (
        len(grid.models)
        * len(grid.workers)
        * len(grid.stragglers)
        * len(grid.slowdowns)
        * len(grid.schemes)
    )
    return _grid_command(
        args,
        "saatp",
        grid,
        steps,
        run_grid,
        compare,
        [
            (
                "cmp",
                "SA-ATP vs ATP",
                [
                    "model",
                    "workers",
                    "stragglers",
                    "slowdown",
                    "atp_ms",
                    "saatp_ms",
                    "reduction",
                    "speedup",
                ],
            )
        ],
    )


def cmd_experiment_esa(args: argparse.Namespace) -> int:
    from gradfabric.experiments.esa import EsaGrid, compare, run_grid, train_error

    grid = EsaGrid.quick() if args.quick else EsaGrid()
    given = {
        "pool_slots": _csv(args.pools, int),
        "loads": _csv(args.loads, float),
        "jitters_us": _csv(args.jitters_us, float),
        "schemes": _csv(args.schemes, str),
        "jobs": args.jobs,
        "train": args.train_packets,
        "seeds": tuple(range(args.seeds)) if args.seeds else None,
        "error_trains": _csv(args.train_error, int),
    }
    grid = replace(grid, **{k: v for k, v in given.items() if v})
    cells = len(grid.pool_slots) * len(grid.loads) * len(grid.jitters_us) * len(grid.seeds)
    studies: dict[str, Callable[[Any, Callable[[str], None]], list[dict[str, Any]]]] = (
        {"train_error": lambda g, tick: train_error(g, tick, args.processes or default_processes())}
        if args.train_error
        else {}
    )
    steps = cells * len(grid.schemes) + (2 * len(grid.error_trains) if studies else 0)
    return _grid_command(
        args,
        "esa",
        grid,
        steps,
        lambda g, tick: run_grid(g, tick, args.processes or default_processes()),
        compare,
        [
            ("rows", "ESA vs ATP vs SwitchML",
             ["scheme", "pool_slots", "load", "jitter_us", "seed", "jobs", "avg_jct_s",
              "p99_jct_s", "mem_util", "mem_held"]),
            ("cmp", "ESA vs ATP (gain: ATP's average JCT over ESA's, paired by seed, "
             "mean ± 95% interval)",
             ["pool_slots", "load", "jitter_us", "seeds", "atp_avg_jct_s", "esa_avg_jct_s",
              "improvement", "improvement_ci"]),
            ("train_error", "Train-size error: average JCT against the finest train",
             ["error_scheme", "train", "jitter_us", "error_avg_jct_s", "train_error"]),
        ],
        studies,
    )  # fmt: skip


def cmd_models(args: argparse.Namespace) -> int:
    from gradfabric.workloads.catalog import MODEL_NAMES, model_spec

    rows = [
        {
            "model": m,
            "params": model_spec(m).params,
            "layers": len(model_spec(m).layers),
            "fwd_gflops_per_sample": model_spec(m).fwd_flops / 1e9,
        }
        for m in MODEL_NAMES
    ]
    if args.json:
        print(json.dumps(rows))
    else:
        out.print(
            _table(rows, "model catalog", ["model", "params", "layers", "fwd_gflops_per_sample"])
        )
    return 0


def cmd_switch_serve(args: argparse.Namespace) -> int:
    import asyncio

    from gradfabric.emu.impair import Impairment
    from gradfabric.emu.switchd import SwitchConfig, SwitchDaemon

    cfg = SwitchConfig(
        policy=args.policy, slots=args.slots, job_slots=args.job_slots,
        values_per_packet=args.values_per_packet, rto_ns=int(args.rto_ms * 1e6), host=args.host,
        port=args.port, control_port=args.control_port, metrics_port=args.metrics_port,
        impair=Impairment(args.loss, args.dup, args.delay_us, args.jitter_us, args.seed),
        port_mbps=args.port_mbps, port_buffer_kb=args.port_buffer_kb,
        push_bound=args.push_bound, pull_bound=args.pull_bound,
    )  # fmt: skip
    daemon = SwitchDaemon(cfg)

    def ready(addrs: dict[str, tuple[str, int]]) -> None:
        where = {k: f"{h}:{p}" for k, (h, p) in addrs.items()}
        if args.json:
            print(json.dumps(where), flush=True)
        else:
            err.print(
                f"switch ({cfg.policy}) serving: " + ", ".join(f"{k} {v}" for k, v in where.items())
            )

    asyncio.run(daemon.serve(ready))
    final = daemon.stats()
    if args.json:
        print(json.dumps(final), flush=True)
    else:
        err.print(f"stopped; counters: {final['counters']}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    import asyncio

    from gradfabric.emu.client import parse_address
    from gradfabric.emu.switchd import control_call

    try:
        st = asyncio.run(control_call(parse_address(args.switch), {"op": "stats"}))
    except (OSError, TimeoutError) as e:
        err.print(f"[red]no switch at {args.switch}:[/red] {e}")
        return 1
    if args.json:
        print(json.dumps(st))
        return 0
    out.print(
        f"policy {st['policy']}, up {st['uptime_s']:.0f} s, {len(st['jobs'])} jobs, "
        f"{st['occupied']}/{st['slots']} aggregators held"
    )
    rows = [{"counter": k, "value": v} for k, v in st["counters"].items()]
    out.print(_table(rows, "switch counters", ["counter", "value"]))
    return 0


def _daemon_options(p: argparse.ArgumentParser) -> None:
    """The options every daemon role shares (``switch``, ``ps`` and ``omni serve``)."""
    p.add_argument("--slots", type=int, default=4096, help="aggregators in the pool")
    p.add_argument(
        "--job-slots", type=int, default=32, help="SwitchML: slots per job; ATP/ESA: the window"
    )
    p.add_argument("--values-per-packet", type=int, default=1024)
    p.add_argument("--rto-ms", type=float, default=20.0, help="workers' retransmission timeout")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="data (UDP) port; 0 picks one")
    p.add_argument("--control-port", type=int, default=0, help="control (TCP) port")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus text here")
    p.add_argument("--loss", type=float, default=0.0, help="drop probability per datagram")
    p.add_argument("--dup", type=float, default=0.0, help="duplication probability")
    p.add_argument("--delay-us", type=float, default=0.0)
    p.add_argument("--jitter-us", type=float, default=0.0, help="uniform extra delay (reorders)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--port-mbps", type=float, default=0.0,
        help="dlcp: the rate of the port into the job servers (0: unshaped)",
    )  # fmt: skip
    p.add_argument("--port-buffer-kb", type=int, default=256, help="dlcp: that port's buffer")
    p.add_argument("--push-bound", type=float, default=0.1, help="dlcp: loss bound, push")
    p.add_argument("--pull-bound", type=float, default=0.02, help="dlcp: loss bound, pull")
    p.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradfabric", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--version", action="version", version="gradfabric 0.1.0")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="simulate baselines on real models (built-in default)")
    s.add_argument("config", nargs="?", help="YAML config (default: the built-in baselines)")
    s.add_argument("--train-packets", type=int, help="override ina.train_packets (1 = packets)")
    s.add_argument("--out", help="results directory (default: results/simulate-<time>)")
    s.add_argument("--json", action="store_true", help="print results as JSON")
    s.set_defaults(fn=cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser("sim", help="simulator speed: packet events per wall second")
    bs.add_argument("--scheme", default="atp")
    bs.add_argument("--model", default="resnet50")
    bs.add_argument("--workers", type=int, default=8)
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(fn=cmd_bench_sim)

    bo = bsub.add_parser(
        "omnireduce",
        help="sparse vs dense all-reduce on gloo (loopback or shaped links)",
        description="Sparse (OmniReduce-style) vs torch.distributed.all_reduce "
        "on gloo ranks, medians of --iters timed calls after a warm-up, side by "
        "side in one run. On loopback, or with --link-gbps each rank in a network "
        "namespace behind a tbf-shaped link (root). bytes_ratio: bytes the busiest "
        "rank sends on the sparse path over a dense ring's 2(n-1)/n*N*4. "
        "floor_ratio (shaped links only): measured time over the data-volume "
        f"floor; {OMNI_FLOOR}.",
    )
    bo.add_argument("--ranks", type=int, default=2)
    bo.add_argument("--size-mb", type=float, default=100.0)
    bo.add_argument("--densities", help="comma-separated, default 1,.8,.4,.2,.1,.08,.04,.02,.01")
    bo.add_argument("--iters", type=int, default=10)
    bo.add_argument("--link-gbps", type=float, help="shape links in network namespaces (root)")
    bo.add_argument("--json", action="store_true", help="one JSON object per row")
    bo.set_defaults(fn=cmd_bench_omnireduce)

    r = sub.add_parser("reproduce", help="run the reproduction suite and write its report")
    r.add_argument("--quick", action="store_true", help="minutes, not hours")
    r.add_argument("--only", help="comma-separated experiment names")
    r.add_argument("--out", help="results directory (default: results/reproduce-<time>)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_reproduce)

    e = sub.add_parser("experiment", help="run one experiment's grid and print its rows")
    esub = e.add_subparsers(dest="experiment", required=True)
    es = esub.add_parser("saatp", help="SA-ATP vs ATP, SwitchML and ring under stragglers")
    es.add_argument("--quick", action="store_true", help="ResNet-50, 8 workers, one straggler")
    es.add_argument("--models", help="comma-separated, e.g. resnet50,vgg16,bert-base")
    es.add_argument("--workers", help="comma-separated worker counts, e.g. 8,32")
    es.add_argument("--stragglers", help="comma-separated straggler counts, e.g. 1,2")
    es.add_argument("--slowdowns", help="comma-separated factors, e.g. 1,1.25,2,4")
    es.add_argument("--iterations", type=int, help="iterations per run (default 3)")
    es.add_argument("--out", help="results directory (default: results/saatp-<time>)")
    es.add_argument("--json", action="store_true", help="one JSON object per row")
    es.set_defaults(fn=cmd_experiment_saatp)

    ee = esub.add_parser("esa", help="ESA vs ATP vs SwitchML: JCT against pool size and load")
    ee.add_argument(
        "--quick", action="store_true", help="one pool size, one load, 200 us jitter, 4 jobs"
    )
    ee.add_argument("--pools", help="comma-separated pool sizes in aggregators, e.g. 512,4096")
    ee.add_argument("--loads", help="comma-separated offered loads, e.g. 0.5,0.9")
    ee.add_argument("--jobs", type=int, help="jobs per trace")
    ee.add_argument(
        "--jitters-us",
        help="comma-separated per-iteration start jitter of workers in us (0: lockstep), "
        "e.g. 0,200; with any, packets also get 2 us of jitter per link",
    )
    ee.add_argument("--train-packets", type=int, help="real packets per simulated one (4)")
    ee.add_argument("--schemes", help="comma-separated: switchml,atp,esa")
    ee.add_argument("--seeds", type=int, help="traces per cell (seeds 0..N-1; default 1)")
    ee.add_argument(
        "--train-error",
        help="also the train-size error study at these trains, finest last, e.g. 16,4,1",
    )
    ee.add_argument("-p", "--processes", type=int, help="cells run at once (default: one per core)")
    ee.add_argument("--out", help="results directory (default: results/esa-<time>)")
    ee.add_argument("--json", action="store_true", help="one JSON object per row")
    ee.set_defaults(fn=cmd_experiment_esa)

    bw = bsub.add_parser(
        "switch",
        help="the software switch vs gloo all-reduce on loopback",
        description="For each worker count: a switch daemon and that many gloo ranks "
        "(torchrun) sum the same float32 tensor through the switch (what ina_hook does: "
        "block-exponent round, quantisation, packets, decoding) and with "
        "torch.distributed.all_reduce, alternating, medians of --iters after a warm-up. "
        "goodput_gbps: tensor bits per second of switch time; switch_cpu_gbps: the same "
        "per second of the switch process's CPU time (what one switch core sustains).",
    )
    bw.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    bw.add_argument("--tensor-mb", type=float, default=4.0)
    bw.add_argument("--iters", type=int, default=5)
    bw.add_argument("--policy", default="switchml", choices=["switchml", "atp", "esa"])
    bw.add_argument("--job-slots", type=int, default=8, help="the workers' window")
    bw.add_argument(
        "--values-per-packet", type=int, default=16_000,
        help="values per datagram (16000: 64 KB, whole on loopback)",
    )  # fmt: skip
    bw.add_argument("--json", action="store_true", help="one JSON object per row")
    bw.set_defaults(fn=cmd_bench_switch)

    pl = sub.add_parser(
        "plan",
        help="plan joint data/model parallelism on a heterogeneous cluster",
        description="Choose device groups, pipeline cut points and batch shares for a model "
        "on a cluster (YAML; default: 16 devices of three GPU generations), next to the "
        "baselines under the same cost model. With --trace or --slots, re-plan each slot "
        "under changing device speeds with a Lyapunov controller that keeps the average "
        "price under --budget.",
    )
    pl.add_argument("cluster", nargs="?", help="cluster YAML (device_types, devices)")
    pl.add_argument("--model", default="resnet50")
    pl.add_argument("--batch", type=int, default=512)
    pl.add_argument("--trace", help="CSV with slot,device,speed rows")
    pl.add_argument("--slots", type=int, help="a random trace of this many slots")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--budget", type=float, help="$ per hour (default: the static plan's price)")
    pl.add_argument("--v", type=float, default=1000.0, help="time-vs-cost trade-off V")
    pl.add_argument("--out", help="results directory for the plots")
    pl.add_argument("--json", action="store_true", help="one JSON object")
    pl.set_defaults(fn=cmd_plan)

    ed = esub.add_parser(
        "dlcp",
        help="DLCP: transport vs reliable under load, and the convergence study",
        description="Transport rows (scheme, baseline, load, iter_time_ms, p99_comm_ms): "
        "8 workers on a simulated leaf-spine with background traffic, either pushing to and "
        "pulling from a PS (baseline ps) or in a ring all-reduce (baseline allreduce); DLCP "
        "(bounded loss, strict-priority queues with WRED, spraying) and its ablations "
        "against reliable transport; lost is the share of gradient values that never "
        "reached the sum. The reliable transports: open-loop paced with receiver NACKs "
        "(reliable) and windowed, ECN-reactive with fast retransmit (dctcp), each with ECMP "
        "or spraying; DLCP's gain is stated against the best of them under the same routing. "
        "Convergence rows: a student MLP on a seeded teacher task (20,000 test examples) "
        "with 4 data-parallel workers whose gradient packets are lost up to a bound under a "
        "drop policy (magnitude: DLCP's priorities; random; largest), against lossless "
        "training on the same seeds: accuracy and its paired difference with 95% intervals, "
        "and steps to a target accuracy.",
    )
    ed.add_argument("--quick", action="store_true", help="smaller tensors, fewer bounds/seeds")
    ed.add_argument("--loads", help="comma-separated background loads, e.g. 0,0.5,0.8")
    ed.add_argument(
        "--collectives",
        default="ps,allreduce",
        help="comma-separated: ps,allreduce (empty: no transport grid)",
    )
    ed.add_argument("--seeds", type=int, help="seeds per cell (default 5, quick 3; convergence 10)")
    ed.add_argument("--no-convergence", action="store_true", help="the transport grid only")
    ed.add_argument("--out", help="results directory (default: results/dlcp-<time>)")
    ed.add_argument(
        "-p", "--processes", type=int, help="grid cells run at once (default: one per core)"
    )
    ed.add_argument("--policies", help="comma-separated: magnitude,random,largest")
    ed.add_argument("--bounds", help="comma-separated loss bounds, e.g. 0.05,0.1,0.3")
    ed.add_argument("--json", action="store_true", help="one JSON object per row")
    ed.set_defaults(fn=cmd_experiment_dlcp)

    sw = sub.add_parser("switch", help="the software switch daemon")
    swsub = sw.add_subparsers(dest="switch", required=True)
    ss = swsub.add_parser(
        "serve",
        help="run the switch (SwitchML, ATP, ESA or DLCP) on UDP until SIGTERM",
        description="Serve in-network aggregation on a UDP port for any number of jobs. "
        "Jobs register on the control port (TCP, JSON lines) and get an id and a secret "
        "token; datagrams with a wrong token, an unknown job or a malformed packet are "
        "counted drops. --loss/--dup/--delay-us/--jitter-us impair every datagram in "
        "and out (user space: this kernel has no netem). Prints its addresses once ready "
        "(one JSON object with --json) and its final counters on SIGTERM or SIGINT.",
    )
    ss.add_argument(
        "--policy", default="atp", choices=["switchml", "atp", "esa", "dlcp", "ps", "omni"],
        help="the switch's aggregation (switchml, atp, esa), a DLCP server behind a "
        "priority port (dlcp), a parameter server (ps) or an OmniReduce aggregator (omni)",
    )  # fmt: skip
    _daemon_options(ss)
    ss.set_defaults(fn=cmd_switch_serve)

    ps = sub.add_parser("ps", help="the parameter server daemon")
    pss = ps.add_subparsers(dest="ps", required=True)
    pserve = pss.add_parser(
        "serve", help="run a parameter server on UDP until SIGTERM (switch serve --policy ps)"
    )
    _daemon_options(pserve)
    pserve.set_defaults(fn=cmd_switch_serve, policy="ps")
    om = sub.add_parser("omni", help="the OmniReduce aggregator daemon")
    oms = om.add_subparsers(dest="omni", required=True)
    oserve = oms.add_parser(
        "serve", help="run an OmniReduce aggregator on UDP (switch serve --policy omni)"
    )
    _daemon_options(oserve)
    oserve.set_defaults(fn=cmd_switch_serve, policy="omni")

    st = sub.add_parser("stats", help="a running switch's counters")
    st.add_argument("--switch", required=True, help="HOST:CONTROL_PORT")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_stats)

    eu = esub.add_parser(
        "saatp-udp",
        help="ATP vs SA-ATP through the switch daemon on UDP, one worker slowed",
        description="A switch daemon (atp) and worker processes on loopback UDP; each "
        "iteration a worker sleeps compute-ms (worker 1: times --slowdown), then pushes "
        "its gradient (seeded ints: exact references). With SA-ATP the switch asks a "
        "replica holder to compute and send the straggler's share. Side by side: the "
        "median iteration time of each; every aggregate checked (exit 1 if one is wrong).",
    )
    eu.add_argument("--workers", type=int, default=4)
    eu.add_argument("--iterations", type=int, default=8)
    eu.add_argument("--compute-ms", type=float, default=100.0)
    eu.add_argument("--slowdown", type=float, default=4.0)
    eu.add_argument("--json", action="store_true", help="one JSON object per row")
    eu.set_defaults(fn=cmd_experiment_saatp_udp)

    eq = esub.add_parser(
        "dlcp-udp",
        help="DLCP vs reliable over UDP through the switch's congested priority port",
        description="A switch daemon (policy dlcp) hosts a DLCP server behind one port "
        "served at --port-mbps with strict-priority queues and WRED by drop precedence; "
        "workers push float32 tensors and pull the sums while a background job loads the "
        "port. Rows: reliable (bounds 0) and DLCP (push 0.1, pull 0.02): round time, "
        "shares of values lost (zero-filled), drop rate per precedence at the port "
        "(0: the largest gradients). Exit 1 if reliable is inexact or a bound is broken.",
    )
    eq.add_argument("--workers", type=int, default=3)
    eq.add_argument("--rounds", type=int, default=3)
    eq.add_argument("--port-mbps", type=float, default=200.0)
    eq.add_argument("--background-mbps", type=float, default=50.0)
    eq.add_argument("--json", action="store_true", help="one JSON object per row")
    eq.set_defaults(fn=cmd_experiment_dlcp_udp)

    m = sub.add_parser("models", help="list the model catalog")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_models)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        err.print(f"[red]config error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
