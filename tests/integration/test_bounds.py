"""Simulated baselines agree with their analytic bounds (small tensors, fast)."""

from __future__ import annotations

import pytest

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.experiments.simulate import ring_bound_ns, switchml_bound_gbps
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig, run_collective
from gradfabric.sim.network import LinkSpec


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_within_5pct_of_bound(n: int) -> None:
    fabric = FabricConfig(link=LinkSpec(link_gbps=100, prop_delay_ns=500))
    ina = InaConfig()
    r = run_collective("ring", n, [Bucket(0, 1_000_000)], fabric, ina)
    assert r.comm_ns / ring_bound_ns(n, 1_000_000, ina, fabric) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("window, limited", [(128, "line"), (8, "window"), (2, "window")])
def test_switchml_goodput_within_5pct_of_bound(window: int, limited: str) -> None:
    fabric = FabricConfig(link=LinkSpec(link_gbps=100, prop_delay_ns=500))
    ina = InaConfig(switchml_slots=window)
    r = run_collective("switchml", 8, [Bucket(0, 1_000_000)], fabric, ina)
    bound = switchml_bound_gbps(ina, fabric, window)
    line = switchml_bound_gbps(ina, fabric, 10**6)
    assert (bound == line) == (limited == "line")
    assert r.goodput_gbps / bound == pytest.approx(1.0, abs=0.05)


def test_ina_beats_ring_by_the_traffic_ratio() -> None:
    ring = run_collective("ring", 8, [Bucket(0, 2_000_000)])
    sml = run_collective("switchml", 8, [Bucket(0, 2_000_000)])
    assert ring.comm_ns / sml.comm_ns == pytest.approx(2 * 7 / 8, rel=0.05)


def test_a_dead_worker_ends_the_collective_with_a_timeout_naming_it() -> None:
    for scheme in ("switchml", "atp"):
        with pytest.raises(PeerTimeoutError, match="waits on w3") as e:
            run_collective(
                scheme,
                4,
                [Bucket(0, 10_000)],
                ina=InaConfig(rto_ns=10_000),
                dead_workers=frozenset({3}),
            )
        assert e.value.peer == "w3"
