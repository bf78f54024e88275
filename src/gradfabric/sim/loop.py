"""The event heap. Ties at equal times break by insertion order (SimPy's eid),
so one seed reproduces a run exactly."""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable
from typing import Any

# an entry of the heap: (time_ns, seq, fn, arg); ``fn(arg)`` runs at time_ns
Event = tuple[int, int, Callable[[Any], None], Any]


class EventLoop:
    """``heap`` holds ``(time_ns, seq, fn, arg)`` entries and ``seq`` counts
    pushes; both are public for a caller on the simulator's hottest path
    (``Link.send``) that pushes inline exactly as ``push`` does."""

    __slots__ = ("_stopped", "events", "heap", "now", "seq")

    def __init__(self) -> None:
        self.now = 0
        self.seq = 0
        self.heap: list[Event] = []
        self.events = 0
        self._stopped = False

    def stop(self) -> None:
        """Make ``run`` return after the event being processed."""
        self._stopped = True

    def at(self, time_ns: int, fn: Callable[[Any], None], arg: Any = None) -> None:
        if time_ns < self.now:
            raise ValueError(f"cannot schedule in the past: {time_ns} < {self.now}")
        self.seq += 1
        heapq.heappush(self.heap, (time_ns, self.seq, fn, arg))

    def push(self, time_ns: int, fn: Callable[[Any], None], arg: Any) -> None:
        """``at`` without the past-time check, for callers that add a delay to ``now``."""
        self.seq += 1
        heapq.heappush(self.heap, (time_ns, self.seq, fn, arg))

    def run(self, until_ns: int | None = None) -> None:
        """Process events in time order until none remain, ``until_ns`` or ``stop()``.

        The cyclic collector is off while events run. Every event is a heap
        entry, a tuple the collector tracks, and each of its full passes walks
        the whole heap and every engine: in a ring all-reduce of 1,024 workers
        the collector took 4.0 s of 17 s, at 2,048 workers 53 s of 127 s.
        Nothing here needs it: events make no reference cycles, so reference
        counting frees all they leave (``tests/unit/test_sim.py`` holds every
        scheme to that), and the caller's setting comes back on return."""
        heap, pop = self.heap, heapq.heappop
        horizon = until_ns if until_ns is not None else 1 << 62
        self._stopped = False
        n = 0
        collecting = gc.isenabled()
        gc.disable()
        try:
            while heap and not self._stopped:
                if heap[0][0] > horizon:
                    self.now = horizon
                    break
                t, _, fn, arg = pop(heap)
                self.now = t
                fn(arg)
                n += 1
        finally:
            self.events += n
            if collecting:
                gc.enable()

    @property
    def pending(self) -> int:
        return len(self.heap)
