"""The planner's search: more devices never make a slower plan, baselines get
the same freedom, and the tentative search against the exact optimum beyond
the exhaustive range."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.planner.baselines import BASELINES, best_subset
from gradfabric.planner.cost import Device, Workload, evaluate
from gradfabric.planner.search import exact, plan
from gradfabric.planner.spec import A100, H100, V100, DeviceType
from gradfabric.workloads.catalog import model_spec

MODELS = {m: Workload.of(model_spec(m), 512) for m in ("resnet50", "bert-large", "gpt2")}


@st.composite
def device_types(draw: st.DrawFn) -> DeviceType:
    """A GPU type with independent speed, memory, NIC and price: no type need
    dominate another."""
    return DeviceType(
        f"t{draw(st.integers(0, 10**6))}",
        draw(st.floats(50, 1500)),
        draw(st.sampled_from([16, 32, 48, 80])),
        draw(st.floats(0.5, 10)),
        draw(st.sampled_from([10, 25, 100, 200, 400])),
    )


@pytest.mark.long  # ~14 s: past the default suite's budget; CI's second pass runs it
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(sorted(MODELS)),
    types=st.lists(device_types(), min_size=1, max_size=3, unique_by=lambda t: t.name),
    counts=st.lists(st.integers(0, 10), min_size=3, max_size=3),
    added=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_adding_devices_never_raises_the_planned_batch_time(
    model: str, types: list[DeviceType], counts: list[int], added: list[int]
) -> None:
    w = MODELS[model]
    small = [t for t, n in zip(types, counts, strict=False) for _ in range(n)]
    extra = [t for t, n in zip(types, added, strict=False) for _ in range(n)]
    if len(small) <= 6 or not extra:  # the tentative range (the exhaustive one is exact)
        return
    devs = [Device(i, t) for i, t in enumerate(small)]
    more = [Device(i, t) for i, t in enumerate(small + extra)]
    try:
        before = plan(w, devs).estimate.batch_time_s
    except ValueError:  # the model fits none of the smaller cluster's plans
        return
    assert plan(w, more).estimate.batch_time_s <= before


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_planner_on_64_mixed_devices_beats_every_plan_on_one_tier(model: str) -> None:
    """The reviewer's case: 16 H100 + 24 A100 + 24 V100 against the planner's
    own plan and every baseline rule on the H100s (or A100s) alone."""
    w = MODELS[model]
    types = [H100] * 16 + [A100] * 24 + [V100] * 24
    got = plan(w, [Device(i, t) for i, t in enumerate(types)]).estimate.batch_time_s
    for tier in (H100, A100):
        alone = [Device(i, tier) for i in range(types.count(tier))]
        assert got <= plan(w, alone).estimate.batch_time_s
        for name in BASELINES.names():
            e = evaluate(w, alone, BASELINES.get(name)(w, alone))
            assert got <= e.batch_time_s


def test_a_baseline_on_its_best_subset_is_no_slower_than_on_every_device() -> None:
    w = MODELS["resnet50"]
    devs = [Device(i, t) for i, t in enumerate([H100] * 4 + [A100] * 6 + [V100] * 6)]
    for name in BASELINES.names():
        rule = BASELINES.get(name)
        _, best = best_subset(rule, w, devs)
        assert best.batch_time_s <= evaluate(w, devs, rule(w, devs)).batch_time_s
    # the V100s' 25 Gbit/s NICs make any replica on them sync-bound: proportional
    # data parallelism does best without them
    plan_dp, _ = best_subset(BASELINES.get("proportional-dp"), w, devs)
    assert all(devs[d].type is not V100 for d in plan_dp.devices())


@pytest.mark.parametrize(
    ("model", "counts"),
    [("bert-large", (2, 3, 2)), ("gpt2", (3, 3, 2)), ("resnet50", (3, 2, 2))],
)
def test_tentative_search_against_the_exact_optimum(model: str, counts: tuple[int, ...]) -> None:
    """7-8 devices, past the exhaustive range: the exact search over class
    multisets is a lower bound the tentative search cannot beat, and the
    tentative search comes within 5% of it here (the gaps over 7-12 devices
    are reported by ``gradfabric experiment planner``)."""
    w = Workload.of(model_spec(model), 512, max_layers=8)
    types = [t for t, n in zip((H100, A100, V100), counts, strict=True) for _ in range(n)]
    devs = [Device(i, t) for i, t in enumerate(types)]
    opt = exact(w, devs).estimate.batch_time_s
    got = plan(w, devs, exhaustive_upto=0).estimate.batch_time_s
    assert opt <= got * (1 + 1e-12)
    assert got <= opt * 1.05


def test_executed_baselines_include_each_rule_on_its_best_subset() -> None:
    """``bench plan`` runs even DP on the subset where the cost model finds it
    fastest: the brute-force minimum over every non-empty subset of the four
    emulated devices."""
    from itertools import combinations

    from gradfabric.lab.plan_bench import ExecConfig, best_subsets, devices, workload
    from gradfabric.planner.baselines import even_dp
    from gradfabric.planner.cost import Device, evaluate

    cfg = ExecConfig()
    devs, w = devices(cfg, 30e9), workload(cfg)
    got = best_subsets(w, devs, 1e-3, {"even-dp": even_dp(w, devs)})

    def on(keep: tuple[int, ...]) -> float:
        sub = [d if d.index in keep else Device(d.index, d.type, 0.0) for d in devs]
        return evaluate(w, devs, even_dp(w, sub), 1e-3).batch_time_s

    every = [c for k in range(1, 5) for c in combinations(range(4), k)]
    brute = min(on(c) for c in every)
    assert evaluate(w, devs, got["even-dp-best"], 1e-3).batch_time_s == pytest.approx(brute)
    assert brute < on((0, 1, 2, 3))  # the slowest device holds every replica back


def test_migration_counts_only_the_layers_a_device_gains() -> None:
    """Hand-counted: device 0 keeps layers 0-1 and gains 2 (from device 1);
    device 1 keeps 3 of its 2-3; device 2 is new and gains all four, 0-1 from
    device 0 and 2-3 from device 1 (fp32 parameters). The term is the busiest
    NIC: device 1 sending 400 bytes (and device 2 receiving them)."""
    from gradfabric.planner.cost import Group, Plan, Stage
    from gradfabric.planner.online import migration_bytes, migration_flows, migration_s

    w = Workload("toy", (1.0,) * 4, (10, 20, 30, 40), (1.0,) * 4, 8)
    old = Plan((Group((Stage(0, 0, 2), Stage(1, 2, 4)), 1.0),))
    new = Plan((Group((Stage(0, 0, 3), Stage(1, 3, 4)), 1.0), Group((Stage(2, 0, 4),), 1.0)))
    assert migration_flows(w, old, new) == {(1, 0): 4 * 30, (0, 2): 4 * 30, (1, 2): 4 * 70}
    assert migration_bytes(w, old, new) == {0: 4 * 30, 2: 4 * 100}
    assert migration_bytes(w, new, new) == {}
    nic = DeviceType("nic-1g", peak_tflops=1.0, mem_gb=8.0, cost_per_hour=0.0, nic_gbps=1.0)
    devs = [Device(i, nic, 1.0) for i in range(3)]
    assert migration_s(w, devs, old, new) == pytest.approx(400 * 8 / 1e9)
    assert migration_s(w, devs, old, new, state_copies=1) == pytest.approx(2 * 400 * 8 / 1e9)
    assert migration_s(w, devs, None, new) == 0.0
