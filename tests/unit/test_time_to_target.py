"""Time to a target accuracy: the end of the first step whose accuracy reaches
the target, counted from the job's start, as MLPerf reads it; the best
alternative is the one that reached it most often, then soonest."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gradfabric.experiments.saatp_train import _mark_tuned, best, claims, time_to_target


def test_the_first_step_at_the_target_counts_and_later_dips_do_not() -> None:
    run = {"step_ms": [100.0, 50.0, 25.0, 40.0], "accs": [0.5, 0.9, 0.8, 0.95]}
    at, steps = time_to_target(run, 0.9) or (math.nan, 0)
    assert steps == 2 and at == pytest.approx(0.150)
    at, steps = time_to_target(run, 0.91) or (math.nan, 0)
    assert steps == 4 and at == pytest.approx(0.215)
    assert time_to_target(run, 0.96) is None


def test_the_best_reached_the_target_most_often_then_soonest() -> None:
    rows = [
        {"mode": "backup-1", "tta_s": 2.0, "reached": 4, "runs": 5},
        {"mode": "backup-2", "tta_s": 1.5, "reached": 3, "runs": 5},  # faster, missed more
        {"mode": "saatp", "tta_s": 1.0, "reached": 5, "runs": 5},
    ]
    _mark_tuned(rows)
    assert [r.get("tuned") for r in rows] == [True, False, None]
    assert best(rows)["mode"] == "saatp"
    assert best(rows[:2])["mode"] == "backup-1"


def _row(mode: str, tta: float | None, reached: int, **kw: Any) -> dict[str, Any]:
    return {
        "setting": "moving", "move_every": 2, "mode": mode, "runs": 3, "reached": reached,
        "tta_s": tta, "tta_s_half": None if tta is None else 0.1, "tta_pairs": reached,
        "steps_to_target": None if tta is None else 14.0,
        "saatp_tta_speedup": None, "saatp_tta_speedup_half": None,
        "simulated_tta_s": None, "step_ms": 50.0, "saatp_speedup": 1.0,
        "saatp_speedup_half": 0.0, "simulated_ms": None, "predicted_ms": 40.0,
        "bitwise_reference": None, "replica_shards": 2, "extra_compute": 0.0, "tuned": None,
    } | kw  # fmt: skip


def test_claims_read_a_quick_study_and_one_where_nothing_reached_the_target() -> None:
    cfg = {"slowdown": 4.0, "seeds": 3}
    quick = [
        _row("atp", 2.4, 3, saatp_tta_speedup=1.8, saatp_tta_speedup_half=0.1),
        _row("saatp", 1.3, 3, saatp_tta_speedup=1.0, saatp_tta_speedup_half=0.0),
        _row("backup-1", 0.8, 3, tuned=True, saatp_tta_speedup=0.6, saatp_tta_speedup_half=0.05),
        _row("backup-2", 0.9, 2, tuned=False, saatp_tta_speedup=0.7, saatp_tta_speedup_half=0.2),
    ]
    got = claims({"rows": quick, "config": cfg, "target": 0.9})
    assert [c.baseline for c in got][:2] == [
        "ATP through the switch", "the best alternative: backup workers (first n-1)"]  # fmt: skip
    assert got[1].met is False and got[0].met is True
    never = [_row(m, None, 0) for m in ("atp", "saatp", "backup-1")]
    got = claims({"rows": never, "config": cfg, "target": 0.99})
    assert got[0].ours == "not reached" and got[0].met is None
