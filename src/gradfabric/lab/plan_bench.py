"""Plans run for real on throttled processes, beside the cost model's prediction.

``run_plans`` spawns one gloo process per emulated device (rank ``r`` is a
device at ``speeds[r]`` of a reference device of ``device_gflops``:
``pipeline.Throttled``'s deadline throttle) and trains an MLP stack
(``layers`` blocks of ``Linear(width, width) + Tanh``) under each plan: the
planner's own plan for these devices (on the cost model as is and
calibrated), the baselines (even and speed-proportional data parallelism, an
even pipeline: each over every device and over the subset where the
calibrated model finds it fastest, the freedom the planner has) and seeded
random plans, all in one run with their steps interleaved (noise falls on
all alike), ``repeats`` times. Each row: the plan, its measured step time
(median over runs of the median step, each step ending with the slowest
rank), the cost model's predicted batch time for the same plan before and
after calibration, the relative errors, and the throttle's overruns.

``shaped``: each rank runs in a network namespace of its own behind one link
shaped to ``link_gbps`` both ways (``net.netns.shaped_star``), so every
transfer between devices, gradient rings and pipeline hops alike, crosses
links of the rate the cost model prices (loopback, by default, is far
faster than any such link).

``devices="quota"`` runs no throttle: rank ``r``'s steps run on a thread in
a CPU quota of ``speeds[r] * quota_cores`` of one core (``core.cpuquota``;
root and cgroup v1), while its process groups' threads (made before, outside
the quota) move its data at the host's speed, as a slow accelerator behind an
ordinary NIC would have it; its speed is whatever the host's compute makes of
that share, and the
cost model's compute is a prediction like the rest: the reference device is
priced at this host's measured single-core FLOP/s (``host_gflops``, on the
same MLP) times ``quota_cores`` before calibration.

The cost model sees the reference device (``device_gflops``) and each device
as a type of its own at ``speeds[r]`` of it (a static heterogeneity every
baseline knows of), and links at ``link_gbps``. The throttle makes the
compute exactly the model's wherever the host's real compute fits in the
device's time (the reference device is several times slower than a
contended host core; the rows report the calls that did not fit), so what
the model gets wrong is the rest: transfers, the schedule's per
micro-batch work, synchronisation, which calibration measures.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import random
import statistics
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.core.cpuquota import quota
from gradfabric.core.errors import ConfigError
from gradfabric.core.stats import mean_ci
from gradfabric.planner.baselines import best_subset, even_dp, even_pipeline, proportional_dp
from gradfabric.planner.cost import Device, Group, Plan, Stage, Workload, evaluate
from gradfabric.planner.pipeline import Clock, PlanRunner, as_run, splits_whole, whole_batches
from gradfabric.planner.search import plan as search_plan
from gradfabric.planner.search import shares
from gradfabric.planner.spec import REFERENCE_GFLOPS, ClusterSpec, DeviceCount, DeviceType


@dataclass(frozen=True)
class ExecConfig:
    speeds: tuple[float, ...] = (1.0, 1.0, 0.5, 0.25)
    layers: int = 8
    width: int = 512
    batch: int = 96
    steps: int = 8
    warmup: int = 2
    link_gbps: float = 10.0  # what the cost model assumes of loopback gloo
    seed: int = 0
    device_gflops: float = REFERENCE_GFLOPS  # the reference device, speed 1
    devices: str = "throttle"  # or "quota": a CPU quota per rank, no throttle (module doc)
    shaped: bool = False  # each rank behind its own link shaped to link_gbps (netns; root)
    memory_mb: tuple[float, ...] = ()  # each device's memory (the cost model's); () = 8 GiB
    quota_cores: float = 0.5  # with "quota": the speed-1 device's share of one core

    def __post_init__(self) -> None:
        """Each rule names its field (``ConfigError``, a ``ValueError``), so
        that a cluster file's mistake says where it is."""
        if self.devices not in ("throttle", "quota"):
            raise ConfigError("devices", f"must be 'throttle' or 'quota', got {self.devices!r}")
        if not self.quota_cores > 0:
            raise ConfigError("quota_cores", f"must be > 0, got {self.quota_cores}")
        if len(self.speeds) < 2 or not all(0 < s <= 1 for s in self.speeds):
            raise ConfigError("speeds", f"need >= 2 speeds in (0, 1], got {list(self.speeds)}")
        if self.steps <= self.warmup:
            raise ConfigError("steps", f"need steps > warmup ({self.warmup}), got {self.steps}")
        if self.layers < len(self.speeds):
            raise ConfigError("layers", f"need at least one layer per device, got {self.layers}")
        if self.memory_mb and (len(self.memory_mb) != len(self.speeds)
                               or not min(self.memory_mb) > 0):  # fmt: skip
            raise ConfigError("memory_mb", f"one size > 0 per device ({len(self.speeds)}), got "
                              f"{list(self.memory_mb)}")  # fmt: skip
        for name in ("device_gflops", "link_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")

    @property
    def sample_s(self) -> list[float]:
        """Each layer's forward and backward seconds per sample on the
        reference device (the throttle's budget, the model's compute)."""
        return [3 * f / (self.device_gflops * 1e9) for f in workload(self).fwd_flops]


