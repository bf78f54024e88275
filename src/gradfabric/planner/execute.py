"""Plans run for real on throttled processes, beside the cost model's prediction.

``run_plans`` spawns one gloo process per emulated device (rank ``r`` runs at
``speeds[r]`` of a host core: ``pipeline.Throttled``) and trains an MLP stack
(``layers`` blocks of ``Linear(width, width) + Tanh``) under three plans side
by side, steps interleaved: the planner's own plan for these devices, even
data parallelism over all of them, and an even pipeline over all of them.
Each row: the plan, its measured step time (median over ranks' slowest), the
cost model's predicted batch time for the same plan, and the relative error.

The cost model sees the host as a device type whose FLOP/s is measured here
first (forward and backward of one block on one core, ``calibrate_flops``),
each device at its throttle's speed factor, and links at ``link_gbps``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.planner.baselines import even_dp, even_pipeline
from gradfabric.planner.cost import Device, Plan, Workload, evaluate
from gradfabric.planner.pipeline import PlanRunner
from gradfabric.planner.search import plan as search_plan
from gradfabric.planner.spec import DeviceType


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

    def __post_init__(self) -> None:
        if len(self.speeds) < 2 or not all(0 < s <= 1 for s in self.speeds):
            raise ValueError("need >= 2 speeds in (0, 1]")
        if self.steps <= self.warmup or self.layers < len(self.speeds):
            raise ValueError("need steps > warmup and at least one layer per device")


def mlp_stack(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)))  # fmt: skip


def workload(cfg: ExecConfig) -> Workload:
    w = cfg.width
    return Workload("mlp-stack", (2.0 * w * w,) * cfg.layers, (w * w + w,) * cfg.layers,
                    (4 * w,) * cfg.layers, cfg.batch)  # fmt: skip


def calibrate_flops(width: int, batch: int, repeats: int = 5) -> float:
    """FLOP/s of one core on a block's forward and backward (3x forward FLOPs)."""
    torch.set_num_threads(1)
    block = mlp_stack(1, width)
    x = torch.randn(batch, width)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        block(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return 3 * 2.0 * width * width * batch / statistics.median(times[1:])


def devices(cfg: ExecConfig, flops: float) -> list[Device]:
    host = DeviceType("host-core", peak_tflops=flops / 1e12, mem_gb=8.0, cost_per_hour=0.0,
                      nic_gbps=cfg.link_gbps, efficiency=1.0)  # fmt: skip
    return [Device(i, host, s) for i, s in enumerate(cfg.speeds)]


def plans(cfg: ExecConfig, devs: list[Device]) -> dict[str, Plan]:
    w = workload(cfg)
    return {
        "planner": search_plan(w, devs).plan,
        "even-dp": even_dp(w, devs),
        "even-pipeline": even_pipeline(w, devs, depth=len(devs)),
    }


def run_plans(cfg: ExecConfig) -> list[dict[str, Any]]:
    """Measure every plan; rows with predicted and measured step times."""
    from gradfabric.collectives.spawn import spawn

    flops = calibrate_flops(cfg.width, cfg.batch // len(cfg.speeds))
    devs = devices(cfg, flops)
    chosen = plans(cfg, devs)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, len(cfg.speeds), (cfg, chosen, tmp), threads=1, deadline_s=900)
        times: dict[str, list[float]] = torch.load(os.path.join(tmp, "times.pt"))
    w = workload(cfg)
    rows: list[dict[str, Any]] = []
    for name, p in chosen.items():
        measured = statistics.median(times[name][cfg.warmup :])
        predicted = evaluate(w, devs, p).batch_time_s
        rows.append({
            "plan": name, "groups": [[(s.device, s.first, s.end) for s in g.stages]
                                     for g in p.groups],
            "batches": [round(g.batch, 2) for g in p.groups],
            "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
            "error": predicted / measured - 1, "host_gflops": flops / 1e9,
        })  # fmt: skip
    base = next(r for r in rows if r["plan"] == "even-dp")
    for r in rows:
        r["speedup_vs_even_dp"] = base["measured_ms"] / r["measured_ms"]
        r["predicted_speedup_vs_even_dp"] = base["predicted_ms"] / r["predicted_ms"]
    return rows


def _rank(rank: int, world: int, cfg: ExecConfig, chosen: dict[str, Plan], out: str) -> None:
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    y = torch.randn(cfg.batch, cfg.width, generator=g)
    runners = {}
    for name, p in chosen.items():
        torch.manual_seed(cfg.seed)
        runners[name] = PlanRunner(p, mlp_stack(cfg.layers, cfg.width), nn.functional.mse_loss,
                                   cfg.batch, lambda ps: torch.optim.SGD(ps, lr=0.01), x[:1],
                                   speed=cfg.speeds[rank])  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for step in range(cfg.steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            runners[name].step(x, y)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
            times[name].append(float(took))
    if rank == 0:
        torch.save(times, os.path.join(out, "times.pt"))


def config_dict(cfg: ExecConfig) -> dict[str, Any]:
    return asdict(cfg)
