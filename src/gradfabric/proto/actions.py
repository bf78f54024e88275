"""What an engine asks its driver to do.

Timers are not actions: an engine reports ``next_deadline()`` (as aioquic's
``get_timer``) and the driver calls ``on_timer(now_ns)`` once it passes. One
pending timer per engine instead of one per packet keeps the simulator's
event count at the packets themselves. Drops are counted in the engine's
``counters`` (by reason) rather than returned, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gradfabric.core.trace import Counters
from gradfabric.wire.packet import Packet


@dataclass(slots=True)
class Send:
    dst: str
    pkt: Packet


@dataclass(slots=True)
class Multicast:
    """Send one copy of ``pkt`` to each of ``dsts`` (the driver clones headers)."""

    dsts: tuple[str, ...]
    pkt: Packet


@dataclass(slots=True)
class Deliver:
    """An aggregated result handed to the application (once per sequence)."""

    seq: int
    pkt: Packet


@dataclass(slots=True)
class Fail:
    """The engine gave up on a peer; the driver raises ``PeerTimeoutError``."""

    peer: str
    reason: str
    waited_ns: int = 0


@dataclass(slots=True)
class HelpRequest:
    """SA-ATP: the switch asks this host to send ``straggler``'s share from
    ``from_seq`` on, computed from its replica of the straggler's data."""

    straggler: int
    from_seq: int


Action = Send | Multicast | Deliver | Fail | HelpRequest


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


class NoTimers:
    """Mixin for engines that never set a deadline (switches, servers, rings)."""

    def on_timer(self, now_ns: int) -> list[Action]:
        return []

    def next_deadline(self) -> int | None:
        return None
