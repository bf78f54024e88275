"""Device memory in the emulated cluster: the cost model's, enforced before a
plan runs."""

from __future__ import annotations

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.planner.baselines import even_dp
from gradfabric.planner.cost import BYTES_PER_PARAM_STATE, evaluate
from gradfabric.planner.execute import ExecConfig, devices, require_fits, workload
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
