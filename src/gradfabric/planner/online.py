"""Online control: re-plan each slot as device speeds and availability change,
keeping the time-averaged price under a budget (Lyapunov drift-plus-penalty).

Each slot ``t`` the controller sees the devices' current speed factors (0: not
available) and picks, among candidate plans, the one minimising

    V * (batch_time + migration / iterations_per_slot) + Q(t) * price_per_hour

then updates the virtual queue ``Q(t+1) = max(Q(t) + price(t) - budget, 0)``.
``Q`` grows while the spending runs above the budget, so cheaper plans win
until it drains; ``V`` trades batch time against cost (large ``V``: faster,
with a longer excursion over the budget). Candidates: the planner's plan on
all devices, the best half and quarter by throughput per dollar, the cheapest
quarter and the single cheapest device, plus the previous slot's plan if its devices are still there
(no migration). Migration: the parameters (and optimizer state) of the layers
a device holds in the new plan and did not in the old, each from the lowest
device that held it, over the busiest NIC (sending or receiving).

A trace is a list of per-slot speed-factor vectors: ``random_trace`` draws
contention (a device at 30-90% speed for a while), preemptions (gone for a
while) and devices joining late; ``load_trace`` reads ``slot,device,speed``
CSV rows (a device keeps its last speed until the next row for it).
"""

from __future__ import annotations

import csv
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gradfabric.core.errors import ConfigError
from gradfabric.planner.baselines import BASELINES, best_subset, nominal
from gradfabric.planner.cost import Device, Plan, Workload, evaluate
from gradfabric.planner.search import plan
from gradfabric.planner.spec import DeviceType

Trace = list[list[float]]
# The controller plans several subsets per slot: exhaustive search only for
# the smallest, so that a slot's decision stays well under a second.
CONTROLLER_EXHAUSTIVE_UPTO = 4


