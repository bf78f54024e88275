"""One job trained across the slots of a speed trace, re-planned for real.

``train_plan`` is the online controller (``planner.online``) driving the
runtime (``planner.pipeline``): one gloo process per emulated device (rank
``r`` at ``speeds[r]`` of the reference device, the deadline throttle of
``execute``, times the trace's factor for the slot; a factor of 0 takes the
device away), an MLP stack (``execute.mlp_stack``)
trained with momentum SGD to match a seeded teacher stack. Before each slot
the controller picks a plan for the devices as they are now, weighing the
step time against the migration's cost (its term: the fp32 parameters a
device gains, over its NIC); every rank then calls ``PlanRunner.replan``,
which sends each layer, with its optimizer state, to each rank that will
hold it and does not, and ``steps_per_slot`` steps run under the new plan.

Per slot: the plan, the controller's predicted step time and migration term,
the measured step time (median over the slot's steps, each ending with its
slowest rank), the measured migration (the transfers' wall time on the
slowest receiver, and the whole re-plan with its new process groups and
stages), the bytes moved, and the loss beside that of the unsplit model
trained on the full batch in one process (same initialisation, data and
optimizer): a plan changes where the arithmetic runs, not what it computes,
so the curves agree to the dtype's rounding.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.planner.cost import Device, Plan, evaluate
from gradfabric.planner.execute import (
    ExecConfig,
    calibrate,
    mlp_stack,
    reference,
    throttle_score,
    workload,
)
from gradfabric.planner.online import Trace, migration_bytes, run_online
from gradfabric.planner.pipeline import PlanRunner, as_run, splits_whole

# The built-in trace (factors on top of each device's speed): all present; the
# second device contended to 30%; the first leaves; it returns; all as at first.
DEFAULT_TRACE: Trace = [
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [0.0, 0.3, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
]


def default_trace(devices: int) -> Trace:
    """``DEFAULT_TRACE`` for ``devices`` devices (those past the fourth stay at 1)."""
    return [(f + [1.0] * devices)[:devices] for f in DEFAULT_TRACE]


@dataclass(frozen=True)
class TrainPlanConfig:
    """The emulated cluster and model (``exec``: speeds, layers, width, batch,
    the link the controller assumes, the seed) and the training run."""

    exec: ExecConfig = field(default_factory=lambda: ExecConfig(width=256))
    steps_per_slot: int = 6
    lr: float = 0.5
    momentum: float = 0.9
    dtype: str = "float32"  # or float64 (the tests' exactness check)
    v: float = 1000.0
    calibrate: bool = True  # the controller's cost model calibrated first (bench plan's way)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.steps_per_slot < 2:
            raise ValueError("need >= 2 steps per slot (the first of a slot warms up)")


def _model(cfg: TrainPlanConfig) -> nn.Sequential:
    torch.manual_seed(cfg.exec.seed)
    return mlp_stack(cfg.exec.layers, cfg.exec.width).to(getattr(torch, cfg.dtype))


@functools.cache
def _teacher(cfg: TrainPlanConfig) -> nn.Sequential:
    torch.manual_seed(cfg.exec.seed + 7919)
    return mlp_stack(cfg.exec.layers, cfg.exec.width).to(getattr(torch, cfg.dtype))


def _data(cfg: TrainPlanConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: inputs and a fixed teacher's outputs (another
    stack of the same shape, so the student can fit it)."""
    g = torch.Generator().manual_seed(cfg.exec.seed * 1_000_003 + step)
    x = torch.randn(cfg.exec.batch, cfg.exec.width, generator=g, dtype=getattr(torch, cfg.dtype))
    with torch.no_grad():
        return x, _teacher(cfg)(x)


def _opt(cfg: TrainPlanConfig) -> Any:
    return lambda ps: torch.optim.SGD(ps, lr=cfg.lr, momentum=cfg.momentum)


def describe(plan: Plan) -> str:
    """``[0:0-4 1:4-8] [2:0-8]``: per group, each stage's device and layers."""
    return " ".join("[" + " ".join(f"{s.device}:{s.first}-{s.end}" for s in g.stages) + "]"
                    for g in plan.groups)  # fmt: skip


