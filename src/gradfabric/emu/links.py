"""Links the switch daemon models for the servers it hosts (``ShardLinks``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Packet

DOWN, UP = 0, 1  # a modelled link's directions: into the server, out of it
IP_UDP_BYTES = 28


class ShardLinks:
    """The links of a server the daemon hosts where a deployment would give
    it hosts of its own (ATP's fallback PS: BytePS style, one shard per
    worker, sequence ``s`` on shard ``s mod shards``, each behind a link of
    the workers' rate), modelled as the simulator models them: each shard's
    link in each direction a FIFO served at ``mbps``; a packet goes on when
    its last byte has crossed; a copy per destination leaves a host (a host
    multicasts by unicast). Timers are the event loop's: a packet goes on
    at the first wake-up at or after its time, in order."""

    __slots__ = ("free", "rate")

    def __init__(self, shards: int, mbps: float) -> None:
        self.free = [[0.0, 0.0] for _ in range(shards)]  # loop time each way is free
        self.rate = mbps * 1e6 / 8

    def cross(self, pkt: Packet, way: int, then: Callable[..., None], *args: Any) -> None:
        loop = asyncio.get_running_loop()
        free = self.free[pkt.seq % len(self.free)]
        values = 0 if pkt.payload is None else pkt.payload.size
        size = IP_UDP_BYTES + HEADER_BYTES + VALUE_BYTES * values
        free[way] = max(loop.time(), free[way]) + size / self.rate
        loop.call_at(free[way], then, *args)
