"""Untrusted bytes: only the remote error, counted drops, no cross-job effects."""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.core.errors import ProtocolError
from gradfabric.proto.actions import Deliver, Send
from gradfabric.proto.dctcp import DctcpReceiver, DctcpSender
from gradfabric.proto.dlcp import DlcpEndpoint, DlcpReceiver, DlcpSender, DlcpServer
from gradfabric.proto.omni import OmniAggregator, OmniLayout, OmniWorker
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.ring import REDUCE_SCATTER, HierarchicalRingEngine, RingEngine
from gradfabric.proto.switch import SwitchEngine, SwitchJob
from gradfabric.proto.switch.atp import atp_index
from gradfabric.wire.packet import HEADER, MAGIC, VERSION, Flag, Packet, decode, encode

N_FUZZ = 100_000


def _valid(rng: random.Random) -> bytes:
    n = rng.randint(1, 64)
    w = rng.randrange(n)
    count = rng.choice([0, 1, 7, 256])
    flags = rng.choice([0, Flag.ACK, Flag.RESEND, Flag.FLOAT, Flag.ECN | Flag.COLLISION])
    payload = (
        np.array([rng.uniform(-9, 9) for _ in range(count)], np.float32)
        if flags & Flag.FLOAT
        else np.array([rng.randint(-(2**31), 2**31 - 1) for _ in range(count)], np.int32)
    )
    return encode(
        Packet(
            rng.choice([1, 2, 3, 999]),
            w,
            rng.randrange(2**32),
            rng.randrange(64),
            1 << w,
            n,
            flags,
            rng.randrange(256),
            rng.choice([0, 1, 2, rng.randrange(2**16)]),  # layer: ATP's levels, or noise
            count,
            payload,
        )
    )


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    op = rng.randrange(6)
    if op == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncate
        b = b[: rng.randrange(len(b) + 1)]
    elif op == 2:  # extend
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif op == 3:  # overwrite a header field with an extreme value
        off = rng.randrange(max(1, HEADER.size - 4))
        b[off : off + 4] = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x7f\xff\xff\xff"])
    elif op == 4:  # pure noise with a valid magic/version prefix
        b = bytearray(struct.pack("<HB", MAGIC, VERSION)) + bytes(
            rng.randrange(256) for _ in range(rng.randint(0, 80))
        )
    return bytes(b)


def _engines() -> list[Any]:
    omni = OmniWorker("a", 1, 0, OmniLayout(["agg0", "agg1"], streams=4))
    for b in range(3):  # buckets in progress, for results to land in
        omni.start(b, 5000, 0, np.arange(5000, dtype=np.int32))
    jobs = (
        SwitchJob(1, ("a", "b", "c"), parent="ps", slot_count=8, window=8),
        SwitchJob(2, ("d", "e"), parent="ps", slot_base=8, slot_count=8, window=8),
    )
    return [
        SwitchEngine.build("sml", "switchml", 16, jobs),
        SwitchEngine.build("atp", "atp", 16, jobs),
        ParameterServer(
            "ps", (PsJob(1, ("a", "b", "c"), via="sml"), PsJob(2, ("d", "e"), via="sml"))
        ),
        *_two_levels(),
        OmniAggregator("agg0", 1, 0, ["a", "b", "c"], streams=4),
        omni,
        *_transport_engines(),
    ]


def _two_levels() -> list[Any]:
    """ATP's two levels: a rack's switch, the spine above two racks, the PS
    merging by (rack, worker) bits; job 2 is a PS job of 70 in two groups."""
    rack = SwitchJob(1, ("a", "b", "c"), parent="spine", index_at_parent=0, parent_fan_in=2,
                     window=8, group=1)  # fmt: skip
    top = SwitchJob(1, ("l0", "l1"), window=8, ps_shards=("ps",), below=(3, 2))
    big = tuple(f"w{i}" for i in range(70))
    return [
        SwitchEngine.build("l0", "atp", 16, (rack,)),
        SwitchEngine.build("spine", "esa", 16, (top,)),
        ParameterServer("ps", (PsJob(1, ("a", "b", "c", "d", "e"), via="spine", groups=(3, 2)),
                               PsJob(2, big, groups=(64, 6)))),
    ]  # fmt: skip