def reference_losses(cfg: TrainPlanConfig, steps: int) -> list[float]:
    """The unsplit model on the full batch, in this process."""
    model = _model(cfg)
    opt = _opt(cfg)(list(model.parameters()))
    out = []
    for step in range(steps):
        x, y = _data(cfg, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(float(loss.detach()))
    return out


def train_plan(cfg: TrainPlanConfig, trace: Trace | None = None) -> dict[str, Any]:
    """Run the job over ``trace`` (default ``default_trace``); rows per slot
    and a summary (see the module doc)."""
    from gradfabric.collectives.spawn import spawn

    trace = default_trace(len(cfg.exec.speeds)) if trace is None else trace
    if any(len(f) != len(cfg.exec.speeds) for f in trace):
        raise ValueError(f"every slot of the trace needs {len(cfg.exec.speeds)} factors")
    speeds = [[s * f for s, f in zip(cfg.exec.speeds, fs, strict=True)] for fs in trace]
    w, model_cfg, lat = workload(cfg.exec), cfg.exec, 5e-6
    model_flops = cfg.exec.device_gflops * 1e9
    if cfg.calibrate:
        cal, _ = calibrate(cfg.exec)
        model_cfg, model_flops, lat = (
            replace(cfg.exec, link_gbps=cal.link_gbps),
            cal.flops,
            cal.latency_s,
        )
    host = reference(model_cfg, model_flops)  # (the trace's factors are speeds on top of it)

    online = run_online(w, [host] * len(cfg.exec.speeds), speeds, 0.0, cfg.v, cfg.steps_per_slot,
                        baselines=False, admissible=lambda p: splits_whole(p, cfg.exec.batch),
                        latency_s=lat,
                        state_copies=1.0 if cfg.momentum else 0.0)  # fmt: skip
    plans = online.plans
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, len(cfg.exec.speeds), (cfg, plans, speeds, tmp), threads=1, deadline_s=900)
        got: dict[str, Any] = torch.load(os.path.join(tmp, "slots.pt"))
    ref = reference_losses(cfg, len(trace) * cfg.steps_per_slot)
    rows: list[dict[str, Any]] = []
    k = cfg.steps_per_slot
    for t, (plan, rec) in enumerate(zip(plans, online.slots, strict=True)):
        devs = [Device(i, host, sp) for i, sp in enumerate(speeds[t])]
        losses, want = got["losses"][t * k : (t + 1) * k], ref[t * k : (t + 1) * k]
        before = plans[t - 1] if t else None
        gained = migration_bytes(w, before, plan) if before is not None else {}
        rows.append({
            "slot": t, "factors": trace[t],
            "plan": describe(plan),
            "groups": [[(s.device, s.first, s.end) for s in g.stages] for g in plan.groups],
            "predicted_step_ms": evaluate(w, devs, as_run(plan, cfg.exec.batch),
                                          lat).batch_time_s * 1e3,
            "measured_step_ms": statistics.median(got["step_s"][t * k + 1 : (t + 1) * k]) * 1e3,
            "predicted_migration_ms": rec.migration_s * 1e3,
            "predicted_param_mb": sum(gained.values()) / 1e6,
            "measured_migration_ms": got["move_s"][t] * 1e3,
            "replan_ms": got["replan_s"][t] * 1e3,
            "moved_mb": got["moved"][t] / 1e6,
            "loss": losses[-1], "reference_loss": want[-1],
            "loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)),
        })  # fmt: skip
    summary = {
        "slots": len(rows), "steps": len(ref), "dtype": cfg.dtype,
        "device_gflops": cfg.exec.device_gflops, "throttle": got["throttle"],
        "model_gflops": model_flops / 1e9, "model_latency_ms": lat * 1e3,
        "model_link_gbps": model_cfg.link_gbps,
        "max_loss_rel_diff": max(r["loss_rel_diff"] for r in rows),
        "first_loss": ref[0], "last_loss": ref[-1],
        "migrations": sum(1 for r in rows if r["moved_mb"] > 0),
    }  # fmt: skip
    return {"rows": rows, "summary": summary}


def _rank(
    rank: int, world: int, cfg: TrainPlanConfig, plans: list[Plan], speeds: list[list[float]],
    out: str,
) -> None:  # fmt: skip
    sample_s, scores = cfg.exec.sample_s, []
    rec: dict[str, list[float]] = {k: [] for k in ("losses", "step_s", "move_s", "replan_s",
                                                   "moved")}  # fmt: skip
    runner: PlanRunner | None = None
    step = 0
    for t, plan in enumerate(plans):
        speed = speeds[t][rank] or 1.0  # (a device the plan leaves out runs nothing)
        if runner is None:
            first = _data(cfg, 0)[0][:1]
            runner = PlanRunner(plan, _model(cfg), nn.functional.mse_loss, cfg.exec.batch,
                                _opt(cfg), first, speed=speed, layer_sample_s=sample_s)  # fmt: skip
            took = 0.0
        else:
            scores.append(runner.throttle_stats())
            runner, took = runner.replan(plan, speed)
        slowest = torch.tensor([runner.moved_s, took], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        moved = torch.tensor([float(runner.moved_bytes)], dtype=torch.float64)
        dist.all_reduce(moved)
        rec["move_s"].append(float(slowest[0]))
        rec["replan_s"].append(float(slowest[1]))
        rec["moved"].append(float(moved[0]))
        for _ in range(cfg.steps_per_slot):
            x, y = _data(cfg, step)
            dist.barrier()
            t0 = time.perf_counter()
            loss = runner.step(x, y)
            took_step = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took_step, op=dist.ReduceOp.MAX)
            # the full batch's loss: each group's mean, weighted by its samples
            share = runner.batches[runner.role.group] / runner.total if runner.active else 0.0
            part = torch.tensor([0.0 if loss is None else loss * share], dtype=torch.float64)
            dist.all_reduce(part)
            rec["step_s"].append(float(took_step))
            rec["losses"].append(float(part))
            step += 1
    got: dict[str, Any] = {**rec, "throttle": throttle_score(
        [*scores, runner.throttle_stats()] if runner else scores)}  # fmt: skip
    if rank == 0:
        torch.save(got, os.path.join(out, "slots.pt"))
