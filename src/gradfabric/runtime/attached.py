"""Clients whose engine runs on the session's asyncio loop: OmniReduce's
(``OmniClient``), and DLCP's and SA-ATP's (``runtime.dlcp``, ``lab.saatp_udp``).

``Attached`` serves a packet-level engine (the simulator's) from a UDP
socket through the shared dispatcher (``net.udp.EngineProtocol``): every
datagram carries the job's token (``wire.envelope``); a collective starts in
the loop thread and the caller waits for its ``Call`` to fill. These jobs do
not survive a daemon restart (their engines keep no replay state): their
collectives end with the switch, naming it. The aggregation worker that
does, and that has a native implementation, is ``runtime.ina.InaClient``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from gradfabric.net.udp import EngineProtocol, open_engine
from gradfabric.proto.actions import Action, Deliver
from gradfabric.proto.interface import Engine
from gradfabric.proto.omni import OmniWorker
from gradfabric.proto.worker_node import result_error
from gradfabric.runtime.session import Session, bind_host_for, say_hello
from gradfabric.runtime.ticket import Ticket, scheme_worker
from gradfabric.wire.packet import Packet


class Call:
    """One collective of a client: its int64 sum, filled as results arrive."""

    def __init__(self, n: int, vpp: int, out: npt.NDArray[np.int64] | None = None) -> None:
        self.vpp = vpp
        if out is not None and (out.dtype != np.int64 or len(out) != n):
            raise ValueError(f"out: an int64 array of {n} values")
        # every value is written before the call returns (a partial sum never does)
        self.result = np.zeros(n, dtype=np.int64) if out is None else out
        self.first = 0
        self.done = threading.Event()
        self.failed = False
        self.error: Exception | None = None

    def take(self, seq: int, pkt: Packet) -> None:
        """Sequence ``seq``'s result (``proto.worker_node.WorkerNode``'s rule:
        an integer result of the count that was sent, else the call's error)."""
        lo = (seq - self.first) * self.vpp
        sent = min(self.vpp, len(self.result) - lo)
        if (wrong := result_error(seq, pkt, sent)) is not None:
            self.error = self.error or wrong
        else:
            assert pkt.payload is not None  # (result_error saw to it)
            self.result[lo : lo + sent] = pkt.payload


class Attached(Session):
    """A packet-level engine on a UDP socket at a daemon, run by the
    session's asyncio loop (see the module doc)."""

    _call: Call | None = None  # the collective in flight
    proto: EngineProtocol

    def _attach(
        self, ticket: Ticket, rank: int, timeout_s: float, engine: Engine,
        on_deliver: Callable[[Deliver], None], bind_host: str | None = None,
        on_help: Callable[[Any], None] | None = None,
    ) -> None:  # fmt: skip
        self._start(ticket, rank, timeout_s)
        host = bind_host_for(ticket) if bind_host is None else bind_host

        async def open_() -> None:
            t = ticket
            transport, self.proto = await open_engine(
                engine, {t.entry: t.switch}, (host, 0), on_deliver, bytes.fromhex(t.token),
                on_help,
            )  # fmt: skip
            # (no probe of the job's group: the daemon sends these clients' results
            # one by one; ``InaClient`` probes and takes them multicast)
            await say_hello(t, rank, transport.get_extra_info("sockname")[1], host)

        self._wait(open_(), timeout_s)

    def _run(self, call: Call, start: Callable[[], list[Action]]) -> npt.NDArray[np.int64]:
        """Start a collective in the loop thread and wait for it."""

        def begin() -> None:
            self.proto.execute(start())
            if self.proto.gave_up.done():
                call.failed = True
                call.done.set()

        self.loop.call_soon_threadsafe(begin)
        if not call.done.wait(self.timeout_s) or call.failed:
            raise self._blame()
        if call.error is not None:
            raise call.error
        return call.result

    async def _shut(self) -> None:
        proto = getattr(self, "proto", None)
        if proto is not None:
            proto.attach(None)
            if proto.transport is not None:
                proto.transport.close()
        await asyncio.sleep(0)  # the transports' close callbacks run


class OmniClient(Attached):
    """Rank ``rank`` of an OmniReduce job at an aggregator daemon (``omni``):
    only non-zero blocks of ``values_per_packet`` values travel."""

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, bind_host: str | None = None
    ) -> None:
        engine = scheme_worker(ticket, rank, timeout_s)
        assert isinstance(engine, OmniWorker)
        self.engine = engine
        self.bucket = 0
        self._attach(ticket, rank, timeout_s, self.engine, self._deliver, bind_host)

    def allreduce_ints(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.int64]:
        q = np.ascontiguousarray(q, dtype=np.int32)
        call = self._call = Call(len(q), self.ticket.values_per_packet, out)
        b, self.bucket = self.bucket, (self.bucket + 1) % 0x10000  # the header's bucket id
        if len(q) == 0:
            return call.result
        return self._run(call, lambda: self.engine.start(b, len(q), time.monotonic_ns(), q))

    def _deliver(self, d: Deliver) -> None:
        call = self._call
        if call is not None and d.pkt.payload is not None:
            call.result[:] = d.pkt.payload
            call.done.set()
