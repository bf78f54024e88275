"""``gradfabric plan``: joint data/model parallelism on a heterogeneous
cluster, static and under a Lyapunov online controller."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradfabric.cli.common import Sub, add_output, csv, out, progress, report, results_dir
from gradfabric.core.errors import ConfigError
from gradfabric.planner.spec import REFERENCE_GFLOPS, ClusterSpec


def add(sub: Sub) -> None:
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
    pl.add_argument(
        "--calibrate",
        metavar="OUT.yaml",
        help="first measure this host's emulated cluster (gloo processes at --speeds of a "
        "reference device, as bench plan runs them: three plans and an all-reduce), write "
        "it as a cluster YAML with the measured FLOP/s, link rate and per-hop latency, and "
        "plan on it",
    )
    pl.add_argument("--speeds", default="1,1,0.5,0.25", help="with --calibrate: one per rank")
    add_output(pl, "plan", "print the plan as one JSON object")
    pl.set_defaults(fn=run)

    tp = sub.add_parser(
        "train-plan",
        help="train across the slots of a speed trace, re-planned for real",
        description="One gloo process per emulated device (rank r at --speeds[r] of a "
        "reference device of --device-gflops, times the trace's factor for the slot; 0: "
        "the device is gone) trains an MLP stack. Before each slot the online controller "
        "picks a plan for the devices as they are; every rank re-plans (each layer, with "
        "its optimizer state, sent to each rank that will hold it and does not) and the "
        "slot's steps run under the plan. Rows per slot: the plan, predicted and measured "
        "step time, the controller's migration term beside the measured transfers, bytes "
        "moved, and the loss beside the unsplit model's full-batch loss on the same seeds. "
        "Default trace: all present; device 1 at 30%; device 0 leaves; it returns; all "
        "as at first. With --compare, the controller against fixed rules on the same "
        "trace (default: 24 slots of late joiners, contention and preemptions): the best "
        "static plan in hindsight within the budget, re-planning every slot without the "
        "budget, and speed-proportional DP re-balanced each slot; per schedule the "
        "time-averaged step, price per hour and per batch, and the controller's paired "
        "speed-up over it.",
    )
    tp.add_argument("--speeds", default="1,1,0.5,0.25", help="comma-separated, one per rank")
    tp.add_argument("--trace", help="CSV with slot,device,speed rows (speed: a factor, 0: gone)")
    tp.add_argument("--slots", type=int, help="a random trace of this many slots (seeded)")
    tp.add_argument("--steps-per-slot", type=int, default=6)
    tp.add_argument("--layers", type=int, default=8)
    tp.add_argument("--width", type=int, default=256)
    tp.add_argument("--batch", type=int, default=96)
    tp.add_argument(
        "--device-gflops",
        type=float,
        default=REFERENCE_GFLOPS,
        help="the reference device (speed 1)",
    )
    tp.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument(
        "--no-calibrate",
        action="store_true",
        help="the controller's cost model as is (default: calibrated first)",
    )
    tp.add_argument("--v", type=float, default=1000.0, help="time-vs-cost trade-off V")
    tp.add_argument(
        "--compare", action="store_true", help="run every schedule of the comparison (above)"
    )
    tp.add_argument("--repeats", type=int, default=1, help="runs of each schedule (intervals)")
    tp.add_argument("--prices", help="$/h per device, comma-separated (default: 4 x its speed)")
    tp.add_argument("--budget", type=float, help="$/h (default: 75%% of all the devices' price)")
    add_output(tp, "train-plan")
    tp.set_defaults(fn=train_plan)


def train_plan(args: argparse.Namespace) -> int:
    from gradfabric.lab.plan_bench import ExecConfig
    from gradfabric.lab.train_plan import (
        SCHEDULES,
        TrainPlanConfig,
        changing_trace,
        default_trace,
    )
    from gradfabric.lab.train_plan import train_plan as run_slots
    from gradfabric.planner.online import load_trace, random_trace

    try:
        cluster = ExecConfig(speeds=tuple(csv(args.speeds, float) or ()),
                             layers=args.layers, width=args.width, batch=args.batch,
                             seed=args.seed, device_gflops=args.device_gflops)  # fmt: skip
        cfg = TrainPlanConfig(cluster, steps_per_slot=args.steps_per_slot, dtype=args.dtype,
                              v=args.v, calibrate=not args.no_calibrate,
                              prices=tuple(csv(args.prices, float) or ()), budget=args.budget,
                              schedules=tuple(SCHEDULES) if args.compare else ("controller",),
                              repeats=args.repeats)  # fmt: skip
    except ValueError as e:
        raise ConfigError("train-plan", str(e)) from None
    n = len(cluster.speeds)
    trace = (load_trace(Path(args.trace), n) if args.trace
             else random_trace(n, args.slots, args.seed) if args.slots
             else changing_trace(n) if args.compare
             else default_trace(n))  # fmt: skip
    with progress(1, args.json) as tick:
        tick(f"{len(trace)} slots of {cfg.steps_per_slot} steps on {n} processes, "
             f"{len(cfg.schedules)} schedules x {cfg.repeats}")  # fmt: skip
        res = run_slots(cfg, trace)
    sm = res["summary"]
    slots = ("rows", "slots of the trace, each under the controller's plan",
             ["slot", "factors", "plan", "predicted_step_ms", "measured_step_ms",
              "predicted_migration_ms", "measured_migration_ms", "replan_ms",
              "predicted_param_mb", "moved_mb", "loss", "reference_loss"])  # fmt: skip
    schedules = ("schedules", f"the schedules over {sm['slots']} slots (budget "
                 f"{sm['budget_per_hour']:.2f} $/h), means of {cfg.repeats} runs",
                 ["schedule", "step_ms", "step_ms_half", "predicted_step_ms", "price_per_hour",
                  "over_budget", "dollars_per_1k_batches", "replans", "moved_mb",
                  "controller_speedup", "controller_speedup_half", "loss_rel_diff"])  # fmt: skip
    report(
        args, "train-plan", {**asdict(cfg), "trace": trace}, res,
        tables=[schedules] if args.compare else [slots],
        json_keys=("schedules",) if args.compare else ("rows",),
        footer=f"{sm['steps']} steps a run, {sm['migrations']} migrations; loss "
        f"{sm['first_loss']:.4g} -> {sm['last_loss']:.4g}, largest relative difference "
        f"from the unsplit full-batch run {sm['max_loss_rel_diff']:.1e} ({cfg.dtype})",
    )  # fmt: skip
    return 0


def calibrate_here(args: argparse.Namespace) -> ClusterSpec:
    """``--calibrate``: measure the local emulated cluster, write it, return it."""
    import yaml

    from gradfabric.core.config import dump
    from gradfabric.lab.plan_bench import ExecConfig, calibrate, calibrated_cluster

    try:
        cfg = ExecConfig(speeds=tuple(csv(args.speeds, float) or ()))
    except ValueError as e:
        raise ConfigError("speeds", str(e)) from None
    with progress(1, args.json) as tick:
        tick(f"calibrating {len(cfg.speeds)} emulated devices")
        cal, _ = calibrate(cfg)
    spec = calibrated_cluster(cfg, cal)
    Path(args.calibrate).write_text(yaml.safe_dump(dump(spec), sort_keys=False))
    if not args.json:
        out.print(f"calibrated: {cal.flops / 1e9:.2f} GFLOP/s at speed 1, "
                  f"{cal.link_gbps:.2f} Gbit/s, {cal.latency_s * 1e6:.0f} us per hop; "
                  f"written to {args.calibrate}")  # fmt: skip
    return spec


def run(args: argparse.Namespace) -> int:
    from gradfabric.experiments import plots
    from gradfabric.planner.baselines import BASELINES, best_subset
    from gradfabric.planner.cost import BYTES_PER_PARAM_STATE, Device, Workload
    from gradfabric.planner.online import load_trace, random_trace, run_online
    from gradfabric.planner.search import plan
    from gradfabric.planner.spec import example_cluster, load_cluster
    from gradfabric.workloads.catalog import model_spec

    if args.batch < 1:
        raise ConfigError("batch", "must be >= 1")
    if args.calibrate and args.cluster:
        raise ConfigError("plan", "--calibrate measures the cluster: give no cluster YAML")
    cluster = (calibrate_here(args) if args.calibrate
               else load_cluster(Path(args.cluster)) if args.cluster
               else example_cluster())  # fmt: skip
    w = Workload.of(model_spec(args.model), args.batch)
    types = cluster.expand()
    devs = [Device(i, t) for i, t in enumerate(types)]
    lat = cluster.link_latency_us * 1e-6
    try:
        res = plan(w, devs, lat)
    except ValueError:  # no plan fits the devices' memory
        need = BYTES_PER_PARAM_STATE * sum(w.params) / 2**30
        have = sum(t.mem_gb for t in types)
        raise ConfigError("device_types.mem_gb", f"no plan of {args.model} fits these devices: "
                          f"its weights, gradients and optimizer state alone take {need:.2f} "
                          f"GiB, the devices hold {have:.2f} GiB in all, before "
                          "activations") from None  # fmt: skip
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
        with progress(len(trace), args.json) as tick:
            on = run_online(w, types, trace, budget, args.v, tick=tick)
        dest = results_dir(args.out, "plan")  # the plots go next to the results
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
    if not args.json:
        out.print(res.explain(devs, w), markup=False)
    footer = ""
    if "online" in out_obj:
        on_obj = out_obj["online"]
        footer = (
            f"online over {on_obj['slots']} slots: mean batch time "
            f"{on_obj['mean_batch_time_s'] * 1e3:.1f} ms at ${on_obj['mean_cost_per_hour']:.2f}/h "
            f"(budget ${on_obj['budget_per_hour']:.2f}/h); plots in {on_obj['plots']}"
        )
        out_obj["online_baselines"] = on_obj["baselines"]
    config = {"cluster": asdict(cluster), "model": args.model, "batch": args.batch,
              "trace": args.trace, "slots": args.slots, "seed": args.seed,
              "budget": args.budget, "v": args.v}  # fmt: skip
    report(
        args, "plan", config, out_obj, json_keys=None, footer=footer,
        tables=[
            ("baselines", "baselines (same cost model, each on its best device subset)",
             ["name", "batch_time_s", "cost_per_hour", "devices_used"]),
            ("online_baselines", "baselines under the same trace",
             ["name", "mean_batch_time_s"]),
        ],
    )  # fmt: skip
    return 0
