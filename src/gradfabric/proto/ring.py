"""Ring all-reduce (the non-INA baseline), streamed packet by packet.

Rank ``r`` of ``n`` splits a bucket into ``n`` chunks. Reduce-scatter steps
``s = 0..n-2``: rank ``r`` sends chunk ``(r - s) mod n`` to its successor,
which adds its own copy and passes the sum on; after step ``n-2`` rank ``r``
holds chunk ``(r + 1) mod n`` fully reduced. All-gather steps
``s = n-1..2n-3`` pass the reduced chunks around once more. Each packet is
forwarded as soon as it arrives (as NCCL pipelines slices), so the time is
``2(n-1)/n * S/B`` plus ``2(n-1)`` per-hop latencies.

The ring rides on the same ``Packet`` as everything else; its fields mean:
``layer`` = bucket id, ``seq`` = step, ``agg_index`` = packet index within the
chunk, ``bitmap`` = chunk id, ``worker_id`` = sending rank. It assumes a
lossless network (as a TCP or RDMA ring would provide).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, NoTimers, Send
from gradfabric.wire.packet import Packet


@dataclass
class _Bucket:
    count: int
    bounds: list[tuple[int, int]]
    own: np.ndarray | None
    final: np.ndarray | None
    remaining: int


class RingEngine(NoTimers):
    def __init__(
        self, name: str, job_id: int, rank: int, n: int, successor: str, values_per_packet: int
    ) -> None:
        self.name = name
        self.job_id = job_id
        self.rank = rank
        self.n = n
        self.successor = successor
        self.vpp = values_per_packet
        self.counters = Counters()
        self.buckets: dict[int, _Bucket] = {}
        self.early: dict[int, list[Packet]] = {}  # packets of buckets not started here yet

    def _npk(self, length: int) -> int:
        return max(1, -(-length // self.vpp))

    def _slice(self, bk: _Bucket, chunk: int, j: int) -> tuple[int, int]:
        lo, hi = bk.bounds[chunk]
        a = lo + j * self.vpp
        return a, min(hi, a + self.vpp)

    def start(
        self, b: int, count: int, now_ns: int, payload: np.ndarray | None = None
    ) -> list[Action]:
        if b in self.buckets:
            raise ValueError(f"bucket {b} already started")
        edges = np.linspace(0, count, self.n + 1).astype(np.int64)
        bounds = [(int(edges[c]), int(edges[c + 1])) for c in range(self.n)]
        total = sum(self._npk(hi - lo) for lo, hi in bounds)
        bk = self.buckets[b] = _Bucket(count, bounds, None, None, total)
        if payload is not None:
            bk.own = payload.astype(np.int64)
            bk.final = np.zeros(count, dtype=np.int64)
        if self.n == 1:
            return [self._deliver(b, bk)]
        c = self.rank
        out: list[Action] = []
        for j in range(self._npk(bk.bounds[c][1] - bk.bounds[c][0])):
            lo, hi = self._slice(bk, c, j)
            vals = None if bk.own is None else bk.own[lo:hi]
            out.append(self._send(b, 0, j, c, hi - lo, vals))
        for pkt in self.early.pop(b, []):
            out += self.on_packet(pkt, now_ns)
        return out

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.job_id != self.job_id:
            self.counters["drop_foreign"] += 1
            return []
        b, s, j, c = pkt.layer, pkt.seq, pkt.agg_index, pkt.bitmap
        bk = self.buckets.get(b)
        if bk is None:
            self.early.setdefault(b, []).append(pkt)
            return []
        lo, hi = self._slice(bk, c, j)
        vals = pkt.payload
        n = self.n
        out: list[Action] = []
        if s <= n - 2:
            if vals is not None and bk.own is not None:
                vals = bk.own[lo:hi] + vals
            if s == n - 2:
                self._keep(bk, lo, hi, vals)
            out.append(self._send(b, s + 1, j, c, hi - lo, vals))
        else:
            self._keep(bk, lo, hi, vals)
            if s < 2 * n - 3:
                out.append(self._send(b, s + 1, j, c, hi - lo, vals))
        if bk.remaining == 0:
            out.append(self._deliver(b, bk))
        return out

    def _keep(self, bk: _Bucket, lo: int, hi: int, vals: np.ndarray | None) -> None:
        bk.remaining -= 1
        if bk.final is not None and vals is not None:
            bk.final[lo:hi] = vals

    def _send(
        self, b: int, step: int, j: int, chunk: int, count: int, vals: np.ndarray | None
    ) -> Send:
        return Send(
            self.successor,
            Packet(self.job_id, self.rank, step, j, chunk, self.n, 0, 0, b, count, vals),
        )

    def _deliver(self, b: int, bk: _Bucket) -> Deliver:
        final = bk.own if self.n == 1 else bk.final
        self.buckets.pop(b)
        return Deliver(b, Packet(self.job_id, self.rank, b, 0, 0, self.n, 0, 0, b, bk.count, final))
