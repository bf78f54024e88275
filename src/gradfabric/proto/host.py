"""A worker host: its own transport stream plus, under SA-ATP, shadow streams
that send other workers' shares (helping a straggler).

Results go to every stream (each keeps its own window and dedupes); only the
host's own stream delivers to the application. A ``NOTIFY`` from the switch
becomes a ``HelpRequest`` for the application, which owns the compute: it
decides whether and when the replica's gradients exist and pushes them into
``shadow(s)``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gradfabric.proto.actions import Action, Deliver, HelpRequest
from gradfabric.proto.worker import WorkerEngine
from gradfabric.wire.packet import Flag, Packet


class HostEngine:
    def __init__(self, own: WorkerEngine) -> None:
        self.name = own.name
        self.own = own
        self.counters = own.counters
        self.shadows: dict[int, WorkerEngine] = {}

    def shadow(self, straggler: int) -> WorkerEngine:
        """The stream that sends ``straggler``'s share from this host."""
        sh = self.shadows.get(straggler)
        if sh is None:
            cfg = replace(self.own.cfg, helping=straggler)
            # Sending past the host's own window is useless (those sequences also
            # wait on the host) and would only wait out retransmission budgets.
            sh = self.shadows[straggler] = WorkerEngine(
                f"{self.name}~{straggler}", cfg, self.own.route, cap=self.own
            )
        return sh

    @property
    def next_seq(self) -> int:
        return self.own.next_seq

    def push(
        self, count: int, now_ns: int, payload: np.ndarray | None = None, priority: int = 0,
        at_seq: int | None = None,
    ) -> list[Action]:  # fmt: skip
        """The host's own share (``WorkerEngine.push``)."""
        return self.own.push(count, now_ns, payload, priority, at_seq)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.flags & Flag.NOTIFY:
            if pkt.job_id != self.own.cfg.job_id or not 0 <= pkt.worker_id < self.own.cfg.fan_in:
                self.counters["drop_bad_notify"] += 1
                return []
            self.counters["help_requests"] += 1
            return [HelpRequest(pkt.worker_id, pkt.seq)]
        actions = self.own.on_packet(pkt, now_ns)
        for sh in self.shadows.values():
            actions += [a for a in sh.on_packet(pkt, now_ns) if not isinstance(a, Deliver)]
            actions += sh.pump(now_ns)
        return actions

    def on_timer(self, now_ns: int) -> list[Action]:
        actions = self.own.on_timer(now_ns)
        for sh in self.shadows.values():
            actions += sh.on_timer(now_ns)
        return actions

    def next_deadline(self) -> int | None:
        ds = [d for e in (self.own, *self.shadows.values()) if (d := e.next_deadline()) is not None]
        return min(ds) if ds else None
