"""The asyncio UDP driver: one engine behind one UDP socket, wall-clock time.

The driver owns everything the engine may not: the socket, the clock
(``time.monotonic_ns``, the same clock as ``loop.time()``), the single timer
(kept by the shared dispatcher, ``proto.dispatch``) and the address book that turns
engine names (``"w0"``, ``"sw0"``) into ``(host, port)``. Datagrams that do
not decode are a ``ProtocolError``: counted in ``counters['drop_malformed']``
and otherwise ignored, never a crash. With a ``token`` (the emulator's job
secret, ``wire.envelope``) every datagram carries it, and one that carries
another is counted in ``counters['drop_bad_token']``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from typing import Final, cast

from gradfabric.core.errors import ConfigError, PeerTimeoutError, ProtocolError
from gradfabric.proto.actions import Deliver, Fail, HelpRequest
from gradfabric.proto.dispatch import Port, timeout_error
from gradfabric.proto.interface import Engine
from gradfabric.wire.envelope import TOKEN_BYTES, drop_reason, seal, unseal
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Packet, decode, encode

Address = tuple[str, int]
SOCKET_BUFFER_BYTES = 4 * 2**20


def sockaddr(sock: socket.socket, address: Address) -> bytes:
    """``address`` as the raw ``struct sockaddr`` that ``sock``'s family sends
    to (for the native datapaths, ``net.datapath`` and ``net.switchpath``)."""
    info = socket.getaddrinfo(address[0], address[1], sock.family, socket.SOCK_DGRAM)
    host, port = str(info[0][4][0]), int(info[0][4][1])
    family = struct.pack("=H", sock.family)
    if sock.family == socket.AF_INET:
        return family + struct.pack("!H", port) + socket.inet_pton(socket.AF_INET, host) + bytes(8)
    if sock.family == socket.AF_INET6:
        return (family + struct.pack("!HI", port, 0) + socket.inet_pton(socket.AF_INET6, host)
                + struct.pack("=I", 0))  # fmt: skip
    raise ValueError(f"the native datapaths speak IPv4 and IPv6, not family {sock.family}")


# Linux's: a socket gets only the groups it joined, not every group its host
# joined (the default, 1); Python names it from 3.12 on.
IP_MULTICAST_ALL: Final = getattr(socket, "IP_MULTICAST_ALL", 49)


def group_of(job_id: int, port: int) -> Address:
    """Job ``job_id``'s multicast group (1 <= job_id <= 0xFFFF) on ``port``:
    administratively scoped (RFC 2365), one per job."""
    return f"239.77.{job_id >> 8}.{job_id & 0xFF}", port


def join_group(group: Address, toward: Address) -> socket.socket:
    """A non-blocking socket that receives ``group``'s datagrams, joined on
    the interface that routes toward ``toward`` (the daemon), and only those."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(toward)  # no datagram: the kernel picks the route
        iface = probe.getsockname()[0]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the group's other members
        sock.bind(group)
        mreq = socket.inet_aton(group[0]) + socket.inet_aton(iface)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    except OSError as e:
        sock.close()
        raise ConfigError("multicast", f"cannot join {group[0]}:{group[1]} toward "
                          f"{toward[0]}: {e}") from e  # fmt: skip
    finally:
        probe.close()
    sock.setblocking(False)
    size_buffers(sock)
    return sock


IP_MTU: Final = getattr(socket, "IP_MTU", 14)  # Linux's: a connected socket's route MTU
AUTO_MAX_VALUES: Final = 2048  # a datagram chosen from an MTU carries at most 8 KB of values


IP_UDP_BYTES: Final = 28  # IPv4's header and UDP's, before a datagram's own bytes


def datagram_bytes(values: int) -> int:
    """The IP packet of a datagram of ``values`` 4-byte values: IPv4 and UDP,
    the job token, the header, the values."""
    return IP_UDP_BYTES + TOKEN_BYTES + HEADER_BYTES + VALUE_BYTES * values


def values_fitting(mtu: int) -> int:
    """The most values one datagram carries whole (never an IP fragment) on
    a path of ``mtu`` bytes (``datagram_bytes``' inverse)."""
    return (mtu - datagram_bytes(0)) // VALUE_BYTES


