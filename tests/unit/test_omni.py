"""OmniReduce's streaming engines in the simulator: exact, sparse on the wire,
at the data-volume bound, and loud about a dead peer."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.proto.actions import Fail
from gradfabric.proto.omni import NONE, OmniAggregator, OmniLayout, OmniWorker, block_mask
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, CollectiveResult, FabricConfig, run_collective
from gradfabric.sim.network import LinkSpec
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, decode, encode
from tests.property.test_aggregation import lossy


def _union_blocks(r: CollectiveResult, sizes: list[int], block: int = 256) -> int:
    """Blocks non-zero at some worker, bucket by bucket (blocks restart per bucket)."""
    assert r.inputs is not None
    edges = np.cumsum([0, *sizes])
    return sum(
        int(np.logical_or.reduce([block_mask(x[lo:hi], block) for x in r.inputs]).sum())
        for lo, hi in itertools.pairwise(edges)
    )


def _exact(r: CollectiveResult) -> None:
    assert r.inputs is not None and r.results is not None
    ref = np.sum([x.astype(np.int64) for x in r.inputs], axis=0)
    for w, res in enumerate(r.results):
        assert np.array_equal(res, ref), f"worker {w} differs from the int64 reference"


def test_layout_maps_every_block_to_one_stream_position() -> None:
    lay = OmniLayout(["a0", "a1", "a2"], streams=5)
    seen = {lay.where(b) for b in range(1000)}
    assert len(seen) == 1000  # a bijection onto (stream, position)
    assert all(lay.block_of(*lay.where(b)) == b for b in range(1000))
    # positions ascend with block index inside each stream: streams run in order
    for g in range(lay.width):
        blocks = [b for b in range(1000) if lay.where(b)[0] == g]
        assert [lay.where(b)[1] for b in blocks] == list(range(len(blocks)))


@pytest.mark.parametrize("density", [1.0, 0.4, 0.1])
def test_time_is_the_union_over_the_downlink(density: float) -> None:
    """Each worker's downlink must carry every block non-zero anywhere (the
    union), once: the bound is union * (block + header) / link rate."""
    r = run_collective("omnireduce", 8, [Bucket(0, 1_000_000)], values=True, density=density)
    _exact(r)
    bound_ns = _union_blocks(r, [1_000_000]) * (1024 + HEADER_BYTES) * 8 / 100.0
    ratio = r.comm_ns / bound_ns
    assert ratio >= 1.0, ratio  # never faster than the bound
    assert ratio <= 1.15, ratio


def test_blocks_zero_everywhere_never_travel() -> None:
    r = run_collective(
        "omnireduce", 4, [Bucket(0, 300_000), Bucket(0, 77_777)], values=True, density=0.05
    )
    _exact(r)
    ina = InaConfig()
    streams = 4 * ina.omni_streams * 2  # aggregators x streams x buckets
    # one result per non-zero-somewhere block, plus each stream's announce round
    assert r.counters["OmniAggregator.results"] == _union_blocks(r, [300_000, 77_777]) + streams
    dense = run_collective("ring", 4, [Bucket(0, 300_000), Bucket(0, 77_777)], density=0.05)
    assert r.comm_ns < dense.comm_ns / 3


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workers=st.integers(2, 8),
    link=lossy,
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.integers(1, 6000), min_size=1, max_size=3),
    density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
    streams=st.sampled_from([1, 4, 16]),
    aggregators=st.sampled_from([0, 1, 3]),
)
def test_exact_under_loss_dup_reorder(
    workers: int,
    link: LinkSpec,
    seed: int,
    sizes: list[int],
    density: float,
    streams: int,
    aggregators: int,
) -> None:
    buckets = [Bucket(i * 5_000, s) for i, s in enumerate(sizes)]
    ina = InaConfig(rto_ns=100_000, omni_streams=streams, omni_aggregators=aggregators)
    r = run_collective(
        "omnireduce", workers, buckets, FabricConfig(link=link), ina, seed, True, density=density
    )
    _exact(r)


def test_exact_past_one_bitmap_word() -> None:
    """130 workers and as many aggregators (one stream each) on a
    leaf-spine, under loss: senders past 64, the in-network bitmap's word,
    are OmniReduce's to name (it keeps no bitmap of them)."""
    fabric = FabricConfig(topology="leaf_spine", hosts_per_rack=32, spines=2,
                          link=LinkSpec(loss=0.01))  # fmt: skip
    ina = InaConfig(rto_ns=200_000, omni_streams=1)
    r = run_collective("omnireduce", 130, [Bucket(0, 40_000)], fabric, ina, 0, True,
                       density=0.02)  # fmt: skip
    _exact(r)
    assert r.counters["link_loss"] > 0 and r.counters["OmniWorker.timeouts"] > 0


