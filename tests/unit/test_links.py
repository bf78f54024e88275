"""The daemon's modelled server links (``emu.links.ShardLinks``): packets
cross each shard's link in order at its rate, shards and directions apart."""

from __future__ import annotations

import asyncio

import numpy as np

from gradfabric.emu.links import DOWN, IP_UDP_BYTES, UP, ShardLinks
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Packet

VALUES = 1024
WIRE = IP_UDP_BYTES + HEADER_BYTES + VALUE_BYTES * VALUES
SLACK_S = 0.25  # a loaded host's late wake-ups; below the 12 packet times (0.4 s) that
# one link carrying all 16 would add


def _cross(sends: list[tuple[int, int]], mbps: float, shards: int) -> list[tuple[int, int, float]]:
    """(seq, way) packets offered at once; each one's (seq, way, delay)."""

    async def go() -> list[tuple[int, int, float]]:
        loop = asyncio.get_running_loop()
        links, got = ShardLinks(shards, mbps), []
        done = asyncio.Event()
        t0 = loop.time()

        def arrive(seq: int, way: int) -> None:
            got.append((seq, way, loop.time() - t0))
            if len(got) == len(sends):
                done.set()

        for seq, way in sends:
            pkt = Packet(1, 0, seq, payload=np.zeros(VALUES, np.int32))
            links.cross(pkt, way, arrive, seq, way)
        await asyncio.wait_for(done.wait(), 10)
        return got

    return asyncio.run(go())


def test_one_shard_serialises_its_packets_in_order_at_the_link_rate() -> None:
    mbps, n = 1.0, 8  # 4 KB in about 33 ms: far above the loop's timer grain
    got = _cross([(0, DOWN)] * n, mbps, shards=1)
    per = WIRE * 8 / (mbps * 1e6)
    assert [g[0] for g in got] == [0] * n
    for k, (_, _, t) in enumerate(got):
        assert t >= (k + 1) * per - 1e-3  # never before its last byte has crossed
    assert got[-1][2] < n * per + SLACK_S  # and not held much past it


def test_shards_and_directions_are_separate_links() -> None:
    mbps = 1.0
    per = WIRE * 8 / (mbps * 1e6)
    # sequences 0 and 1 map to shards 0 and 1; each shard gets 4 down and 4 up
    sends = [(s, w) for _ in range(4) for s in (0, 1) for w in (DOWN, UP)]
    got = _cross(sends, mbps, shards=2)
    last = max(t for _, _, t in got)
    assert last < 4 * per + SLACK_S  # 16 packets over 4 links: 4 packet times, not 16
    for s in (0, 1):
        for w in (DOWN, UP):
            ts = [t for seq, way, t in got if (seq, way) == (s, w)]
            assert len(ts) == 4 and ts == sorted(ts) and ts[-1] >= 4 * per - 1e-3
