"""The asyncio UDP driver: one engine behind one UDP socket, wall-clock time.

The driver owns everything the engine may not: the socket, the clock
(``time.monotonic_ns``, the same clock as ``loop.time()``), the single timer
(armed at the engine's ``next_deadline``) and the address book that turns
engine names (``"w0"``, ``"sw0"``) into ``(host, port)``. Datagrams that do
not decode are a ``ProtocolError``: counted in ``counters['drop_malformed']``
and otherwise ignored, never a crash. With a ``token`` (the emulator's job
secret, ``wire.envelope``) every datagram carries it, and one that carries
another is counted in ``counters['drop_bad_token']``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import cast

from gradfabric.core.errors import ProtocolError
from gradfabric.proto.actions import Action, Deliver, Engine, Fail, HelpRequest, Multicast, Send
from gradfabric.wire.envelope import drop_reason, seal, unseal
from gradfabric.wire.packet import Packet, decode, encode

Address = tuple[str, int]
SOCKET_BUFFER_BYTES = 4 * 2**20


def size_buffers(sock: socket.socket) -> None:
    """Socket buffers of SOCKET_BUFFER_BYTES each way (the kernel caps them at
    rmem_max/wmem_max): a burst of a window's datagrams must fit."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


class EngineProtocol(asyncio.DatagramProtocol):
    def __init__(
        self,
        engine: Engine,
        book: dict[str, Address],
        on_deliver: Callable[[Deliver], None] | None = None,
        token: bytes | None = None,
        on_help: Callable[[HelpRequest], None] | None = None,
    ) -> None:
        self.engine = engine
        self.token = token
        self.on_help = on_help
        self.book = book
        self.on_deliver = on_deliver
        self.transport: asyncio.DatagramTransport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at: int | None = None
        self.failed: asyncio.Future[Fail] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        try:
            pkt = decode(data) if self.token is None else unseal(data, self.token)
        except ProtocolError as e:
            self.engine.counters[drop_reason(e)] += 1
            return
        self.execute(self.engine.on_packet(pkt, time.monotonic_ns()))

    def _encode(self, pkt: Packet) -> bytes:
        return encode(pkt) if self.token is None else seal(self.token, pkt)

    def error_received(self, exc: Exception) -> None:
        self.engine.counters["socket_error"] += 1

    def execute(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send(a.dst, self._encode(a.pkt))
            elif isinstance(a, Multicast):
                raw = self._encode(a.pkt)
                for d in a.dsts:
                    self._send(d, raw)
            elif isinstance(a, Deliver):
                if self.on_deliver is not None:
                    self.on_deliver(a)
            elif isinstance(a, Fail) and not self.failed.done():
                self.failed.set_result(a)
            elif isinstance(a, HelpRequest) and self.on_help is not None:
                self.on_help(a)
        self._arm()

    def _send(self, dst: str, raw: bytes) -> None:
        addr = self.book.get(dst)
        if addr is None or self.transport is None:
            self.engine.counters["drop_no_address"] += 1
            return
        self.transport.sendto(raw, addr)

    def _arm(self) -> None:
        d = self.engine.next_deadline()
        if d is None or d == self.timer_at:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = d
        self.timer = asyncio.get_running_loop().call_at(d / 1e9, self._fire)

    def _fire(self) -> None:
        self.timer = None
        self.timer_at = None
        self.execute(self.engine.on_timer(time.monotonic_ns()))


async def open_engine(
    engine: Engine,
    book: dict[str, Address],
    bind: Address,
    on_deliver: Callable[[Deliver], None] | None = None,
    token: bytes | None = None,
    on_help: Callable[[HelpRequest], None] | None = None,
) -> tuple[asyncio.DatagramTransport, EngineProtocol]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        lambda: EngineProtocol(engine, book, on_deliver, token, on_help), local_addr=bind
    )
    size_buffers(transport.get_extra_info("socket"))
    return transport, proto
