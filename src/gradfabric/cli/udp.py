"""``gradfabric experiment saatp-udp`` and ``dlcp-udp``: the systems through
the switch daemon on real UDP sockets, side by side with their baselines."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from gradfabric.cli.common import Sub, add_output, progress, report


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


def saatp_udp(args: argparse.Namespace) -> int:
    from gradfabric.emu.saatp import SaatpEmuConfig, run_emu_saatp

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


def dlcp_udp(args: argparse.Namespace) -> int:
    from gradfabric.emu.dlcp import DlcpEmuConfig, run_emu_dlcp, summary_row

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