def host_gflops(cfg: ExecConfig, repeats: int = 5) -> float:
    """This host's FLOP/s on one thread for the config's MLP (forward and
    backward of the whole batch, the median of ``repeats``): what a device
    with all of one core would sustain."""
    torch.manual_seed(cfg.seed)
    model, threads = mlp_stack(cfg.layers, cfg.width), torch.get_num_threads()
    x = torch.randn(cfg.batch, cfg.width)
    torch.set_num_threads(1)
    try:
        took = []
        for _ in range(repeats + 1):  # (the first warms up)
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            took.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 3 * sum(workload(cfg).fwd_flops) * cfg.batch / statistics.median(took[1:]) / 1e9


def _device(cfg: ExecConfig, rank: int) -> tuple[AbstractContextManager[Any], float,
                                                  list[float] | None]:  # fmt: skip
    """Rank ``rank``'s device: the context its steps run in (a CPU quota on
    the calling thread, or nothing), and the throttle's speed and per-layer
    budget (none in a quota)."""
    if cfg.devices == "quota":
        return quota(cfg.speeds[rank] * cfg.quota_cores, thread=True), 1.0, None
    return nullcontext(), cfg.speeds[rank], cfg.sample_s


def mlp_stack(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)))  # fmt: skip


def workload(cfg: ExecConfig) -> Workload:
    w = cfg.width
    return Workload("mlp-stack", (2.0 * w * w,) * cfg.layers, (w * w + w,) * cfg.layers,
                    (4 * w,) * cfg.layers, cfg.batch)  # fmt: skip


def reference(cfg: ExecConfig, flops: float | None = None) -> DeviceType:
    """The reference device (speed 1) as the cost model sees it (``flops``:
    its FLOP/s, by default the throttle's)."""
    flops = cfg.device_gflops * 1e9 if flops is None else flops
    return DeviceType("reference", peak_tflops=flops / 1e12, mem_gb=8.0, cost_per_hour=0.0,
                      nic_gbps=cfg.link_gbps, efficiency=1.0)  # fmt: skip


def devices(cfg: ExecConfig, flops: float | None = None) -> list[Device]:
    """The emulated devices, each speed a device type of its own (a known,
    static heterogeneity, as a cluster's GPU generations: every baseline
    sees it, speed-proportional DP included), at their full speed."""
    ref = reference(cfg, flops)
    mbs = cfg.memory_mb or (None,) * len(cfg.speeds)
    each = zip(cfg.speeds, mbs, strict=True)
    return [Device(i, _at(ref, s, mb)) for i, (s, mb) in enumerate(each)]


def _at(ref: DeviceType, speed: float, memory_mb: float | None = None) -> DeviceType:
    """The reference device at ``speed`` (and ``memory_mb``, where given)."""
    mem = f"-{memory_mb:g}MB" if memory_mb is not None else ""
    return replace(ref, name=f"reference-x{speed:g}{mem}", peak_tflops=ref.peak_tflops * speed,
                   mem_gb=ref.mem_gb if memory_mb is None else memory_mb / 1024)  # fmt: skip


def require_fits(w: Workload, devs: list[Device], chosen: dict[str, Plan]) -> None:
    """Raise ``ConfigError`` (field ``memory_mb``) naming the first plan that
    does not fit its devices' memory: none is run."""
    for name, p in chosen.items():
        why = evaluate(w, devs, p).why
        if why:
            raise ConfigError("memory_mb", f"plan {name} does not fit: {'; '.join(why)}")


def plans(cfg: ExecConfig, devs: list[Device], lat: float = 5e-6) -> dict[str, Plan]:
    w = workload(cfg)
    return {
        "planner": search_plan(w, devs, lat).plan,
        "even-dp": even_dp(w, devs),
        "even-pipeline": even_pipeline(w, devs, depth=len(devs)),
    }


