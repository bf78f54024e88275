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

Input is untrusted: a packet that is not the next hop of this ring (another
job, a sender other than the predecessor, a step, chunk or index outside the
bucket, a length or payload that does not match, a duplicate) is a counted
drop, never an exception or a corrupted sum. Packets of a bucket not started
here yet wait, up to ``MAX_EARLY_BUCKETS`` buckets.

A rank runs one bucket at a time, in the order they are started (a ring is one
communicator, as NCCL's): a bucket started while another is in flight here
waits, and begins the moment that one is delivered.

A ring can run one half of the all-reduce (``phase``): the reduce-scatter
alone (delivered once chunk ``(r + 1) mod n`` is reduced here and every
other chunk has passed through; the rest of the result is zeros) or the
all-gather alone (rank ``r`` starts holding chunk ``(r + 1) mod n`` of its
input, reduced: what a reduce-scatter leaves). The hierarchical ring
(``HierarchicalRingEngine``) is built of these.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, NoTimers, Send
from gradfabric.wire.packet import Packet, result_packet


def ring_packet(
    *, job_id: int, sender: int, bucket: int, step: int, index: int, chunk: int, ranks: int,
    count: int, values: np.ndarray | None,
) -> Packet:  # fmt: skip
    """The ring's header (see the module doc for which field carries what)."""
    return Packet(job_id, sender, step, index, chunk, ranks, 0, 0, bucket, count, values)


@dataclass
class _Bucket:
    count: int
    bounds: list[tuple[int, int]]
    own: np.ndarray | None
    final: np.ndarray | None
    remaining: int
    seen: set[tuple[int, int]] = field(default_factory=set)  # (step, index) received


ALL, REDUCE_SCATTER, ALL_GATHER = "all", "reduce_scatter", "all_gather"
MAX_EARLY_BUCKETS: Final = 64
KEEP_DONE: Final = 1024  # finished buckets remembered, so late duplicates are dropped


def chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """A bucket of ``count`` values cut into the ring's ``n`` chunks."""
    edges = np.linspace(0, count, n + 1).astype(np.int64)
    return [(int(edges[c]), int(edges[c + 1])) for c in range(n)]


class RingEngine(NoTimers):
    def __init__(
        self, name: str, job_id: int, rank: int, n: int, successor: str, values_per_packet: int,
        phase: str = ALL,
    ) -> None:  # fmt: skip
        if phase not in (ALL, REDUCE_SCATTER, ALL_GATHER):
            raise ValueError(f"unknown ring phase {phase!r}")
        self.name = name
        self.job_id = job_id
        self.rank = rank
        self.n = n
        self.successor = successor
        self.vpp = values_per_packet
        self.phase = phase
        # the steps this ring runs (see the module doc)
        self.first_step = n - 1 if phase == ALL_GATHER else 0
        self.last_step = n - 2 if phase == REDUCE_SCATTER else 2 * n - 3
        self.counters = Counters()
        self.buckets: dict[int, _Bucket] = {}
        self.early: dict[int, list[Packet]] = {}  # packets of buckets not started here yet
        self.done: dict[int, None] = {}  # recently finished buckets, oldest first
        self.queued: deque[tuple[int, int, np.ndarray | None]] = deque()

    def _npk(self, length: int) -> int:
        return max(1, -(-length // self.vpp))

    def _slice(self, bk: _Bucket, chunk: int, j: int) -> tuple[int, int]:
        lo, hi = bk.bounds[chunk]
        a = lo + j * self.vpp
        return a, min(hi, a + self.vpp)

    def start(
        self, b: int, count: int, now_ns: int, payload: np.ndarray | None = None
    ) -> list[Action]:
        if b in self.buckets or any(q[0] == b for q in self.queued):
            raise ValueError(f"bucket {b} already started")
        if self.buckets:
            self.queued.append((b, count, payload))
            return []
        return self._begin(b, count, now_ns, payload)

    def _begin(self, b: int, count: int, now_ns: int, payload: np.ndarray | None) -> list[Action]:
        self.done.pop(b, None)
        bounds = chunk_bounds(count, self.n)
        kept = (self.rank + 1) % self.n  # the chunk the reduce-scatter leaves here
        sizes = [self._npk(hi - lo) for lo, hi in bounds]
        total = sum(sizes)
        if self.phase == REDUCE_SCATTER:
            # every chunk but its own passes here, and the bucket is done when
            # all have (a reordered early step may come after the last one)
            total -= sizes[self.rank]
        elif self.phase == ALL_GATHER:
            total -= sizes[kept]
        bk = self.buckets[b] = _Bucket(count, bounds, None, None, total)
        if payload is not None:
            bk.own = payload.astype(np.int64)
            bk.final = np.zeros(count, dtype=np.int64)
        if self.n == 1:
            return [self._deliver(b, bk), *self._next(now_ns)]
        # the chunk this rank sends at its first step: its own at step 0, the
        # one it holds reduced at step n - 1
        c = kept if self.phase == ALL_GATHER else self.rank
        if self.phase == ALL_GATHER and bk.final is not None and bk.own is not None:
            lo, hi = bounds[c]
            bk.final[lo:hi] = bk.own[lo:hi]
        out: list[Action] = []
        for j in range(self._npk(bk.bounds[c][1] - bk.bounds[c][0])):
            lo, hi = self._slice(bk, c, j)
            vals = None if bk.own is None else bk.own[lo:hi]
            out.append(self._send(b, self.first_step, j, c, hi - lo, vals))
        for pkt in self.early.pop(b, []):
            out += self.on_packet(pkt, now_ns)
        return out

    def _drop(self, reason: str) -> list[Action]:
        self.counters[f"drop_{reason}"] += 1
        return []

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        n = self.n
        pred = (self.rank - 1) % n
        if pkt.job_id != self.job_id or pkt.worker_id != pred or n == 1:
            return self._drop("foreign")
        b, s, j, c = pkt.layer, pkt.seq, pkt.agg_index, pkt.bitmap
        # the predecessor forwards chunk (pred - s) mod n at step s, in either half
        if not self.first_step <= s <= self.last_step or c != (pred - s) % n:
            return self._drop("malformed")
        bk = self.buckets.get(b)
        if bk is None:
            if b in self.done:
                return self._drop("duplicate")
            if b not in self.early and len(self.early) >= MAX_EARLY_BUCKETS:
                return self._drop("early_overflow")
            self.early.setdefault(b, []).append(pkt)
            return []
        if not 0 <= j < self._npk(bk.bounds[c][1] - bk.bounds[c][0]):
            return self._drop("malformed")
        lo, hi = self._slice(bk, c, j)
        vals = pkt.payload
        if pkt.count != hi - lo or (vals is not None and len(vals) != hi - lo):
            return self._drop("malformed")
        if (s, j) in bk.seen:
            return self._drop("duplicate")
        bk.seen.add((s, j))
        out: list[Action] = []
        if s <= n - 2:
            if vals is not None and bk.own is not None:
                vals = bk.own[lo:hi] + vals
            if s == n - 2:
                self._keep(bk, lo, hi, vals)
            elif self.phase == REDUCE_SCATTER:
                bk.remaining -= 1  # passed on, not kept: counted all the same
        else:
            self._keep(bk, lo, hi, vals)
        if s < self.last_step:
            out.append(self._send(b, s + 1, j, c, hi - lo, vals))
        if bk.remaining == 0:
            out.append(self._deliver(b, bk))
            out += self._next(now_ns)
        return out

    def _next(self, now_ns: int) -> list[Action]:
        """The bucket queued behind the one just delivered, if any."""
        if not self.queued:
            return []
        b, count, payload = self.queued.popleft()
        return self._begin(b, count, now_ns, payload)

    def _keep(self, bk: _Bucket, lo: int, hi: int, vals: np.ndarray | None) -> None:
        bk.remaining -= 1
        if bk.final is not None and vals is not None:
            bk.final[lo:hi] = vals

    def _send(
        self, b: int, step: int, j: int, chunk: int, count: int, vals: np.ndarray | None
    ) -> Send:
        pkt = ring_packet(
            job_id=self.job_id, sender=self.rank, bucket=b, step=step, index=j, chunk=chunk,
            ranks=self.n, count=count, values=vals,
        )  # fmt: skip
        return Send(self.successor, pkt)

    def _deliver(self, b: int, bk: _Bucket) -> Deliver:
        final = bk.own if self.n == 1 else bk.final
        self.buckets.pop(b)
        self.done[b] = None
        if len(self.done) > KEEP_DONE:
            del self.done[next(iter(self.done))]
        res = result_packet(
            job_id=self.job_id, sender=self.rank, seq=b, count=bk.count, values=final, fan_in=self.n
        )
        return Deliver(b, res)


MAX_HRING_JOB: Final = (1 << 14) - 1  # its phases' ids fit the header's 16 bits


def sub_ring(job_id: int, phase: int) -> int:
    """The job id a hierarchical ring's ``phase`` (0-2) puts on its packets:
    a hierarchical ring takes ids ``4 job_id`` to ``4 job_id + 2``, so jobs
    sharing a fabric with one must not use those."""
    return job_id << 2 | phase


class HierarchicalRingEngine(NoTimers):
    """The 2D ring (NCCL's and Horovod's hierarchical all-reduce): the ranks
    of a rack reduce-scatter in a ring (each left with ``1/h`` of the bucket
    reduced over its rack), the ranks of one local index all-reduce that
    shard across the racks in a ring, and the rack all-gathers. Three
    ``RingEngine`` rings, one per phase, their packets told apart by job id
    (``sub_ring``); a bucket enters the next phase when this rank's ring
    delivers it, so a rank's buckets pipeline across the phases. ``rack``:
    this rank's rack's ranks in ring order; ``across``: the ranks of its
    local index, one per rack, in ring order (both include this rank). Its
    rank (the result's sender) is ``rack index * h + local index``: the
    placement's where workers are listed rack by rack."""

    def __init__(
        self, name: str, job_id: int, rack: tuple[str, ...], across: tuple[str, ...],
        values_per_packet: int,
    ) -> None:  # fmt: skip
        if name not in rack or name not in across:
            raise ValueError(f"{name} is not in its rack's or its local index's ring")
        if not 0 <= job_id <= MAX_HRING_JOB:
            raise ValueError(f"a hierarchical ring's job id is 0..{MAX_HRING_JOB}, got {job_id}")
        self.name = name
        self.job_id = job_id
        local, k = rack.index(name), across.index(name)
        h, racks = len(rack), len(across)
        self.h = h
        self.shard = (local + 1) % h  # the chunk the rack's reduce-scatter leaves here
        self.rank = k * h + local
        self.counters = Counters()
        nxt = rack[(local + 1) % h]
        self.rings = (
            RingEngine(name, sub_ring(job_id, 0), local, h, nxt, values_per_packet,
                       REDUCE_SCATTER),
            RingEngine(name, sub_ring(job_id, 1), k, racks, across[(k + 1) % racks],
                       values_per_packet),
            RingEngine(name, sub_ring(job_id, 2), local, h, nxt, values_per_packet, ALL_GATHER),
        )  # fmt: skip
        for ring in self.rings:
            ring.counters = self.counters
        self.in_flight: dict[int, int] = {}  # buckets in flight here: their sizes

    def start(
        self, b: int, count: int, now_ns: int, payload: np.ndarray | None = None
    ) -> list[Action]:
        if b in self.in_flight:
            raise ValueError(f"bucket {b} already started")
        self.in_flight[b] = count
        return self._advance(0, self.rings[0].start(b, count, now_ns, payload), now_ns)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        phase = pkt.job_id - sub_ring(self.job_id, 0)
        if not 0 <= phase <= 2:
            self.counters["drop_foreign"] += 1
            return []
        return self._advance(phase, self.rings[phase].on_packet(pkt, now_ns), now_ns)

    def _advance(self, phase: int, actions: list[Action], now_ns: int) -> list[Action]:
        """A phase's ring's actions, with each bucket it delivered started on
        the next phase (the last phase's delivery is the bucket's)."""
        out: list[Action] = []
        for a in actions:
            if not isinstance(a, Deliver):
                out.append(a)
                continue
            b, got = a.seq, a.pkt.payload
            count = self.in_flight[b]
            lo, hi = chunk_bounds(count, self.h)[self.shard]
            if phase == 0:  # the shard reduced over the rack: across the racks
                shard = None if got is None else got[lo:hi]
                out += self._advance(1, self.rings[1].start(b, hi - lo, now_ns, shard), now_ns)
            elif phase == 1:  # reduced everywhere: back round the rack
                whole = None
                if got is not None:
                    whole = np.zeros(count, dtype=np.int64)
                    whole[lo:hi] = got
                out += self._advance(2, self.rings[2].start(b, count, now_ns, whole), now_ns)
            else:
                del self.in_flight[b]
                res = result_packet(job_id=self.job_id, sender=self.rank, seq=b, count=count,
                                    values=got, fan_in=self.h * self.rings[1].n)  # fmt: skip
                out.append(Deliver(b, res))
        return out
