"""ESA's training study read back: which ATP its headline is against, which
setting it is in, and the order its policies run in."""

from __future__ import annotations

from typing import Any

import pytest

from gradfabric.experiments.esa_train import GAIN, claims, headline, policies, ticks, turn
from gradfabric.lab.esa_train import TIMEOUTS


def _result(jct: dict[str, float], order: tuple[str, ...]) -> dict[str, Any]:
    """A study's rows: mean JCTs ``jct`` per policy in ``GAIN``, every policy
    at 10 s in the ample setting; ``order``: the settings as a user listed them."""
    every = {GAIN: (40, 5.0), "ample, jittered": (4096, 5.0)}
    rows: list[dict[str, Any]] = []
    for name in order:
        here = jct if name == GAIN else {"atp": 10.0, "esa": 10.0}
        for p, t in here.items():
            rows.append({"setting": name, "pool_slots": every[name][0], "jitter_ms": 5.0,
                         "policy": p, "mean_jct_s": t, "p99_jct_s": t, "sim_mean_jct_s": t,
                         "sim_cal_mean_jct_s": t, "hybrid_mean_jct_s": t,
                         "hybrid_cal_mean_jct_s": t, "exact": True, "start_late_ms": 1.0,
                         "preemptions": 0, "ps_fallback": 0, "daemon_load": 0.2,
                         "workers_load": 1.0})  # fmt: skip
        for base in (p for p in here if p != "esa"):
            x = here[base] / here["esa"]
            rows.append({"setting": name, "pool_slots": every[name][0], "jitter_ms": 5.0,
                         "policy": f"esa/{base}", "mean_jct_speedup": x,
                         "mean_jct_speedup_half": 0.05, "p99_jct_speedup": x,
                         "p99_jct_speedup_half": 0.05, "sim_mean_jct_speedup": x,
                         "sim_cal_mean_jct_speedup": x, "hybrid_mean_jct_speedup": x,
                         "hybrid_cal_mean_jct_speedup": 0.5 * x})  # fmt: skip
    config = {"link_gbps": 1.0, "seeds": 6, "jobs": 3, "host_overhead_ms": 3.0,
              "settings": {n: every[n] for n in order}}  # fmt: skip
    return {"rows": rows, "config": config}


@pytest.mark.parametrize("order", [(GAIN, "ample, jittered"), ("ample, jittered", GAIN)])
@pytest.mark.parametrize(("atp", "timeouts", "against"), [
    (30.0, 32.0, "ATP through"),
    (33.0, 31.0, "ATP with its workers' fast retransmit off"),
])  # fmt: skip
def test_the_headline_is_against_the_faster_atp_where_the_gain_is_predicted(
    order: tuple[str, ...], atp: float, timeouts: float, against: str
) -> None:
    res = _result({"atp": atp, "esa": 27.0, TIMEOUTS: timeouts}, order)
    heads = [c for c in claims(res) if c.headline]
    assert len(heads) == 1 and heads[0].baseline.startswith(against)
    assert "scarce, jittered" in heads[0].claim
    assert heads[0].speedup == pytest.approx(min(atp, timeouts) / 27.0)
    half = 0.5 * min(atp, timeouts) / 27.0  # the hybrid level's calibrated prediction
    assert f"(the hybrid level: {2 * half:.2f}x and {half:.2f}x)" in heads[0].note
    assert len(claims(res)) == 3  # ESA over each ATP where the gain is, over ATP elsewhere


def test_the_ablation_runs_where_the_gain_is_and_each_policy_takes_each_place() -> None:
    listed = {"ample, jittered": (4096, 5.0), GAIN: (40, 5.0)}
    assert headline(listed) == GAIN  # wherever a user lists it
    assert headline({"ample, jittered": (4096, 5.0)}) == "ample, jittered"
    assert policies(GAIN, listed) == ("atp", "esa", TIMEOUTS)
    assert policies("ample, jittered", listed) == ("atp", "esa")
    assert ticks(listed, 6) == 1 + 6 * (3 + 2)
    arms = policies(GAIN, listed)
    for p in arms:  # over any 3 traces in a row, first, second and last once each
        assert sorted(turn(arms, s).index(p) for s in range(4, 7)) == [0, 1, 2]
    assert [turn(("atp", "esa"), s) for s in (0, 1)] == [("atp", "esa"), ("esa", "atp")]
