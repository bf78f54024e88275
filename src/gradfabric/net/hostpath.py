"""SA-ATP's helped host on real sockets: the engine in C, and its driver.

A helped host is ``proto.host.HostEngine``: its own stream and the shadow
streams that send a straggler's share from it. Its datagram interface,
the one both implementations here offer::

    push(values, now_ns, at_seq, priority, stream)   a share into a stream (OWN or a shadow's)
    state(stream) / skip_to(stream, seq)             a stream's base, next sequence, idleness
    receive_datagram(data, now_ns)                   a datagram from the switch
    datagrams_to_send(now_ns)                        what leaves, in order, to the switch
    get_timer() / handle_timer(now_ns)               the streams' earliest deadline
    events()                                         (RESULT, seq, count), (HELP, straggler,
                                                     seq), (FAIL, stream, 0), in order

Results go into the *sink*, an int64 array the application registers, each
sequence's values at ``seq * vpp``; a result in floats is never taken (its
event's count is -1), nor one for a sequence past the sink.

``ReferenceHost`` is ``HostEngine`` with its envelope (the token, the
wire's checks); ``NativeHost`` is the same in C (``native/host.c``), held
equal to it datagram for datagram by its differential harness
(``tests/property/test_host_native.py``, and the fuzzers' corpus in
``tests/property/test_corpus.py``). ``HostDriver`` serves either
from an asyncio loop on a UDP socket: the native host's socket is read and
answered in C (``udp.c``'s drain, batches of datagrams a wake-up), and
the loop runs Python once per batch, not once per datagram.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.errors import ConfigError, ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.net.datapath import taken
from gradfabric.net.switchpath import UdpBook
from gradfabric.net.udp import Address, sockaddr
from gradfabric.proto.actions import Fail
from gradfabric.proto.dispatch import Port
from gradfabric.proto.host import HostEngine
from gradfabric.proto.routes import HashedPool, StaticSlots
from gradfabric.proto.worker import WorkerEngine
from gradfabric.wire.envelope import drop_reason, seal, unseal
from gradfabric.wire.packet import Flag, Packet

HERE = Path(__file__).parent
SOURCES = [HERE / "native" / f for f in ("host.c", "wire.h")]
# host.c's order
COUNTERS: Final = (
    "results", "results_ahead", "drop_duplicate_result", "drop_foreign", "drop_stale_nack",
    "nack_resends", "fast_retransmits", "retransmits", "timer_rearmed", "ecn_halvings",
    "drop_bad_token", "drop_malformed", "drop_bad_notify", "help_requests",
)  # fmt: skip
OWN: Final = -1  # the host's own stream; a worker's id names the shadow sending its share
RESULT, HELP, FAIL = 1, 2, 3  # events
_ROUTES: Final = {StaticSlots: 0, HashedPool: 1}
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
Event = tuple[int, int, int]

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_LIB, WHY_NOT = native.load(HERE / "_host", SOURCES, (
    ("gf_h_new", [_i64] * 15 + [ctypes.c_double, _i64, ctypes.c_char_p, _i64], _p),
    ("gf_h_free", [_p], None), ("gf_h_sink", [_p, _p, _i64], None),
    ("gf_h_counters", [_p, _i64], ctypes.POINTER(_i64)),
    ("gf_h_state", [_p, _i64, _p], ctypes.c_int), ("gf_h_skip_to", [_p, _i64, _i64], ctypes.c_int),
    ("gf_h_push", [_p, _i64, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    ("gf_h_datagram", [_p, ctypes.c_char_p, _i64, _i64], ctypes.c_int),
    ("gf_h_deadline", [_p], _i64), ("gf_h_timer", [_p, _i64], ctypes.c_int),
    ("gf_h_events", [_p, _p, _i64], _i64), ("gf_h_take", [_p, _p, _i64], _i64),
    ("gf_h_ops", [], _p),
))  # fmt: skip
PATH = native.COMPILED if _LIB is not None else native.PYTHON


class StreamState(NamedTuple):
    base: int
    next_seq: int
    idle: bool


def unsuitable(own: WorkerEngine) -> str | None:
    """Why the native host cannot serve ``own``'s job (None: it can)."""
    if _LIB is None:
        return f"not available: {WHY_NOT}"
    if type(own.route) not in _ROUTES:
        return f"route {type(own.route).__name__} is not a switch's"
    if own.cfg.group or own.cfg.helping >= 0 or own.cap is not None:
        return "a rack's layer or a shadow stream: the host's own stream configures it"
    if own.next_seq != own.cfg.first_seq or not own.idle:
        return "the engine has been used already"
    return None


HOSTS: Final = ("auto", "native", "python")


