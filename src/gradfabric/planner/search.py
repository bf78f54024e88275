"""Choosing a plan: groups, stage order and cut points, batch shares.

- **Cut points** of one group (a given device order): a dynamic programme over
  (stage, layer) minimising the slowest stage's per-sample cost (compute plus
  the activation transfer to the next stage, so a cut at a bulky activation
  is avoided), then single-layer moves of each cut while the group's true
  step time improves.
- **Batch shares**: each group's step is linear in its share,
  ``T_g = alpha_g b_g + beta_g``; the shares that equalise the groups' finish
  times solve ``alpha_g b_g + beta_g = T, sum b_g = B`` (groups that would get
  a negative share are dropped), then are rounded to whole samples.
- **Groups**: for up to ``EXHAUSTIVE_MAX`` devices every subset of devices and
  every partition of it into groups is tried, each group in every distinct
  order of its device types; for more, a tentative search over pipeline depths
  ``1, 2, 3, 4, 6, 8`` with groups built from the speed-sorted device list (mixed
  speeds per group, as HetPipe's virtual workers, or alike speeds), each also
  without its slowest devices.

``brute_force`` is the reference the tests hold the planner to: every subset,
partition, device order and combination of cut points.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from gradfabric.planner.cost import (
    MICRO_PER_STAGE,
    Device,
    Estimate,
    Group,
    Plan,
    Stage,
    Workload,
    evaluate,
    fits,
    stage_costs,
    whole,
)

EXHAUSTIVE_MAX = 6
TENTATIVE_ORDERS_UPTO = 4  # larger groups in the tentative search: two orders only


@dataclass
class PlanResult:
    plan: Plan
    estimate: Estimate
    plan_time_s: float
    considered: int
    notes: list[str] = field(default_factory=list)

    def explain(self, devs: list[Device], w: Workload) -> str:
        e = self.estimate
        lines = [
            f"{len(self.plan.groups)} data-parallel group(s) over {len(self.plan.devices())} of "
            f"{len(devs)} devices; batch {w.batch} in {e.batch_time_s * 1e3:.1f} ms "
            f"(slowest group {max(e.group_times_s) * 1e3:.1f} ms + gradient sync "
            f"{e.sync_s * 1e3:.1f} ms), ${e.cost_per_hour:.2f}/h; "
            f"{self.considered} candidate plans in {self.plan_time_s * 1e3:.0f} ms.",
        ]
        for i, g in enumerate(self.plan.groups):
            stages = ", ".join(
                f"{devs[s.device].type.name}#{s.device}[layers {s.first}-{s.end - 1}]"
                for s in g.stages
            )
            lines.append(
                f"  group {i}: {g.batch:g} samples ({e.group_times_s[i] * 1e3:.1f} ms), {stages}"
            )
        unused = sorted(set(range(len(devs))) - set(self.plan.devices()))
        if unused:
            lines.append(
                "  unused: "
                + ", ".join(f"{devs[d].type.name}#{d}" for d in unused)
                + " (adding them would not shorten the step)"
            )
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------- groups


def _rate(w: Workload, devs: list[Device], stages: tuple[Stage, ...], lat: float) -> float:
    """Seconds per sample of a group in steady state (its alpha)."""
    per_sample, _ = stage_costs(w, devs, stages, lat)
    m = 1 if len(stages) == 1 else MICRO_PER_STAGE * len(stages)
    return (sum(per_sample) + (m - 1) * max(per_sample)) / m


def _stages(order: tuple[int, ...], edges: list[int]) -> tuple[Stage, ...]:
    return tuple(Stage(d, a, b) for d, a, b in zip(order, edges[:-1], edges[1:], strict=True))


def dp_cuts(
    w: Workload, devs: list[Device], order: tuple[int, ...], lat: float
) -> tuple[Stage, ...]:
    """Cut points for devices ``order`` (see the module doc)."""
    n, s = w.layers, len(order)
    if s > n:
        return ()
    cum = [0.0, *itertools.accumulate(w.fwd_flops)]

    def cost(j: int, a: int, b: int) -> float:
        d = devs[order[j]]
        c = 3 * (cum[b] - cum[a]) / d.flops
        if j + 1 < s:
            nxt = devs[order[j + 1]]
            c += 2 * w.activation_bytes[b - 1] / (min(d.type.nic_gbps, nxt.type.nic_gbps) * 1e9 / 8)
        return c

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    back = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for j in range(1, s + 1):
        for i in range(j, n - (s - j) + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], cost(j - 1, k, i))
                if v < best[j][i]:
                    best[j][i], back[j][i] = v, k
    edges = [n]
    for j in range(s, 0, -1):
        edges.append(back[j][edges[-1]])
    edges.reverse()
    # refine on the true step rate: move single cuts while it improves
    rate = _rate(w, devs, _stages(order, edges), lat)
    improved = True
    while improved:
        improved = False
        for c in range(1, s):
            for step in (-1, 1):
                e2 = list(edges)
                e2[c] += step
                if e2[c - 1] < e2[c] < e2[c + 1]:
                    r2 = _rate(w, devs, _stages(order, e2), lat)
                    if r2 < rate - 1e-15:
                        edges, rate, improved = e2, r2, True
    return _stages(order, edges)


def all_cuts(
    w: Workload, devs: list[Device], order: tuple[int, ...]
) -> Iterator[tuple[Stage, ...]]:
    for inner in itertools.combinations(range(1, w.layers), len(order) - 1):
        yield _stages(order, [0, *inner, w.layers])


# ------------------------------------------------------------------- shares


def shares(w: Workload, devs: list[Device], groups: list[tuple[Stage, ...]], lat: float) -> Plan:
    """Equalise the groups' finish times (see the module doc); whole samples."""
    live = list(groups)
    while True:
        ab = []
        for g in live:
            per_sample, fixed = stage_costs(w, devs, g, lat)
            m = 1 if len(g) == 1 else MICRO_PER_STAGE * len(g)
            ab.append(((sum(per_sample) + (m - 1) * max(per_sample)) / m,
                       sum(fixed) + (m - 1) * max(fixed)))  # fmt: skip
        t = (w.batch + sum(b / a for a, b in ab)) / sum(1 / a for a, _ in ab)
        raw = [(t - b) / a for a, b in ab]
        if min(raw) >= 0 or len(live) == 1:
            break
        live = [g for g, x in zip(live, raw, strict=True) if x > 0]
    base = whole(raw, w.batch)
    return Plan(tuple(Group(g, float(b)) for g, b in zip(live, base, strict=True) if b > 0))


