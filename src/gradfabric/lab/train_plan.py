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

The controller against fixed rules on the same changing cluster (``train-plan
--compare``, ``SCHEDULES``): each device has a price per hour (by default in
proportion to its speed, so every device buys the same throughput per dollar
and only using fewer of them saves) and the job a budget (by default 75% of
all the devices' price). Each schedule's plans are fixed before the run from
the calibrated cost model at each slot's speeds, then every schedule trains
the same job from the same initialisation through the same trace, the
schedules in turn and rotated each repeat. Per schedule: the time-averaged
step (all steps and re-plans, wall time, over the steps), the price per hour
averaged over the slots (what the budget bounds) and per batch, and the
controller's speed-up over it, paired per repeat.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.core.errors import ConfigError
from gradfabric.core.stats import mean_ci
from gradfabric.lab.plan_bench import (
    ExecConfig,
    calibrate,
    mlp_stack,
    reference,
    throttle_score,
    workload,
)
from gradfabric.planner.baselines import best_subset, proportional_dp
from gradfabric.planner.cost import Device, Plan, Workload, evaluate
from gradfabric.planner.online import (
    CONTROLLER_EXHAUSTIVE_UPTO,
    Trace,
    migration_bytes,
    migration_s,
    run_online,
)
from gradfabric.planner.pipeline import PlanRunner, as_run, splits_whole
from gradfabric.planner.search import plan as search_plan
from gradfabric.planner.spec import DeviceType

# The built-in trace (factors on top of each device's speed): all present; the
# second device contended to 30%; the first leaves; it returns; all as at first.
DEFAULT_TRACE: Trace = [
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [0.0, 0.3, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
]


# The comparison's built-in trace: twelve slots, twice. The fourth device joins
# in the third slot; the second is contended to 30% for three slots; the first
# is preempted for three (the last of the second's among them); the third runs
# at half speed for two; then all at full speed. (Its second pass preempts the
# fourth device for two slots, where the first pass had it join.)
CHANGING_TRACE: Trace = [
    [1.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [1.0, 0.3, 1.0, 1.0],
    [0.0, 0.3, 1.0, 1.0],
    [0.0, 1.0, 1.0, 1.0],
    [0.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 0.5, 1.0],
    [1.0, 1.0, 0.5, 1.0],
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0],
] * 2

SCHEDULES = {
    "controller": "the Lyapunov controller (step time and migration; the queue keeps the budget)",
    "static": "the best static plan in hindsight (devices present throughout, within the budget)",
    "greedy": "re-planned every slot without the queue (the budget ignored)",
    "proportional": "speed-proportional DP re-balanced to each slot's speeds (best subset)",
}
PRICE_PER_SPEED = 4.0  # $/h of a device at speed 1, by default (prices in proportion to speed)
BUDGET_SHARE = 0.75  # the default budget: this share of all the devices' price


def default_trace(devices: int) -> Trace:
    """``DEFAULT_TRACE`` for ``devices`` devices (those past the fourth stay at 1)."""
    return _fit(DEFAULT_TRACE, devices)


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
    prices: tuple[float, ...] = ()  # $/h per device; () = PRICE_PER_SPEED x its speed
    budget: float | None = None  # $/h; None = BUDGET_SHARE of all the devices' price
    schedules: tuple[str, ...] = ("controller",)  # which of SCHEDULES run
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.steps_per_slot < 2:
            raise ValueError("need >= 2 steps per slot (the first of a slot warms up)")
        if self.prices and (len(self.prices) != len(self.exec.speeds)
                            or min(self.prices) < 0):  # fmt: skip
            raise ValueError(f"prices: one price >= 0 per device ({len(self.exec.speeds)})")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"budget must be > 0 $/h, got {self.budget}")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if not self.schedules or unknown:
            raise ValueError(f"schedules must be among {', '.join(SCHEDULES)}, got {unknown}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    @property
    def device_prices(self) -> tuple[float, ...]:
        return self.prices or tuple(PRICE_PER_SPEED * s for s in self.exec.speeds)

    @property
    def budget_per_hour(self) -> float:
        return BUDGET_SHARE * sum(self.device_prices) if self.budget is None else self.budget

    @property
    def state_copies(self) -> float:
        """Optimizer state per parameter that moves with it (momentum: 1)."""
        return 1.0 if self.momentum else 0.0


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


def changing_trace(devices: int) -> Trace:
    """``CHANGING_TRACE`` for ``devices`` devices (those past the fourth stay at 1)."""
    return _fit(CHANGING_TRACE, devices)


def _fit(trace: Trace, devices: int) -> Trace:
    return [(f + [1.0] * devices)[:devices] for f in trace]


def _devices(cfg: TrainPlanConfig, host: DeviceType, speeds: list[float]) -> list[Device]:
    priced = zip(cfg.device_prices, speeds, strict=True)
    return [Device(i, replace(host, cost_per_hour=c), sp) for i, (c, sp) in enumerate(priced)]


def best_static(
    w: Workload, slots: list[list[Device]], budget: float, lat: float,
    admissible: Callable[[Plan], bool],
) -> Plan:  # fmt: skip
    """The best static plan in hindsight: among the planner's plans for every
    subset of the devices present in every slot (planned at each slot's
    speeds), the one within ``budget`` whose predicted batch time, summed
    over the slots, is least."""
    always = [d.index for d in slots[0] if all(devs[d.index].speed > 0 for devs in slots)]
    if not always:
        raise ConfigError("trace", "no device is present in every slot: no static plan runs")
    cands: set[Plan] = set()
    for devs in slots:
        for k in range(1, len(always) + 1):
            for keep in itertools.combinations(always, k):
                sub = [d if d.index in keep else replace(d, speed=0.0) for d in devs]
                try:
                    p = search_plan(w, sub, lat, CONTROLLER_EXHAUSTIVE_UPTO).plan
                except ValueError:
                    continue
                if admissible(p) and evaluate(w, devs, p, lat).cost_per_hour <= budget:
                    cands.add(p)
    if not cands:
        raise ConfigError("budget", f"no static plan on devices {always} fits {budget:g} $/h")
    batch = w.batch
    return min(sorted(cands, key=Plan.describe), key=lambda p: sum(
        evaluate(w, devs, as_run(p, batch), lat).batch_time_s for devs in slots))  # fmt: skip


def schedule_plans(
    cfg: TrainPlanConfig, w: Workload, slots: list[list[Device]], lat: float
) -> dict[str, list[Plan]]:  # fmt: skip
    """Each schedule's plan for every slot (``SCHEDULES``), on the cost model
    ``slots`` describe (devices at each slot's speeds, priced)."""

    def admissible(p: Plan) -> bool:
        return splits_whole(p, cfg.exec.batch)

    types, speeds = [d.type for d in slots[0]], [[d.speed for d in devs] for devs in slots]
    online = functools.partial(
        run_online,
        w,
        types,
        speeds,
        v=cfg.v,
        iterations_per_slot=cfg.steps_per_slot,
        baselines=False,
        admissible=admissible,
        latency_s=lat,
        state_copies=cfg.state_copies,
    )
    out: dict[str, list[Plan]] = {}
    for name in cfg.schedules:
        if name == "controller":
            out[name] = online(cfg.budget_per_hour).plans
        elif name == "greedy":  # the queue never grows: the budget plays no part
            out[name] = online(math.inf).plans
        elif name == "static":
            out[name] = [best_static(w, slots, cfg.budget_per_hour, lat, admissible)] * len(slots)
        else:
            out[name] = [best_subset(proportional_dp, w, devs, lat)[0] for devs in slots]
    return out  # fmt: skip


def train_plan(cfg: TrainPlanConfig, trace: Trace | None = None) -> dict[str, Any]:
    """Run the job over ``trace`` (default ``default_trace``) under each of
    ``cfg.schedules``, ``cfg.repeats`` times; per-slot rows, one row per
    schedule and a summary (see the module doc)."""
    from gradfabric.net.launch import spawn

    trace = default_trace(len(cfg.exec.speeds)) if trace is None else trace
    if not trace:
        raise ValueError("a trace needs at least one slot")
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
    slots = [_devices(cfg, host, sp) for sp in speeds]
    plans = schedule_plans(cfg, w, slots, lat)
    # the schedules in turn, rotated each repeat: the host's noise falls on all
    order = [(cfg.schedules[(i + r) % len(cfg.schedules)], r)
             for r in range(cfg.repeats) for i in range(len(cfg.schedules))]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, len(cfg.exec.speeds), (cfg, [plans[n] for n, _ in order], speeds, tmp),
              threads=1, deadline_s=900 + 300 * len(order))  # fmt: skip
        got: dict[str, Any] = torch.load(os.path.join(tmp, "slots.pt"))
    ref = reference_losses(cfg, len(trace) * cfg.steps_per_slot)
    runs: dict[str, list[dict[str, list[float]]]] = {n: [] for n in cfg.schedules}
    for (name, _), rec in zip(order, got["runs"], strict=True):
        runs[name].append(rec)
    rows = [
        row
        for n in cfg.schedules
        for row in _slot_rows(cfg, w, slots, lat, trace, n, plans[n], runs[n][0], ref)
    ]
    table = [_schedule_row(cfg, w, slots, lat, n, plans[n], runs[n], ref, runs.get("controller"))
             for n in cfg.schedules]  # fmt: skip
    first = [r for r in rows if r["schedule"] == cfg.schedules[0]]
    summary = {
        "slots": len(trace), "steps": len(ref), "dtype": cfg.dtype, "repeats": cfg.repeats,
        "device_gflops": cfg.exec.device_gflops, "throttle": got["throttle"],
        "model_gflops": model_flops / 1e9, "model_latency_ms": lat * 1e3,
        "model_link_gbps": model_cfg.link_gbps,
        "prices_per_hour": list(cfg.device_prices), "budget_per_hour": cfg.budget_per_hour,
        "max_loss_rel_diff": max(r["loss_rel_diff"] for r in table),
        "first_loss": ref[0], "last_loss": ref[-1],
        "migrations": sum(1 for r in first if r["moved_mb"] > 0),
        "schedules": {r["schedule"]: r for r in table},
    }  # fmt: skip
    return {"rows": rows, "schedules": table, "summary": summary}


def _predicted(
    cfg: TrainPlanConfig, w: Workload, slots: list[list[Device]], lat: float, plans: list[Plan]
) -> list[tuple[float, float, float]]:  # fmt: skip
    """Per slot: the cost model's step time, migration term and price per hour."""
    out = []
    for t, (devs, plan) in enumerate(zip(slots, plans, strict=True)):
        est = evaluate(w, devs, as_run(plan, cfg.exec.batch), lat)
        mig = migration_s(w, devs, plans[t - 1] if t else None, plan, cfg.state_copies)
        out.append((est.batch_time_s, mig, est.cost_per_hour))
    return out


def _slot_rows(
    cfg: TrainPlanConfig, w: Workload, slots: list[list[Device]], lat: float, trace: Trace,
    name: str, plans: list[Plan], rec: dict[str, list[float]], ref: list[float],
) -> list[dict[str, Any]]:  # fmt: skip
    k, rows = cfg.steps_per_slot, []
    for t, (plan, (step_s, mig_s, price)) in enumerate(
            zip(plans, _predicted(cfg, w, slots, lat, plans), strict=True)):  # fmt: skip
        losses, want = rec["losses"][t * k : (t + 1) * k], ref[t * k : (t + 1) * k]
        gained = migration_bytes(w, plans[t - 1], plan) if t else {}
        rows.append({
            "schedule": name, "slot": t, "factors": trace[t],
            "plan": plan.describe(),
            "groups": [[(s.device, s.first, s.end) for s in g.stages] for g in plan.groups],
            "price_per_hour": price,
            "predicted_step_ms": step_s * 1e3,
            "measured_step_ms": statistics.median(rec["step_s"][t * k + 1 : (t + 1) * k]) * 1e3,
            "predicted_migration_ms": mig_s * 1e3,
            "predicted_param_mb": sum(gained.values()) / 1e6,
            "measured_migration_ms": rec["move_s"][t] * 1e3,
            "replan_ms": rec["replan_s"][t] * 1e3,
            "moved_mb": rec["moved"][t] / 1e6,
            "loss": losses[-1], "reference_loss": want[-1],
            "loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)),
        })  # fmt: skip
    return rows


def _schedule_row(
    cfg: TrainPlanConfig, w: Workload, slots: list[list[Device]], lat: float, name: str,
    plans: list[Plan], recs: list[dict[str, list[float]]], ref: list[float],
    controller: list[dict[str, list[float]]] | None,
) -> dict[str, Any]:  # fmt: skip
    """One schedule over the whole trace: the time-averaged step (every step
    and every re-plan's wall time, over the steps), the price per hour
    averaged over the slots (the controller's budget is on that) and per
    batch (each slot's price for its wall time), the model's prediction, and
    the controller's speed-up over it paired per repeat."""
    k, pred = cfg.steps_per_slot, _predicted(cfg, w, slots, lat, plans)

    def wall(rec: dict[str, list[float]]) -> list[float]:  # per slot
        return [sum(rec["step_s"][t * k : (t + 1) * k]) + rec["replan_s"][t]
                for t in range(len(slots))]  # fmt: skip

    per_step = [sum(wall(rec)) / len(ref) for rec in recs]
    dollars = [sum(p * s for (_, _, p), s in zip(pred, wall(rec), strict=True)) / 3600 / len(ref)
               for rec in recs]  # fmt: skip
    price = sum(p for _, _, p in pred) / len(pred)
    step, cost = mean_ci(per_step), mean_ci(dollars)
    row: dict[str, Any] = {
        "schedule": name, "what": SCHEDULES[name],
        "step_ms": step.mean * 1e3, "step_ms_half": step.half * 1e3,
        "predicted_step_ms": sum(k * s + m for s, m, _ in pred) / len(ref) * 1e3,
        "price_per_hour": price, "over_budget": price / cfg.budget_per_hour - 1,
        "dollars_per_1k_batches": cost.mean * 1e3, "dollars_per_1k_batches_half": cost.half * 1e3,
        "replans": sum(1 for a, b in itertools.pairwise(plans) if a != b),
        "moved_mb": sum(recs[0]["moved"]) / 1e6,
        "loss_rel_diff": max(abs(a - b) / abs(b) for rec in recs
                             for a, b in zip(rec["losses"], ref, strict=True)),
        "runs": len(recs),
    }  # fmt: skip
    if controller is not None:
        mine = [sum(wall(rec)) for rec in controller]
        ratio = mean_ci([sum(wall(o)) / m for o, m in zip(recs, mine, strict=True)])
        row |= {"controller_speedup": ratio.mean, "controller_speedup_half": ratio.half}
    return row


def _rank(
    rank: int, world: int, cfg: TrainPlanConfig, runs: list[list[Plan]],
    speeds: list[list[float]], out: str,
) -> None:  # fmt: skip
    """Each run in turn: a fresh model trained through its plans, one per
    slot (the process groups made once, for all of them)."""
    scores: list[dict[str, float]] = []
    groups: dict[tuple[int, ...], Any] = {}
    recs = []
    for plans in runs:
        rec, runner = _run(cfg, plans, speeds, groups, scores)
        recs.append(rec)
        scores.append(runner.throttle_stats())
    got = {"runs": recs, "throttle": throttle_score(scores)}  # (a collective: every rank)
    if rank == 0:
        torch.save(got, os.path.join(out, "slots.pt"))


def _run(
    cfg: TrainPlanConfig, plans: list[Plan], speeds: list[list[float]],
    groups: dict[tuple[int, ...], Any], scores: list[dict[str, float]],
) -> tuple[dict[str, list[float]], PlanRunner]:  # fmt: skip
    rank = dist.get_rank()
    rec: dict[str, list[float]] = {k: [] for k in ("losses", "step_s", "move_s", "replan_s",
                                                   "moved")}  # fmt: skip
    runner: PlanRunner | None = None
    step = 0
    for t, plan in enumerate(plans):
        speed = speeds[t][rank] or 1.0  # (a device the plan leaves out runs nothing)
        if runner is None:
            first = _data(cfg, 0)[0][:1]
            runner = PlanRunner(plan, _model(cfg), nn.functional.mse_loss, cfg.exec.batch,
                                _opt(cfg), first, speed=speed, layer_sample_s=cfg.exec.sample_s,
                                groups=groups)  # fmt: skip
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
    if runner is None:
        raise ValueError("a trace needs at least one slot")
    return rec, runner
