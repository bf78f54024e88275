"""What a driver may assume of an engine (structural types).

Kept apart from ``proto.actions`` because the actions are compiled with the
hot path (mypyc) and a ``runtime_checkable`` protocol cannot be.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action
from gradfabric.wire.packet import Packet


class Engine(Protocol):
    name: str
    counters: Counters

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]: ...

    def on_timer(self, now_ns: int) -> list[Action]: ...

    def next_deadline(self) -> int | None: ...


@runtime_checkable
class Aggregator(Engine, Protocol):
    """An engine that merges contributions and can say whom it waits on
    (switches, parameter servers, aggregators): drivers ask it to name the
    peers behind a stalled collective."""

    def missing_peers(self, job_id: int | None = None) -> list[str]: ...
