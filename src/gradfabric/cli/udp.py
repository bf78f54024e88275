"""``gradfabric experiment saatp-udp``, ``saatp-train``, ``esa-train``,
``dlcp-udp`` and ``dlcp-train``: the systems through the switch daemon on real UDP sockets,
side by side with their baselines."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from gradfabric.cli.common import Sub, add_output, csv, progress, report

if TYPE_CHECKING:
    from gradfabric.lab.esa_train import EsaTrainConfig


def add(esub: Sub) -> None:
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
    add_output(eu, "saatp-udp")
    eu.set_defaults(fn=saatp_udp)

    et = esub.add_parser(
        "saatp-train",
        help="SA-ATP in real training: a slow rank helped through the switch, vs the alternatives",
        description="Four ranks train the digits MLP (real forward and backward, a deadline "
        "throttle: one rank --slowdown times slower, steady and moving every --move-every "
        "steps) for --steps steps on each of --seeds seeds (weights and batches). Modes, "
        "interleaved per seed: ATP and SA-ATP through the switch daemon, gloo's all-reduce "
        "(DDP's default hook), speed-proportional batch shares re-balanced from measured "
        "speeds, and backup workers (a parameter server stepping on the first n-b "
        "gradients, b = 1 and 2, the best marked tuned). Rows: time to --target test "
        "accuracy (mean and 95% interval over the seeds that reached it, how many did) and "
        "SA-ATP's paired speed-up in it (over the seeds where both did), steps to the "
        "target, mean step time, the simulator's step time times the steps. Exit 1 if "
        "ATP or SA-ATP differ from the in-process replay of the same quantised steps in "
        "one bit.",
    )
    et.add_argument("--steps", type=int, default=30)
    et.add_argument("--seeds", type=int, default=5)
    et.add_argument("--target", type=float, default=0.90, help="test accuracy (default 0.90)")
    et.add_argument("--compute-ms", type=float, default=40.0,
                    help="a micro-batch's device time at speed 1 (default: 40)")  # fmt: skip
    et.add_argument("--slowdown", type=float, default=4.0)
    et.add_argument("--move-every", type=int, default=2,
                    help="the moving setting: the slow rank changes every N steps")  # fmt: skip
    et.add_argument("--settings", default="steady,moving",
                    help="comma-separated, of steady and moving (default: both)")  # fmt: skip
    et.add_argument("--shards", default="interleaved",
                    help="how the data is cut among the ranks: interleaved (each shard the "
                    "same mix of classes) or by-label (each a few classes: a dropped rank's "
                    "classes go missing from its step)")  # fmt: skip
    add_output(et, "saatp-train")
    et.set_defaults(fn=saatp_train)

    ee = esub.add_parser(
        "esa-train",
        help="ESA vs ATP with real training jobs sharing one switch daemon",
        description="Seeded traces of jobs (2 or 3 workers, --steps of the digits MLP, "
        "Poisson arrivals --mean-gap-s apart), each launched by torchrun, train through one "
        "switch daemon, every worker behind its own shaped link (--link-gbps; root, network "
        "namespaces), under ATP (its fallback PS "
        "sharded per worker behind links of the same rate) and under ESA (srpt-aging "
        "priorities stamped by the workers). Settings: the pool scarce (--pool-slots, which "
        "two jobs' windows overfill) with workers out of lockstep (each step's device time "
        "longer by up to --jitter-ms), where the simulator predicts ESA a gain, and where ATP "
        "also runs with its workers' fast retransmit off (atp-timeouts, an ablation); the "
        "pool ample; the pool scarce in lockstep. Rows: mean and p99 job completion time, the "
        "simulator's for the same trace, preemptions, PS fallbacks, the CPU of the daemon "
        "and of the workers; ESA's speed-up over each ATP per trace, mean with its 95% "
        "interval. Exit 1 if a job's loss curve or weights differ in one bit from its solo "
        "replay.",
    )
    ee.add_argument("--seeds", type=int, default=6, help="traces per setting")
    ee.add_argument("--jobs", type=int, help="concurrent jobs in a trace (default 5)")
    ee.add_argument("--steps", help="comma-separated: a job's length in steps, drawn per job "
                    "(default 600,1200,2400: jobs of tens of seconds)")  # fmt: skip
    ee.add_argument("--mean-gap-s", type=float, default=None,
                    help="the mean gap between arrivals (default 3)")  # fmt: skip
    ee.add_argument("--settings", help="comma-separated, of scarce-jittered (the simulator "
                    "predicts ESA a gain), ample-jittered, scarce-lockstep (it predicts none); "
                    "default: the first two")  # fmt: skip
    ee.add_argument("--pool-slots", type=int, default=None,
                    help="the scarce settings' pool (default: one window, 32)")  # fmt: skip
    ee.add_argument("--predict", metavar="POOLS", type=pools,
                    help="comma-separated pools: run no job, print the simulator's ESA "
                    "speed-up over ATP on the first --seeds traces at each (--jitter-ms's "
                    "jitter): where the study's scarce pool gains most")  # fmt: skip
    ee.add_argument("--compute-ms", type=float, default=5.0, help="a step's device time")
    ee.add_argument("--jitter-ms", type=float, default=5.0,
                    help="the jittered settings: each step's device time longer by up to this")
    ee.add_argument("--link-gbps", type=float, default=None,
                    help="every worker's link (default 0.25 where namespaces can be made, else "
                    "0: loopback)")  # fmt: skip
    add_output(ee, "esa-train")
    ee.set_defaults(fn=esa_train)

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
    add_output(eq, "dlcp-udp")
    eq.set_defaults(fn=dlcp_udp)

    ed = esub.add_parser(
        "dlcp-train",
        help="DLCP in real DDP training over congested, shaped links, vs gloo and reliable mode",
        description="Four ranks in network namespaces, each behind a --link-mbps link whose "
        "ports serve three strict-priority classes; background UDP at each --loads share of "
        "every link, both ways. The digits MLP trains under DDP with gloo's default hook "
        "(unmarked, and marked into the top class: gloo-prio), dlcp_hook in reliable mode "
        "and dlcp_hook within its loss bounds, the server where the top-of-rack switch sits. "
        "Rows per load and scheme: time to the target test accuracy and final accuracy (95% "
        "intervals over --seeds), step time, values lost, drop rate per class, CPU per step; "
        "DLCP's speed-up over each, paired by seed. Root, namespaces and nftables needed "
        "(exit 2 where missing).",
    )
    ed.add_argument("--seeds", type=int, default=5)
    ed.add_argument("--loads", default="0.8",
                    help="background loads, shares of a link (default 0.8, about 8 minutes on "
                    "2 cores; 0.5,0.8 twice that)")  # fmt: skip
    ed.add_argument("--steps", type=int, default=40)
    ed.add_argument("--link-mbps", type=float, default=50.0)
    ed.add_argument("--push-bound", type=float, default=0.1)
    ed.add_argument("--fabric", default="star",
                    help="star: every rank one link from the server's switch (default); "
                    "leaf-spine: two racks, --spines spines, TCP hashed per flow and DLCP "
                    "sprayed per datagram, bursty on/off background between the racks, the "
                    "simulator's prediction for the same fabric beside")  # fmt: skip
    ed.add_argument("--spines", type=int, default=2)
    ed.add_argument("--values-per-packet", type=int, default=256,
                    help="DLCP's datagrams: 256 values (1 KB), up to 2,048 (8 KB, a jumbo "
                    "frame's; the fabric's MTU is 9,000)")  # fmt: skip
    ed.add_argument("--burst-ms", type=float, default=50.0,
                    help="leaf-spine: the background's mean on period")  # fmt: skip
    ed.add_argument("--pace-kb", type=int, default=64,
                    help="DLCP's send buffers, workers' and server's, in KB (default 64: the "
                    "kernel takes datagrams as the first link drains them; 0: the large "
                    "default, a bucket at once into the ports' queues; a server's full "
                    "buffer drops what it sends)")  # fmt: skip
    add_output(ed, "dlcp-train")
    ed.set_defaults(fn=dlcp_train)


def saatp_udp(args: argparse.Namespace) -> int:
    from gradfabric.lab.saatp_udp import SaatpEmuConfig, run_emu_saatp

    cfg = SaatpEmuConfig(
        workers=args.workers, iterations=args.iterations, compute_ms=args.compute_ms,
        slowdown=args.slowdown,
    )  # fmt: skip
    rows = []
    with progress(2, args.json) as tick:
        for helped in (False, True):
            tick("SA-ATP" if helped else "ATP")
            r = run_emu_saatp(cfg, helped)
            rows.append(
                {"scheme": "saatp" if helped else "atp", "workers": cfg.workers,
                 "slowdown": cfg.slowdown, "iter_time_ms": r["median_iteration_ms"],
                 "helps": r["helps_sent"], "abandoned": r["abandoned"], "exact": r["exact"]}
            )  # fmt: skip
    report(
        args, "saatp-udp", asdict(cfg), {"rows": rows},
        tables=[("rows", f"ATP vs SA-ATP over UDP, worker {cfg.straggler} {cfg.slowdown:g}x "
                 f"slower (median of {cfg.iterations - 1} iterations)",
                 ["scheme", "iter_time_ms", "helps", "abandoned", "exact"])],
    )  # fmt: skip
    return 0 if all(r["exact"] for r in rows) else 1


def saatp_train(args: argparse.Namespace) -> int:
    from gradfabric.experiments import saatp_train as st
    from gradfabric.experiments.registry import chosen
    from gradfabric.lab.saatp_train import SaatpTrainConfig

    cfg = SaatpTrainConfig(steps=args.steps, compute_ms=args.compute_ms, slowdown=args.slowdown,
                           shards=args.shards)  # fmt: skip
    settings = chosen({"steady": 0, "moving": args.move_every}, args.settings)
    with progress(len(settings) * len(st.MODES_TUNED) * args.seeds, args.json) as tick:
        res = st.study(cfg, args.seeds, settings, tick, target=args.target)

    def x(r: dict[str, object], key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.2f} ± {r[key + '_half']:.2f}"

    res["claims"] = [c.__dict__ for c in st.claims(res)]
    top = st.tuned(res["rows"])
    res["table"] = [
        {"setting": r["setting"],
         "mode": r["mode"] + (" (tuned)" if (r["setting"], r["mode"]) in top else ""),
         "TTA s": x(r, "tta_s"), "reached": f"{r['reached']}/{r['runs']}",
         "steps": "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:.1f}",
         "SA-ATP TTA speed-up": x(r, "saatp_tta_speedup"),
         "step ms": x(r, "step_ms"),
         "sim TTA s": "-" if r["simulated_tta_s"] is None else f"{r['simulated_tta_s']:.2f}",
         "exact": r["bitwise_reference"]}
        for r in res["rows"]
    ]  # fmt: skip
    res["table_targets"] = [
        {"setting": r["setting"], "target": f"{r['target']:.0%}", "mode": r["mode"],
         "TTA s": x(r, "tta_s"), "reached": f"{r['reached']}/{r['runs']}",
         "SA-ATP TTA speed-up": x(r, "saatp_tta_speedup"), "paired": r["tta_pairs"],
         "after step 1": x(r, "saatp_tta_speedup_warm"),
         "at least": "-" if r["saatp_tta_speedup_censored"] is None or r["reached"] == r["runs"]
         else f"{r['saatp_tta_speedup_censored']:.2f}"}
        for r in st.by_target(res) if r["mode"] != "saatp"
    ]  # fmt: skip
    dest = report(
        args, "saatp-train", res["config"], res,
        tables=[("table", f"one rank {cfg.slowdown:g}x slower: time to {args.target:.0%} test "
                 f"accuracy over {args.seeds} seeds of {cfg.steps} steps (95% interval); "
                 "SA-ATP's speed-up over each mode paired per seed; sim: the simulator's step "
                 "times the steps taken; exact: equal to the replay bit for bit",
                 ["setting", "mode", "TTA s", "reached", "steps", "SA-ATP TTA speed-up",
                  "step ms", "sim TTA s", "exact"]),
                ("table_targets", "the same runs at every target of the ladder up to "
                 f"{args.target:.0%}: SA-ATP's speed-up paired over the seeds where both "
                 "reached it, the same with the clock started after step 1 (it and its "
                 "one-off costs left out), and where a mode missed some seeds, at least: over "
                 "every seed with its misses counted at its run's end (a lower bound on its time)",
                 ["setting", "target", "mode", "TTA s", "reached", "SA-ATP TTA speed-up",
                  "paired", "after step 1", "at least"])],
    )  # fmt: skip
    st.draw_tta(res, dest)
    st.draw_steps(res, dest)
    st.draw_accuracy(res, dest)
    st.draw_targets(res, dest)
    exact = [r for r in res["rows"] if r["bitwise_reference"] is not None]
    return 0 if all(r["bitwise_reference"] and r["replicas_agree"] for r in exact) else 1


def esa_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from gradfabric.experiments.esa_train import (
        BASELINE,
        LONG_LINK_GBPS,
        SCARCE_POOL,
        chosen,
        claims,
        draw,
        long_config,
        settings,
        study,
        ticks,
    )

    cfg = replace(long_config(), compute_ms=args.compute_ms)
    if args.jobs is not None:
        cfg = replace(cfg, jobs=args.jobs)
    if args.steps:
        cfg = replace(cfg, steps=tuple(int(x) for x in args.steps.split(",")))
    if args.mean_gap_s is not None:
        cfg = replace(cfg, mean_gap_s=args.mean_gap_s)
    if args.link_gbps is not None:
        cfg = replace(cfg, link_gbps=args.link_gbps)
    if args.predict is not None:  # no job runs: the full study's links wherever it would run
        links = LONG_LINK_GBPS if args.link_gbps is None else args.link_gbps
        return esa_predict(args, replace(cfg, jitter_ms=args.jitter_ms, link_gbps=links))
    scarce = SCARCE_POOL if args.pool_slots is None else args.pool_slots
    setting = chosen(settings(scarce, args.jitter_ms), args.settings)
    with progress(ticks(setting, args.seeds), args.json) as tick:
        res = study(cfg, args.seeds, setting, tick)
    res["claims"] = [c.__dict__ for c in claims(res)]
    res["table"] = [
        {"setting": r["setting"], "pool": r["pool_slots"], "policy": r["policy"],
         "mean JCT ms": f"{r['mean_jct_s'] * 1e3:.0f}", "p99 JCT ms": f"{r['p99_jct_s'] * 1e3:.0f}",
         "sim mean ms": f"{r['sim_mean_jct_s'] * 1e3:.0f}, {r['sim_cal_mean_jct_s'] * 1e3:.0f}",
         "hybrid mean ms": f"{r['hybrid_mean_jct_s'] * 1e3:.0f}, "
                           f"{r['hybrid_cal_mean_jct_s'] * 1e3:.0f}",
         "preemptions": r["preemptions"],
         "PS fallbacks": r["ps_fallback"],
         "CPU: daemon, workers": f"{r['daemon_load']:.2f}, {r['workers_load']:.2f}",
         "exact": r["exact"]}
        if not r["policy"].startswith("esa/") else
        {"setting": r["setting"], "pool": r["pool_slots"],
         "policy": f"ESA over {BASELINE[r['policy'].removeprefix('esa/')][0]}",
         "mean JCT ms": f"{r['mean_jct_speedup']:.2f}x ± {r['mean_jct_speedup_half']:.2f}",
         "p99 JCT ms": f"{r['p99_jct_speedup']:.2f}x ± {r['p99_jct_speedup_half']:.2f}",
         "sim mean ms": f"{r['sim_mean_jct_speedup']:.2f}x, "
                        f"{r['sim_cal_mean_jct_speedup']:.2f}x",
         "hybrid mean ms": f"{r['hybrid_mean_jct_speedup']:.2f}x, "
                           f"{r['hybrid_cal_mean_jct_speedup']:.2f}x",
         "preemptions": "",
         "PS fallbacks": "", "CPU: daemon, workers": "", "exact": ""}
        for r in res["rows"]
    ]  # fmt: skip
    dest = report(
        args, "esa-train", res["config"], res,
        tables=[("table", f"{args.seeds} seeded traces of {cfg.jobs} jobs per setting; sim "
                 "(packet level) and hybrid (the multi-job simulator's hybrid level): "
                 "as is, and given the host's own cost per step (measured alone: "
                 f"{res['config']['host_overhead_ms']:.1f} ms)",
                 ["setting", "pool", "policy", "mean JCT ms", "p99 JCT ms", "sim mean ms",
                  "hybrid mean ms", "preemptions", "PS fallbacks", "CPU: daemon, workers",
                  "exact"])],
    )  # fmt: skip
    draw(res, dest)
    return 0 if all(r.get("exact", True) for r in res["rows"]) else 1


def pools(text: str) -> list[int]:
    """``--predict``'s comma-separated pools, each a positive integer
    (argparse names the flag and the text where this raises)."""
    out = csv(text, int)
    if not out or min(out) < 1:
        raise ValueError(text)
    return list(out)


def esa_predict(args: argparse.Namespace, cfg: EsaTrainConfig) -> int:
    from gradfabric.experiments.esa_train import predicted_gain

    every: list[int] = args.predict
    with progress(len(every) * args.seeds, args.json) as tick:
        rows = predicted_gain(cfg, every, args.seeds, tick=tick)
    table = [{"pool": r["pool_slots"], "jitter ms": f"{r['jitter_ms']:g}",
              "ESA over ATP": f"{r['predicted_speedup']:.3f}x "
                              + (f"± {r['predicted_speedup_half']:.3f}" if args.seeds > 1
                                 else "(one trace)"),
              "per trace": ", ".join(f"{x:.3f}" for x in r["per_trace"])}
             for r in rows]  # fmt: skip
    report(args, "esa-train-predict", asdict(cfg) | {"seeds": args.seeds, "pools": every},
           {"rows": rows, "table": table},
           tables=[("table", f"the simulator (hybrid level) on {args.seeds} seeded traces of "
                    f"{cfg.jobs} jobs: ESA's mean-JCT speed-up over ATP",
                    ["pool", "jitter ms", "ESA over ATP", "per trace"])])  # fmt: skip
    return 0


def dlcp_udp(args: argparse.Namespace) -> int:
    from gradfabric.lab.dlcp_udp import DlcpEmuConfig, run_emu_dlcp, summary_row

    cfg = DlcpEmuConfig(
        workers=args.workers, rounds=args.rounds, port_mbps=args.port_mbps,
        background_mbps=args.background_mbps,
    )  # fmt: skip
    rows = []
    with progress(2, args.json) as tick:
        for reliable in (True, False):
            tick("reliable" if reliable else "DLCP")
            rows.append(summary_row(run_emu_dlcp(cfg, reliable)))
    report(
        args, "dlcp-udp", asdict(cfg), {"rows": rows},
        tables=[("rows", f"DLCP over UDP: {cfg.workers} workers, {cfg.port_mbps:g} Mbit/s "
                 f"port, {cfg.background_mbps:g} Mbit/s background (median of {cfg.rounds} "
                 "rounds)",
                 ["scheme", "round_ms", "lost_push", "lost_pull", "drop_rate_p0",
                  "drop_rate_p1", "drop_rate_p2", "drop_rate_p3"])],
    )  # fmt: skip
    ok = rows[0]["wrong_share"] == 0 and rows[1]["lost_push"] <= cfg.push_bound
    return 0 if ok and rows[1]["lost_pull"] <= cfg.pull_bound else 1


def dlcp_train(args: argparse.Namespace) -> int:
    from gradfabric.core.errors import ConfigError
    from gradfabric.experiments.dlcp_train import claims, draw, study
    from gradfabric.lab.dlcp_train import SCHEMES, DlcpTrainConfig
    from gradfabric.net.netns import nft_available, usable

    if not (usable() and nft_available()):
        print("dlcp-train needs root, network namespaces and nftables", file=sys.stderr)
        return 2
    try:  # the fabric, and every load on it, checked before the first run
        loads = tuple(float(x) for x in args.loads.split(","))
        cfg, *_ = [
            DlcpTrainConfig(steps=args.steps, link_mbps=args.link_mbps, load=load,
                            push_bound=args.push_bound, fabric=args.fabric, spines=args.spines,
                            burst_ms=args.burst_ms, values_per_packet=args.values_per_packet,
                            pace_kb=args.pace_kb)
            for load in loads
        ]  # fmt: skip
    except (ConfigError, ValueError) as e:
        print(f"dlcp-train: {e}", file=sys.stderr)
        return 2
    with progress(len(loads) * len(SCHEMES) * args.seeds, args.json) as tick:
        res = study(cfg, args.seeds, loads, tick)
    res["claims"] = [c.__dict__ for c in claims(res)]

    def ci(r: dict[str, object], key: str, fmt: str) -> str:
        v, h = r.get(key), r.get(f"{key}_half")
        return "-" if v is None else f"{v:{fmt}} ± {h or 0:{fmt}}"

    res["table"] = [
        {"load": r["load"], "scheme": r["scheme"],
         "to target s": ci(r, "tta_s", ".2f") + f" ({r['reached']}/{r['runs']})",
         "step ms": ci(r, "step_ms", ".1f"), "accuracy": ci(r, "accuracy", ".3f"),
         "lost push/pull": f"{r['lost_push']:.3f} / {r['lost_pull']:.3f}",
         "top/mid/bottom drops": " / ".join(f"{v:.3f}" for v in r["drop_rate"].values()),
         "CPU ms/step": f"{r['cpu_ms_per_step']:.0f}"}
        if "speedup" not in r and not r["scheme"].startswith("sim:") else
        {"load": r["load"], "scheme": r["scheme"], "to target s": "",
         "step ms": ci(r, "step_ms", ".1f"), "accuracy": "", "lost push/pull": "",
         "top/mid/bottom drops": "", "CPU ms/step": ""}
        if "speedup" not in r else
        {"load": r["load"], "scheme": r["scheme"].replace("/", " over "),
         "to target s": f"{r['speedup']:.2f}x ± {r['speedup_half']:.2f}", "step ms": "",
         "accuracy": "", "lost push/pull": "", "top/mid/bottom drops": "", "CPU ms/step": ""}
        for r in res["rows"]
    ]  # fmt: skip
    dest = report(
        args, "dlcp-train", res["config"], res,
        tables=[("table", f"{args.seeds} seeds per load; time to "
                 f"{res['config']['target'] * 100:.0f}% test accuracy (reached/runs), 95% "
                 "intervals; speed-ups paired by seed",
                 ["load", "scheme", "to target s", "step ms", "accuracy", "lost push/pull",
                  "top/mid/bottom drops", "CPU ms/step"])],
    )  # fmt: skip
    draw(res, dest)
    dl = [r for r in res["rows"] if r["scheme"] == "dlcp"]
    return 0 if all(r["lost_push"] <= cfg.push_bound + 1e-9 for r in dl) else 1
