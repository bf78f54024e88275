"""ESA: preemption storms with loss stay exact; a long low-priority job is not starved."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import FabricConfig
from gradfabric.sim.multijob import JobSpec, TenancyConfig, run_tenancy
from gradfabric.sim.network import LinkSpec

SMALL = dict(models=("mlp",), batch=64, device="t4", bucket_mb=0.05, hosts=16)


@st.composite
def storms(draw: st.DrawFn) -> tuple[list[JobSpec], TenancyConfig]:
    n = draw(st.integers(2, 5))
    jobs = [
        JobSpec(
            i + 1,
            draw(st.integers(0, 200_000)),
            "mlp",
            draw(st.integers(2, 3)),
            draw(st.integers(1, 3)),
        )
        for i in range(n)
    ]
    link = LinkSpec(
        loss=draw(st.floats(0.0, 0.1)),
        dup=draw(st.floats(0.0, 0.05)),
        jitter_ns=draw(st.integers(0, 3_000)),
    )
    cfg = TenancyConfig(
        scheme=draw(st.sampled_from(["esa", "atp"])),
        pool_slots=draw(st.integers(2, 24)),
        seed=draw(st.integers(0, 2**31)),
        priority=draw(st.sampled_from(["srpt-aging", "fifo"])),
        fabric=FabricConfig(link=link),
        ina=InaConfig(train_packets=1, atp_window=8, rto_ns=200_000),
        **SMALL,
    )  # type: ignore[arg-type]
    return sorted(jobs, key=lambda j: j.arrival_ns), cfg


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(storm=storms())
def test_every_aggregate_exact_under_preemption_storms_and_loss(
    storm: tuple[list[JobSpec], TenancyConfig],
) -> None:
    jobs, cfg = storm
    r = run_tenancy(cfg, jobs, values=True)
    assert r.exact is True
    assert len(r.jobs) == len(jobs)


def test_preemptions_really_happen_and_stay_exact() -> None:
    # Jitter leaves aggregators partly filled long enough to be preempted.
    jobs = [JobSpec(i + 1, i * 10_000, "mlp", 3, 3 - i % 2) for i in range(4)]
    cfg = TenancyConfig(
        scheme="esa",
        pool_slots=6,
        fabric=FabricConfig(link=LinkSpec(jitter_ns=2_000)),
        ina=InaConfig(train_packets=1, atp_window=8),
        **SMALL,
    )  # type: ignore[arg-type]
    r = run_tenancy(cfg, jobs, values=True)
    assert r.exact is True
    assert r.counters["preemptions"] > 0


def _long_job(stream: int) -> tuple[float, int, float]:
    """(JCT of the long job, preemptions, when the last job ends), in seconds."""
    # Job 1 is long (low priority under least-remaining-work-first); a steady
    # stream of short jobs (high priority when they start) keeps arriving.
    jobs = [JobSpec(1, 0, "mlp", 4, 40)]
    jobs += [JobSpec(2 + i, 20_000 + i * 60_000, "mlp", 4, 2) for i in range(stream)]
    cfg = TenancyConfig(
        scheme="esa",
        pool_slots=8,
        aging_s=0.0005,
        fabric=FabricConfig(link=LinkSpec(jitter_ns=2_000)),
        ina=InaConfig(train_packets=1, atp_window=8),
        **SMALL,
    )  # type: ignore[arg-type]
    r = run_tenancy(cfg, jobs)
    jct = next(j["jct_s"] for j in r.jobs if j["job"] == 1)
    return jct, r.counters.get("preemptions", 0), max(j["arrival_s"] + j["jct_s"] for j in r.jobs)


def test_a_steady_high_priority_stream_does_not_starve_a_long_job() -> None:
    alone, _, _ = _long_job(0)
    jct20, pre20, _ = _long_job(20)
    jct60, pre60, end60 = _long_job(60)
    assert pre20 > 0 and pre60 > 0  # the stream really competes for its aggregators
    assert jct60 <= 1.25 * jct20  # bounded: three times the stream, no longer a JCT
    assert jct60 < 0.5 * end60  # it finishes long before the stream does
    assert jct60 < 2 * alone


def test_leaf_spine_racks_each_with_a_pool_stay_exact_under_loss() -> None:
    jobs = [JobSpec(i + 1, i * 10_000, "mlp", 4, 2) for i in range(6)]
    fabric = FabricConfig(
        topology="leaf_spine", spines=2, link=LinkSpec(loss=0.05, jitter_ns=2_000)
    )
    for scheme in ("esa", "atp", "switchml"):
        cfg = TenancyConfig(
            scheme=scheme,
            racks=3,
            pool_slots=16,
            fabric=fabric,
            ina=InaConfig(train_packets=1, atp_window=8, switchml_slots=4, rto_ns=200_000),
            **{**SMALL, "hosts": 8},
        )  # type: ignore[arg-type]
        r = run_tenancy(cfg, jobs, values=True)
        assert r.exact is True, scheme


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(["esa", "atp"]),
    sizes=st.lists(st.integers(2, 14), min_size=2, max_size=5),
    pool=st.integers(2, 24),
    loss=st.floats(0.0, 0.08),
    seed=st.integers(0, 2**31),
)
def test_jobs_spanning_racks_share_both_levels_exactly(
    scheme: str, sizes: list[int], pool: int, loss: float, seed: int
) -> None:
    """Jobs larger than a rack (of 5) span racks: their racks' switches and
    the spine's pool, shared with every other spanning job (ESA preempting
    at both levels), stay exact under loss and reordering."""
    jobs = [JobSpec(i + 1, i * 20_000, "mlp", n, 2) for i, n in enumerate([11, *sizes])]
    link = LinkSpec(loss=loss, jitter_ns=2_000)
    cfg = TenancyConfig(
        scheme=scheme, racks=3, pool_slots=pool, seed=seed,
        fabric=FabricConfig(topology="leaf_spine", spines=2, link=link),
        ina=InaConfig(train_packets=1, atp_window=8, rto_ns=200_000), **{**SMALL, "hosts": 5},
    )  # type: ignore[arg-type]  # fmt: skip
    r = run_tenancy(cfg, jobs, values=True)
    assert r.exact is True
    assert len(r.jobs) == len(jobs)
