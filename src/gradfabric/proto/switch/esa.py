"""ESA: ATP's shared pool with preemptive, priority-scheduled aggregators.

Theory of operation
-------------------
ATP frees an aggregator only when the PS result for its key passes back, so a
completed aggregator sits idle for a PS round trip, and a packet that finds
an aggregator held by another job falls back to the PS. ESA changes one rule,
``_make_room``: a packet may take an occupied aggregator

* at once if the occupant is COMPLETE (its aggregate is already on its way to
  the PS; nothing is left to lose; a retransmission for it now goes to the PS
  directly, which holds or rebuilds the sum);
* by preemption if the occupant is still AGGREGATING and the packet's
  priority (carried in its header) is strictly higher: the occupant's partial
  aggregate and bitmap go to the occupant's PS (``PARTIAL``), which merges it
  by bitmap like any ATP partial, so nothing is lost or counted twice;
* otherwise it collides and goes to the PS, as in ATP.

Priorities are chosen by the workers (``proto/priority.py``); the switch only
compares them.
"""

from __future__ import annotations

from gradfabric.proto.actions import Action, Send
from gradfabric.proto.switch.atp import AGGREGATING, COMPLETE, ATPPolicy, _Agg
from gradfabric.proto.switch.engine import ALLOCATORS
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.packet import Flag, Packet


class ESAPolicy(ATPPolicy):
    name = "esa"

    def _make_room(self, a: _Agg, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action] | None:
        room = super()._make_room(a, job, pkt, now_ns)  # a stale occupant: reclaimed
        if room is not None:
            return room
        if a.state == COMPLETE:
            self.counters["reclaimed_complete"] += 1
            self._free(a, now_ns)
            return []
        if a.state == AGGREGATING and pkt.priority > a.priority and a.owner is not None:
            owner = a.owner
            ps = owner.ps_for(a.seq)
            if ps is None:
                return None
            self.counters["preemptions"] += 1
            evict = Send(ps, self._aggregate(owner, a, Flag.PARTIAL))
            self._free(a, now_ns)
            return [evict]
        return None


ALLOCATORS.add("esa", ESAPolicy)