def test_the_timeout_follows_rounds_slower_than_its_floor() -> None:
    """16 workers' blocks into one aggregator over 1 Gbit/s links: a round
    takes 32 packets in and 32 results out of its port, hundreds of
    microseconds, against a 100 us floor, and nothing is lost. A fixed
    timeout re-sent every round's block until it gave up on a live
    aggregator; the timeout learns the rounds instead: exact, a few
    re-sends per stream and worker while each one's timeout doubles past
    the round, and the run within the time of one with a timeout (10 ms)
    no round reaches plus what those re-sends cost the port (a block in,
    a result out, each)."""
    fabric = FabricConfig(link=LinkSpec(link_gbps=1.0))
    buckets = [Bucket(0, 160_000)]

    def run(rto_ns: int) -> CollectiveResult:
        ina = InaConfig(rto_ns=rto_ns, omni_streams=2, omni_aggregators=1)
        return run_collective("omnireduce", 16, buckets, fabric, ina, 0, True, density=1.0)

    learnt, ample = run(100_000), run(10_000_000)
    _exact(learnt)
    assert ample.counters.get("OmniWorker.timeouts", 0) == 0  # (no round reaches it)
    resent = learnt.counters["OmniWorker.timeouts"]
    assert 0 < resent < 32 * 12  # each stream's timeout doubles to the round's in a few
    packet_ns = (1024 + HEADER_BYTES) * 8 / 1.0
    took, bound = learnt.comm_ns, ample.comm_ns + 2 * resent * packet_ns
    assert took <= bound, (took, bound)


def test_an_aggregator_takes_1_to_65536_workers() -> None:
    """The header names a sender in a u16: no aggregator of none, or of more."""
    for n in (0, 2**16 + 1):
        with pytest.raises(ConfigError, match="workers"):
            OmniAggregator("agg0", 1, 0, [f"w{i}" for i in range(n)], streams=1)
    assert len(OmniAggregator("agg0", 1, 0, ["w"] * 2**16, streams=1).workers) == 2**16


def test_a_dead_worker_is_named() -> None:
    with pytest.raises(PeerTimeoutError, match="waits on w2") as e:
        run_collective(
            "omnireduce",
            4,
            [Bucket(0, 10_000)],
            ina=InaConfig(rto_ns=10_000),
            dead_workers=frozenset({2}),
            density=0.3,
        )
    assert e.value.peer == "w2"


def test_aggregator_drops_foreign_and_malformed_input() -> None:
    agg = OmniAggregator("agg0", 1, 0, ["w0", "w1"], streams=4)
    good = Packet(1, 0, 0, 0, 5, 64, 0, 0, 0, 0, np.zeros(0, dtype=np.int32))
    assert agg.on_packet(good, 0) == []  # w0 announces; w1 has not yet
    for bad in (
        Packet(2, 0, 0, 0, 5, 64, 0, 0, 0, 0, None),  # another job
        Packet(1, 9, 0, 0, 5, 64, 0, 0, 0, 0, None),  # no such worker
        Packet(1, 1, 0, 0, 5, 64, Flag.ACK, 0, 0, 0, None),  # a result sent to an aggregator
        Packet(1, 1, 0, 7, 5, 64, 0, 0, 0, 0, None),  # data for a round not open
    ):
        assert agg.on_packet(bad, 0) == []
    assert agg.counters["drop_foreign"] == 3 and agg.counters["drop_bad_position"] == 1
    assert agg.missing_workers() == ["w1"]
    # the stream is unharmed: w1 announces and the round completes
    (res,) = agg.on_packet(Packet(1, 1, 0, 0, NONE, 64, 0, 0, 0, 0, None), 0)
    assert res.pkt.bitmap == 5 and res.pkt.has(Flag.ACK)  # type: ignore[union-attr]
    # results are valid wire packets: the header round-trips
    wire = res.pkt.clone()  # type: ignore[union-attr]
    wire.payload = np.zeros(0, dtype=np.int32)
    assert decode(encode(wire)).bitmap == 5


def test_the_worker_s_timer_step_by_step() -> None:
    """One worker, one aggregator, one stream, results scripted: the timer
    as the module doc states it (floor 100 ns, a stream given up 400 floors
    after its last result, no timeout past 1/32 of that)."""
    lay = OmniLayout(["agg"], streams=1, block=4)
    w = OmniWorker("w", 7, 0, lay, rto_ns=100, max_tries=400)
    x = np.arange(1, 9, dtype=np.int64)  # two blocks, both non-zero

    def result(pos: int, nxt: int, at: int) -> list[Any]:
        vals = None if pos < 0 else x[4 * pos : 4 * pos + 4]
        pkt = Packet(7, 0, 0, pos + 1, nxt, 64, Flag.ACK, 0, 0, 0 if pos < 0 else 4, vals)
        return w.on_packet(pkt, at)

    w.start(0, 8, 0, payload=x)
    assert w.next_deadline() == 100  # the floor
    assert len(w.on_timer(100)) == 2  # the announce again and a RESEND
    assert w.next_deadline() == 300  # backed off: twice the floor
    result(-1, 0, 250)  # the announce round's result, after a re-send: no sample
    assert w.rto.srtt == 0 and w.next_deadline() == 300
    assert w.on_timer(300) == [] and w.next_deadline() == 450  # still backed off
    result(0, 1, 400)  # a clean round, inside its timeout (200): sampled
    assert w.rto.srtt == 150 and w.rto.ns() == 150 + 4 * 75
    assert w.next_deadline() == 450  # (the timer moves only earlier)
    # due at 400 + 450, but every stream is scanned at most once a timeout
    assert w.on_timer(450) == [] and w.next_deadline() == 450 + 450
    # silence: doubling up to the ceiling (40,000 / 32), given up 40,000 after
    fired = []
    while (at := w.next_deadline()) is not None:
        acts = w.on_timer(at)
        fired.append(at)
        if any(isinstance(a, Fail) for a in acts):
            (fail,) = acts
            break
    assert fail.waited_ns == 40_000 and fired[-1] == 400 + 40_000
    gaps = np.diff(fired[:-1])
    assert gaps.max() == 1_250 and np.all(gaps[1:] >= gaps[:-1])
    assert w.next_deadline() is None and not w.buckets  # forgotten, no timer left