def default_values(mtu: int) -> int:
    """The datagram a daemon chooses on an interface of ``mtu`` bytes: the
    most values it carries whole, at most AUTO_MAX_VALUES."""
    return max(1, min(AUTO_MAX_VALUES, values_fitting(mtu)))


def _sysfs(name: str, what: str) -> int | None:
    try:
        with open(f"/sys/class/net/{name}/{what}") as f:
            return int(f.read(), 0)  # (flags are hexadecimal, 0x1003)
    except (OSError, ValueError):
        return None


def _ipv4(sock: socket.socket, name: str) -> str | None:
    import fcntl

    try:  # SIOCGIFADDR: the interface's (first) IPv4 address
        got = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(got[20:24])


def interface_mtu(host: str) -> int:
    """The MTU of the interface that holds IPv4 address (or name) ``host``
    as its first address; for the wildcard (or an address held otherwise:
    a secondary one), the smallest of the interfaces that are up,
    loopback's only where no other is up
    (Linux's ``/sys/class/net``; 1500 where none can be read)."""
    try:
        addr = socket.gethostbyname(host) if host else "0.0.0.0"
    except OSError:
        addr = "0.0.0.0"
    up: dict[str, int] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            mtu, flags = _sysfs(name, "mtu"), _sysfs(name, "flags")
            if mtu is None:
                continue
            held = _ipv4(s, name)
            if held == addr or (name == "lo" and addr.startswith("127.")):  # (all 127/8 is lo's)
                return mtu
            if flags is not None and flags & 1:
                up[name] = mtu
    others = [m for n, m in up.items() if n != "lo"]
    return min(others) if others else up.get("lo", 1500)


def path_mtu(toward: Address) -> int:
    """The MTU of the route toward ``toward`` as the kernel knows it (IP_MTU
    of a socket connected there; no datagram is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(toward)
        return int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))


PROBE: Final = b"gfprobe1"  # a multicast probe datagram: these bytes, then the asker's nonce


async def await_probe(sock: socket.socket, nonce: bytes, seconds: float) -> bool:
    """Whether the probe carrying ``nonce`` reaches non-blocking ``sock``
    within ``seconds`` (anything else that arrives is passed over)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            if await asyncio.wait_for(loop.sock_recv(sock, 64), left) == PROBE + nonce:
                return True
        except TimeoutError:
            break
    return False


def size_buffers(sock: socket.socket) -> None:
    """Socket buffers of SOCKET_BUFFER_BYTES each way (the kernel caps them at
    rmem_max/wmem_max): a burst of a window's datagrams must fit."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


class EngineProtocol(asyncio.DatagramProtocol, Port):
    """One engine on one socket; its actions go through the shared dispatcher
    (``proto.dispatch.Port``). ``Fail`` completes ``gave_up`` with a
    ``PeerTimeoutError`` naming the peer, for whoever waits on the job."""

    def __init__(
        self,
        engine: Engine,
        book: dict[str, Address],
        on_deliver: Callable[[Deliver], None] | None = None,
        token: bytes | None = None,
        on_help: Callable[[HelpRequest], None] | None = None,
    ) -> None:
        Port.__init__(self, engine)
        self.engine: Engine = engine
        self.token = token
        self.on_help = on_help
        self.book = book
        self.on_deliver = on_deliver
        self.transport: asyncio.DatagramTransport | None = None
        self.gave_up: asyncio.Future[PeerTimeoutError] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # closed: what the engine still sends is a counted drop

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

    # -- the dispatcher's driver side ------------------------------------
    def send(self, dst: str, pkt: Packet) -> None:
        self._sendto(dst, self._encode(pkt))

    def multicast(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        raw = self._encode(pkt)  # one encoding for every destination
        for d in dsts:
            self._sendto(d, raw)

    def schedule(self, deadline_ns: int) -> None:
        asyncio.get_running_loop().call_at(deadline_ns / 1e9, self.fire, deadline_ns)

    def now(self) -> int:
        return time.monotonic_ns()

    def on_fail(self, fail: Fail) -> None:
        if not self.gave_up.done():
            self.gave_up.set_result(timeout_error(fail))

    def _sendto(self, dst: str, raw: bytes) -> None:
        addr = self.book.get(dst)
        if addr is None or self.transport is None:
            self.engine.counters["drop_no_address"] += 1
            return
        self.transport.sendto(raw, addr)


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
