"""Straggler models and their effect on a simulated iteration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.sim.stragglers import StragglerConfig, factors
from gradfabric.sim.training import TrainingConfig, run_training


def test_fixed_slows_only_the_chosen_workers() -> None:
    f = factors(StragglerConfig(model="fixed", workers=(1, 3), slowdown=2.5), 4, 5, seed=0)
    assert f.shape == (4, 5)
    assert np.all(f[:, [1, 3]] == 2.5) and np.all(f[:, [0, 2, 4]] == 1.0)


def test_random_models_are_seeded_and_at_least_one() -> None:
    for cfg in (
        StragglerConfig(model="lognormal", sigma=0.5),
        StragglerConfig(model="bursts", slowdown=3.0, burst_prob=0.3),
    ):
        a, b, c = (factors(cfg, 50, 8, seed=s) for s in (1, 1, 2))
        assert np.array_equal(a, b) and not np.array_equal(a, c)
        assert np.all(a >= 1.0) and np.any(a > 1.0)
    bursts = factors(
        StragglerConfig(model="bursts", slowdown=3.0, burst_prob=0.3, burst_iterations=2),
        200,
        4,
        seed=3,
    )
    assert set(np.unique(bursts)) == {1.0, 3.0}


def test_moving_slows_one_worker_at_a_time_in_turn() -> None:
    f = factors(StragglerConfig(model="moving", workers=(3,), slowdown=4, move_every=2), 6, 4, 0)
    assert [int(np.argmax(row)) for row in f] == [3, 3, 0, 0, 1, 1]
    assert np.all(np.sort(f, axis=1)[:, :-1] == 1.0) and np.all(f.max(axis=1) == 4.0)
    with pytest.raises(ConfigError, match="move_every"):
        factors(StragglerConfig(model="moving", workers=(0,), move_every=0), 2, 4, seed=0)


def test_trace_file(tmp_path: Path) -> None:
    p = tmp_path / "trace.csv"
    p.write_text("0,1,2.0\n2,0,4\n9,9,9\n")
    f = factors(StragglerConfig(model="trace", trace_file=str(p)), 3, 2, seed=0)
    assert f.tolist() == [[1.0, 2.0], [1.0, 1.0], [4.0, 1.0]]
    p.write_text("zero,1,2\n")
    with pytest.raises(ConfigError, match="line 1"):
        factors(StragglerConfig(model="trace", trace_file=str(p)), 3, 2, seed=0)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ConfigError, match="straggler model"):
        StragglerConfig(model="gremlins")
    with pytest.raises(ConfigError, match="slowdown"):
        StragglerConfig(slowdown=0.5)
    with pytest.raises(ConfigError, match=r"stragglers\.workers"):
        factors(StragglerConfig(model="fixed", workers=(9,), slowdown=2), 2, 4, seed=0)


def test_compute_and_nic_slowdowns_stretch_the_iteration() -> None:
    base = dict(model="mlp", batch=16384, device="t4", iterations=2, workers=4, bucket_mb=0.05)
    calm = run_training(TrainingConfig(scheme="atp", **base))  # type: ignore[arg-type]
    slow = StragglerConfig(model="fixed", workers=(2,), slowdown=3.0)
    cpu = run_training(TrainingConfig(scheme="atp", stragglers=slow, **base))  # type: ignore[arg-type]
    # compute-bound: one 3x-slower worker makes every iteration about 3x longer
    assert cpu.mean_iteration_ms / calm.mean_iteration_ms == pytest.approx(3.0, rel=0.1)
    nic = StragglerConfig(model="fixed", workers=(2,), slowdown=50.0, nic=True)
    net = run_training(TrainingConfig(scheme="atp", stragglers=nic, **base))  # type: ignore[arg-type]
    assert net.mean_iteration_ms > 1.2 * calm.mean_iteration_ms


def test_a_given_compute_time_replaces_the_devices() -> None:
    """``compute_ms`` (an emulated device's deadline) sets the iteration's
    compute; one 4x-slower worker stretches it 4x (communication here is
    microseconds: 4 workers, 200 KB, 100 Gbit/s)."""
    base = dict(model="mlp", batch=32, iterations=3, workers=4, compute_ms=40.0)
    calm = run_training(TrainingConfig(scheme="ring", **base))  # type: ignore[arg-type]
    assert calm.mean_iteration_ms == pytest.approx(40.0, rel=0.02)
    slow = StragglerConfig(model="fixed", workers=(1,), slowdown=4.0)
    late = run_training(TrainingConfig(scheme="ring", stragglers=slow, **base))  # type: ignore[arg-type]
    assert late.mean_iteration_ms == pytest.approx(160.0, rel=0.02)