# --------------------------------------------------------------- partitions


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every set partition of ``items``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in partitions(rest):
        yield [[first], *p]
        for i in range(len(p)):
            yield [*p[:i], [first, *p[i]], *p[i + 1 :]]


BRUTE = -1  # ``distinct_upto`` for brute force: every permutation and every cut


def _orders(devs: list[Device], group: list[int], distinct_upto: int) -> list[tuple[int, ...]]:
    """Device orders to try: every permutation (brute force); every distinct
    order of (type, speed) for groups of at most ``distinct_upto`` devices
    (devices alike are interchangeable); fastest first and fastest last beyond."""
    if distinct_upto == BRUTE:
        return list(itertools.permutations(group))
    if len(group) <= distinct_upto:
        seen: dict[tuple[tuple[str, float], ...], tuple[int, ...]] = {}
        for order in itertools.permutations(group):
            seen.setdefault(tuple((devs[d].type.name, devs[d].speed) for d in order), order)
        return list(seen.values())
    fast = tuple(sorted(group, key=lambda d: -devs[d].flops))
    return [fast, fast[::-1]]


def _best_pipeline(
    w: Workload, devs: list[Device], group: list[int], lat: float, distinct_upto: int,
    memo: dict[tuple[tuple[str, float], ...], tuple[tuple[int, ...], list[int]]],
) -> tuple[Stage, ...]:  # fmt: skip
    """The fastest (per sample) ordering and cuts of one group; devices of the
    same type and speed are interchangeable, so results are kept by those."""
    key = tuple(sorted((devs[d].type.name, devs[d].speed) for d in group))
    hit = memo.get(key)
    if hit is None:
        best: tuple[float, tuple[Stage, ...]] = (math.inf, ())
        brute = distinct_upto == BRUTE
        for order in _orders(devs, group, distinct_upto):
            cands = all_cuts(w, devs, order) if brute else [dp_cuts(w, devs, order, lat)]
            for st in cands:
                if not st or fits(w, devs, Group(st, 1.0)):
                    continue
                r = _rate(w, devs, st, lat)
                if r < best[0]:
                    best = (r, st)
        st = best[1]
        hit = memo[key] = (tuple(s.device for s in st), [s.first for s in st] + [w.layers])
    order, edges = hit
    if not order:
        return ()
    # map the remembered type sequence onto this group's devices
    pool = {d: devs[d] for d in group}
    mapped = []
    for d in order:
        want = (devs[d].type.name, devs[d].speed)
        pick = next(x for x, v in pool.items() if (v.type.name, v.speed) == want)
        mapped.append(pick)
        del pool[pick]
    return _stages(tuple(mapped), edges)


