"""The controller's comparison on the cost model (``train_plan``'s schedules):
the budget kept where the budget-blind schedule breaks it, the static plan
the hindsight optimum, proportional shares re-balanced to current speeds."""

from __future__ import annotations

import itertools

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.lab.plan_bench import ExecConfig, reference, workload
from gradfabric.lab.train_plan import (
    CHANGING_TRACE,
    SCHEDULES,
    TrainPlanConfig,
    _devices,
    best_static,
    schedule_plans,
)
from gradfabric.planner.baselines import even_dp, proportional_dp
from gradfabric.planner.cost import Device, Plan, evaluate
from gradfabric.planner.pipeline import as_run, splits_whole
from gradfabric.planner.search import brute_force

CFG = TrainPlanConfig(ExecConfig(width=256), steps_per_slot=4, calibrate=False,
                      schedules=tuple(SCHEDULES))  # fmt: skip
W = workload(CFG.exec)


def _slots(trace: list[list[float]], cfg: TrainPlanConfig = CFG) -> list[list[Device]]:
    host = reference(cfg.exec)
    return [_devices(cfg, host, [s * f for s, f in zip(cfg.exec.speeds, fs, strict=True)])
            for fs in trace]  # fmt: skip


def _mean(slots: list[list[Device]], plans: list[Plan], key: str) -> float:
    ests = [evaluate(W, d, as_run(p, W.batch)) for d, p in zip(slots, plans, strict=True)]
    return sum(getattr(e, key) for e in ests) / len(ests)


def test_the_controller_keeps_the_budget_the_queue_free_schedule_breaks() -> None:
    slots = _slots(CHANGING_TRACE)
    plans = schedule_plans(CFG, W, slots, 5e-6)
    budget = CFG.budget_per_hour
    assert budget == pytest.approx(0.75 * 4 * sum(CFG.exec.speeds))
    price = {n: _mean(slots, p, "cost_per_hour") for n, p in plans.items()}
    time = {n: _mean(slots, p, "batch_time_s") for n, p in plans.items()}
    assert price["greedy"] > 1.1 * budget  # the budget binds here: the check can fail
    assert price["controller"] <= 1.05 * budget
    assert price["static"] <= budget
    # without the queue it is the fastest on the model; with it, slower but
    # faster than any one plan that keeps the budget throughout
    assert time["greedy"] <= min(time.values()) * (1 + 1e-12)
    assert time["controller"] < time["static"]
    for name, ps in plans.items():  # no plan uses a device while it is gone
        for fs, p in zip(CHANGING_TRACE, ps, strict=True):
            assert all(fs[d] > 0 for d in p.devices()), name


def test_the_static_plan_is_the_brute_force_optimum_when_nothing_changes() -> None:
    trace = [[1.0, 1.0, 1.0, 1.0]] * 3
    slots = _slots(trace)
    got = best_static(W, slots, 1e9, 5e-6, lambda p: splits_whole(p, W.batch))
    opt = brute_force(W, slots[0]).estimate.batch_time_s
    assert evaluate(W, slots[0], got).batch_time_s == pytest.approx(opt, rel=1e-9)


def test_the_static_plan_keeps_its_budget_and_beats_the_rules_that_do() -> None:
    """Budget 6 $/h of 11: against even and proportional DP on every device
    subset that fits the budget (a brute force over subsets)."""
    slots = _slots(CHANGING_TRACE)
    always = [d for d in range(4) if all(fs[d] > 0 for fs in CHANGING_TRACE)]
    got = best_static(W, slots, 6.0, 5e-6, lambda p: splits_whole(p, W.batch))
    assert set(got.devices()) <= set(always)
    assert evaluate(W, slots[0], got).cost_per_hour <= 6.0
    mine = sum(evaluate(W, d, as_run(got, W.batch)).batch_time_s for d in slots)
    for k in range(1, len(always) + 1):
        for keep in itertools.combinations(always, k):
            sub = [d if d.index in keep else Device(d.index, d.type, 0.0) for d in slots[0]]
            for rule in (even_dp, proportional_dp):
                p = rule(W, sub)
                if evaluate(W, slots[0], p).cost_per_hour <= 6.0:
                    theirs = sum(evaluate(W, d, as_run(p, W.batch)).batch_time_s for d in slots)
                    assert mine <= theirs * (1 + 1e-9), (rule.__name__, keep)


def test_no_static_plan_where_no_device_stays() -> None:
    trace = [[0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ConfigError, match="trace"):
        best_static(W, _slots(trace), 1e9, 5e-6, lambda p: True)


def test_proportional_shares_follow_the_current_speeds() -> None:
    host = reference(CFG.exec)
    devs = [Device(0, host, 1.0), Device(1, host, 0.5), Device(2, host, 0.0)]
    plan = proportional_dp(W, devs)
    assert [g.batch for g in plan.groups] == [64, 32]


def test_a_config_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="schedules"):
        TrainPlanConfig(schedules=("fastest",))
    with pytest.raises(ValueError, match="prices"):
        TrainPlanConfig(prices=(1.0, 2.0))
    with pytest.raises(ValueError, match="budget"):
        TrainPlanConfig(budget=0.0)
