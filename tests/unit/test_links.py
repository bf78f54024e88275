"""The switch node's modelled server links (``proto.node.ModelledLinks``):
packets cross each shard's link in order at its rate, shards and directions
apart, in virtual time (exact, whatever the host's load)."""

from __future__ import annotations

import numpy as np

from gradfabric.proto.node import DOWN, IP_UDP_BYTES, UP, ModelledLinks
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Packet

VALUES = 1024
WIRE = IP_UDP_BYTES + HEADER_BYTES + VALUE_BYTES * VALUES


def _pkt(seq: int) -> Packet:
    return Packet(1, 0, seq, count=VALUES, payload=np.zeros(VALUES, np.int32))


def test_one_shard_serialises_its_packets_in_order_at_the_link_rate() -> None:
    links, per_ns = ModelledLinks(1, 1.0), WIRE * 8 * 1000  # 1 Mbit/s: 8 us a byte
    got = [links.cross(_pkt(0), DOWN, 0) for _ in range(8)]
    assert got == [(k + 1) * per_ns for k in range(8)]  # each once its last byte crossed
    # a packet offered after the link went idle starts when offered
    assert links.cross(_pkt(0), DOWN, 100 * per_ns) == 101 * per_ns


def test_shards_and_directions_are_separate_links() -> None:
    links, per_ns = ModelledLinks(2, 1.0), WIRE * 8 * 1000
    # sequences 0 and 1 map to shards 0 and 1; each shard gets 4 down and 4 up
    got: dict[tuple[int, int], list[int]] = {}
    for _ in range(4):
        for s in (0, 1):
            for w in (DOWN, UP):
                got.setdefault((s, w), []).append(links.cross(_pkt(s), w, 0))
    assert all(ts == [per_ns, 2 * per_ns, 3 * per_ns, 4 * per_ns] for ts in got.values())