def _evaluate_partition(
    w: Workload, devs: list[Device], part: list[list[int]], lat: float, distinct_upto: int,
    memo: dict[tuple[tuple[str, float], ...], tuple[tuple[int, ...], list[int]]],
) -> tuple[Plan, Estimate] | None:  # fmt: skip
    groups = [_best_pipeline(w, devs, g, lat, distinct_upto, memo) for g in part]
    if not all(groups):
        return None
    plan = shares(w, devs, groups, lat)
    est = evaluate(w, devs, plan, lat)
    return (plan, est) if est.feasible else None


def _best_of(
    w: Workload, devs: list[Device], parts: Iterator[list[list[int]]], lat: float,
    distinct_upto: int,
) -> PlanResult:  # fmt: skip
    """The fastest feasible plan over candidate partitions."""
    t0 = time.perf_counter()
    memo: dict[tuple[tuple[str, float], ...], tuple[tuple[int, ...], list[int]]] = {}
    best: tuple[Plan, Estimate] | None = None
    n = 0
    for part in parts:
        n += 1
        got = _evaluate_partition(w, devs, part, lat, distinct_upto, memo)
        if got and (best is None or got[1].batch_time_s < best[1].batch_time_s):
            best = got
    if best is None:
        raise ValueError("no feasible plan: the model does not fit these devices")
    return PlanResult(best[0], best[1], time.perf_counter() - t0, n)


def _every_partition(devs: list[Device]) -> Iterator[list[list[int]]]:
    ids = [d.index for d in devs if d.speed > 0]
    for size in range(1, len(ids) + 1):
        for subset in itertools.combinations(ids, size):
            yield from partitions(list(subset))


def brute_force(w: Workload, devs: list[Device], lat: float = 5e-6) -> PlanResult:
    """Every subset, partition, order and cut (small clusters only)."""
    return _best_of(w, devs, _every_partition(devs), lat, BRUTE)


def _tentative_partitions(w: Workload, devs: list[Device]) -> Iterator[list[list[int]]]:
    ranked = sorted((d.index for d in devs if d.speed > 0), key=lambda d: -devs[d].flops)
    for depth in (1, 2, 3, 4, 6, 8):
        for drop in range(0, max(1, len(ranked) // 4) + 1, max(1, len(ranked) // 16)):
            use = ranked[: len(ranked) - drop]
            k = len(use) // depth
            if k == 0 or depth > w.layers:
                continue
            use = use[: k * depth]
            yield [use[i::k] for i in range(k)]  # mixed: one of each speed tier per group
            yield [use[i * depth : (i + 1) * depth] for i in range(k)]  # alike


def plan(
    w: Workload, devs: list[Device], lat: float = 5e-6, exhaustive_upto: int = EXHAUSTIVE_MAX
) -> PlanResult:
    """The planner: exhaustive for up to ``exhaustive_upto`` devices,
    tentative search above."""
    live = [d for d in devs if d.speed > 0]
    if len(live) <= exhaustive_upto:
        res = _best_of(w, devs, _every_partition(devs), lat, EXHAUSTIVE_MAX)
        res.notes.append("exhaustive over device subsets and partitions")
    else:
        res = _best_of(w, devs, _tentative_partitions(w, devs), lat, TENTATIVE_ORDERS_UPTO)
        res.notes.append("tentative search over pipeline depths 1-8, mixed or alike groups")
    return res