def check_path(path: str) -> None:
    """A config's choice of host: one of ``HOSTS``."""
    if path not in HOSTS:
        raise ConfigError("host", f"one of {', '.join(HOSTS)}, got {path!r}")


def host(
    own: WorkerEngine, token: bytes, sink: I64, path: str = "auto"
) -> NativeHost | ReferenceHost:
    """``own``'s host: ``native`` (C; a ``ConfigError`` saying why where it
    cannot serve), ``python`` (the reference) or ``auto``: native where it can."""
    check_path(path)
    if path == "python" or (path == "auto" and unsuitable(own) is not None):
        return ReferenceHost(own, token, sink)
    return NativeHost(own, token, sink)


def _check_push(values: I32, priority: int, stream: int) -> None:
    """What both hosts refuse before a push: the reference would fail later, on the wire."""
    if values.dtype != np.int32 or values.ndim != 1:
        raise ValueError(f"values: a 1-d int32 array, got {values.dtype} of {values.ndim} dims")
    if not 0 <= priority <= 255:
        raise ValueError(f"priority must be in 0..255, got {priority}")
    if stream < OWN:
        raise ConfigError("helping", "must name another worker of the job (or -1)")


def _sink_seqs(sink: I64, vpp: int) -> int:
    if sink.dtype != np.int64 or not sink.flags.c_contiguous or not sink.flags.writeable:
        raise ValueError("the sink: a writable, contiguous int64 array")
    return len(sink) // vpp


class ReferenceHost(Port):
    """``HostEngine`` behind the datagram interface (see the module doc); its
    actions go through the one dispatcher (``proto.dispatch.Port``), which
    here queues what is sent and turns the rest into events."""

    path: Final = native.PYTHON

    def __init__(self, own: WorkerEngine, token: bytes, sink: I64) -> None:
        Port.__init__(self)  # (no engine attached: the driver owns the timer)
        self.host, self.token, self.sink = HostEngine(own), token, sink
        self.vpp = own.cfg.values_per_packet
        self.seqs = _sink_seqs(sink, self.vpp)
        self._tx: list[bytes] = []
        self._events: list[Event] = []
        self._timing = OWN  # the stream whose timer's actions are being dispatched
        self.on_deliver = lambda d: self._deliver(d.seq, d.pkt)
        self.on_help = lambda r: self._events.append((HELP, r.straggler, r.from_seq))
        self.sock: socket.socket | None = None
        self.switch: Address | None = None

    def _stream(self, stream: int) -> WorkerEngine:
        return self.host.own if stream == OWN else self.host.shadow(stream)

    # -- the dispatcher's driver side ------------------------------------------
    def send(self, dst: str, pkt: Packet) -> None:
        self._tx.append(seal(self.token, pkt))

    def on_fail(self, fail: Fail) -> None:
        self._events.append((FAIL, self._timing, 0))

    def _deliver(self, seq: int, pkt: Packet) -> None:
        if seq >= self.seqs:
            return
        if pkt.flags & Flag.FLOAT or pkt.payload is None:
            self._events.append((RESULT, seq, -1))
            return
        n = min(pkt.count, self.vpp)
        self.sink[seq * self.vpp : seq * self.vpp + n] = pkt.payload[:n]
        self._events.append((RESULT, seq, n))

    def push(
        self, values: I32, now_ns: int, at_seq: int | None = None, priority: int = 0,
        stream: int = OWN,
    ) -> None:  # fmt: skip
        _check_push(values, priority, stream)
        e = self._stream(stream)
        self.execute(e.push(len(values), now_ns, values.copy(), priority, at_seq))

    def state(self, stream: int = OWN) -> StreamState:
        e = self._stream(stream)
        return StreamState(e.base, e.next_seq, e.idle)

    def skip_to(self, stream: int, seq: int) -> None:
        self._stream(stream).skip_to(seq)

    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        try:
            pkt = unseal(data, self.token)
        except ProtocolError as e:
            self.host.counters[drop_reason(e)] += 1
            return
        self.execute(self.host.on_packet(pkt, now_ns))

    def datagrams_to_send(self, now_ns: int) -> list[bytes]:
        out, self._tx = self._tx, []
        return out

    def get_timer(self) -> int | None:
        return self.host.next_deadline()

    def handle_timer(self, now_ns: int) -> None:
        """``HostEngine.on_timer``, stream by stream (a give-up names its stream)."""
        d = self.host.next_deadline()
        if d is None or d > now_ns:
            return
        for s, e in [(OWN, self.host.own), *self.host.shadows.items()]:
            self._timing = s
            self.execute(e.on_timer(now_ns))

    def events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def counters(self, stream: int = OWN) -> Counters:
        """A stream's counters (none for a shadow never made: asking makes none)."""
        e = self.host.own if stream == OWN else self.host.shadows.get(stream)
        return Counters() if e is None else e.counters

    # -- on a socket (HostDriver) --------------------------------------------
    def serve_on(self, sock: socket.socket, switch: Address) -> None:
        self.sock, self.switch = sock, switch

    def drain(self) -> None:
        assert self.sock is not None
        for _ in range(256):  # then the loop runs the rest
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            self.receive_datagram(data, time.monotonic_ns())
        self.flush()

    def flush(self) -> None:
        assert self.sock is not None and self.switch is not None
        for d in self.datagrams_to_send(time.monotonic_ns()):
            try:
                self.sock.sendto(d, self.switch)
            except OSError:  # a full buffer: a loss, repaired as any other
                self.host.counters["drop_tx_full"] += 1

    def close(self) -> None:
        pass


