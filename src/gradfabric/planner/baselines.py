"""The plans a user would otherwise run, under the same cost model.

- ``even-dp``: every available device a data-parallel replica, equal shares.
- ``proportional-dp``: the same replicas, shares proportional to each device's
  nominal speed (what a heterogeneity-aware DP scheduler does).
- ``even-pipeline``: pipelines of 4 devices in cluster order, layers split
  into equal counts, equal shares.
- ``hetpipe``: HetPipe-like virtual workers (each mixes one device of every
  speed tier), FLOP-balanced cuts, shares equalising the virtual workers'
  nominal finish times; static: re-planned only when devices join or leave.

The baselines see nominal speeds, not the current ones: they do not measure
contention. ``best_subset`` gives a rule the planner's freedom over which
devices to use: the rule is applied to every device subset the planner's
search visits (``search.subsets``, by class counts) and the fastest result
kept, so a comparison is between rules, not between device counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gradfabric.core.registry import Registry
from gradfabric.planner.cost import (
    Device,
    Estimate,
    Group,
    Plan,
    Stage,
    Workload,
    evaluate,
    split,
)
from gradfabric.planner.search import _stages, dp_cuts, shares, subsets

Baseline = Callable[[Workload, list[Device]], Plan]
BASELINES: Registry[Baseline] = Registry("baseline")


def nominal(devs: list[Device]) -> list[Device]:
    return [Device(d.index, d.type, 1.0 if d.speed > 0 else 0.0) for d in devs]


def even_dp(w: Workload, devs: list[Device]) -> Plan:
    live = [d.index for d in devs if d.speed > 0]
    b = split(w.batch, [1.0] * len(live))
    return Plan(tuple(Group((Stage(d, 0, w.layers),), x) for d, x in zip(live, b, strict=True)))


def proportional_dp(w: Workload, devs: list[Device]) -> Plan:
    """Shares in proportion to each device's FLOP/s at the speed it is given
    (``nominal`` devices: its type's; current speeds: re-balanced)."""
    live = [d for d in devs if d.speed > 0]
    b = split(w.batch, [d.flops for d in live])
    return Plan(
        tuple(Group((Stage(d.index, 0, w.layers),), x) for d, x in zip(live, b, strict=True))
    )


def even_pipeline(w: Workload, devs: list[Device], depth: int = 4) -> Plan:
    live = [d.index for d in devs if d.speed > 0]
    depth = min(depth, w.layers, len(live))
    groups = [tuple(live[i : i + depth]) for i in range(0, len(live) - depth + 1, depth)]
    edges = [round(i * w.layers / depth) for i in range(depth + 1)]
    b = split(w.batch, [1.0] * len(groups))
    return Plan(tuple(Group(_stages(g, edges), x) for g, x in zip(groups, b, strict=True)))


def hetpipe(w: Workload, devs: list[Device], lat: float = 5e-6) -> Plan:
    live = sorted((d for d in devs if d.speed > 0), key=lambda d: -d.type.flops)
    speed = {d.type.name: d.type.flops for d in live}
    tiers = sorted(speed, key=lambda t: -speed[t])
    k = min(sum(1 for d in live if d.type.name == t) for t in tiers)
    vws: list[list[int]] = [[] for _ in range(k)]
    for t in tiers:  # one device of each tier per virtual worker (extra devices idle)
        of_t = [d.index for d in live if d.type.name == t]
        for i in range(k):
            vws[i].append(of_t[i])
    nom = nominal(devs)
    groups = [dp_cuts(w, nom, tuple(v[: w.layers]), lat) for v in vws]
    return shares(w, nom, [g for g in groups if g], lat)


for _name, _fn in (
    ("even-dp", even_dp),
    ("proportional-dp", proportional_dp),
    ("even-pipeline", even_pipeline),
    ("hetpipe", hetpipe),
):
    BASELINES.add(_name, _fn)


def best_subset(
    rule: Baseline,
    w: Workload,
    devs: list[Device],
    lat: float = 5e-6,
    admissible: Callable[[Plan], bool] | None = None,
) -> tuple[Plan, Estimate]:
    """``rule`` on the device subset where it is fastest, among those the
    planner's search visits (least compute bound first; a subset whose bound
    reaches the best time so far cannot win, and ends the scan);
    ``admissible``: only plans a runtime can execute (a baseline at its best
    is its best runnable plan, not a faster one that is then dropped).
    Raises ``ValueError`` if the rule fits no subset."""
    best: tuple[Plan, Estimate] | None = None
    for bound, use in subsets(w, devs):
        if best is not None and bound >= best[1].batch_time_s:
            break
        keep = set(use)
        sub = [d if d.index in keep else Device(d.index, d.type, 0.0) for d in devs]
        p = rule(w, sub)
        if not p.groups or (admissible is not None and not admissible(p)):
            continue
        e = evaluate(w, devs, p, lat)
        if e.feasible and (best is None or e.batch_time_s < best[1].batch_time_s):
            best = (p, e)
    if best is None or math.isinf(best[1].batch_time_s):
        raise ValueError("the rule fits no subset of these devices")
    return best
