"""ATP: one aggregator pool shared best-effort by every job.

Theory of operation
-------------------
A worker sends ``seq`` to aggregator ``atp_index(job, seq, pool)``. An
aggregator holds an owner key ``(job, seq)``, a bitmap, a counter and the
values. The parameter server (PS) is every job's safety net: whatever the
switch cannot aggregate goes on to it, and it merges partial aggregates by
bitmap (``proto/ps.py``).

Aggregator lifecycle::

    FREE --packet--> AGGREGATING(key) --last worker--> COMPLETE: aggregate -> PS
    COMPLETE --PS result with the same key passes back--> FREE (then multicast)
    AGGREGATING --resend for the key--> FREE (partial flushed to the PS)

Other paths to the PS: a packet whose aggregator holds another key
(``COLLISION``); a packet that overflowed the integer domain (``OVERFLOW``,
float payload); a retransmission (``RESEND``), which first flushes the
partial for its key. An aggregator still holding a key of the same job at
least ``window`` sequences behind that job's newest result is stale (that
sequence completed; a late duplicate re-claimed it) and is reclaimed.

ECN marks are OR-ed into the aggregate; the PS echoes them in the result.
"""

from __future__ import annotations

import numpy as np

from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Multicast, Send
from gradfabric.proto.routes import atp_index as atp_index
from gradfabric.proto.switch.engine import ALLOCATORS, PoolStats
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.packet import Flag, Packet, ina_packet

FREE, AGGREGATING, COMPLETE = range(3)


class _Agg:
    __slots__ = (
        "bitmap",
        "claim_ns",
        "count",
        "flags",
        "index",
        "job",
        "nvalues",
        "owner",
        "priority",
        "seq",
        "state",
        "values",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = FREE
        self.job = -1
        self.seq = -1
        self.bitmap = 0
        self.count = 0
        self.nvalues = 0
        self.flags = 0
        self.values: np.ndarray | None = None
        self.claim_ns = 0
        self.owner: SwitchJob | None = None
        self.priority = 0


class ATPPolicy:
    name = "atp"

    def __init__(self, pool_slots: int, counters: Counters) -> None:
        self.pool = [_Agg(i) for i in range(pool_slots)]
        self.counters = counters
        self.stats = PoolStats(aggregators=pool_slots)
        self.newest_result: dict[int, int] = {}

    def result_fan_in(self, job: SwitchJob) -> int:
        return job.fan_in

    def admit(self, job: SwitchJob) -> None:
        return None  # the pool is shared: nothing is reserved

    def retire(self, job: SwitchJob) -> None:
        for a in self.pool:
            if a.state != FREE and a.job == job.job_id:
                self._free(a, a.claim_ns)  # its remaining hold is not counted as use
        self.newest_result.pop(job.job_id, None)

    def missing(self, job: SwitchJob) -> int:
        bits = 0
        for a in self.pool:
            if a.state == AGGREGATING and a.job == job.job_id:
                bits |= job.full & ~a.bitmap
        return bits

    def on_gradient(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        shards = job.ps_shards  # job.ps_for, inlined (once per gradient packet)
        ps = shards[pkt.seq % len(shards)] if shards else job.parent
        if ps is None or pkt.agg_index >= len(self.pool):
            self.counters["drop_bad_slot"] += 1
            return []
        if pkt.flags & (Flag.OVERFLOW | Flag.FLOAT):
            self.counters["ps_overflow"] += 1
            return [Send(ps, pkt)]
        a = self.pool[pkt.agg_index]
        mine = a.state != FREE and a.job == job.job_id and a.seq == pkt.seq
        out: list[Action] = []
        if pkt.flags & Flag.RESEND:
            self.counters["ps_resend"] += 1
            if mine and a.state == AGGREGATING:
                self.counters["flush_partial"] += 1
                out.append(Send(ps, self._aggregate(job, a, Flag.PARTIAL)))
                self._free(a, now_ns)
            elif mine:  # COMPLETE: the aggregate may have been lost on its way
                out.append(Send(ps, self._aggregate(job, a, Flag.NONE)))
            out.append(Send(ps, pkt))
            return out
        if not mine:
            if a.state != FREE:
                evicted = self._make_room(a, job, pkt, now_ns)
                if evicted is None:
                    self.counters["ps_collision"] += 1
                    fwd = pkt.clone()
                    fwd.flags |= Flag.COLLISION
                    return [Send(ps, fwd)]
                out = evicted
            self._claim(a, job, pkt, now_ns)
        elif a.bitmap & pkt.bitmap:
            self.counters["drop_duplicate"] += 1
            return []
        elif pkt.count != a.nvalues or a.state != AGGREGATING:
            self.counters["drop_count_mismatch" if a.state == AGGREGATING else "drop_late"] += 1
            return []
        a.bitmap |= pkt.bitmap
        a.count += 1
        a.flags |= pkt.flags & Flag.ECN
        if pkt.payload is not None:
            if a.values is None:
                a.values = pkt.payload.astype(np.int32, copy=True)
            else:
                np.add(a.values, pkt.payload, out=a.values)
        if a.count < job.fan_in:
            return out
        a.state = COMPLETE
        self.stats.busy_ns += now_ns - a.claim_ns
        out.append(Send(ps, self._aggregate(job, a, Flag.NONE)))
        return out

    def _make_room(self, a: _Agg, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action] | None:
        """May ``pkt`` take occupied aggregator ``a``? None: no (a collision);
        else the actions that evict the occupant (none for ATP: only a stale
        occupant, whose sequence already completed, is reclaimed)."""
        if not self._stale(a, job):
            return None
        self.counters["stale_reclaimed"] += 1
        self._free(a, now_ns)
        return []

    def on_result(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.agg_index < len(self.pool):
            a = self.pool[pkt.agg_index]
            if (
                a.state != FREE
                and a.job == job.job_id
                and (a.seq == pkt.seq or self._stale(a, job))
            ):
                self._free(a, now_ns)
        if pkt.seq > self.newest_result.get(job.job_id, -1):
            self.newest_result[job.job_id] = pkt.seq
        if pkt.flags & Flag.RESEND:  # the PS answering one worker's retransmission
            if pkt.worker_id >= job.fan_in:
                self.counters["drop_bad_result"] += 1
                return []
            return [Send(job.children[pkt.worker_id], pkt)]
        return [Multicast(job.children, pkt)]

    def _stale(self, a: _Agg, job: SwitchJob) -> bool:
        newest = self.newest_result.get(a.job, -1)
        return a.job == job.job_id and job.window > 0 and a.seq <= newest - job.window

    def _claim(self, a: _Agg, job: SwitchJob, pkt: Packet, now_ns: int) -> None:
        self.stats.claims += 1
        a.state = AGGREGATING
        a.owner = job
        a.priority = pkt.priority
        a.job = pkt.job_id
        a.seq = pkt.seq
        a.bitmap = 0
        a.count = 0
        a.flags = 0
        a.nvalues = pkt.count
        a.values = None
        a.claim_ns = now_ns

    def _free(self, a: _Agg, now_ns: int) -> None:
        self.stats.held_ns += now_ns - a.claim_ns
        a.state = FREE
        a.values = None

    def _aggregate(self, job: SwitchJob, a: _Agg, flag: int) -> Packet:
        return ina_packet(
            job_id=job.job_id, worker_id=0, seq=a.seq, agg_index=a.index, bitmap=a.bitmap,
            fan_in=job.fan_in, flags=a.flags | flag, count=a.nvalues, values=a.values,
        )  # fmt: skip


ALLOCATORS.add("atp", ATPPolicy)
