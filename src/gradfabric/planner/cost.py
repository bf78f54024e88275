"""The planner's cost model: a pure function of cluster, model and plan.

A plan is a set of *groups*; each group is a pipeline of *stages*, a stage is
one device running a contiguous range of layers. Every group holds the whole
model; groups are data-parallel with their own share ``b_g`` of the global
batch and synchronise gradients at the end of the step.

Per sample, stage ``j`` (device ``d``, layers ``[a, b)``) costs
``c_j = 3 F[a:b] / s_d`` of compute (forward + backward = 3x forward FLOPs;
``s_d`` = sustained FLOP/s times the device's current speed factor) and
``x_j = 2 A_{b-1} / bw`` to move its output activation forward and its
gradient back over the link to the next stage (``bw`` = the slower NIC;
``x`` = 0 for the last stage). A group runs ``m`` micro-batches of
``mu = b_g / m`` samples (``m = 1`` for a single stage, ``4 S`` for an
``S``-stage pipeline), each stage taking ``t_j = mu (c_j + x_j) + 2 lat`` per
micro-batch; the group's step is the pipeline's fill, steady state and drain:

    T_g = sum_j t_j + (m - 1) max_j t_j

Memory per stage: ``16 P[a:b]`` bytes (fp32 weights, gradients and two Adam
moments) plus ``mu * sum A[a:b] * min(m, S - j)`` of stashed activations (the
micro-batches 1F1B keeps in flight); a single-stage group accumulates
gradients over as many micro-batches as it needs to fit (same compute time).
A plan that does not fit is infeasible (infinite time).

Gradient synchronisation across ``k`` groups: each layer's ``k`` replicas
(one device per group) all-reduce its gradient in a ring, ``2 (k-1)/k * 4 P_l``
bytes through every member, at the slowest member's NIC rate (a ring moves no
faster than its slowest link); a device serves the rings of all the layers it
holds over its one NIC, one after another, and the slowest device sets
``sync``. Batch time ``= max_g T_g + sync``. Cost: the price per hour of
the devices used.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from gradfabric.planner.spec import DeviceType
from gradfabric.workloads.catalog import ModelSpec

BYTES_PER_PARAM_STATE = 16
MICRO_PER_STAGE = 4


def whole(raw: list[float], total: int) -> list[int]:
    """Round non-negative shares ``raw`` (summing to ``total``) to whole
    samples that still sum to ``total``: floors, then the largest remainders
    get one more."""
    base = [math.floor(max(0.0, x)) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: base[i] - raw[i])[: total - sum(base)]:
        base[i] += 1
    return base


def split(total: int, weights: list[float]) -> list[int]:
    """Whole-sample shares of ``total`` proportional to ``weights``."""
    return whole([total * x / sum(weights) for x in weights], total)


@dataclass(frozen=True)
class Workload:
    """Per-sample layer figures (after coarsening) and the global batch."""

    name: str
    fwd_flops: tuple[float, ...]
    params: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    batch: int

    @property
    def layers(self) -> int:
        return len(self.fwd_flops)

    @staticmethod
    def of(model: ModelSpec, batch: int, max_layers: int = 24) -> Workload:
        """Merge consecutive layers into at most ``max_layers`` segments of
        about equal FLOPs (a cut can then fall only between segments)."""
        f = np.array([float(x.fwd_flops) for x in model.layers])
        p = np.array([x.params for x in model.layers])
        a = np.array([x.activation_bytes for x in model.layers])
        n = len(f)
        if n <= max_layers:
            edges = list(range(n + 1))
        else:
            cum = np.cumsum(f + 1.0)  # +1: FLOP-free layers still advance
            targets = cum[-1] * np.arange(1, max_layers) / max_layers
            inner = np.unique(np.searchsorted(cum, targets) + 1)
            edges = [0, *[int(e) for e in inner if 0 < e < n], n]
        seg = list(itertools.pairwise(edges))
        return Workload(
            model.name,
            tuple(float(f[lo:hi].sum()) for lo, hi in seg),
            tuple(int(p[lo:hi].sum()) for lo, hi in seg),
            tuple(int(a[hi - 1]) for lo, hi in seg),  # a segment's output
            batch,
        )


@dataclass(frozen=True)
class Device:
    """A device as a plan sees it: its type and current speed factor."""

    index: int
    type: DeviceType
    speed: float = 1.0  # 1 = nominal; contention lowers it

    @property
    def flops(self) -> float:
        return self.type.flops * self.speed


@dataclass(frozen=True)
class Stage:
    device: int
    first: int
    end: int  # layers [first, end)


@dataclass(frozen=True)
class Group:
    stages: tuple[Stage, ...]
    batch: float

    @property
    def micro_batches(self) -> int:
        return 1 if len(self.stages) == 1 else MICRO_PER_STAGE * len(self.stages)


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]

    def devices(self) -> list[int]:
        return [s.device for g in self.groups for s in g.stages]

    def describe(self) -> str:
        """``[0:0-4 1:4-8] [2:0-8]``: per group, each stage's device and layers."""
        return " ".join("[" + " ".join(f"{s.device}:{s.first}-{s.end}" for s in g.stages) + "]"
                        for g in self.groups)  # fmt: skip

    def owners(self, layers: int) -> list[set[int]]:
        """For each of ``layers`` layers, the devices that hold it."""
        return [{s.device for g in self.groups for s in g.stages if s.first <= layer < s.end}
                for layer in range(layers)]  # fmt: skip


