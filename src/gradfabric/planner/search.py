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
  order of its device types. For more, a tentative search over *subsets by
  class* (a class: devices of one type at one speed, interchangeable): every
  count vector ``u`` with ``u_c`` on ``COUNT_GRID`` and at most the class's
  size, and for each, pipeline depths ``1, 2, 3, 4, 6, 8`` with groups built
  from the speed-sorted devices (mixed speeds per group, as HetPipe's virtual
  workers, or alike speeds).
- **Monotone by construction**: the candidates depend only on the count
  vector, and a cluster with more devices has every count vector a smaller one
  has (the grid is fixed), so adding devices never makes the plan slower
  (``tests/property/test_planner.py``). The search also reaches any single
  tier, so a fast tier is never dragged down by slow ones.
- **Pruned exactly**: the groups' compute alone takes at least
  ``3 F B / sum(flops)`` (every sample's three forwards over all the FLOP/s in
  use), so count vectors are visited by that bound, and the search stops once
  the bound reaches the best plan found: nothing faster is skipped.

``brute_force`` is the reference the tests hold the planner to on small
clusters: every subset, partition, device order and combination of cut
points. ``exact`` is the same optimum where devices of a class are
interchangeable: every sub-multiset of classes, every multiset partition of it
into groups, every distinct class order and every cut of each group; it
reaches 7-12 devices, where the tentative search is measured against it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

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
    link_bytes_per_s,
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
                + " (no plan the search tried with them was faster)"
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
    cum = np.array([0.0, *itertools.accumulate(w.fwd_flops)])
    act = np.array([0.0, *w.activation_bytes])  # act[b]: the output of layer b - 1
    # best[j][i]: the least bottleneck of layers [0, i) on the first j devices,
    # where device j - 1 runs [k, i) at 3 (cum[i] - cum[k]) / flops plus sending
    # its output on (not the last device); a vector over i, minimised over k
    best = np.full((s + 1, n + 1), math.inf)
    back = np.zeros((s + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for j in range(1, s + 1):
        d = devs[order[j - 1]]
        send = 0.0
        if j < s:
            send = 2 / link_bytes_per_s(d.type, devs[order[j]].type)
        for i in range(j, n - (s - j) + 1):
            ks = np.arange(j - 1, i)
            v = np.maximum(best[j - 1][ks], 3 * (cum[i] - cum[ks]) / d.flops + send * act[i])
            at = int(np.argmin(v))
            best[j][i], back[j][i] = v[at], ks[at]
    edges = [n]
    for j in range(s, 0, -1):
        edges.append(int(back[j][edges[-1]]))
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
BRUTE_DISTINCT = -2  # every cut, and every order that differs in (type, speed)


def _orders(devs: list[Device], group: list[int], distinct_upto: int) -> list[tuple[int, ...]]:
    """Device orders to try: every permutation (brute force); every distinct
    order of (type, speed) for groups of at most ``distinct_upto`` devices
    (devices alike are interchangeable); fastest first and fastest last beyond."""
    if distinct_upto == BRUTE:
        return list(itertools.permutations(group))
    if distinct_upto == BRUTE_DISTINCT:
        return list(_distinct_orders(devs, group))
    if len(group) <= distinct_upto:
        seen: dict[tuple[tuple[str, float], ...], tuple[int, ...]] = {}
        for order in itertools.permutations(group):
            seen.setdefault(tuple((devs[d].type.name, devs[d].speed) for d in order), order)
        return list(seen.values())
    fast = tuple(sorted(group, key=lambda d: -devs[d].flops))
    return [fast, fast[::-1]]


def _distinct_orders(devs: list[Device], group: list[int]) -> Iterator[tuple[int, ...]]:
    """One order per distinct sequence of (type, speed), built class by class
    (``len(group)!`` permutations would be visited otherwise)."""
    pools: dict[tuple[str, float], list[int]] = {}
    for d in group:
        pools.setdefault((devs[d].type.name, devs[d].speed), []).append(d)
    keys = list(pools)
    left = {k: len(v) for k, v in pools.items()}

    def extend(prefix: list[int]) -> Iterator[tuple[int, ...]]:
        if len(prefix) == len(group):
            yield tuple(prefix)
            return
        for k in keys:
            if left[k]:
                left[k] -= 1
                yield from extend([*prefix, pools[k][left[k]]])
                left[k] += 1

    return extend([])


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
        brute = distinct_upto in (BRUTE, BRUTE_DISTINCT)
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


Candidates = Iterator[tuple[float, list[list[int]]]]  # (lower bound on batch time, partition)


def _best_of(
    w: Workload, devs: list[Device], parts: Candidates, lat: float, distinct_upto: int
) -> PlanResult:
    """The fastest feasible plan over candidate partitions, visited in order of
    their lower bounds: the first bound at or above the best plan ends the search."""
    t0 = time.perf_counter()
    memo: dict[tuple[tuple[str, float], ...], tuple[tuple[int, ...], list[int]]] = {}
    best: tuple[Plan, Estimate] | None = None
    n = 0
    for bound, part in parts:
        if best is not None and bound >= best[1].batch_time_s:
            break
        if best is not None and partition_bound(w, devs, part) >= best[1].batch_time_s:
            continue
        n += 1
        got = _evaluate_partition(w, devs, part, lat, distinct_upto, memo)
        if got and (best is None or got[1].batch_time_s < best[1].batch_time_s):
            best = got
    if best is None:
        raise ValueError("no feasible plan: the model does not fit these devices")
    return PlanResult(best[0], best[1], time.perf_counter() - t0, n)


def _every_partition(devs: list[Device]) -> Candidates:
    ids = [d.index for d in devs if d.speed > 0]
    for size in range(1, len(ids) + 1):
        for subset in itertools.combinations(ids, size):
            for part in partitions(list(subset)):
                yield 0.0, part


def brute_force(w: Workload, devs: list[Device], lat: float = 5e-6) -> PlanResult:
    """Every subset, partition, order and cut (small clusters only)."""
    return _best_of(w, devs, _every_partition(devs), lat, BRUTE)


# The counts of one class the tentative search uses: every count up to 6, then
# steps of about 1.25-1.5x. A fixed grid: a class with more devices offers every
# count a smaller one did (that is what makes the search monotone).
COUNT_GRID = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
DEPTHS = (1, 2, 3, 4, 6, 8)


def _grid(n: int) -> list[int]:
    out = [c for c in COUNT_GRID if c <= n]
    step = COUNT_GRID[-1]
    while out[-1] * 2 <= n:  # past the table: doubling
        out.append(min(out[-1] + step, out[-1] * 2))
        step = out[-1]
    return out


MAX_COUNT_VECTORS = 2048  # past this, the tentative search's classes are types alone


def classes(devs: list[Device], by_speed: bool = True) -> list[list[int]]:
    """Available devices grouped by (type, speed) (or by type alone), fastest
    class first (ties by name), each class fastest first, then by index."""
    by: dict[tuple[str, float], list[int]] = {}
    for d in devs:
        if d.speed > 0:
            by.setdefault((d.type.name, d.speed if by_speed else 0.0), []).append(d.index)
    for members in by.values():
        members.sort(key=lambda i: (-devs[i].flops, i))
    order = sorted(by, key=lambda k: (-devs[by[k][0]].flops, k))
    return [by[k] for k in order]


def _search_classes(devs: list[Device]) -> list[list[int]]:
    """The tentative search's classes: (type, speed), or types alone where
    per-device speeds (contention) make too many classes to count over; the
    search is monotone in added devices while the classes are (type, speed)."""
    cls = classes(devs)
    if math.prod(len(_grid(len(c))) for c in cls) > MAX_COUNT_VECTORS:
        cls = classes(devs, by_speed=False)
    return cls


def compute_bound(w: Workload, devs: list[Device], use: list[int]) -> float:
    """The least time the groups' compute can take on devices ``use``: three
    forwards per sample, spread perfectly over their FLOP/s."""
    return 3 * sum(w.fwd_flops) * w.batch / sum(devs[d].flops for d in use)


def partition_bound(w: Workload, devs: list[Device], part: list[list[int]]) -> float:
    """A lower bound on the batch time of any plan on groups ``part`` (the
    share solve may drop some): if ``k'`` groups stay, their compute takes at
    least ``3 F B`` over the ``k'`` largest groups' FLOP/s, and their gradient
    sync at least ``8 (k'-1)/k' P`` bytes over the largest group NIC total
    (some device of each group holds ``P_d / nic_d >= P / sum(nic)``)."""
    flops = sorted((sum(devs[d].flops for d in g) for g in part), reverse=True)
    nic = max(sum(devs[d].type.nic_gbps for d in g) for g in part) * 1e9 / 8
    work, grads = 3 * sum(w.fwd_flops) * w.batch, 8 * sum(w.params) / nic
    best, total = math.inf, 0.0
    for k, f in enumerate(flops, 1):
        total += f
        best = min(best, work / total + grads * (k - 1) / k)
    return best


def subsets(w: Workload, devs: list[Device]) -> Iterator[tuple[float, list[int]]]:
    """Device subsets by class counts on ``COUNT_GRID`` (each class's first
    devices), fastest-first, with their compute bound, least bound first."""
    cls = _search_classes(devs)
    out = []
    for u in itertools.product(*(_grid(len(c)) for c in cls)):
        use = [d for c, k in zip(cls, u, strict=True) for d in c[:k]]
        if use:
            out.append((compute_bound(w, devs, use), u, use))
    out.sort(key=lambda x: (x[0], x[1]))
    for bound, _, use in out:
        yield bound, use


def _tentative_partitions(w: Workload, devs: list[Device]) -> Candidates:
    for bound, use in subsets(w, devs):
        for depth in DEPTHS:
            k = len(use) // depth
            if k == 0 or depth > w.layers:
                continue
            kept = use[: k * depth]  # (the slowest left over: another subset drops them)
            yield bound, [kept[i::k] for i in range(k)]  # mixed: one of each speed tier per group
            if depth > 1:
                yield bound, [kept[i * depth : (i + 1) * depth] for i in range(k)]  # alike


# --------------------------------------------------------------- exact (symmetric)


def _multiset_partitions(
    rem: tuple[int, ...], top: tuple[int, ...]
) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of the multiset with counts ``rem`` into parts (count
    vectors), each once: parts in non-increasing order, none above ``top``."""
    if not any(rem):
        yield []
        return
    for v in itertools.product(*(range(r + 1) for r in rem)):
        if any(v) and v <= top:
            rest = tuple(a - b for a, b in zip(rem, v, strict=True))
            for tail in _multiset_partitions(rest, v):
                yield [v, *tail]


def _exact_partitions(w: Workload, devs: list[Device]) -> Candidates:
    cls = classes(devs)
    counts = [u for u in itertools.product(*(range(len(c) + 1) for c in cls)) if any(u)]
    bounds = {
        u: compute_bound(w, devs, [d for c, k in zip(cls, u, strict=True) for d in c[:k]])
        for u in counts
    }
    for u in sorted(counts, key=lambda u: (bounds[u], u)):
        for parts in _multiset_partitions(u, u):
            taken = [0] * len(cls)
            groups = []
            for v in parts:
                g = []
                for i, k in enumerate(v):
                    g += cls[i][taken[i] : taken[i] + k]
                    taken[i] += k
                groups.append(g)
            yield bounds[u], groups


def exact(w: Workload, devs: list[Device], lat: float = 5e-6) -> PlanResult:
    """The optimum over every subset, partition, device order and cut, with
    devices of one class interchangeable (see the module doc). Exponential in
    the number of classes and devices: 7-12 devices of 2-3 classes on a model
    of up to about 12 layers take seconds to minutes."""
    res = _best_of(w, devs, _exact_partitions(w, devs), lat, BRUTE_DISTINCT)
    res.notes.append("exact over device classes' sub-multisets, partitions, orders and cuts")
    return res


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
        res.notes.append(
            "tentative search over device subsets by class and pipeline depths 1-8, "
            "mixed or alike groups"
        )
    return res