class NativeHost:
    """``ReferenceHost`` in C (see the module doc). ``own`` only configures it."""

    path: Final = native.COMPILED

    def __init__(self, own: WorkerEngine, token: bytes, sink: I64) -> None:
        why = unsuitable(own)
        if why is not None:
            raise ConfigError("native", f"the native host cannot serve this job: {why}")
        assert _LIB is not None
        self.lib, cfg, route = _LIB, own.cfg, own.route
        self.vpp, self.sink, self.job = cfg.values_per_packet, sink, cfg.job_id
        self.fan_in = cfg.fan_in
        seqs = _sink_seqs(sink, self.vpp)
        self.h = self.lib.gf_h_new(
            cfg.job_id, cfg.worker_id, cfg.fan_in, _ROUTES[type(route)],
            getattr(route, "slot_base", 0), getattr(route, "slot_count", 0),
            getattr(route, "pool_slots", 0), int(route.resend_flag), cfg.rto_ns,
            cfg.max_retries, cfg.fast_retransmit, int(own.ecn_window), int(cfg.nack),
            cfg.max_ahead, cfg.window, own.max_cwnd, self.vpp, token, cfg.first_seq,
        )  # fmt: skip
        if not self.h:
            raise ConfigError("native", "the native host refused the job's parameters")
        self.lib.gf_h_sink(self.h, sink.ctypes.data, seqs)
        self.ops = int(self.lib.gf_h_ops())
        self._counters: dict[int, Counters] = {}
        self._st = np.zeros(4, np.int64)
        self._ev = np.zeros(3 * 256, np.int64)
        self._buf = ctypes.create_string_buffer(1 << 22)
        self.book: UdpBook | None = None
        self.fd = -1

    def push(
        self, values: I32, now_ns: int, at_seq: int | None = None, priority: int = 0,
        stream: int = OWN,
    ) -> None:  # fmt: skip
        _check_push(values, priority, stream)
        self._open()
        v = np.ascontiguousarray(values)
        at = -1 if at_seq is None else at_seq
        r = self.lib.gf_h_push(self.h, stream, v.ctypes.data, len(v), now_ns, priority, at)
        if r == -2:
            raise ValueError(f"at_seq {at_seq} is behind the stream's next sequence")
        if r == -3:
            raise ConfigError("helping", "must name another worker of the job (or -1)")
        if r:
            raise MemoryError("the native host's buffers")

    def _open(self) -> None:
        if not self.h:
            raise RuntimeError("the native host is closed")

    def state(self, stream: int = OWN) -> StreamState:
        self._open()
        if self.lib.gf_h_state(self.h, stream, self._st.ctypes.data):
            raise ConfigError("helping", "must name another worker of the job (or -1)")
        s = self._st
        return StreamState(int(s[0]), int(s[1]), bool(s[2]))

    def skip_to(self, stream: int, seq: int) -> None:
        self._open()
        if self.lib.gf_h_skip_to(self.h, stream, seq):
            raise ValueError("skip_to needs an idle stream and a later sequence")

    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        self._open()
        if self.lib.gf_h_datagram(self.h, data, len(data), now_ns):
            raise MemoryError("the native host's buffers")

    def datagrams_to_send(self, now_ns: int) -> list[bytes]:
        self._open()
        return taken(lambda: self.lib.gf_h_take(self.h, self._buf, len(self._buf)), self._buf)

    def get_timer(self) -> int | None:
        self._open()
        d = int(self.lib.gf_h_deadline(self.h))
        return None if d < 0 else d

    def handle_timer(self, now_ns: int) -> None:
        d = self.get_timer()
        if d is not None and d <= now_ns and self.lib.gf_h_timer(self.h, now_ns) < 0:
            raise MemoryError("the native host's buffers")

    def events(self) -> list[Event]:
        self._open()
        out: list[Event] = []
        while n := int(self.lib.gf_h_events(self.h, self._ev.ctypes.data, len(self._ev) // 3)):
            ev = self._ev[: 3 * n].tolist()
            out += [(k, a, 0 if k == FAIL else b) for k, a, b in zip(*[iter(ev)] * 3, strict=True)]
        return out

    def counters(self, stream: int = OWN) -> Counters:
        """A stream's counters, the C ones moved into the reference's names."""
        c = self._counters.setdefault(stream, Counters())
        ptr = self.lib.gf_h_counters(self.h, stream) if self.h else None
        for i, name in enumerate(COUNTERS):
            if ptr and ptr[i]:
                c[name] += ptr[i]
                ptr[i] = 0
        if stream == OWN and self.book is not None:
            self.book.fold(c)
        return c

    # -- on a socket (HostDriver) --------------------------------------------
    def serve_on(self, sock: socket.socket, switch: Address) -> None:
        self.book = UdpBook(self.ops, self.h)
        self.book.job(self.job, 1, {0: sockaddr(sock, switch)})  # the switch: rank 0
        self.fd = sock.fileno()

    def drain(self) -> None:
        self._open()
        assert self.book is not None
        self.book.drain(self.fd)

    def flush(self) -> None:
        self._open()
        assert self.book is not None
        self.book.flush(self.fd)

    def close(self) -> None:
        """Free the C host (its counters stay readable)."""
        if self.h:
            for s in (OWN, *range(self.fan_in)):  # every stream made: its counters kept
                if self.lib.gf_h_counters(self.h, s):
                    self.counters(s)
            if self.book is not None:
                self.book.close()
                self.book = None
            self.lib.gf_h_free(self.h)
            self.h = None


class HostDriver:
    """A host on a UDP socket, served from the running asyncio loop: the
    socket read and answered when readable, the streams' timers, each
    event handed to the application (``on_result(seq, count)``,
    ``on_help(straggler, from_seq)``). ``gave_up`` completes with the
    stream that gave up on the switch, or with the exception a callback
    (or the host) raised: the driver's timers and reads go on, and every
    event is still handed over. ``call_at`` takes the loop's clock for
    ``time.monotonic``'s, as asyncio's own loops keep it."""

    def __init__(
        self, host: NativeHost | ReferenceHost, sock: socket.socket, switch: Address,
        on_result: Callable[[int, int], None], on_help: Callable[[int, int], None],
    ) -> None:  # fmt: skip
        self.host, self.sock = host, sock
        self.on_result, self.on_help = on_result, on_help
        self.loop = asyncio.get_running_loop()
        self.gave_up: asyncio.Future[int] = self.loop.create_future()
        self.timer_at: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        sock.setblocking(False)
        host.serve_on(sock, switch)
        self.loop.add_reader(sock.fileno(), self._readable)

    def push(
        self, values: I32, at_seq: int | None = None, stream: int = OWN, priority: int = 0
    ) -> None:
        try:
            self.host.push(values, time.monotonic_ns(), at_seq, priority, stream)
            self.host.flush()
        finally:
            self._after()

    def _readable(self) -> None:
        self._guarded(self.host.drain)

    def _fire(self, when: int) -> None:
        if when != self.timer_at or self.closed:
            return
        self.timer_at = None
        self._guarded(lambda: (self.host.handle_timer(time.monotonic_ns()), self.host.flush()))

    def _guarded(self, step: Callable[[], object]) -> None:
        """A wake-up's work; what it raises goes to ``gave_up``, not the loop."""
        try:
            step()
        except Exception as e:  # handed to whoever waits on the job
            self._fail(e)
        self._after()

    def _fail(self, e: Exception) -> None:
        if not self.gave_up.done():
            self.gave_up.set_exception(e)

    def _after(self) -> None:
        if self.closed:
            return
        for kind, a, b in self.host.events():  # every one handed over, whatever one raises
            try:
                if kind == RESULT:
                    self.on_result(a, b)
                elif kind == HELP:
                    self.on_help(a, b)
                elif not self.gave_up.done():
                    self.gave_up.set_result(a)
            except Exception as e:  # handed to whoever waits on the job
                self._fail(e)
            if self._stopped():  # a callback closed the driver
                return
        d = self.host.get_timer()
        if d is not None and (self.timer_at is None or d < self.timer_at):
            self.timer_at = d
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(d / 1e9, self._fire, d)

    def _stopped(self) -> bool:
        return self.closed

    def close(self) -> None:
        """Stop serving and free the host (its counters stay readable); again: nothing."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if not self.gave_up.done():
            self.gave_up.cancel()
        self.loop.remove_reader(self.sock.fileno())
        self.host.close()
        self.sock.close()