def _transport_engines() -> list[Any]:
    """The ring and the DLCP/DCTCP hosts, each with transfers in progress."""
    ring = RingEngine("r1", 1, 1, 3, "r2", 4)
    ring.start(0, 40, 0, np.arange(40, dtype=np.int32))
    half = RingEngine("r1", 1, 1, 3, "r2", 4, REDUCE_SCATTER)  # one half of it alone
    half.start(0, 40, 0, np.arange(40, dtype=np.int32))
    # job 0's three rings carry job ids 0-2: fuzzed packets of job 1 and 2 reach
    # the cross-rack ring and the all-gather
    hring = HierarchicalRingEngine("r1", 0, ("r0", "r1", "r2"), ("r1", "x1"), 4)
    hring.start(0, 40, 0, np.arange(40, dtype=np.int32))
    server = DlcpServer("ps", 1, ["a", "b", "c"], push_bound=0.1, per_packet=8)
    host = DlcpEndpoint("a", DlcpReceiver("a", 1, 0, ["ps"]), [DlcpSender("a", 1, 0, "ps", 8)])
    tcp = DlcpEndpoint("b", DctcpReceiver("b", 1, 1, ["ps"]), [DctcpSender("b", 1, 1, "ps", 8)])
    for eng in (host, tcp):
        eng.rx.expect(0, 5, 64, 0.0, 0)
        eng.tx[0].send(5, 64, 0, 1, np.ones(64, dtype=np.float32))
    return [ring, half, hring, server, host, tcp]


@pytest.mark.long  # (9 s on a slow day; CI runs it in its second pass)
def test_fuzzed_bytes_raise_only_protocol_error_and_engines_only_count() -> None:
    rng = random.Random(1234)
    engines = _engines()
    decoded = rejected = 0
    for i in range(N_FUZZ):
        raw = _valid(rng) if i % 10 == 0 else _mutate(rng, _valid(rng))
        try:
            pkt = decode(raw)
        except ProtocolError:
            rejected += 1
            continue
        decoded += 1
        for eng in engines:
            eng.on_packet(pkt, i)  # must not raise
    assert decoded + rejected == N_FUZZ
    assert decoded > 10_000 and rejected > 10_000  # both paths really exercised
    assert sum(e.counters.total() for e in engines) >= decoded


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_protocol_error(raw: bytes) -> None:
    try:
        pkt = decode(raw)
    except ProtocolError:
        return
    assert encode(pkt) == raw  # whatever is accepted is canonical: it re-encodes exactly


def _snapshot_switchml(eng: SwitchEngine, lo: int, hi: int) -> list[Any]:
    pol: Any = eng.policy
    return [
        (c.seq, c.state, c.bitmap, c.count, None if c.values is None else c.values.tolist())
        for pair in pol.copies[lo:hi]
        for c in pair
    ]


def _snapshot_atp(eng: SwitchEngine, job: int) -> list[Any]:
    pol: Any = eng.policy
    return [
        (a.index, a.seq, a.state, a.bitmap, None if a.values is None else a.values.tolist())
        for a in pol.pool
        if a.job == job and a.state != 0
    ]


