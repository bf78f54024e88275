"""DLCP's client: workers push tensors to a DLCP server behind the switch
daemon's congested port and pull the sum, both within their loss bounds.

The switch daemon (policy ``dlcp``) hosts each DLCP job's server
(``proto.dlcp.DlcpServer``) behind one port served at ``--port-mbps`` with
strict-priority queues and WRED by drop precedence (``proto.qos``).
``DlcpClient`` is one worker (a ``DlcpEndpoint`` on a UDP socket, driven by
an asyncio loop in a background thread); ``dlcp_hook`` (``runtime.hook``) uses
it under DDP. A congested run over UDP, measured: ``lab.dlcp_udp``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.proto.actions import Deliver
from gradfabric.proto.dlcp import DlcpEndpoint, DlcpReceiver, DlcpSender
from gradfabric.runtime.client import CLIENTS, Attached, Ticket
from gradfabric.runtime.switchd import worker_name
from gradfabric.wire import fastquant


@dataclass(frozen=True)
class Pending:
    """A tensor begun and not yet finished: ``done`` is set once its sum is in ``got``."""

    tensor: int
    done: threading.Event = field(default_factory=threading.Event)
    got: list[Any] = field(default_factory=list)


class DlcpClient(Attached):
    """Rank ``rank`` of a DLCP job (a ``dlcp`` ticket from a ``--policy dlcp`` switch)."""

    KIND = "dlcp"
    DAEMON_OPTIONS = ("--values-per-packet", "256")  # DLCP's loss bound counts 256-value packets

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, pace_kb: int = 0
    ) -> None:
        """``pace_kb``: a send buffer that small, so the kernel takes a tensor's
        datagrams only as fast as the link drains them (the rest waits in the
        socket's transport) instead of bursting a whole tensor into the
        port's queue; 0 keeps the large default (loopback)."""
        t = ticket
        if t.kind != "dlcp":
            raise ConfigError("kind", f"a DLCP client needs a dlcp job, got {t.kind!r}")
        name, pp = worker_name(t.job_id, rank), t.values_per_packet
        self.endpoint = DlcpEndpoint(
            name,
            DlcpReceiver(name, t.job_id, rank, [t.entry], t.rto_ns),
            [DlcpSender(name, t.job_id, rank, t.entry, pp, t.rto_ns)],
        )
        self.next_tensor = 0
        self.buckets = 1  # DDP buckets seen (for dlcp_hook's layer order)
        self.results: dict[int, Pending] = {}
        self._attach(ticket, rank, timeout_s, self.endpoint, self._deliver)
        if pace_kb and self.proto.transport is not None:
            sock = self.proto.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, pace_kb * 1024)

    def allreduce(  # bounded loss on floats: no quantisation round
        self, x: npt.NDArray[np.float32], layer: int = 0, layers: int = 1, *,
        out: npt.NDArray[np.float32] | None = None, key: int = 0,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """Sum ``x`` over the job within the bounds (every rank calls with the same
        length in the same order): values lost beyond recovery read as zero.
        ``out``: as ``Attached.allreduce``'s (the sum is copied there); ``key``
        is unused (floats travel as they are: no exponents)."""
        return self.finish(self.begin(x, layer, layers), out=out)

    def begin(self, x: npt.NDArray[np.float32], layer: int = 0, layers: int = 1) -> Pending:
        """``allreduce``'s first half: ``x``'s push starts now, on the client's
        loop, and returns at once (any thread; every rank begins the same
        tensors in the same order). ``x`` must stay as it is until its
        ``finish``: its datagrams are sent, and resent, from it. Several may
        be in flight: a bucket's push then overlaps the sums of earlier ones
        coming back. (Each tensor's datagrams queue behind the ones begun
        before it: tensors are not reordered by layer here.)"""
        tensor = self.next_tensor
        self.next_tensor = (self.next_tensor + 1) % 0x10000  # the header's tensor id
        done = Pending(tensor)
        self.results[tensor] = done
        vals = np.ascontiguousarray(x, dtype=np.float32)

        def start() -> None:
            now = time.monotonic_ns()
            ep = self.endpoint
            ep.rx.expect(0, tensor, len(vals), self.ticket.pull_bound, now)
            self.proto.execute(
                ep.tx[0].send(tensor, len(vals), layer, layers, values=vals, now_ns=now)
            )

        self.loop.call_soon_threadsafe(start)
        return done

    def finish(
        self, pending: Pending, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """``allreduce``'s second half: the sum of a ``begin``, once it is in;
        ``PeerTimeoutError`` naming the server if it is not in ``timeout_s``
        (the tensor is then given up: a sum arriving later is dropped)."""
        try:
            if not pending.done.wait(self.timeout_s):
                raise PeerTimeoutError(self.ticket.entry, self.timeout_s)
        finally:
            self.results.pop(pending.tensor, None)
        total = np.asarray(pending.got[0], dtype=np.float32)
        if out is None:
            return total
        into: npt.NDArray[np.float32] = fastquant.output(out, len(total), np.float32)
        into[:] = total
        return into

    def lost(self) -> int:
        return int(self.endpoint.counters.get("values_lost", 0))

    def _deliver(self, d: Deliver) -> None:
        hit = self.results.get(d.seq)
        if hit is not None and d.pkt.payload is not None:
            hit.got.append(d.pkt.payload.copy())
            hit.done.set()


CLIENTS.add("dlcp", DlcpClient)
