"""Time to a target accuracy: the end of the first step whose accuracy reaches
the target, counted from the job's start, as MLPerf reads it."""

from __future__ import annotations

import math

import pytest

from gradfabric.experiments.saatp_train import _mark_tuned, time_to_target


def test_the_first_step_at_the_target_counts_and_later_dips_do_not() -> None:
    run = {"step_ms": [100.0, 50.0, 25.0, 40.0], "accs": [0.5, 0.9, 0.8, 0.95]}
    at, steps = time_to_target(run, 0.9) or (math.nan, 0)
    assert steps == 2 and at == pytest.approx(0.150)
    at, steps = time_to_target(run, 0.91) or (math.nan, 0)
    assert steps == 4 and at == pytest.approx(0.215)
    assert time_to_target(run, 0.96) is None


def test_backup_workers_tuned_is_the_fastest_that_always_reached_the_target() -> None:
    rows = [
        {"mode": "backup-1", "tta_s": 2.0, "reached": 5, "runs": 5},
        {"mode": "backup-2", "tta_s": 1.5, "reached": 4, "runs": 5},  # faster, missed once
        {"mode": "backup-3", "tta_s": 2.5, "reached": 5, "runs": 5},
        {"mode": "saatp", "tta_s": 1.0, "reached": 5, "runs": 5},
    ]
    _mark_tuned(rows)
    assert [r.get("tuned") for r in rows] == [True, False, False, None]
