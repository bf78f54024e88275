"""``gradfabric bench``: speed, measured side by side in one run."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradfabric.cli.common import Sub, add_output, csv, progress, report
from gradfabric.core.errors import ConfigError
from gradfabric.net.netns import MAX_MTU, MTU
from gradfabric.planner.spec import REFERENCE_GFLOPS
from gradfabric.proto.switch import ALLOCATORS

if TYPE_CHECKING:
    from gradfabric.lab.plan_bench import ExecConfig

OMNI_FLOOR = (
    "floor = max over ranks r of max(|N_r|, |U_-r|) * B * 8 / link rate, where N_r "
    "are the non-zero blocks of rank r, U_-r the blocks non-zero at some rank other "
    "than r, and B the bytes of a block: whatever the exchange, every rank sends each "
    "of its non-zero blocks at least once and receives, for each block another rank "
    "holds, at least one block of their sum (with 2 ranks the gather path moves "
    "exactly this). path_ratio: bytes on the busiest link of the paths taken (gather, "
    "sharded or dense, chosen per chunk) over the floor's bytes"
)


def add(sub: Sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser(
        "sim",
        help="simulator speed: compiled vs pure Python, events per wall second",
        description="One all-reduce of a model's gradients in the simulator, on the "
        "compiled hot path (mypyc, built by pip) and on the pure-Python "
        "sources, alternating in child processes, medians of --repeats. --scaling adds "
        "events/s and wall time against workers (8, 64, 256, 1024) for SwitchML and ATP, "
        "with trains of workers/8 packets.",
    )
    bs.add_argument("--scheme", default="atp")
    bs.add_argument("--model", default="resnet50")
    bs.add_argument("--workers", type=int, default=8)
    bs.add_argument("--train-packets", type=int, default=1, help="1: packet level")
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("--paths", help="comma-separated from mypyc,python (default: those built)")
    bs.add_argument("--scaling", action="store_true", help="add the table against workers")
    bs.add_argument("--profile", action="store_true",
                    help="add where the time goes: the bare event heap's events/s and the "
                         "run's functions by own time (pure-Python path, cProfile)")
    add_output(bs, "bench-sim", "print the result as one JSON object")
    bs.set_defaults(fn=sim)

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
    add_output(bo, "bench-omnireduce")
    bo.set_defaults(fn=omnireduce)

    bw = bsub.add_parser(
        "switch",
        help="the software switch vs gloo all-reduce, on loopback or on shaped links",
        description="For each worker count: a switch daemon and that many gloo ranks "
        "(torchrun) sum the same float32 tensor through the switch (what ina_hook does: "
        "block-exponent round, quantisation, packets, decoding) and with "
        "torch.distributed.all_reduce, alternating, medians of --iters after a warm-up. "
        "--link-gbps R (root): each worker in its own network namespace behind one "
        "tbf-shaped link of R Gbit/s, the switch daemon where the top-of-rack switch sits "
        "(the namespace that bridges them); gloo's ring crosses the same links; each way's "
        "time is shown against its bytes floor (S/R through the switch, 2(n-1)/n*S/R for "
        "the ring). goodput_gbps: tensor bits per second of wall time; switch_cpu_gbps: "
        "the same per second of the switch process's CPU time (what one switch core "
        "sustains); *_cpu_s: CPU seconds per sum (the switch; the slowest worker).",
    )
    bw.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    bw.add_argument("--tensor-mb", type=float, default=4.0)
    bw.add_argument("--iters", type=int, default=5)
    bw.add_argument("--warmup", type=int, default=2,
                    help="untimed sums of each way first (a run's first sum through the "
                    "switch is a one-off: connections and buffers touched first)")  # fmt: skip
    bw.add_argument("--policy", default="switchml", choices=(*ALLOCATORS.names(), "ps"),
                    help="the switch's pool, or ps: the parameter-server baseline, one PS per "
                    "job where the switch sits")  # fmt: skip
    bw.add_argument("--job-slots", type=int, default=0,
                    help="the workers' window (default: the daemon's, 256 KB of values)")
    bw.add_argument(
        "--values-per-packet", type=int,
        help="values per datagram (default 16000: 64 KB, whole on loopback; with "
        "--link-gbps the daemon's: the most one datagram of --mtu carries whole, at most "
        "2048: 358 at 1500, 2048 at 9000)",
    )  # fmt: skip
    bw.add_argument("--rto-ms", type=float, default=20.0, help="workers' retransmission timeout")
    bw.add_argument("--link-gbps", type=float, help="shape links in network namespaces (root)")
    bw.add_argument("--mtu", default="1500,9000",
                    help=MTU_HELP + "; comma-separated, each a run (default: 1500,9000)")
    bw.add_argument(
        "--kernel-loss", type=float, default=0.0,
        help="with --link-gbps: nftables drops this share of the UDP reaching the switch",
    )  # fmt: skip
    bw.add_argument(
        "--datapath", default="auto", choices=("auto", "native", "python"),
        help="the workers' and the switch's datapath: native (C, batched socket I/O, where "
        "built; the switch's for switchml), python (the reference engines), auto (native)",
    )  # fmt: skip
    bw.add_argument(
        "--multicast", action=argparse.BooleanOptionalAction, default=True,
        help="the daemon's default: the switch sends each result once, to the job's multicast "
        "group, and the network replicates it; --no-multicast: once per worker",
    )  # fmt: skip
    add_output(bw, "bench-switch")
    bw.set_defaults(fn=switch)

    bp = bsub.add_parser(
        "plan",
        help="plans executed on throttled processes beside the cost model's prediction",
        description="One gloo process per emulated device (rank r at --speeds[r] of a "
        "reference device of --device-gflops: each stage's forward and backward sleep to "
        "the end of that device's compute time), an MLP stack trained under the "
        "planner's plan (with the cost model as is, and calibrated), even and "
        "speed-proportional data parallelism, an even pipeline (each on every device and on "
        "its best subset) and --random random plans, steps interleaved, --repeats runs "
        "(torch.distributed.pipelining inside groups, per-layer gradient sums across "
        "them). Each row: measured step time (median over runs of the median step, each "
        "ending with the slowest rank), the cost model's prediction for the same plan "
        "before and after calibration, their relative errors, the throttle's overruns and "
        "both speedups over even data parallelism; the footer gives the planner's speedup "
        "over the fastest baseline with a 95% interval over runs. Calibration: "
        "the device's effective FLOP/s, a pipeline hop's latency and the link rate solved "
        "from three separately measured plans (even DP, two pipelines) and an all-reduce. "
        "--devices quota runs no throttle: each rank in a CPU quota of speed x "
        "--quota-cores of one core (root, cgroup v1), its speed what the host makes of it, "
        "the model as is priced at this host's measured single-core FLOP/s times the quota.",
    )
    bp.add_argument("--cluster", metavar="FILE",
                    help="the emulated cluster and model from a YAML (the fields of "
                    "lab.plan_bench.ExecConfig: speeds, device_gflops, link_gbps, shaped, "
                    "devices, quota_cores, layers, width, batch, steps; example: "
                    "configs/emulated-cluster.yaml); the flags below do not apply")  # fmt: skip
    bp.add_argument("--speeds", default="1,1,0.5,0.25", help="comma-separated, one per rank")
    bp.add_argument("--layers", type=int, default=8)
    bp.add_argument("--width", type=int, default=512)
    bp.add_argument("--batch", type=int, default=96)
    bp.add_argument("--steps", type=int, default=8)
    bp.add_argument("--link-gbps", type=float, default=10.0,
                    help="what the model assumes (with --shaped: each rank's link)")  # fmt: skip
    bp.add_argument("--shaped", action="store_true",
                    help="each rank in a network namespace behind one link shaped to "
                    "--link-gbps both ways (root)")  # fmt: skip
    bp.add_argument("--device-gflops", type=float, default=REFERENCE_GFLOPS,
                    help="the reference device (speed 1); keep it below what a host "
                    "core shared by two processes does, or the throttle overruns "
                    "(reported)")  # fmt: skip
    bp.add_argument("--devices", choices=("throttle", "quota"), default="throttle",
                    help="how a rank becomes a slower device (above)")  # fmt: skip
    bp.add_argument("--quota-cores", type=float, default=0.5,
                    help="with --devices quota: the speed-1 device's share of a core")  # fmt: skip
    bp.add_argument("--random", type=int, default=9, help="random plans measured too")
    bp.add_argument("--repeats", type=int, default=3, help="runs (samples of each speedup)")
    bp.add_argument("--apart", action="store_true",
                    help="each plan in a run of its own (as a job would run it; slower, and "
                    "noise no longer falls on all plans alike)")  # fmt: skip
    add_output(bp, "bench-plan")
    bp.set_defaults(fn=plan_bench)

    bh = bsub.add_parser(
        "helped-host",
        help="SA-ATP's helped host in C vs its Python reference, over UDP and in training",
        description="An SA-ATP job through a switch daemon on loopback, one worker 4x "
        "slower, run --repeats times with the native helped host and with the reference, "
        "alternating. --job udp: saatp-udp's (compute a sleep, every aggregate checked); "
        "--job train: saatp-train's SA-ATP runs (the digits MLP, the straggler moving every "
        "2 steps; exact: every replica's weights alike). Per run: the median step time and "
        "each host's CPU time a step (the median host's; with compute a sleep, the "
        "transport and the event loop around it). Side by side: the reference's over the "
        "native's (paired, 95% interval), and the native's step time over the compute "
        "floor, 2 x --compute-ms (a helper computes its own share and the straggler's).",
    )  # fmt: skip
    bh.add_argument("--job", choices=("udp", "train"), default="udp")
    bh.add_argument("--repeats", type=int, default=5)
    bh.add_argument("--workers", type=int, default=4)
    bh.add_argument("--iterations", type=int, default=16, help="steps a run")
    bh.add_argument("--compute-ms", type=float,
                    help="a share's compute at speed 1 (default: 20 for udp, 40 for train)")
    bh.add_argument("--packets", type=int, default=64, help="udp: a step's packets")
    add_output(bh, "bench-helped-host")
    bh.set_defaults(fn=helped_host)

    bd = bsub.add_parser(
        "ddp",
        help="DDP training per hook: default, omnireduce_hook, auto_hook (ina_hook)",
        description="Real models trained with DDP on gloo ranks under torchrun, one "
        "replica per hook from the same weights and batches, iterations interleaved "
        "(each step runs every replica once, rotating the order); medians of the "
        "slowest rank's iteration time after --warmup steps. On loopback, or with "
        "--link-gbps each rank in a network namespace behind a tbf-shaped link (root). "
        "Models: mlp (dense gradients, 32 MB), neumf (sparse embeddings), mixed (a "
        "large embedding bag plus a dense 1024-wide MLP). --switch: a switch daemon's "
        "control address, adding ina_hook and the ina path of auto_hook.",
    )
    bd.add_argument("--models", default="mlp,neumf,mixed",
                    help="comma-separated: mlp, neumf, mixed, dlrm, transformer")  # fmt: skip
    bd.add_argument("--ranks", type=int, default=2)
    bd.add_argument("--link-gbps", type=float, help="shape links in network namespaces (root)")
    bd.add_argument("--steps", type=int, default=20)
    bd.add_argument("--warmup", type=int, default=3)
    bd.add_argument("--bucket-cap-mb", type=float, default=4.0)
    bd.add_argument("--gradient-as-bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True) for every replica")  # fmt: skip
    bd.add_argument("--hooks", default="default,omnireduce,auto",
                    help="comma-separated; also: rows (rows_hook: embedding tables by the "
                    "rows looked up), sparse (no hook: the model's tables sparse=True under "
                    "plain DDP), sparse+auto (the same sparse=True tables, auto_hook "
                    "choosing how each table's rows are exchanged), allreduce (PyTorch's "
                    "own Python hook), "
                    "builtin (its C++ one), omnireduce-python and auto-python (their dense "
                    "calls in Python, not the compiled path), torchrec (the mixed, dlrm and neumf "
                    "models' tables sharded by TorchRec's DistributedModelParallel as its planner "
                    "picks, SGD; needs GRADFABRIC_TORCHREC=1 bash scripts/bootstrap.sh), "
                    "torchrec-cw (the same, every table column-wise over every rank), local "
                    "(the sparse=True replica without DDP: compute alone, the floor); HOOK@MB "
                    "gives that replica its own bucket cap (each at its best in one run: "
                    "default,ina@16)")  # fmt: skip
    bd.add_argument("--switch", help="host:port of a switch daemon's control socket")
    bd.add_argument("--mtu", default="1500,9000",
                    help=MTU_HELP + "; comma-separated, each a run (default: 1500,9000)")
    bd.add_argument(
        "--switch-window", type=int, default=0,
        help="with --switch-policy: the workers' window in packets (the daemon's --job-slots; "
        "default: its own, 256 KB of values)",
    )  # fmt: skip
    bd.add_argument(
        "--switch-multicast", action=argparse.BooleanOptionalAction, default=True,
        help="with --switch-policy: the daemon's --multicast (its default: each result "
        "once, to the job's group, where the group reaches every rank)",
    )  # fmt: skip
    bd.add_argument(
        "--switch-policy", choices=ALLOCATORS.names(),
        help="start a switch daemon with this policy for the run (with --link-gbps: where "
        "the top-of-rack switch sits, so ina_hook and gloo cross the same links)",
    )  # fmt: skip
    bd.add_argument(
        "--block", type=int, default=1, metavar="N",
        help="steps each replica takes in a row before the next takes its turn (default 1: "
        "step by step); the replicas' order rotates every round",
    )  # fmt: skip
    bd.add_argument(
        "--optimizer", choices=("sgd", "adam"), default="sgd",
        help="every replica's optimizer; with adam the sparse replica (--hooks sparse: "
        "sparse=True tables) runs SparseAdam on its tables and Adam on the rest",
    )  # fmt: skip
    add_output(bd, "bench-ddp")
    bd.set_defaults(fn=ddp)


def helped_host(args: argparse.Namespace) -> int:
    from statistics import median

    from gradfabric.core.stats import ratio_ci
    from gradfabric.lab.saatp_train import SaatpTrainConfig, run_switch
    from gradfabric.lab.saatp_udp import SaatpEmuConfig, iteration_times, run_emu_saatp

    if args.repeats < 1:
        raise ConfigError("repeats", f"must be >= 1, got {args.repeats}")
    train = args.job == "train"
    compute_ms = args.compute_ms or (40.0 if train else 20.0)

    def one(host: str) -> dict[str, Any]:
        if not train:
            c = SaatpEmuConfig(workers=args.workers, iterations=args.iterations,
                               compute_ms=compute_ms, iteration_packets=args.packets, host=host)
            r = run_emu_saatp(c, help=True)
            return {"iter_ms": r["median_iteration_ms"], "cpu_ms": r["cpu_ms_per_iteration"],
                    "helps": r["helps_sent"], "exact": r["exact"], "served": ",".join(r["host"])}
        t = SaatpTrainConfig(workers=args.workers, steps=args.iterations, compute_ms=compute_ms,
                             move_every=2, host=host)
        recs = run_switch(t, help=True)["recs"]
        return {"iter_ms": median(iteration_times(recs)[1:]) * 1e3,
                "cpu_ms": median(r["cpu_s"] for r in recs) * 1e3 / t.steps,
                "helps": sum(r["helps"] for r in recs),
                "exact": len({r["weights"] for r in recs}) == 1,  # every replica alike
                "served": ",".join(sorted({r["host"] for r in recs}))}  # fmt: skip

    hosts = ("native", "python")
    runs: dict[str, list[dict[str, Any]]] = {h: [] for h in hosts}
    with progress(2 * args.repeats, args.json) as tick:
        for rep in range(args.repeats):
            for h in hosts if rep % 2 == 0 else hosts[::-1]:
                tick(f"run {rep + 1}: {h}")
                runs[h].append({"run": rep, "host": h} | one(h))
    floor = 2 * compute_ms
    nat, ref = runs["native"], runs["python"]
    summary = []
    for key, what in (("iter_ms", "step (ms)"), ("cpu_ms", "host CPU (ms)")):
        ratio = ratio_ci([r[key] for r in ref], [r[key] for r in nat])
        native_ms = median(r[key] for r in nat)
        summary.append({
            "measure": what, "native": native_ms, "python": median(r[key] for r in ref),
            "python_over_native": ratio.fmt(digits=3),
            "native_over_floor": round(native_ms / floor, 3) if key == "iter_ms" else None,
        })  # fmt: skip
    rows = [r for pair in zip(nat, ref, strict=True) for r in pair]
    report(
        args, "bench-helped-host", {"job": args.job, "repeats": args.repeats,
                                    "workers": args.workers, "iterations": args.iterations,
                                    "compute_ms": compute_ms, "packets": args.packets},
        {"summary": summary, "rows": rows},
        tables=[("rows", f"each {args.job} run (median step; CPU a step, the median host's)",
                 ["run", "host", "served", "iter_ms", "cpu_ms", "helps", "exact"]),
                ("summary", f"medians; the reference over the native host ({args.repeats} paired "
                 f"runs, 95% interval); the native against the floor, 2 x {compute_ms:g} ms",
                 list(summary[0]))],
    )  # fmt: skip
    return 0 if all(r["exact"] for r in rows) else 1


def sim(args: argparse.Namespace) -> int:
    from gradfabric.experiments import simspeed as ss

    paths: tuple[str, ...] = csv(args.paths, str) or ss.available_paths()
    if bad := [p for p in paths if p not in ss.PATHS]:
        raise ConfigError("paths", f"unknown {bad}; valid: {', '.join(ss.PATHS)}")
    case = ss.SpeedCase(args.scheme, args.model, args.workers, args.train_packets)
    steps = args.repeats * len(paths) + (len(ss.SCALING) if args.scaling else 0) + args.profile
    with progress(steps, args.json) as tick:
        res = ss.side_by_side(case, args.repeats, paths, tick)
        if args.scaling:
            res["scaling"] = ss.scaling(tick)
        if args.profile:
            tick("profile")
            res["bare_loop_events_per_s"] = ss.bare_loop()
            res["profile"] = ss.profile(case)
    eps = res["events_per_s"]
    footer = (
        f"{args.scheme} {args.model}, {args.workers} workers, {res['granularity']}: "
        f"{res['events']} events; median events/s over {args.repeats} runs: "
        + ", ".join(f"{p} {eps[p]:,.0f}" for p in paths)
        + (f"; compiled/python {res['compiled_vs_python']:.2f}x"
           if "compiled_vs_python" in res else "")
        + (f"; the event heap alone: {res['bare_loop_events_per_s']:,.0f}/s"
           if args.profile else "")
    )  # fmt: skip
    config = {k: vars(args)[k] for k in ("scheme", "model", "workers", "train_packets", "repeats")}
    tables = [("scaling", "events per second against workers (this process's path)",
               ["scheme", "workers", "train_packets", "topology", "path", "events",
                "wall_s", "events_per_s", "simulated_ms"]),
              ("profile", "where the time goes (pure-Python path, by own time)",
               ["function", "calls", "own_s", "share"])]  # fmt: skip
    report(args, "bench-sim", config, res, tables=tables, json_keys=None, footer=footer)
    return 0


def omnireduce(args: argparse.Namespace) -> int:
    from gradfabric.lab.collective_bench import DENSITIES, run_bench

    densities = list(csv(args.densities, float) or DENSITIES)
    if args.ranks < 2 or args.iters < 1 or args.size_mb <= 0:
        raise ConfigError("ranks", "need --ranks >= 2, --iters >= 1 and --size-mb > 0")
    rows = run_bench(args.ranks, args.size_mb, densities, args.iters, args.link_gbps)
    where = f"{args.link_gbps:g} Gbit/s shaped links" if args.link_gbps else "loopback"
    config = {"ranks": args.ranks, "size_mb": args.size_mb, "densities": densities,
              "iters": args.iters, "link_gbps": args.link_gbps}  # fmt: skip
    report(
        args, "bench-omnireduce", config, {"rows": rows},
        tables=[("rows", f"sparse vs dense all-reduce, {args.size_mb:g} MB, {args.ranks} gloo "
                 f"ranks, {where} (medians of {args.iters})",
                 ["density", "gradfabric_ms", "dense_ms", "speedup", "bytes_ratio",
                  "path_ratio", "floor_ratio", "max_abs_diff"])],
        footer=OMNI_FLOOR if args.link_gbps else "",
    )  # fmt: skip
    return 0 if all(r["max_abs_diff"] < 1e-3 for r in rows) else 1


MTU_HELP = (
    f"with --link-gbps: every link's MTU, the same for gloo and the switch ({MTU}: "
    f"jumbo frames; up to {MAX_MTU}, which takes the kernel's per-packet cost out of the "
    "way: see net.netns.tor_star)"
)


def switch(args: argparse.Namespace) -> int:
    from gradfabric.lab.switch_bench import SwitchBenchConfig, run_switch_bench

    shaped = args.link_gbps is not None
    cfgs = [
        SwitchBenchConfig(workers=w, tensor_mb=args.tensor_mb, iters=args.iters,
                          warmup=args.warmup,
                          policy=args.policy, job_slots=args.job_slots,
                          values_per_packet=args.values_per_packet or 0,
                          link_gbps=args.link_gbps,
                          kernel_loss=args.kernel_loss, rto_ms=args.rto_ms, mtu=mtu,
                          datapath=args.datapath, multicast=args.multicast)
        for mtu in ((csv(args.mtu, int) or [MTU]) if shaped else [MTU])
        for w in csv(args.workers, int) or (2, 4)
    ]  # fmt: skip
    rows = []
    with progress(len(cfgs), args.json) as tick:
        for c in cfgs:
            tick(f"{c.workers} workers" + (f", MTU {c.mtu}" if shaped else ""))
            rows.append(run_switch_bench(c))
    shown = [{k: v for k, v in r.items() if k != "switch_counters"} for r in rows]
    where = f"{args.link_gbps:g} Gbit/s links" if shaped else "loopback"
    times = ["workers", "tensor_mb", "switch_ms", "gloo_ms", "speedup", "goodput_gbps"]
    if shaped:
        times.insert(1, "mtu")
        times += ["floor_ms", "floor_ratio", "ring_floor_ms", "ring_floor_ratio"]
    cpu = ["workers", "switch_cpu_s", "switch_cpu_gbps", "worker_cpu_s", "gloo_worker_cpu_s",
           "max_error", "datapath"]  # fmt: skip
    report(
        args, "bench-switch", {"runs": [asdict(c) for c in cfgs]}, {"rows": shown, "full": rows},
        tables=[("rows", f"software switch ({args.policy}) vs gloo all-reduce, {where} "
                 f"(medians of {args.iters}; speedup: gloo's time over the switch's)", times),
                ("rows", "CPU seconds per sum (switch process; slowest worker)", cpu)],
    )  # fmt: skip
    # both sum float32; the switch adds only block quantisation (~1e-8 of a block's peak)
    return 0 if all(r["max_error"] < 1e-4 for r in rows) else 1


def ddp(args: argparse.Namespace) -> int:
    from gradfabric.lab.ddp_bench import DdpBenchConfig, held_to_default, run_ddp_bench

    mtus = (csv(args.mtu, int) or [MTU]) if args.link_gbps else [MTU]
    try:
        cfgs = [DdpBenchConfig(
            models=tuple(csv(args.models, str) or ()), ranks=args.ranks,
            link_gbps=args.link_gbps, steps=args.steps, warmup=args.warmup,
            bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
            hooks=tuple(csv(args.hooks, str) or ()), switch=args.switch,
            switch_policy=args.switch_policy, mtu=mtu, switch_window=args.switch_window,
            switch_multicast=args.switch_multicast, optimizer=args.optimizer, block=args.block,
        ) for mtu in mtus]  # fmt: skip
    except ValueError as e:
        raise ConfigError("bench ddp", str(e)) from None
    rows = [r | {"mtu": c.mtu if args.link_gbps else None} for c in cfgs for r in run_ddp_bench(c)]
    cfg = cfgs[0]
    where = f"{args.link_gbps:g} Gbit/s shaped links" if args.link_gbps else "loopback"
    shown = [{k: v for k, v in r.items() if k != "iter_ms_all"} for r in rows]
    dest = report(
        args, "bench-ddp", {"runs": [asdict(c) for c in cfgs]}, {"rows": shown, "full": rows},
        tables=[("rows", f"DDP iteration time per hook, {cfg.ranks} gloo ranks, {where} "
                 f"(medians of {cfg.steps - cfg.warmup} interleaved steps)",
                 ["model", "mtu", "hook", "iter_ms", "cpu_ms", "hook_cpu_ms", "host_busy",
                  "speedup_vs_default", "paired_vs_default",
                  "best_stock", "paired_vs_best_stock", "density",
                  "max_param_diff_vs_default", "paths", "dense_calls_in"])],
    )  # fmt: skip
    if any(r["bucket_spans_ms"] for r in rows):
        from gradfabric.experiments import plots

        title = f"DDP steps, {cfg.ranks} ranks, {where}\neach bucket on the hook's thread"
        plots.step_timeline(rows, f"{title} (rank 0, medians)", dest / "timeline.png")
    # every hook averages what DDP does: to the bit at 2 ranks, within float32
    # rounding of other orders and the switch's quantisation otherwise
    # (``held_to_default`` says where the weights can show it)
    diffs = [r["max_param_diff_vs_default"] or 0.0 for r in rows
             if held_to_default(r, cfg.optimizer)]  # fmt: skip
    return 0 if all(d <= 1e-4 for d in diffs) else 1


def _exec_config(args: argparse.Namespace) -> ExecConfig:
    from gradfabric.lab.plan_bench import ExecConfig

    try:
        return ExecConfig(speeds=tuple(csv(args.speeds, float) or ()), layers=args.layers,
                          width=args.width, batch=args.batch, steps=args.steps,
                          link_gbps=args.link_gbps, device_gflops=args.device_gflops,
                          devices=args.devices, quota_cores=args.quota_cores,
                          shaped=args.shaped)  # fmt: skip
    except ValueError as e:
        raise ConfigError("bench plan", str(e)) from None


def plan_bench(args: argparse.Namespace) -> int:
    from gradfabric.lab.plan_bench import ExecConfig, run_plans, speedup

    if args.cluster:
        from gradfabric.core.config import load_yaml

        cfg = load_yaml(ExecConfig, Path(args.cluster))
    else:
        cfg = _exec_config(args)
    from gradfabric.experiments.plots import predicted_vs_measured

    res = run_plans(cfg, args.random, together=not args.apart, repeats=args.repeats)
    sm = res["summary"]
    speeds = ",".join(f"{s:g}" for s in cfg.speeds)
    dest = report(
        args, "bench-plan", asdict(cfg), res,
        tables=[("rows", f"plans executed on {len(cfg.speeds)} gloo processes ({cfg.devices}"
                 f"{f', links of {cfg.link_gbps:g} Gbit/s' if cfg.shaped else ''}) (speeds "
                 f"{speeds}), medians of {cfg.steps - cfg.warmup} steps x {args.repeats} runs",
                 ["plan", "measured_ms", "predicted_ms", "calibrated_ms", "error",
                  "error_calibrated", "overrun_share", "speedup_vs_even_dp",
                  "predicted_speedup_vs_even_dp"])],
        footer=f"cost model vs measured over {sm['plans']} plans: median |error| "
        f"{sm['median_abs_error']:.0%}, worst {sm['worst_abs_error']:.0%}; calibrated "
        f"(device {sm['calibration']['flops'] / 1e9:.1f} GFLOP/s, latency "
        f"{sm['calibration']['latency_s'] * 1e3:.2f} ms, link "
        f"{sm['calibration']['link_gbps']:.1f} Gbit/s): median "
        f"{sm['median_abs_error_calibrated']:.0%}, worst {sm['worst_abs_error_calibrated']:.0%}; "
        f"throttle overran {sm['overrun_share']:.1%} of calls, its sleeps ended "
        f"{sm['late_us_per_call']:.0f} us late on average; the calibrated planner's "
        f"plan vs the fastest baseline ({sm['best_baseline']}): {speedup(sm, 'best_baseline')}; "
        f"vs even DP {speedup(sm, 'even_dp')}; vs the even pipeline "
        f"{speedup(sm, 'even_pipeline')}",
    )  # fmt: skip
    predicted_vs_measured(
        res["rows"], {"cost model": "predicted_ms", "calibrated": "calibrated_ms"},
        f"{sm['plans']} plans on {len(cfg.speeds)} processes ({cfg.devices})",
        dest / "predicted_vs_measured.png",
    )  # fmt: skip
    return 0
