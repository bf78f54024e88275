"""The emulated cluster: device memory (the cost model's, enforced before a
plan runs), its YAML, and baselines held to the plans that can run."""

from __future__ import annotations

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.lab.plan_bench import ExecConfig, devices, require_fits, workload
from gradfabric.planner.baselines import even_dp
from gradfabric.planner.cost import BYTES_PER_PARAM_STATE, evaluate
from gradfabric.planner.search import plan


def test_a_plan_past_a_devices_memory_is_refused_naming_the_field() -> None:
    # 16 layers of 512: 4.2 MB of weights, gradients and Adam state a layer;
    # the slow devices hold 2 layers' worth, the fast ones the whole model
    cfg = ExecConfig(layers=16, width=512, memory_mb=(256, 256, 11, 11))
    w, devs = workload(cfg), devices(cfg)
    per_layer_mb = BYTES_PER_PARAM_STATE * w.params[0] / 2**20
    assert 2 < 11 / per_layer_mb < 3
    with pytest.raises(ConfigError, match="memory_mb") as e:
        require_fits(w, devs, {"even-dp": even_dp(w, devs)})
    assert "device 2" in str(e.value)
    # the planner keeps to it: no stage on a small device holds more than fits
    got = plan(w, devs).plan
    assert evaluate(w, devs, got).feasible
    for g in got.groups:
        for st in g.stages:
            if st.device >= 2:
                assert st.end - st.first <= 2
    require_fits(w, devs, {"planner": got})


def test_memory_is_one_size_per_device() -> None:
    with pytest.raises(ConfigError, match="memory_mb"):
        ExecConfig(memory_mb=(64.0,))
    with pytest.raises(ConfigError, match="memory_mb"):
        ExecConfig(memory_mb=(64.0, 64.0, 0.0, 64.0))


def test_the_example_cluster_file_loads() -> None:
    from pathlib import Path

    from gradfabric.core.config import load_yaml

    example = Path(__file__).parents[2] / "src/gradfabric/configs/emulated-cluster.yaml"
    cfg = load_yaml(ExecConfig, example)
    assert cfg.shaped and cfg.link_gbps == 1.0 and cfg.memory_mb == (8192.0,) * 4
    assert cfg.speeds == (1.0, 1.0, 0.5, 0.25) and cfg.layers == 16


def test_a_baseline_at_its_best_is_its_best_runnable_plan() -> None:
    """16x256, batch 32, 0.1 Gbit/s: the even pipeline's fastest subset by the
    model is 3 stages, whose 12 micro-batches cannot split 32 samples; at its
    best among runnable plans (a brute force over every device subset) it is
    what ``best_subset`` returns when told what can run."""
    import itertools
    import math

    from gradfabric.planner.baselines import best_subset, even_pipeline
    from gradfabric.planner.cost import Device, Plan
    from gradfabric.planner.pipeline import splits_whole

    cfg = ExecConfig(layers=16, width=256, batch=32, link_gbps=0.1)
    w, devs = workload(cfg), devices(cfg)
    lat = 5e-4

    def runs(p: Plan) -> bool:
        return splits_whole(p, cfg.batch)

    assert not runs(best_subset(even_pipeline, w, devs, lat)[0])
    got, est = best_subset(even_pipeline, w, devs, lat, runs)
    assert runs(got)
    best = math.inf
    for k in range(1, len(devs) + 1):
        for keep in itertools.combinations(range(len(devs)), k):
            sub = [d if d.index in keep else Device(d.index, d.type, 0.0) for d in devs]
            p = even_pipeline(w, sub)
            if runs(p):
                best = min(best, evaluate(w, devs, p, lat).batch_time_s)
    assert est.batch_time_s == pytest.approx(best, rel=1e-12)
