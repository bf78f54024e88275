"""``gradfabric simulate``: the baselines on real models, simulated."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from gradfabric.cli.common import Sub, add_output, progress, report


def add(sub: Sub) -> None:
    s = sub.add_parser("simulate", help="simulate baselines on real models (built-in default)")
    s.add_argument("config", nargs="?", help="YAML config (default: the built-in baselines)")
    s.add_argument("--train-packets", type=int, help="override ina.train_packets (1 = packets)")
    own = s.add_mutually_exclusive_group()
    own.add_argument("--module", metavar="PKG.MOD:FN",
                     help="your own model instead of the config's: FN() returns (nn.Module, "
                          "example inputs for one sample); profiled on the meta device")
    own.add_argument("--trace", metavar="STEP.json",
                     help="a step recorded by torch.profiler.ExecutionTraceObserver instead "
                          "of the config's models")
    s.add_argument("--workers", type=int, help="override workers")
    s.add_argument("--schemes", help="override schemes (comma-separated)")
    s.add_argument("--mode", choices=("packet", "flow"),
                   help="override mode (without a config, --module, --trace or --workers "
                        "past 64 run at flow level)")
    add_output(s, "simulate", "print the results as one JSON object")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from gradfabric.core.config import load_yaml
    from gradfabric.experiments.baselines import builtin_config
    from gradfabric.experiments.simulate import SimulateConfig, flow_fabric, run_simulate

    cfg = load_yaml(SimulateConfig, Path(args.config)) if args.config else builtin_config()
    if args.train_packets:
        cfg = replace(cfg, ina=replace(cfg.ina, train_packets=args.train_packets))
    own = tuple(m for m in (args.module, args.trace) if m)
    # the built-in config is packet level's 8 workers: a model of one's own or
    # more workers than a star's 64 ports take it to flow level; a config says its own
    scale = not args.config and (own or (args.workers or 0) > 64)
    mode = args.mode or ("flow" if scale else cfg.mode)
    cfg = replace(
        cfg, mode=mode, workers=args.workers or cfg.workers, models=own or cfg.models,
        schemes=tuple(args.schemes.split(",")) if args.schemes else cfg.schemes,
        check_bounds=cfg.check_bounds and mode == "packet",
    )  # fmt: skip
    steps = len(cfg.models) * len(cfg.schemes) + 1
    with progress(steps, args.json) as tick:
        res = run_simulate(cfg, tick)
    if cfg.mode == "flow":
        clos = flow_fabric(cfg)
        shape = (
            f"{clos.pods} pods x {clos.racks_per_pod} racks x {clos.hosts_per_rack} hosts, "
            f"{clos.link.link_gbps:g} Gbit/s"
        )
        report(
            args, "simulate", cfg, res, json_keys=None,
            tables=[("rows", f"{cfg.name}: {cfg.workers} workers at flow level ({shape})",
                     ["model", "scheme", "iteration_ms", "compute_ms", "comm_only_ms",
                      "goodput_gbps", "stragglers", "wall_s"])],
        )  # fmt: skip
        return 0
    title = (
        f"{cfg.name}: {cfg.workers} workers, "
        f"{cfg.fabric.link.link_gbps:g} Gbit/s, train={cfg.ina.train_packets}"
    )
    report(
        args, "simulate", cfg, res, json_keys=None,
        tables=[
            ("rows", title, ["model", "scheme", "iteration_ms", "comm_only_ms", "goodput_gbps",
                             "mem_util", "mem_held", "ps_fallback", "wall_s"]),
            ("checks", "analytic checks",
             ["subject", "check", "measured", "bound", "ratio", "within_5pct"]),
        ],
    )  # fmt: skip
    return 0 if all(c["within_5pct"] for c in res["checks"]) else 1