def random_plans(cfg: ExecConfig, devs: list[Device], n: int, lat: float) -> dict[str, Plan]:
    """``n`` seeded random plans: devices dealt into groups, each group's
    devices in random order with random cut points, batch shares by the
    planner's own rule (groups finishing together)."""
    rng = random.Random(cfg.seed)
    w, out = workload(cfg), dict[str, Plan]()
    while len(out) < n:
        order = list(range(len(devs)))
        rng.shuffle(order)
        k = rng.randint(1, len(devs))
        cuts = sorted(rng.sample(range(1, len(devs)), k - 1))
        groups = []
        for lo, hi in itertools.pairwise([0, *cuts, len(devs)]):
            members = order[lo:hi][: w.layers]
            edges = [0, *sorted(rng.sample(range(1, w.layers), len(members) - 1)), w.layers]
            groups.append(tuple(Stage(d, a, b) for d, a, b
                                in zip(members, edges[:-1], edges[1:], strict=True)))  # fmt: skip
        p = shares(w, devs, groups, lat)
        if splits_whole(p, cfg.batch):  # else not whole micro-batches: draw again
            out[f"random-{len(out)}"] = p
    return out


@dataclass(frozen=True)
class Calibration:
    """What the cost model takes from measurement: the reference device's
    effective FLOP/s (the throttle's, less what a data-parallel step spends
    besides compute and its all-reduce), the per-message latency of a pipeline
    hop, and the link rate of a gradient all-reduce."""

    flops: float
    latency_s: float
    link_gbps: float


def calibrated_cluster(cfg: ExecConfig, cal: Calibration) -> ClusterSpec:
    """The emulated cluster as ``gradfabric plan`` reads clusters: one device
    type per speed at the calibrated FLOP/s (efficiency 1: the FLOP/s is
    already what a step sustains), NICs at the calibrated link rate, the
    calibrated per-hop latency; devices in rank order."""
    devs = devices(replace(cfg, link_gbps=cal.link_gbps), cal.flops)
    types = {d.type.name: d.type for d in devs}
    return ClusterSpec(tuple(types.values()), tuple(DeviceCount(d.type.name, 1) for d in devs),
                       link_latency_us=cal.latency_s * 1e6)  # fmt: skip


