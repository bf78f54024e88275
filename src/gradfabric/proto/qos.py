"""A switch egress port's queues as DLCP uses them, without a clock.

The ``priority`` byte is read as ``wire.packet.traffic_class`` writes it:
the high nibble picks one of ``PRIORITY_QUEUES`` FIFO queues, served in
strict priority (queue 0 first); the low nibble is the drop precedence. WRED
by precedence on the port's backlog: precedence ``d > 0`` is dropped with a
probability rising from 0 at ``(1 - (d + 1) / 8) Q`` to 1 at ``(1 - d / 8) Q``
bytes (``Q``: the buffer), precedence 0 only when the buffer is full. So
under congestion the least important packets are dropped first (from half
the buffer up) and the most important never before the buffer is full.

The simulator's priority links and the emulator's switch port both keep
their queues here; each adds its own clock for the service.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from gradfabric.core.trace import Counters

PRIORITY_QUEUES = 8  # egress queues by the priority byte's high nibble
DROP_LEVELS = 4  # WRED drop precedences by its low nibble

T = TypeVar("T")


class PortQueues(Generic[T]):
    def __init__(self, buffer_bytes: int, counters: Counters, per_queue: bool = False) -> None:
        """``per_queue``: each queue holds ``buffer_bytes`` of its own and WRED
        reads its own backlog (a FIFO per class, as Linux's htb classes with
        a bfifo each); by default the queues share one buffer, as a switch
        ASIC's port does, so other traffic that fills it takes every
        class's room."""
        q = buffer_bytes
        self.red = [(q * (1 - (d + 1) / 8), q * (1 - d / 8)) if d else (q, q)
                    for d in range(DROP_LEVELS)]  # fmt: skip
        self.queues: list[deque[tuple[T, int]]] = [deque() for _ in range(PRIORITY_QUEUES)]
        self.backlog = 0  # bytes waiting (not the one in service)
        self.held = [0] * PRIORITY_QUEUES  # of which, per queue
        self.per_queue = per_queue
        self.counters = counters

    def offer(self, item: T, size: int, priority: int, u: float) -> bool:
        """Queue ``item`` of ``size`` bytes, or drop it (``u``: a uniform draw
        in [0, 1) for WRED). Counts offers and drops by precedence, enqueues by queue."""
        d = min(priority & 15, DROP_LEVELS - 1)
        q = min(priority >> 4, PRIORITY_QUEUES - 1)
        self.counters[f"offered_precedence{d}"] += 1
        lo, hi = self.red[d]
        after = (self.held[q] if self.per_queue else self.backlog) + size
        if after > hi or (after > lo and u < (after - lo) / (hi - lo)):
            self.counters["queue_drop"] += 1
            self.counters[f"queue_drop_precedence{d}"] += 1
            return False
        self.queues[q].append((item, size))
        self.counters[f"queued_q{q}"] += 1
        self.backlog += size
        self.held[q] += size
        return True

    def take(self) -> tuple[T, int] | None:
        """The next packet to send: the head of the most urgent non-empty queue."""
        for i, q in enumerate(self.queues):
            if q:
                item, size = q.popleft()
                self.backlog -= size
                self.held[i] -= size
                return item, size
        return None