def random_trace(devices: int, slots: int, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    speed = [1.0] * devices
    late = set(rng.sample(range(devices), max(1, devices // 8)))  # join after a while
    for d in late:
        speed[d] = 0.0
    out = []
    for t in range(slots):
        for d in range(devices):
            if d in late and t == slots // 4:
                speed[d] = 1.0
            elif d in late and t < slots // 4:
                continue
            elif rng.random() < 0.05:  # something changes for this device
                speed[d] = rng.choice([0.0, rng.uniform(0.3, 0.9), 1.0])
        out.append(list(speed))
    return out


def load_trace(path: Path, devices: int) -> Trace:
    rows: dict[int, list[tuple[int, float]]] = {}
    with open(path) as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                slot, dev, sp = int(row["slot"]), int(row["device"]), float(row["speed"])
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"trace row {i + 1}", "need slot,device,speed columns") from None
            if not 0 <= dev < devices or sp < 0 or slot < 0:
                raise ConfigError(f"trace row {i + 1}", f"device {dev} or speed {sp} out of range")
            rows.setdefault(slot, []).append((dev, sp))
    speed = [1.0] * devices
    out = []
    for t in range(max(rows, default=0) + 1):
        for dev, sp in rows.get(t, []):
            speed[dev] = sp
        out.append(list(speed))
    return out


@dataclass
class SlotRecord:
    slot: int
    batch_time_s: float
    price_per_hour: float
    queue: float
    devices: int
    migrated: bool
    migration_s: float = 0.0  # the controller's term for this slot's move


@dataclass
class OnlineResult:
    slots: list[SlotRecord]
    plans: list[Plan] = field(default_factory=list)  # the plan chosen for each slot
    baselines: dict[str, list[float]] = field(default_factory=dict)  # batch time per slot
    max_plan_time_s: float = 0.0  # the controller's longest decision

    @property
    def mean_batch_time_s(self) -> float:
        return sum(s.batch_time_s for s in self.slots) / len(self.slots)

    @property
    def mean_price(self) -> float:
        return sum(s.price_per_hour for s in self.slots) / len(self.slots)


def migration_flows(w: Workload, old: Plan, new: Plan) -> dict[tuple[int, int], int]:
    """(sender, receiver) -> fp32 parameter bytes, to move from ``old`` to
    ``new``: every layer a device holds in ``new`` and did not in ``old``,
    from the lowest device that holds it in ``old`` (``PlanRunner.replan``'s
    rule)."""
    flows: dict[tuple[int, int], int] = {}
    layers = zip(old.owners(w.layers), new.owners(w.layers), w.params, strict=True)
    for was, will, params in layers:
        for dst in will - was:
            key = (min(was), dst)
            flows[key] = flows.get(key, 0) + 4 * int(params)
    return flows


def migration_bytes(w: Workload, old: Plan, new: Plan) -> dict[int, int]:
    """Bytes each device receives (fp32 parameters; see ``migration_flows``)."""
    got: dict[int, int] = {}
    for (_, dst), b in migration_flows(w, old, new).items():
        got[dst] = got.get(dst, 0) + b
    return got


def migration_s(
    w: Workload, devs: list[Device], old: Plan | None, new: Plan, state_copies: float = 0.0
) -> float:
    """The controller's migration term: the busiest NIC, sending or receiving
    (full duplex), over its rate; ``state_copies``: optimizer state per
    parameter (momentum SGD 1, Adam 2) that moves too."""
    if old is None:
        return 0.0
    load: dict[tuple[int, str], int] = {}
    for (src, dst), b in migration_flows(w, old, new).items():
        load[src, "out"] = load.get((src, "out"), 0) + b
        load[dst, "in"] = load.get((dst, "in"), 0) + b
    nic = {d.index: d.type.nic_gbps * 1e9 for d in devs}
    return max((b * (1 + state_copies) * 8 / nic[d] for (d, _), b in load.items()), default=0.0)


def _candidates(
    w: Workload,
    devs: list[Device],
    memo: dict[tuple[tuple[int, float], ...], Plan | None],
    lat: float = 5e-6,
) -> list[Plan]:
    """Plans on device subsets: all, the best half and quarter by throughput
    per dollar, the cheapest quarter and the single cheapest device."""
    live = [d for d in devs if d.speed > 0]
    rankings = (
        sorted(live, key=lambda d: -d.flops / max(d.type.cost_per_hour, 1e-9)),
        sorted(live, key=lambda d: (d.type.cost_per_hour, -d.flops)),
    )
    by_value, by_price = rankings
    subsets = {
        frozenset(d.index for d in by_value[: max(1, round(len(live) * f))]) for f in (1, 0.5, 0.25)
    }
    subsets |= {
        frozenset(d.index for d in by_price[: max(1, round(len(live) * f))]) for f in (0.25, 0)
    }
    out = []
    for keep in sorted(subsets, key=sorted):
        key = tuple((d.index, d.speed) for d in devs if d.index in keep)
        if key not in memo:  # speeds change rarely: most slots re-use the last plans
            sub = [d if d.index in keep else Device(d.index, d.type, 0.0) for d in devs]
            try:
                memo[key] = plan(w, sub, lat, CONTROLLER_EXHAUSTIVE_UPTO).plan
            except ValueError:  # the model does not fit so few devices
                memo[key] = None
        got = memo[key]
        if got is not None:
            out.append(got)
    return out


def run_online(
    w: Workload,
    types: list[DeviceType],
    trace: Trace,
    budget_per_hour: float,
    v: float = 1000.0,
    iterations_per_slot: int = 100,
    baselines: bool = True,
    tick: Callable[[str], None] | None = None,
    admissible: Callable[[Plan], bool] | None = None,
    latency_s: float = 5e-6,
    state_copies: float = 0.0,
) -> OnlineResult:
    """Drive the controller (and, side by side, the baselines) over ``trace``;
    ``admissible``: the plans a runtime can execute (others are not
    candidates); ``latency_s``: the cost model's per-message latency;
    ``state_copies``: optimizer state per parameter that moves with it."""
    res = OnlineResult([])
    q = 0.0
    current: Plan | None = None
    fixed: dict[tuple[str, frozenset[int]], Plan] = {}
    memo: dict[tuple[tuple[int, float], ...], Plan | None] = {}
    names = BASELINES.names() if baselines else []
    res.baselines = {n: [] for n in names}
    for t, speeds in enumerate(trace):
        if tick is not None:
            tick(f"slot {t}")
        t0 = time.perf_counter()
        devs = [Device(i, ty, sp) for i, (ty, sp) in enumerate(zip(types, speeds, strict=True))]
        cands = _candidates(w, devs, memo, latency_s)
        if current is not None and all(speeds[d] > 0 for d in current.devices()):
            cands.append(current)
        if admissible is not None:
            cands = [c for c in cands if admissible(c)]
        best = None
        for c in cands:
            e = evaluate(w, devs, c, latency_s)
            if not e.feasible:
                continue
            mig = migration_s(w, devs, current, c, state_copies)
            score = v * (e.batch_time_s + mig / iterations_per_slot) + q * e.cost_per_hour
            if best is None or score < best[0]:
                best = (score, c, e, mig)
        if best is None:
            raise ValueError(f"slot {t}: no feasible plan on the devices available")
        _, chosen, est, mig = best
        res.max_plan_time_s = max(res.max_plan_time_s, time.perf_counter() - t0)
        res.slots.append(
            SlotRecord(t, est.batch_time_s + mig / iterations_per_slot, est.cost_per_hour, q,
                       len(chosen.devices()), mig > 0, mig)
        )  # fmt: skip
        res.plans.append(chosen)
        q = max(q + est.cost_per_hour - budget_per_hour, 0.0)
        current = chosen
        alive = frozenset(d.index for d in devs if d.speed > 0)
        for n in names:
            # blind to speed: re-planned when devices join or leave, each rule on
            # its best device subset at nominal speeds (the planner's freedom)
            if (n, alive) not in fixed:
                fixed[n, alive] = best_subset(BASELINES.get(n), w, nominal(devs))[0]
            e = evaluate(w, devs, fixed[n, alive])
            res.baselines[n].append(e.batch_time_s if e.feasible else float("inf"))
    return res
