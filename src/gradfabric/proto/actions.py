"""What an engine asks its driver to do.

Timers are not actions: an engine reports ``next_deadline()`` (as aioquic's
``get_timer``) and the driver calls ``on_timer(now_ns)`` once it passes. One
pending timer per engine instead of one per packet keeps the simulator's
event count at the packets themselves. Drops are counted in the engine's
``counters`` (by reason) rather than returned, for the same reason.

The actions are plain ``@dataclass``es, not ``slots=True`` ones: compiled
(mypyc) they are native classes with a fixed layout already, and ``slots=True``
would replace the compiled class with an interpreted copy. The ones made for
every packet write their ``__init__`` out: mypyc leaves the methods
``dataclass`` generates interpreted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from gradfabric.wire.packet import Packet


@dataclass
class Send:
    dst: str
    pkt: Packet

    def __init__(self, dst: str, pkt: Packet) -> None:
        self.dst = dst
        self.pkt = pkt


@dataclass
class Multicast:
    """Send one copy of ``pkt`` to each of ``dsts`` (the driver clones headers)."""

    dsts: tuple[str, ...]
    pkt: Packet

    def __init__(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        self.dsts = dsts
        self.pkt = pkt


@dataclass
class Deliver:
    """An aggregated result handed to the application (once per sequence)."""

    seq: int
    pkt: Packet

    def __init__(self, seq: int, pkt: Packet) -> None:
        self.seq = seq
        self.pkt = pkt


@dataclass
class Fail:
    """The engine gave up on a peer; the driver raises ``PeerTimeoutError``."""

    peer: str
    reason: str
    waited_ns: int = 0


@dataclass
class HelpRequest:
    """SA-ATP: the switch asks this host to send ``straggler``'s share from
    ``from_seq`` on, computed from its replica of the straggler's data."""

    straggler: int
    from_seq: int


Action = Send | Multicast | Deliver | Fail | HelpRequest


@mypyc_attr(allow_interpreted_subclasses=True)  # engines written in plain Python
class NoTimers:
    """Mixin for engines that never set a deadline (switches, servers, rings)."""

    def on_timer(self, now_ns: int) -> list[Action]:
        return []

    def next_deadline(self) -> int | None:
        return None