def _solve(f: Any, lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with f(x) = target, f increasing (geometric bisection)."""
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def calibration_plans(cfg: ExecConfig) -> dict[str, Plan]:
    """The plans ``calibrate`` measures: the slowest device alone (compute
    and nothing else, whatever the links), a two-stage pipeline on the two
    fastest devices cut at a third, and a pipeline over every device in
    reverse order. ``run_plans`` judges the model on none of them."""
    w, devs = workload(cfg), devices(cfg)
    order = sorted(range(len(devs)), key=lambda i: -cfg.speeds[i])
    third = max(1, w.layers // 3)
    deep = list(reversed(range(len(devs))))  # (the even pipeline's order reversed)
    edges = [round(i * w.layers / len(deep)) for i in range(len(deep) + 1)]
    cuts = zip(deep, edges[:-1], edges[1:], strict=True)
    batch = float(cfg.batch)
    return {
        "slowest-alone": Plan((Group((Stage(order[-1], 0, w.layers),), batch),)),
        "pipe-2": Plan((Group((Stage(order[0], 0, third), Stage(order[1], third, w.layers)),
                              batch),)),
        "pipe-all": Plan((Group(tuple(Stage(d, a, b) for d, a, b in cuts), batch),)),
    }


def calibrate(cfg: ExecConfig) -> tuple[Calibration, dict[str, float]]:
    """Measure the calibration plans (``calibration_plans``) and an all-reduce
    of the model's gradients, then solve the model's FLOP/s (from the slowest
    device alone: compute only, so no link or hop term can bend it), the
    per-hop latency (least squares over the two pipelines: it stands for
    everything a stage pays per micro-batch) and the link rate (from the
    all-reduce). Returns the calibration and the measured seconds."""
    w, flops = workload(cfg), cfg.device_gflops * 1e9
    cal = calibration_plans(cfg)
    measured, _ = _measure(cfg, cal, allreduce=True)
    t = {k: statistics.median(v[cfg.warmup :]) for k, v in measured.items()}
    k = len(cfg.speeds)
    link = 2 * (k - 1) / k * 4 * sum(w.params) * 8 / t["allreduce"] / 1e9
    link_cfg = replace(cfg, link_gbps=link)
    fl = _solve(lambda x: -evaluate(w, devices(link_cfg, x), cal["slowest-alone"]).batch_time_s,
                flops / 100, flops * 10, -t["slowest-alone"])  # fmt: skip

    # the pipelines' per-hop cost: least squares of log time over both depths
    def misfit(x: float) -> float:
        return sum(math.log(evaluate(w, devices(link_cfg, fl), cal[k], x).batch_time_s / t[k]) ** 2
                   for k in ("pipe-2", "pipe-all"))  # fmt: skip

    lat = min((1e-7 * 1.05**i for i in range(400)), key=misfit)
    return Calibration(fl, lat, link), t


def run_plans(
    cfg: ExecConfig, random_count: int = 9, together: bool = True, repeats: int = 1
) -> dict[str, Any]:
    """Calibrate, then measure the planner's plan (before and after
    calibration), the baselines and ``random_count`` random plans; every row
    with both predictions and their errors. ``together``: all plans in one
    run, their steps interleaved, so that the host's noise falls on all alike
    (else each plan in a run of its own, as a job would run it); either way
    ``repeats`` times, each run a sample of the planner's speedups (mean and
    95% interval in the summary)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if cfg.devices == "quota":  # the model as is: this host's core, at the quota
        cfg = replace(cfg, device_gflops=host_gflops(cfg) * cfg.quota_cores)
    cal, cal_times = calibrate(cfg)
    w = workload(cfg)
    raw_devs, cal_cfg = devices(cfg), replace(cfg, link_gbps=cal.link_gbps)
    cal_devs = devices(cal_cfg, cal.flops)
    chosen = plans(cfg, raw_devs)
    chosen["planner-calibrated"] = search_plan(w, cal_devs, cal.latency_s).plan
    chosen["proportional-dp"] = proportional_dp(w, raw_devs)
    chosen |= best_subsets(w, cal_devs, cal.latency_s, chosen)
    chosen |= random_plans(cfg, raw_devs, random_count, 5e-6)
    chosen = {k: p for k, p in chosen.items() if splits_whole(p, cfg.batch)}
    # the model is judged on plans it was not fitted to: a random plan or a
    # baseline's best subset that is a calibration plan is left out (the
    # named rows stay, and the summary says if one of them was fitted to)
    fitted = list(calibration_plans(cfg).values())
    named = ("planner", "planner-calibrated", *RULES)
    chosen = {k: p for k, p in chosen.items() if k in named or p not in fitted}
    # a plan the memory model rejects is not run (a baseline rule may give one)
    why = {k: evaluate(w, raw_devs, p).why for k, p in chosen.items()}
    too_big = {k: "; ".join(ws) for k, ws in why.items() if ws}
    chosen = {k: p for k, p in chosen.items() if k not in too_big}
    batches = ([chosen] if together else [{k: p} for k, p in chosen.items()]) * repeats
    # per plan, the median step of each run (after warm-up), and the throttle's score
    runs: dict[str, list[float]] = {k: [] for k in chosen}
    scores = {k: dict.fromkeys(Clock.KEYS, 0.0) for k in chosen}
    for batch in batches:
        times, score = _measure(cfg, batch)
        for k in batch:
            runs[k].append(statistics.median(times[k][cfg.warmup :]))
            scores[k] = {n: scores[k][n] + score[k][n] for n in Clock.KEYS}
    rows: list[dict[str, Any]] = []
    for name, p in chosen.items():
        measured = statistics.median(runs[name])
        run = as_run(p, cfg.batch)
        predicted = evaluate(w, raw_devs, run).batch_time_s
        calibrated = evaluate(w, cal_devs, run, cal.latency_s).batch_time_s
        sc = scores[name]
        rows.append({
            "plan": name, "groups": [[(s.device, s.first, s.end) for s in g.stages]
                                     for g in p.groups],
            "batches": whole_batches(p, cfg.batch),
            "measured_ms": measured * 1e3, "runs_ms": [t * 1e3 for t in runs[name]],
            "predicted_ms": predicted * 1e3, "calibrated_ms": calibrated * 1e3,
            "error": predicted / measured - 1, "error_calibrated": calibrated / measured - 1,
            "overrun_share": sc["overruns"] / max(sc["calls"], 1),
            "overrun_ms_per_step": sc["overrun_s"] * 1e3 / (repeats * cfg.steps),
        })  # fmt: skip
    by = {r["plan"]: r for r in rows}
    for r in rows:
        r["speedup_vs_even_dp"] = by["even-dp"]["measured_ms"] / r["measured_ms"]
        r["predicted_speedup_vs_even_dp"] = by["even-dp"]["calibrated_ms"] / r["calibrated_ms"]
    fastest = min((r for r in rows if r["plan"] in BASELINE_ROWS), key=lambda r: r["measured_ms"])
    mine = by["planner-calibrated"]

    def speedup(base: dict[str, Any]) -> dict[str, Any]:
        """The planner's speedup over ``base``: per run (paired), mean and
        95% interval; and the calibrated model's prediction of it."""
        est = mean_ci([b / m for b, m in zip(base["runs_ms"], mine["runs_ms"], strict=True)])
        return {"mean": est.mean, "half": est.half, "runs": est.n,
                "predicted": base["calibrated_ms"] / mine["calibrated_ms"]}  # fmt: skip

    errs = [abs(r["error"]) for r in rows]
    cal_errs = [abs(r["error_calibrated"]) for r in rows]
    total = {n: sum(sc[n] for sc in scores.values()) for n in ("calls", "overruns", "late_s")}
    summary = {
        "plans": len(rows), "repeats": repeats, "device_gflops": cfg.device_gflops,
        "devices": cfg.devices, "quota_cores": cfg.quota_cores if cfg.devices == "quota" else None,
        "not_run": too_big,
        "fitted_and_judged": [k for k, p in chosen.items() if p in fitted],
        "overrun_share": total["overruns"] / max(total["calls"], 1),
        "late_us_per_call": total["late_s"] * 1e6 / max(total["calls"], 1),
        "calibration": asdict(cal),
        "calibration_measured_ms": {k: v * 1e3 for k, v in cal_times.items()},
        "median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
        "median_abs_error_calibrated": statistics.median(cal_errs),
        "worst_abs_error_calibrated": max(cal_errs),
        "best_baseline": fastest["plan"],
        "planner_vs_best_baseline": speedup(fastest),
        "planner_vs_even_dp": speedup(by["even-dp"]),
        "planner_vs_even_pipeline": speedup(by["even-pipeline"]),
    }  # fmt: skip
    return {"rows": rows, "summary": summary}