@dataclass
class Estimate:
    batch_time_s: float
    group_times_s: list[float]
    sync_s: float
    cost_per_hour: float
    feasible: bool
    why: list[str] = field(default_factory=list)


def link_bytes_per_s(a: DeviceType, b: DeviceType) -> float:
    return min(a.nic_gbps, b.nic_gbps) * 1e9 / 8


def stage_costs(
    w: Workload, devs: list[Device], group: tuple[Stage, ...], latency_s: float
) -> tuple[list[float], list[float]]:
    """Per-sample seconds (compute + transfer) and per-micro-batch fixed
    seconds (link latencies) of each stage."""
    per_sample, fixed = [], []
    for j, st in enumerate(group):
        d = devs[st.device]
        c = 3 * sum(w.fwd_flops[st.first : st.end]) / d.flops
        x = lat = 0.0
        if j + 1 < len(group):
            nxt = devs[group[j + 1].device]
            x = 2 * w.activation_bytes[st.end - 1] / link_bytes_per_s(d.type, nxt.type)
            lat = 2 * latency_s
        per_sample.append(c + x)
        fixed.append(lat)
    return per_sample, fixed


def pipeline_time(per_sample: list[float], fixed: list[float], batch: float, m: int) -> float:
    mu = batch / m
    t = [mu * c + f for c, f in zip(per_sample, fixed, strict=True)]
    return sum(t) + (m - 1) * max(t)


def fits(w: Workload, devs: list[Device], g: Group) -> str | None:
    """None if every stage fits its device's memory, else why not."""
    s, m = len(g.stages), g.micro_batches
    for j, st in enumerate(g.stages):
        d = devs[st.device]
        mem = d.type.mem_gb * 2**30
        weights = BYTES_PER_PARAM_STATE * sum(w.params[st.first : st.end])
        act = sum(w.activation_bytes[st.first : st.end])
        # one stage accumulates gradients (a sample at a time at the least);
        # a pipeline keeps min(m, S - j) micro-batches' activations in flight
        in_flight = 1.0 if s == 1 else g.batch / m * min(m, s - j)
        need = weights + act * in_flight
        if need > mem:
            return f"stage {j} on device {st.device} ({d.type.name}) needs {need / 2**30:.1f} GiB"
    return None


def sync_time(w: Workload, devs: list[Device], plan: Plan) -> float:
    """Seconds to all-reduce gradients across the plan's groups (see the module
    doc): layer ``l``'s replicas form a ring that runs at its slowest member's
    NIC; a device serves the rings of all the layers it holds over its one NIC,
    one after another; the slowest device sets the time."""
    k = len(plan.groups)
    if k < 2:
        return 0.0
    owners = []  # per group: the device holding each layer
    for g in plan.groups:
        row = [0] * w.layers
        for st in g.stages:
            row[st.first : st.end] = [st.device] * (st.end - st.first)
        owners.append(row)
    busy: dict[int, float] = {}
    for layer, params in enumerate(w.params):
        ring = [row[layer] for row in owners]
        rate = min(devs[d].type.nic_gbps for d in ring) * 1e9 / 8
        t = 2 * (k - 1) / k * 4 * params / rate
        for d in ring:
            busy[d] = busy.get(d, 0.0) + t
    return max(busy.values())


def evaluate(w: Workload, devs: list[Device], plan: Plan, latency_s: float = 5e-6) -> Estimate:
    """The batch time and price of ``plan``; see the module doc."""
    why: list[str] = []
    times = []
    for g in plan.groups:
        problem = fits(w, devs, g)
        if problem:
            why.append(problem)
        per_sample, fixed = stage_costs(w, devs, g.stages, latency_s)
        times.append(pipeline_time(per_sample, fixed, g.batch, g.micro_batches) if g.batch else 0.0)
    sync = sync_time(w, devs, plan)
    covered = sum(g.batch for g in plan.groups)
    if abs(covered - w.batch) > 1e-6 * max(1, w.batch):
        why.append(f"batch shares sum to {covered:g}, not {w.batch}")
    cost = sum(devs[d].type.cost_per_hour for d in plan.devices())
    feasible = not why
    total = max(times) + sync if feasible else math.inf
    return Estimate(total, times, sync, cost, feasible, why)
