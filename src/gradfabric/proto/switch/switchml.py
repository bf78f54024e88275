"""SwitchML: static per-job slot ranges with two shadow copies per slot.

Theory of operation
-------------------
A job owns slots ``[slot_base, slot_base + slot_count)``; with window
``W = slot_count`` a worker sends packet ``seq`` into slot
``slot_base + seq % W``, copy ``(seq // W) % 2``. A worker sends ``seq`` only
after it holds the result of ``seq - W``, which every worker sent only after
holding the result of ``seq - 2W``: so when ``seq`` reaches a copy that still
holds ``seq - 2W``, nobody can need that result any more and the copy is
reset. The other copy keeps the previous result to answer retransmissions.
Each copy also records its ``seq`` (4 bytes), so a stale duplicate of an old
sequence is recognised and dropped rather than corrupting a newer one.

Copy lifecycle (``state``)::

    IDLE --first packet--> AGGREGATING --last child--> COMPLETE   (root: multicast)
                                       \\--last child--> FORWARDED (to parent)
    FORWARDED --result from parent--> COMPLETE (multicast to children)
    any state --packet with seq >= held seq + 2W--> AGGREGATING (reset)

A duplicate (its bit already set) is answered from the copy: COMPLETE gives
the sender the result, FORWARDED re-sends the aggregate up (the parent
dedupes), AGGREGATING drops it.

Loss notice (``Flag.NACK``). A worker sends its shares in sequence order,
so where worker ``w``'s share of ``seq`` arrives while the copy of
``seq - NACK_GAP`` still waits on ``w``'s bit (or holds an older sequence:
nobody's share of it came yet, ``w``'s included), that earlier share was lost
(or reordered past it: the resend is then a duplicate, dropped). The switch
then tells ``w`` alone, with the header of ``seq - NACK_GAP`` flagged
``NACK``, and ``w`` resends that share. Workers cannot tell whose share a
stalled copy lacks, so without the notice every worker of the job resends
on a fast retransmit, and at 4 workers three in four of those resends are
needless bytes on the very links that bound the sum. Only shares that carry
``NACK`` themselves are checked (workers that take notices say so), one
check per fresh share: each sequence is looked at once per worker.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Multicast, Send
from gradfabric.proto.switch.engine import ALLOCATORS, PoolStats
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.packet import Flag, Packet, ina_packet

IDLE, AGGREGATING, FORWARDED, COMPLETE = range(4)
# How far behind a fresh share the switch looks for its sender's missing one:
# 1 (the next share) where paths keep order, as a star's FIFO links do.
NACK_GAP = 1


class _Copy:
    __slots__ = (
        "bitmap",
        "claim_ns",
        "count",
        "flags",
        "nvalues",
        "result",
        "seq",
        "state",
        "values",
    )

    def __init__(self) -> None:
        self.seq = -1
        self.state = IDLE
        self.bitmap = 0
        self.count = 0
        self.nvalues = 0
        self.flags = 0
        self.values: np.ndarray | None = None
        self.result: Packet | None = None
        self.claim_ns = 0


class SwitchMLPolicy:
    name = "switchml"
    sends_notices: ClassVar[bool] = True  # loss notices (read off the class: proto.schemes)

    def __init__(self, pool_slots: int, counters: Counters) -> None:
        self.copies = [(_Copy(), _Copy()) for _ in range(pool_slots)]
        self.counters = counters
        self.stats = PoolStats(aggregators=2 * pool_slots)

    def result_fan_in(self, job: SwitchJob) -> int:
        return job.parent_fan_in

    def admit(self, job: SwitchJob) -> None:
        if job.group or job.below:
            raise ConfigError("group", "SwitchML's hierarchy aggregates at every level")
        if job.slot_base + job.slot_count > len(self.copies):
            raise ConfigError(
                "slot_count",
                f"slots {job.slot_base}..{job.slot_base + job.slot_count}"
                f" exceed the pool of {len(self.copies)}",
            )
        for i in range(job.slot_base, job.slot_base + job.slot_count):
            self.copies[i] = (_Copy(), _Copy())

    def on_lower(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        self.counters["drop_bad_level"] += 1  # (``admit`` takes no job with levels)
        return []

    def retire(self, job: SwitchJob) -> None:
        self.admit(job)  # a static range is simply cleared for its next owner

    def missing(self, job: SwitchJob) -> int:
        bits = 0
        for pair in self.copies[job.slot_base : job.slot_base + job.slot_count]:
            for c in pair:
                if c.state == AGGREGATING:
                    bits |= job.full & ~c.bitmap
        return bits

    def _copy(self, job: SwitchJob, pkt: Packet) -> _Copy | None:
        w = job.slot_count
        if (
            w == 0
            or pkt.agg_index != job.slot_base + pkt.seq % w
            or pkt.agg_index >= len(self.copies)
        ):
            self.counters["drop_bad_slot"] += 1
            return None
        return self.copies[pkt.agg_index][(pkt.seq // w) & 1]

    def on_gradient(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        c = self._copy(job, pkt)
        if c is None:
            return []
        if pkt.flags & Flag.FLOAT:
            self.counters["drop_float_payload"] += 1
            return []
        if pkt.seq != c.seq:
            if pkt.seq < c.seq:
                self.counters["drop_stale"] += 1
                return []
            self._reset(c, pkt, now_ns)
        elif c.bitmap & pkt.bitmap:
            return self._duplicate(job, c, pkt)
        elif pkt.count != c.nvalues:
            self.counters["drop_count_mismatch"] += 1
            return []
        c.bitmap |= pkt.bitmap
        c.count += 1
        c.flags |= pkt.flags & Flag.ECN
        if pkt.payload is not None:
            if c.values is None:
                c.values = pkt.payload.astype(np.int32, copy=True)
            else:
                np.add(c.values, pkt.payload, out=c.values)
        actions = self._notice(job, pkt) if pkt.flags & Flag.NACK else []
        if c.count < job.fan_in:
            return actions
        self.stats.busy_ns += now_ns - c.claim_ns
        if job.parent is None:
            return actions + self._complete(job, c, pkt.agg_index, c.flags, c.values, now_ns)
        c.state = FORWARDED
        return [*actions, Send(job.parent, self._upward(job, c, pkt.agg_index))]

    def _notice(self, job: SwitchJob, pkt: Packet) -> list[Action]:
        """The sender's share of ``pkt.seq - NACK_GAP``, if its copy still waits
        on it: a loss notice to the sender alone (see the module doc)."""
        seq = pkt.seq - NACK_GAP
        if seq < 0 or pkt.flags & Flag.HELP:
            return []
        w = job.slot_count
        agg = job.slot_base + seq % w
        c = self.copies[agg][(seq // w) & 1]
        if c.seq > seq or (c.seq == seq and (c.state != AGGREGATING or c.bitmap & pkt.bitmap)):
            return []  # (an older sequence in the copy: nobody's share of seq came yet)
        self.counters["nack_sent"] += 1
        notice = ina_packet(
            job_id=job.job_id, worker_id=pkt.worker_id, seq=seq, agg_index=agg,
            bitmap=pkt.bitmap, fan_in=job.fan_in, flags=Flag.NACK,
        )  # fmt: skip
        return [Send(job.children[pkt.worker_id], notice)]

    def on_result(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        c = self._copy(job, pkt)
        if c is None:
            return []
        if c.seq != pkt.seq or c.state != FORWARDED:
            self.counters["drop_stale_result"] += 1
            return []
        return self._complete(job, c, pkt.agg_index, pkt.flags & Flag.ECN, pkt.payload, now_ns)

    def _complete(
        self,
        job: SwitchJob,
        c: _Copy,
        agg_index: int,
        flags: int,
        values: np.ndarray | None,
        now_ns: int,
    ) -> list[Action]:
        """The copy's result is known: keep it for retransmissions, multicast it."""
        self.stats.held_ns += now_ns - c.claim_ns
        c.state = COMPLETE
        c.result = ina_packet(
            job_id=job.job_id, worker_id=0, seq=c.seq, agg_index=agg_index, bitmap=job.full,
            fan_in=job.fan_in, flags=Flag.ACK | flags, count=c.nvalues, values=values,
        )  # fmt: skip
        return [Multicast(job.children, c.result)]

    def _reset(self, c: _Copy, pkt: Packet, now_ns: int) -> None:
        self.stats.claims += 1
        c.seq = pkt.seq
        c.state = AGGREGATING
        c.bitmap = 0
        c.count = 0
        c.flags = 0
        c.nvalues = pkt.count
        c.values = None
        c.result = None
        c.claim_ns = now_ns

    def _duplicate(self, job: SwitchJob, c: _Copy, pkt: Packet) -> list[Action]:
        if c.state == COMPLETE and c.result is not None:
            self.counters["retx_answered"] += 1
            return [Send(job.children[pkt.worker_id], c.result.clone())]
        if c.state == FORWARDED and job.parent is not None:
            self.counters["retx_upward"] += 1
            return [Send(job.parent, self._upward(job, c, pkt.agg_index))]
        self.counters["drop_duplicate"] += 1
        return []

    def _upward(self, job: SwitchJob, c: _Copy, agg_index: int) -> Packet:
        i = job.index_at_parent
        return ina_packet(
            job_id=job.job_id, worker_id=i, seq=c.seq, agg_index=agg_index, bitmap=1 << i,
            fan_in=job.parent_fan_in, flags=c.flags, count=c.nvalues, values=c.values,
        )  # fmt: skip


ALLOCATORS.add("switchml", SwitchMLPolicy)