def test_other_jobs_packets_never_touch_this_jobs_aggregators() -> None:
    rng = random.Random(99)
    jobs = (
        SwitchJob(1, ("a", "b", "c"), parent="ps", slot_count=8, window=8),
        SwitchJob(2, ("d", "e"), parent="ps", slot_base=8, slot_count=8, window=8),
    )
    sml = SwitchEngine.build("sml", "switchml", 16, jobs)
    atp = SwitchEngine.build("atp", "atp", 16, jobs)
    # job 1 is mid-aggregation on both switches: workers a and b sent seqs 0..7
    contrib = {}
    for seq in range(8):
        for w in (0, 1):
            vals = np.array([rng.randint(-1000, 1000) for _ in range(4)], np.int32)
            contrib[(seq, w)] = vals
            sml.on_packet(Packet(1, w, seq, seq, 1 << w, 3, count=4, payload=vals), 0)
            atp.on_packet(
                Packet(1, w, seq, atp_index(1, seq, 16), 1 << w, 3, count=4, payload=vals), 0
            )
    before = (_snapshot_switchml(sml, 0, 8), _snapshot_atp(atp, 1))
    for i in range(N_FUZZ // 4):
        try:
            pkt = decode(_mutate(rng, _valid(rng)) if i % 2 else _valid(rng))
        except ProtocolError:
            continue
        if pkt.job_id == 1:
            pkt.job_id = rng.choice([2, 3, 77])  # any job but ours, aimed at our slots
        if rng.random() < 0.5:
            pkt.agg_index = rng.randrange(16)
        sml.on_packet(pkt, i)
        atp.on_packet(pkt, i)
    assert (_snapshot_switchml(sml, 0, 8), _snapshot_atp(atp, 1)) == before
    # job 1 still completes with exactly its own workers' sums
    for seq in range(8):
        vals = np.array([rng.randint(-1000, 1000) for _ in range(4)], np.int32)
        want = contrib[(seq, 0)].astype(np.int64) + contrib[(seq, 1)] + vals
        out = sml.on_packet(Packet(1, 2, seq, seq, 1 << 2, 3, count=4, payload=vals), 1)
        assert np.array_equal(out[0].pkt.payload, want)  # type: ignore[union-attr]
        out = atp.on_packet(
            Packet(1, 2, seq, atp_index(1, seq, 16), 1 << 2, 3, count=4, payload=vals), 1
        )
        assert out[0].pkt.bitmap == 0b111  # type: ignore[union-attr]
        assert np.array_equal(out[0].pkt.payload, want)  # type: ignore[union-attr]


def test_ring_sums_stay_exact_with_fuzzed_packets_in_between() -> None:
    """A ring of 3 ranks, one bucket each of several packets per chunk: every
    hop delivers its packet after a burst of fuzzed datagrams (valid headers
    of this job among them, aimed at this ring's steps and chunks). Every
    rank ends with the int64 sum of the three inputs, and every fuzzed
    packet that decoded was a counted drop."""
    rng = random.Random(7)
    n, count = 3, 50
    names = [f"r{i}" for i in range(n)]
    rings = [RingEngine(names[i], 1, i, n, names[(i + 1) % n], 4) for i in range(n)]
    inputs = [np.array([rng.randint(-(2**20), 2**20) for _ in range(count)], np.int32)
              for _ in range(n)]  # fmt: skip
    want = np.sum([x.astype(np.int64) for x in inputs], axis=0)
    wire = [(names[(i + 1) % n], a) for i, r in enumerate(rings)
            for a in r.start(0, count, 0, inputs[i])]  # fmt: skip
    results: dict[int, np.ndarray] = {}
    fuzzed = 0
    while wire:
        dst, act = wire.pop(0)
        me = names.index(dst)
        for _ in range(20):  # a burst of junk first, aimed at this ring
            try:
                junk = decode(_mutate(rng, _valid(rng)))
            except ProtocolError:
                continue
            junk.job_id = rng.choice([1, junk.job_id])
            junk.layer = rng.choice([0, junk.layer])
            if junk.job_id == 1 and junk.layer == 0 and rng.random() < 0.5:
                # from the predecessor, but never a well-formed next hop (a step past
                # the last): no ring, TCP's or ours, can tell a forged hop from a real one
                junk.worker_id = (me - 1) % n
                junk.seq = 2 * n + rng.randrange(5)
            fuzzed += 1
            rings[me].on_packet(junk, 0)
        assert isinstance(act, Send)
        for out in rings[me].on_packet(act.pkt, 0):
            if isinstance(out, Deliver):
                results[me] = np.asarray(out.pkt.payload)
            else:
                assert isinstance(out, Send)
                wire.append((out.dst, out))
    assert set(results) == set(range(n))
    for r in results.values():
        assert np.array_equal(r, want)
    dropped = sum(r.counters.total() for r in rings)
    assert dropped + sum(len(v) for r in rings for v in r.early.values()) >= fuzzed
