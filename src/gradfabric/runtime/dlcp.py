"""DLCP's client: workers push tensors to a DLCP server behind the switch
daemon's congested port and pull the sum, both within their loss bounds.

The switch daemon (policy ``dlcp``) hosts each DLCP job's server
(``proto.dlcp.DlcpServer``) behind one port served at ``--port-mbps`` with
strict-priority queues and WRED by drop precedence (``proto.qos``).
``DlcpClient`` is one worker: where it is built, the native endpoint
(``net.dlcpath``: the C engine in the C loop, the GIL released, on a
thread of its own); otherwise the reference, a ``DlcpEndpoint`` on a UDP
socket driven by an asyncio loop in a background thread. Both put the
same datagrams on the wire (the differential harness,
``tests/property/test_dlcp_native.py``). ``dlcp_hook`` (``runtime.hook``)
uses it under DDP. A congested run over UDP, measured: ``lab.dlcp_udp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.core.trace import Counters
from gradfabric.net import dlcpath
from gradfabric.net.datapath import ABORT_CHECK_S
from gradfabric.net.udp import size_buffers, sockaddr
from gradfabric.proto.actions import Deliver
from gradfabric.proto.dlcp import DlcpEndpoint, DlcpReceiver, DlcpSender
from gradfabric.runtime.client import CLIENTS, Attached, Ticket
from gradfabric.runtime.session import bind_host_for, say_hello
from gradfabric.runtime.switchd import worker_name
from gradfabric.wire import fastquant


@dataclass(frozen=True)
class Pending:
    """A tensor begun and not yet finished: ``done`` is set once its sum is in
    ``got``, or once ``error`` says why it never will be."""

    tensor: int
    done: threading.Event = field(default_factory=threading.Event)
    got: list[Any] = field(default_factory=list)
    error: list[BaseException] = field(default_factory=list)


class DlcpClient(Attached):
    """Rank ``rank`` of a DLCP job (a ``dlcp`` ticket from a ``--policy dlcp`` switch)."""

    KIND = "dlcp"
    DAEMON_OPTIONS = ("--values-per-packet", "256")  # DLCP's loss bound counts 256-value packets

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, pace_kb: int = 0,
        native_path: bool | None = None,
    ) -> None:  # fmt: skip
        """``pace_kb``: a send buffer that small, so the kernel takes a tensor's
        datagrams only as fast as the link drains them (the rest waits in the
        socket's transport) instead of bursting a whole tensor into the
        port's queue; 0 keeps the large default (loopback). ``native_path``:
        the C endpoint (None: where it is built)."""
        t = ticket
        if t.kind != "dlcp":
            raise ConfigError("kind", f"a DLCP client needs a dlcp job, got {t.kind!r}")
        if native_path is None:
            native_path = dlcpath.PATH == native.COMPILED
        self.next_tensor = 0
        self.buckets = 1  # DDP buckets seen (for dlcp_hook's layer order)
        self.results: dict[int, Pending] = {}
        self.native: dlcpath.NativeDlcpEndpoint | None = None
        self.stopped: BaseException | None = None  # why the native endpoint's thread ended
        if native_path:
            self._attach_native(ticket, rank, timeout_s, pace_kb)
            return
        name, pp = worker_name(t.job_id, rank), t.values_per_packet
        self.endpoint = DlcpEndpoint(
            name,
            DlcpReceiver(name, t.job_id, rank, [t.entry], t.rto_ns, keep_done=dlcpath.KEEP_SUMS),
            [DlcpSender(name, t.job_id, rank, t.entry, pp, t.rto_ns)],
        )
        self._attach(ticket, rank, timeout_s, self.endpoint, self._deliver)
        if pace_kb and self.proto.transport is not None:
            sock = self.proto.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, pace_kb * 1024)

    def _attach_native(self, ticket: Ticket, rank: int, timeout_s: float, pace_kb: int) -> None:
        """The C endpoint on a socket of its own (the session's loop only says hello)."""
        self._start(ticket, rank, timeout_s)
        t = ticket
        self.native = dlcpath.NativeDlcpEndpoint(t.job_id, rank, t.values_per_packet, t.rto_ns,
                                                 bytes.fromhex(t.token))  # fmt: skip
        self.sock = sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        size_buffers(sock)
        if pace_kb:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, pace_kb * 1024)
        host = bind_host_for(t)
        sock.bind((host, 0))
        self.peer = sockaddr(sock, t.switch)
        self.wake = dlcpath.wake_fd()
        self.abort = ctypes.c_int32(0)
        self.driver = Counters()  # the C loop's
        self._wait(say_hello(t, rank, sock.getsockname()[1], host), timeout_s)
        self.serving = threading.Thread(target=self._serve, daemon=True)
        self.serving.start()

    def _serve(self) -> None:
        """The native endpoint's thread: the C loop until the next sum is in
        (then whoever waits for it is woken) or nothing is in flight (then
        until ``begin`` writes to ``wake``)."""
        assert self.native is not None
        ep = self.native
        why: BaseException = RuntimeError(f"DLCP client of rank {self.rank} closed")
        try:
            while not self.abort.value:
                if ep.idle():  # (a wake-up the loop did not read is read here: else it spins)
                    if select.select([self.wake], [], [], ABORT_CHECK_S)[0]:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self.wake)
                    continue
                ep.run(self.sock, self.peer, time.monotonic_ns() + int(ABORT_CHECK_S * 1e9),
                       self.abort, self.wake, self.driver)  # fmt: skip
                for tensor, p in list(self.results.items()):
                    if ep.ready(tensor):
                        p.done.set()
        except Exception as e:  # (out of memory, a socket gone): no finish is left waiting
            why = e
        self.stopped = why
        for p in list(self.results.values()):
            if not p.done.is_set():
                p.error.append(why)
                p.done.set()

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
        """``allreduce``'s first half: ``x``'s push starts now, and returns at
        once (any thread; every rank begins the same tensors in the same
        order). ``x`` must stay as it is until its ``finish``: the reference
        sends, and resends, from it (the native endpoint copies it). Several may
        be in flight: a bucket's push then overlaps the sums of earlier ones
        coming back. (Each tensor's datagrams queue behind the ones begun
        before it: tensors are not reordered by layer here.)"""
        tensor = self.next_tensor
        self.next_tensor = (self.next_tensor + 1) % 0x10000  # the header's tensor id
        done = Pending(tensor)
        vals = np.ascontiguousarray(x, dtype=np.float32)
        self.results[tensor] = done
        if self.native is not None:
            done.got.append(np.empty(len(vals), np.float32))
            back = layers > 1 and layer >= layers / 2  # (proto.dlcp.classify's halves)
            try:
                if self.stopped is not None:
                    raise self.stopped
                self.native.begin(tensor, vals, back, self.ticket.pull_bound, done.got[0],
                                  time.monotonic_ns())  # fmt: skip
            except BaseException:
                del self.results[tensor]
                raise
            os.eventfd_write(self.wake, 1)  # the serving thread sends it now
            return done

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
                if self.native is not None:
                    self.native.forget(pending.tensor)
                else:
                    self.loop.call_soon_threadsafe(self.endpoint.rx.forget, 0, pending.tensor)
                raise PeerTimeoutError(self.ticket.entry, self.timeout_s)
        finally:
            self.results.pop(pending.tensor, None)
        if pending.error:
            raise pending.error[0]
        total = np.asarray(pending.got[0], dtype=np.float32)
        if out is None:
            return total
        into: npt.NDArray[np.float32] = fastquant.output(out, len(total), np.float32)
        into[:] = total
        return into

    def lost(self) -> int:
        if self.native is not None:
            return int(self.native.fold().get("values_lost", 0))
        return int(self.endpoint.counters.get("values_lost", 0))

    def close(self) -> None:
        if self.native is not None:
            self.abort.value = 1
            self.serving.join()
            self.native.close()
            self.sock.close()
            os.close(self.wake)
            self.native = None
        super().close()

    def _deliver(self, d: Deliver) -> None:
        hit = self.results.get(d.seq)
        if hit is not None and d.pkt.payload is not None:
            hit.got.append(d.pkt.payload.copy())
            hit.done.set()


CLIENTS.add("dlcp", DlcpClient)
