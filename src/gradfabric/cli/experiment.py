"""``gradfabric experiment``: one experiment's grid, rows and comparisons."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from gradfabric.cli import udp
from gradfabric.cli.common import (
    Rows,
    Sub,
    TableSpec,
    Tick,
    add_executor,
    add_output,
    csv,
    executor,
    progress,
    report,
)  # fmt: skip
from gradfabric.core.errors import ConfigError
from gradfabric.experiments.registry import Claim

Study = Callable[[Any, Tick], Rows]


_JSON_GRID = "one JSON object per line: each run, then each comparison row (the gains)"


def add(sub: Sub) -> None:
    e = sub.add_parser("experiment", help="run one experiment's grid and print its rows")
    esub = e.add_subparsers(dest="experiment", required=True)

    es = esub.add_parser("saatp", help="SA-ATP vs ATP, SwitchML and ring under stragglers")
    _sizes(es, "ResNet-50, 8 workers, one straggler",
           "every model and slowdown (288 cells; default: ResNet-50 and BERT-base, "
           "slowdowns 1,1.5,2,4, 128 cells)")  # fmt: skip
    es.add_argument("--models", help="comma-separated, e.g. resnet50,vgg16,bert-base")
    es.add_argument("--workers", help="comma-separated worker counts, e.g. 8,32")
    es.add_argument("--stragglers", help="comma-separated straggler counts, e.g. 1,2")
    es.add_argument("--slowdowns", help="comma-separated factors, e.g. 1,1.25,2,4")
    es.add_argument("--iterations", type=int, help="iterations per run (default 3)")
    add_executor(es)
    add_output(es, "saatp", _JSON_GRID)
    es.set_defaults(fn=saatp)

    ee = esub.add_parser("esa", help="ESA vs ATP vs SwitchML: JCT against pool size and load")
    _sizes(
        ee,
        "pool 512, load 0.7, 200 us jitter, 3 jobs, ESA and ATP",
        "pools 256,1024,4096, loads 0.5,0.9, jitter 0 and 200 us, 4 jobs, 3 seeds, every "
        "scheme, and the train-error study: hours on 2 cores (default: pools 256,4096, "
        "load 0.9, 200 us, 3 jobs, ESA and ATP); every grid at packet level",
    )
    ee.add_argument("--pools", help="comma-separated pool sizes in aggregators, e.g. 512,4096")
    ee.add_argument("--loads", help="comma-separated offered loads, e.g. 0.5,0.9")
    ee.add_argument("--jobs", type=int, help="jobs per trace")
    ee.add_argument(
        "--jitters-us",
        help="comma-separated per-iteration start jitter of workers in us (0: lockstep), "
        "e.g. 0,200; with any, packets also get 2 us of jitter per link",
    )
    ee.add_argument("--train-packets", type=int, help="real packets per simulated one (1)")
    ee.add_argument("--schemes", help="comma-separated: switchml,atp,esa")
    ee.add_argument("--seeds", type=int, help="traces per cell (seeds 0..N-1)")
    ee.add_argument(
        "--train-error",
        help="also the train-size error study at these trains, finest last, e.g. 16,4,1",
    )
    add_executor(ee)
    add_output(ee, "esa", _JSON_GRID + "; then the train-error rows")
    ee.set_defaults(fn=esa)

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
    _sizes(
        ed,
        "smaller tensors, fewer bounds and seeds",
        "the convergence study at loss bounds 0.05,0.1,0.2,0.3,0.5 (default: 0.1,0.3,0.5)",
    )
    ed.add_argument("--loads", help="comma-separated background loads, e.g. 0,0.5,0.8")
    ed.add_argument(
        "--collectives",
        default="ps,allreduce",
        help="comma-separated: ps,allreduce (empty: no transport grid)",
    )
    ed.add_argument("--seeds", type=int, help="seeds per cell (default 5, quick 3; convergence 10)")
    ed.add_argument("--no-convergence", action="store_true", help="the transport grid only")
    add_executor(ed)
    ed.add_argument("--policies", help="comma-separated: magnitude,random,largest")
    ed.add_argument("--bounds", help="comma-separated loss bounds, e.g. 0.05,0.1,0.3")
    add_output(ed, "dlcp")
    ed.set_defaults(fn=dlcp)

    udp.add(esub)

    sp = esub.add_parser(
        "sparse-train",
        help="embedding tables: auto_hook's row exchange vs every stock option",
        description="Per model, optimizer and rank count, one bench ddp run with the stock "
        "options (DDP's default hook; sparse=True tables under plain DDP, with Adam the "
        "SparseAdam hybrid; TorchRec's DistributedModelParallel with SGD where it "
        "is installed, with its planner's sharding and column-wise, the faster its row) and "
        "auto_hook on the sparse=True tables (sparse+auto; with Adam also "
        "auto_hook on dense gradients; local, the sparse=True replica exchanging nothing: the "
        "compute floor), each rank behind a 1 Gbit/s link (root, network "
        "namespaces). Rows: each option's median step, ours against the best stock option "
        "(the ratio of mean step times, its 95% interval paired per step), the bytes per "
        "step on the busiest link of the all-gather and of ours. Exit 1 if a replica's "
        "weights end further than 1e-4 from the default hook's where the arithmetic holds "
        "them there (SGD; exact Adam at 2 ranks).",
    )
    sp.add_argument("--models", default="dlrm,neumf", help="comma-separated (default: dlrm,neumf)")
    sp.add_argument("--ranks", default="2,4,8", help="comma-separated (default: 2,4,8)")
    sp.add_argument("--optimizers", default="sgd,adam", help="comma-separated: sgd,adam")
    sp.add_argument("--steps", type=int, default=24)
    sp.add_argument("--warmup", type=int, default=4)
    sp.add_argument("--loopback", action="store_true", help="no shaped links: loopback")
    add_output(sp, "sparse-train")
    sp.set_defaults(fn=sparse_train)


def _sizes(p: argparse.ArgumentParser, quick: str, full: str) -> None:
    """``--quick`` or ``--full``, either: without them the default grid."""
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick)
    size.add_argument("--full", action="store_true", help=full)


def _grid(
    args: argparse.Namespace,
    name: str,
    grid: Any,
    steps: int,
    run: Study,
    compare: Callable[[Rows], Rows],
    tables: list[TableSpec],
    extra: dict[str, Study] | None = None,
    claims: Callable[[dict[str, Any]], list[Claim]] | None = None,
) -> int:
    """Run an experiment grid (and any ``extra`` studies, each a named set of
    rows) and report it: ``rows``, ``cmp`` and each extra's rows (with
    ``--json``, one object per line in that order: the comparison rows carry
    the headline gains, so a script need not recompute them)."""
    with progress(steps, args.json) as tick:
        rows = run(grid, tick)
        data = {"rows": rows, "cmp": compare(rows)}
        for key, study in (extra or {}).items():
            data[key] = study(grid, tick)
    if claims:  # the experiment's claims, as reproduce states them, for scripts/figures.py
        data["claims"] = [asdict(c) for c in claims(data)]
    report(args, name, grid, data, tables, json_keys=["rows", "cmp", *(extra or {})])
    return 0


def saatp(args: argparse.Namespace) -> int:
    from gradfabric.experiments.saatp import SaatpGrid, claims, compare, run_grid

    grid = SaatpGrid.quick() if args.quick else SaatpGrid() if args.full else SaatpGrid.default()
    given = {
        "models": csv(args.models, str),
        "workers": csv(args.workers, int),
        "slowdowns": csv(args.slowdowns, float),
        "stragglers": csv(args.stragglers, int),
        "iterations": args.iterations,
    }
    grid = replace(grid, **{k: v for k, v in given.items() if v})
    steps = len(grid.models) * len(grid.workers) * len(grid.stragglers) * len(grid.slowdowns)
    where = executor(args)
    return _grid(
        args, "saatp", grid, steps * len(grid.schemes),
        lambda g, tick: run_grid(g, tick, where), compare,
        [("cmp", "SA-ATP vs ATP", ["model", "workers", "stragglers", "slowdown", "atp_ms",
                                   "saatp_ms", "reduction", "speedup"])],
        claims=claims,
    )  # fmt: skip


def esa(args: argparse.Namespace) -> int:
    from gradfabric.experiments.esa import EsaGrid, claims, compare, run_grid, train_error

    grid = EsaGrid.quick() if args.quick else EsaGrid() if args.full else EsaGrid.default()
    given = {
        "pool_slots": csv(args.pools, int),
        "loads": csv(args.loads, float),
        "jitters_us": csv(args.jitters_us, float),
        "schemes": csv(args.schemes, str),
        "jobs": args.jobs,
        "train": args.train_packets,
        "seeds": tuple(range(args.seeds)) if args.seeds else None,
        "error_trains": csv(args.train_error, int),
    }
    grid = replace(grid, **{k: v for k, v in given.items() if v})
    where = executor(args)
    cells = len(grid.pool_slots) * len(grid.loads) * len(grid.jitters_us) * len(grid.seeds)
    studies: dict[str, Study] = (
        {"train_error": lambda g, tick: train_error(g, tick, where)} if args.train_error else {}
    )
    steps = cells * len(grid.schemes) + (2 * len(grid.error_trains) if studies else 0)
    return _grid(
        args, "esa", grid, steps, lambda g, tick: run_grid(g, tick, where), compare,
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
        claims=lambda data: claims(data | {"train": grid.train}),
    )  # fmt: skip


def dlcp(args: argparse.Namespace) -> int:
    from gradfabric.experiments.dlcp import LOADS, QUICK_SEEDS, SEEDS, claims, gains, summarise
    from gradfabric.experiments.dlcp_convergence import ConvergenceConfig, cells, run_convergence
    from gradfabric.sim.dlcp import VARIANTS, experiment_configs, run_grid

    cfg = (ConvergenceConfig.quick() if args.quick else ConvergenceConfig() if args.full
           else ConvergenceConfig.default())  # fmt: skip
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
    steps = len(nets) * len(loads) * len(seeds) * len(VARIANTS)
    steps += len(cells(cfg)) if convergence else 0
    with progress(steps, args.json) as tick:
        where = executor(args)
        transport = run_grid(nets, loads, seeds, tick, where)
        rows = run_convergence(cfg, tick, where) if convergence else []
    headline = [g for n in nets for ld in loads for g in gains(transport, n.collective, ld)]
    resolved = {"transport": [asdict(n) for n in nets], "loads": loads, "seeds": seeds,
                "convergence": asdict(cfg) if convergence else None}  # fmt: skip
    results = {"rows": transport, "summary": summarise(transport), "gains": headline,
               "convergence": rows}  # fmt: skip
    results["claims"] = [asdict(c) for c in claims(results | {"config": resolved})]
    report(
        args, "dlcp", resolved, results, json_keys=["rows", "gains", "convergence"],
        tables=[
            ("summary", f"DLCP vs reliable transports on a leaf-spine (simulated), "
             f"mean ± 95% interval over {len(seeds)} seeds",
             ["scheme", "baseline", "load", "iter_time_ms", "iter_ci_ms", "p99_comm_ms",
              "p99_ci_ms", "lost"]),
            ("gains", "DLCP's gain in iteration time over the best reliable transport "
             "under the same routing (paired by seed)",
             ["baseline", "load", "routing", "dlcp", "best", "gain", "gain_ci"]),
            ("convergence", f"DLCP convergence (teacher task, 4 workers, {len(cfg.seeds)} "
             "seeds; delta paired by seed; steps to the target accuracy)",
             ["policy", "loss_bound", "accuracy", "accuracy_ci", "delta_pp", "delta_ci_pp",
              "steps_to_target", "steps_to_target_ci", "reached"]),
        ],
    )  # fmt: skip
    return 0


def sparse_train(args: argparse.Namespace) -> int:
    from gradfabric.experiments.sparse_train import SparseGrid, claims, draw, points, study
    from gradfabric.lab.ddp_bench import held_to_default

    try:
        grid = SparseGrid(
            models=tuple(csv(args.models, str) or ()), ranks=tuple(csv(args.ranks, int) or ()),
            optimizers=tuple(csv(args.optimizers, str) or ()),
            link_gbps=None if args.loopback else 1.0, steps=args.steps, warmup=args.warmup,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError("experiment sparse-train", str(e)) from None
    n = len(grid.models) * len(grid.ranks) * len(grid.optimizers)
    with progress(n, args.json) as tick:
        rows, notes = study(grid, tick)
    pts = points(rows)
    table = [
        {"model": p["model"], "optimizer": p["optimizer"], "ranks": p["ranks"],
         **{f"{h} ms": f"{t:.0f}" for h, t in p["ms"].items()},
         "ours vs best DDP": f"{p['vs_ddp'][0]:.2f} ± {p['vs_ddp'][1]:.2f} ({p['best_ddp']})",
         "ours vs TorchRec": "-" if not p["vs_torchrec"] else
         f"{p['vs_torchrec'][0]:.2f} ± {p['vs_torchrec'][1]:.2f}",
         "tables' kB/step: all-gather, ours, TorchRec": "-" if not p["stock_bytes"] else
         ", ".join(f"{b / 1e3:.0f}" if b else "-" for b in
                   (p["stock_bytes"], p["ours_bytes"], p["torchrec_bytes"])),
         "bytes floor ms": ", ".join(f"{h} {t:.1f}" for h, t in p["floor_ms"].items()) or "-"}
        for p in pts
    ]  # fmt: skip
    res = {"config": asdict(grid), "rows": rows, "points": pts, "table": table, "notes": notes,
           "claims": [c.__dict__ for c in claims({"rows": rows})]}  # fmt: skip
    cols = list(dict.fromkeys(k for t in table for k in t))  # each option's, as first seen
    title = ("median step per option; ours (auto_hook on sparse=True tables) over the best "
             "stock option, the ratio of mean step times (95%, paired per step)")  # fmt: skip
    dest = report(args, "sparse-train", asdict(grid), res, json_keys=("table",),
                  tables=[("table", title, cols)])  # fmt: skip
    draw(pts, dest)
    ok = [r["max_param_diff_vs_default"] or 0.0 for r in rows
          if held_to_default(r, r["optimizer"])]  # fmt: skip
    return 0 if all(d <= 1e-4 for d in ok) else 1
