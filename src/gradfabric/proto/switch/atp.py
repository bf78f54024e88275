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
    COMPLETE --resend for the key--> COMPLETE (the aggregate sent again, once
        for every ``n`` resends of the key, ``n`` the workers below)

Other paths to the PS: a packet whose aggregator holds another key
(``COLLISION``); a packet that overflowed the integer domain (``OVERFLOW``,
float payload); a retransmission (``RESEND``), which first flushes the
partial for its key. An aggregator still holding a key of the same job at
least ``window`` sequences behind that job's newest result is stale (that
sequence completed; a late duplicate re-claimed it) and is reclaimed.

ECN marks are OR-ed into the aggregate; the PS echoes them in the result.

Two levels (ATP's design for jobs past one rack)
------------------------------------------------
Each rack's switch runs the rules above over its workers (``SwitchJob.group``:
their packets carry ``layer = rack + 1``) with the second-level switch as its
``parent``: a complete rack aggregate goes up as one child's share of the
level above (``_aggregate``), where the same rules aggregate racks and send
the sum to the PS. Whatever a rack's switch cannot aggregate (collisions,
overflow, retransmissions, flushed or preempted partials) keeps the rack's
terms and passes the second level untouched (``on_lower``; a retransmission
first flushes what that level holds of its key, as at the rack); the PS
merges every kind by worker (``PsJob.groups``). Results come down through
both levels, each freeing its aggregator and re-addressing the result to its
own children (``_down``); a PS answer to one worker's retransmission finds
its rack by ``layer`` and its worker by ``worker_id``.
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
        "resends",
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
        self.resends = 0  # resends of its key seen since it completed, mod the workers
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
        return job.parent_fan_in if job.group else job.fan_in

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
            return self._resend(job, a, mine, pkt, ps, now_ns)
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

    def _resend(
        self, job: SwitchJob, a: _Agg, mine: bool, pkt: Packet, ps: str, now_ns: int
    ) -> list[Action]:
        """A retransmission on its way to ``ps``: what this switch holds of its
        key goes first (a partial, flushed and freed; a complete aggregate, sent
        again with the first resend of each round of them: it may have been
        lost)."""
        out: list[Action] = []
        if mine and a.state == AGGREGATING:
            self.counters["flush_partial"] += 1
            out.append(Send(ps, self._aggregate(job, a, Flag.PARTIAL)))
            self._free(a, now_ns)
        elif mine:  # COMPLETE: the aggregate may have been lost on its way
            # Sent again once for every round of its workers' resends, not with
            # each: with each, a rack's uplink carried its sum once per worker
            # per round, most of what congested it at scale, and the PS needs
            # one copy (``proto.ps``).
            if a.resends == 0:
                out.append(Send(ps, self._aggregate(job, a, Flag.NONE)))
            a.resends = (a.resends + 1) % job.workers
        out.append(Send(ps, pkt))
        return out

    def on_lower(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        """ATP's second level passes a rack's fallbacks on to the PS untouched
        (its aggregators count whole racks); a retransmission first flushes
        what this level holds of its key, as the rack's switch did."""
        shards = job.ps_shards
        ps = shards[pkt.seq % len(shards)] if shards else job.parent
        if ps is None:
            self.counters["drop_bad_slot"] += 1
            return []
        self.counters["lower_passed"] += 1
        if pkt.flags & Flag.RESEND and pkt.agg_index < len(self.pool):
            a = self.pool[pkt.agg_index]
            mine = a.state != FREE and a.job == job.job_id and a.seq == pkt.seq
            return self._resend(job, a, mine, pkt, ps, now_ns)
        return [Send(ps, pkt)]

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
            # (ATP's second level: to the rack ``layer`` names; a rack's
            # switch: to its worker, in the rack's terms)
            if job.below:
                if not 1 <= pkt.layer <= job.fan_in:
                    self.counters["drop_bad_result"] += 1
                    return []
                return [Send(job.children[pkt.layer - 1], pkt)]
            if pkt.worker_id >= job.fan_in or (job.group and pkt.layer != job.group):
                self.counters["drop_bad_result"] += 1
                return []
            return [Send(job.children[pkt.worker_id], self._down(job, pkt))]
        return [Multicast(job.children, self._down(job, pkt))]

    @staticmethod
    def _down(job: SwitchJob, pkt: Packet) -> Packet:
        """A result in the terms of this switch's children: a rack's switch
        re-addresses its parent's result to its own workers."""
        if not job.group:
            return pkt
        out = pkt.clone()
        out.fan_in, out.bitmap, out.layer = job.fan_in, job.full, job.group
        return out

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
        a.resends = 0
        a.flags = 0
        a.nvalues = pkt.count
        a.values = None
        a.claim_ns = now_ns

    def _free(self, a: _Agg, now_ns: int) -> None:
        self.stats.held_ns += now_ns - a.claim_ns
        a.state = FREE
        a.values = None

    def _aggregate(self, job: SwitchJob, a: _Agg, flag: int) -> Packet:
        """What ``a`` holds, on its way up: a rack's whole sum is one child's
        share at the level above (ATP's second); anything else keeps this
        switch's terms (its group in ``layer``), for the PS to merge."""
        if job.group and a.bitmap == job.full:  # (with its priority: ESA's, a level up)
            i = job.index_at_parent
            return ina_packet(
                job_id=job.job_id, worker_id=i, seq=a.seq, agg_index=a.index, bitmap=1 << i,
                fan_in=job.parent_fan_in, flags=a.flags | flag, priority=a.priority,
                count=a.nvalues, values=a.values,
            )  # fmt: skip
        return ina_packet(
            job_id=job.job_id, worker_id=0, seq=a.seq, agg_index=a.index, bitmap=a.bitmap,
            fan_in=job.fan_in, flags=a.flags | flag, layer=job.group, count=a.nvalues,
            values=a.values,
        )  # fmt: skip


ALLOCATORS.add("atp", ATPPolicy)
