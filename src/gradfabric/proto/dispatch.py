"""The one dispatcher: what every driver does with an engine's actions.

An engine returns actions and reports ``next_deadline()``; a driver turns
them into its own events. ``Port`` is that turn, written once: each driver
(the simulator's ``Node``, the UDP driver's ``EngineProtocol``, the switch
daemon's hosted engines) subclasses it and says only how a packet leaves
(``send``), how a result reaches the application (``deliver``), and how a
timer is set on its clock (``schedule``, ``now``).

* ``Send`` / ``Multicast``: ``send`` per destination (a multicast gives each
  destination its own copy of the header, ``Packet.clone``, unless the driver
  overrides ``multicast`` to encode once).
* ``Deliver``: ``on_deliver``, if the driver's user set one.
* ``Fail``: the engine gave up on ``peer``. The first one is kept in
  ``failed``, and ``on_fail`` turns it into the driver's way of telling whoever
  waits on the job: a ``PeerTimeoutError`` naming the peer (the simulator
  raises it, the UDP driver completes a future with it, the daemon counts it
  and reports the peer as missing). It never passes silently.
* ``HelpRequest``: ``on_help``, if set (SA-ATP hosts).

Timers: one per engine. After every batch of actions the port asks the
engine's deadline (an engine that keeps ``NoTimers``' defaults is never
asked) and schedules a wake-up only if it is earlier than the one
pending; a wake-up that is no longer the pending one is ignored. No timer is
ever cancelled, which suits an event heap and asyncio alike.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy_extensions import mypyc_attr

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.proto.actions import Action, Deliver, Fail, HelpRequest, Multicast, NoTimers, Send
from gradfabric.proto.interface import Engine
from gradfabric.wire.packet import Packet


@mypyc_attr(allow_interpreted_subclasses=True)  # the UDP driver and the daemon subclass it
class Port:
    """One engine at one driver (see the module doc)."""

    __slots__ = ("engine", "failed", "on_deliver", "on_help", "timed", "timer_at")

    engine: Engine | None
    timer_at: int | None
    failed: Fail | None
    on_deliver: Callable[[Deliver], None] | None
    on_help: Callable[[HelpRequest], None] | None

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = None
        self.timed = False
        self.attach(engine)
        self.timer_at = None
        self.failed = None
        self.on_deliver = None
        self.on_help = None

    def attach(self, engine: Engine | None) -> None:
        """Serve ``engine`` from now on. One that keeps the ``NoTimers``
        defaults (switches, servers, rings) is never asked for a deadline."""
        self.engine = engine
        self.timed = engine is not None and not isinstance(engine, NoTimers)

    # -- what a driver says -------------------------------------------------
    def send(self, dst: str, pkt: Packet) -> None:
        raise NotImplementedError

    def schedule(self, deadline_ns: int) -> None:
        """Call ``fire(deadline_ns)`` at or after ``deadline_ns`` on the
        driver's clock (a host's timer may fire late: never early)."""
        raise NotImplementedError

    def now(self) -> int:
        raise NotImplementedError

    def on_fail(self, fail: Fail) -> None:
        """Tell whoever waits on the job; by default, raise."""
        raise timeout_error(fail)

    # -- written once ----------------------------------------------------------
    def multicast(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        """One copy per destination (a driver that encodes once may override)."""
        for d in dsts:
            self.send(d, pkt.clone())

    def execute(self, actions: list[Action]) -> None:
        # The simulator's hottest loop: one pass, the timer check inlined (``rearm``).
        send = self.send
        for a in actions:
            if type(a) is Send:
                send(a.dst, a.pkt)
            elif type(a) is Multicast:
                self.multicast(a.dsts, a.pkt)
            elif type(a) is Deliver:
                if self.on_deliver is not None:
                    self.on_deliver(a)
            elif type(a) is Fail:
                if self.failed is None:
                    self.failed = a
                self.on_fail(a)
            elif type(a) is HelpRequest and self.on_help is not None:
                self.on_help(a)
        if self.timed:
            d = self.engine.next_deadline()  # type: ignore[union-attr]  # timed: set
            if d is not None and (self.timer_at is None or d < self.timer_at):
                self.timer_at = d
                self.schedule(d)

    def rearm(self) -> None:
        eng = self.engine
        if eng is None or not self.timed:
            return
        d = eng.next_deadline()
        if d is not None and (self.timer_at is None or d < self.timer_at):
            self.timer_at = d
            self.schedule(d)

    def fire(self, when: int) -> None:
        """The wake-up ``schedule`` set: run the engine's timer if it is still due."""
        if when != self.timer_at or self.engine is None:
            return
        self.timer_at = None
        self.execute(self.engine.on_timer(self.now()))


def timeout_error(fail: Fail) -> PeerTimeoutError:
    return PeerTimeoutError(fail.peer, fail.waited_ns / 1e9)