def speedup(summary: dict[str, Any], against: str) -> str:
    """``run_plans``'s speedup of the planner over a baseline (``best_baseline``,
    ``even_dp``, ``even_pipeline``), as text."""
    s = summary[f"planner_vs_{against}"]
    return f"{s['mean']:.2f}x ± {s['half']:.2f} ({s['runs']} runs; predicted {s['predicted']:.2f}x)"


RULES = {"even-dp": even_dp, "proportional-dp": proportional_dp, "even-pipeline": even_pipeline}
# the baselines as executed: each rule on every device, and on its best subset
BASELINE_ROWS = (*RULES, *(f"{n}-best" for n in RULES))


def best_subsets(
    w: Workload, devs: list[Device], lat: float, have: dict[str, Plan]
) -> dict[str, Plan]:
    """Each baseline rule on the device subset where the (calibrated) cost
    model finds it fastest among the plans that split the batch into whole
    micro-batches (those that can run), the freedom the planner has
    (``{rule}-best``; left out where that is a plan already run)."""
    out = {}
    for name, rule in RULES.items():
        got = best_subset(rule, w, devs, lat, functools.partial(splits_whole, total=w.batch))[0]
        if got not in have.values():
            out[f"{name}-best"] = got
    return out


def _measure(
    cfg: ExecConfig, chosen: dict[str, Plan], allreduce: bool = False
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Per plan, its step times (each the slowest rank's) and the throttle's
    score summed over ranks."""
    from gradfabric.net.launch import spawn
    from gradfabric.net.netns import shaped_star

    require_fits(workload(cfg), devices(cfg), chosen)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        hosts = (stack.enter_context(shaped_star(len(cfg.speeds), cfg.link_gbps)) if cfg.shaped
                 else None)  # fmt: skip
        spawn(_rank, len(cfg.speeds), (cfg, chosen, allreduce, tmp), threads=1, deadline_s=900,
              hosts=hosts)  # fmt: skip
        got: tuple[dict[str, list[float]], dict[str, dict[str, float]]] = torch.load(
            os.path.join(tmp, "times.pt"))  # fmt: skip
    return got


def _rank(
    rank: int, world: int, cfg: ExecConfig, chosen: dict[str, Plan], allreduce: bool, out: str
) -> None:
    where, speed, sample_s = _device(cfg, rank)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    y = torch.randn(cfg.batch, cfg.width, generator=g)
    runners = {}
    for name, p in chosen.items():
        torch.manual_seed(cfg.seed)
        runners[name] = PlanRunner(p, mlp_stack(cfg.layers, cfg.width), nn.functional.mse_loss,
                                   cfg.batch, lambda ps: torch.optim.SGD(ps, lr=0.01), x[:1],
                                   speed=speed, layer_sample_s=sample_s)  # fmt: skip
    grads = torch.zeros(sum(workload(cfg).params))
    steps: dict[str, Any] = {k: r.step for k, r in runners.items()}
    if allreduce:  # the model's gradients summed over every rank, as a ring would
        steps["allreduce"] = lambda x, y: dist.all_reduce(grads)
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    with where:  # (after the runners: their process groups' threads stay out of a quota)
        for step in range(cfg.steps):
            for name in names[step % len(names) :] + names[: step % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                steps[name](x, y)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
                times[name].append(float(took))
    throttle = {k: throttle_score([r.throttle_stats()]) for k, r in runners.items()}
    if rank == 0:
        torch.save((times, throttle), os.path.join(out, "times.pt"))


def throttle_score(stats: list[dict[str, float]]) -> dict[str, float]:
    """``Clock`` scores summed over this rank's runners and then over every
    rank (a collective: every rank calls it)."""
    total = torch.tensor([sum(s[k] for s in stats) for k in Clock.KEYS], dtype=torch.float64)
    dist.all_reduce(total)
    return dict(zip(Clock.KEYS, total.tolist(), strict=True))


# Where the cost model looks for the planner's largest gain on this host's
# emulated cluster (``predicted_gains``): link rates, MLP widths, depths and
# batches. STEP_BUDGET_S: the longest predicted step a run of repeated,
# interleaved plans affords on 2 cores (so the setting found can be run).
GAIN_GRID: dict[str, tuple[float, ...]] = {
    "link_gbps": (0.1, 0.25, 0.5, 1.0, 10.0),
    "width": (256, 512, 1024),
    "layers": (8, 16),
    "batch": (32, 96, 192),
}
STEP_BUDGET_S = 0.4
GRID_LATENCY_S = 5e-4  # a pipeline hop, as calibrations on this host find it (0.5-1 ms)


def predicted_gains(base: ExecConfig) -> list[dict[str, Any]]:
    """The planner's predicted speed-up over the best baseline at its best
    (each rule of ``RULES`` on its best device subset) at every setting of
    ``GAIN_GRID`` on ``base``'s devices, largest first; each row with both
    plans and their compute and gradient-sync times (why the one wins)."""
    rows = []
    for link, width, layers, batch in itertools.product(*GAIN_GRID.values()):
        cfg = replace(base, link_gbps=link, width=int(width), layers=int(layers), batch=int(batch))
        w, devs, lat = workload(cfg), devices(cfg), GRID_LATENCY_S
        runs = {"planner": search_plan(w, devs, lat).plan}
        runnable_here = functools.partial(splits_whole, total=cfg.batch)
        runs |= {n: best_subset(rule, w, devs, lat, runnable_here)[0] for n, rule in RULES.items()}
        est = {n: evaluate(w, devs, as_run(p, cfg.batch), lat) for n, p in runs.items()
               if splits_whole(p, cfg.batch)}  # fmt: skip
        if "planner" not in est:
            continue
        best = min((n for n in est if n != "planner"), key=lambda n: est[n].batch_time_s)
        rows.append({
            "link_gbps": link, "width": cfg.width, "layers": cfg.layers, "batch": cfg.batch,
            "gain": est[best].batch_time_s / est["planner"].batch_time_s,
            "planner_ms": est["planner"].batch_time_s * 1e3, "best_baseline": best,
            "baseline_ms": est[best].batch_time_s * 1e3,
            "why": "; ".join(
                f"{n} {runs[n].describe()}: compute {max(est[n].group_times_s) * 1e3:.0f} ms "
                f"+ gradient sync {est[n].sync_s * 1e3:.0f} ms" for n in ("planner", best)),
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["gain"])


def runnable(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``predicted_gains``' rows whose plans all fit the step
    budget (the largest predicted gain this host can run)."""
    fit = [r for r in rows if max(r["planner_ms"], r["baseline_ms"]) <= STEP_BUDGET_S * 1e3]
    if not fit:
        raise ValueError(f"no setting of the grid has steps within {STEP_BUDGET_S} s")
    return fit[0]
