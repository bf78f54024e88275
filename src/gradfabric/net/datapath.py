"""The native worker node (``net/native/worker.c``) and the worker's driver.

``NativeWorkerNode`` is a second implementation of
``proto.worker_node.WorkerNode`` for a worker that takes no help on a route
of one destination (SwitchML's static slots, ATP's and ESA's hashed pool, a
parameter server): the same calls (``push``, ``replay``, ``done``,
``base``), the same datagram interface and the same counters under the same
names, held equal to the reference datagram for datagram by the
differential harness (``tests/property/test_differential.py``). The engine
is one C object; nothing outside it reads or writes its state but through
these functions, and no call hands state from one implementation to the
other: ``unsuitable`` says, before a node is built, which one serves.

``run`` is the worker's driver: the calling thread serves its node's
collective on its UDP socket (and the job's multicast group's) until it is
done, aborted, past its deadline or given up. For the native node that
loop is C (``udp.c``'s ``gf_udp_run``, batched reads and writes, the GIL
released); for the reference node it is the same loop in Python. Both wait
for the next datagram, the node's deadline or its read period, and send
what the node lets leave.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.errors import ConfigError, ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.net.udp import Address, sockaddr
from gradfabric.proto.actions import Fail
from gradfabric.proto.routes import HashedPool, Sharded, StaticSlots
from gradfabric.proto.worker import ResumableWorker
from gradfabric.proto.worker_node import Fused, WorkerNode
from gradfabric.wire import fastquant

HERE = Path(__file__).parent
SOURCES = [HERE / "native" / f for f in ("worker.c", "worker.h", "wire.h")]
COUNTERS: Final = (
    "results", "retransmits", "fast_retransmits", "drop_duplicate_result", "drop_foreign",
    "ecn_halvings", "drop_malformed", "drop_bad_token", "timer_rearmed", "nack_resends",
    "drop_stale_nack", "replays", "replay_answered", "replays_retired",
)  # fmt: skip (worker.h's order)
DRIVER_COUNTERS: Final = (
    "native_tx_datagrams", "native_rx_datagrams", "native_syscalls", "socket_error",
    "native_gso_sends", "native_gro_reads",
)  # fmt: skip (udp.c's)
DONE, ABORTED, TIMEOUT, FAILED, OUT_OF_MEMORY = range(5)
_ROUTES: Final = {StaticSlots: 0, HashedPool: 1, Sharded: 2}
READ_BATCH: Final = 32
ABORT_CHECK_S: Final = 0.01  # how often a waiting run looks at its abort flag

_i64, _f64, _p, _i32p = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p
_LIB, WHY_NOT = native.load(HERE / "_worker", SOURCES, (
    ("gf_w_new", [_i64] * 15 + [_f64, _f64, ctypes.c_char_p, _i64], _p),
    ("gf_w_free", [_p], None),
    ("gf_w_counters", [_p], ctypes.POINTER(_i64)), ("gf_w_state", [_p, _p], None),
    ("gf_w_set_priority", [_p, _i64], None),
    ("gf_w_push", [_p, _p, _p, _i64, _i64, _p, _p, _p, _p, _p, _p], ctypes.c_int),
    ("gf_w_replay", [_p, _i64, _i64], ctypes.c_int),
    ("gf_w_datagram", [_p, ctypes.c_char_p, _i64, _i64], ctypes.c_int),
    ("gf_w_deadline", [_p], _i64), ("gf_w_timer", [_p, _i64], ctypes.c_int),
    ("gf_w_read_wait", [_p, _i64], _i64), ("gf_w_take", [_p, _p, _i64, _i64], _i64),
    ("gf_w_ops", [], _p),
))  # fmt: skip
_UDP, UDP_WHY_NOT = native.load(HERE / "_udp", [HERE / "native" / "udp.c", HERE / "native" /
                                                 "wire.h"], (
    ("gf_udp_run", [_p, _p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, _i64,
                    _i64, _p, ctypes.c_int, _p], ctypes.c_int),
    ("gf_udp_offload", [ctypes.c_int, ctypes.c_int], ctypes.c_int),
    ("gf_udp_send", [ctypes.c_int, ctypes.c_char_p, _i64, ctypes.c_char_p, _p, _i64, _p], None),
    ("gf_udp_take", [ctypes.c_int, _p, _i64, _p, _i64, _p], _i64),
))  # fmt: skip
if _LIB is not None and _UDP is None:
    _LIB, WHY_NOT = None, f"its driver: {UDP_WHY_NOT}"
PATH = native.COMPILED if _LIB is not None else native.PYTHON


OFFLOAD_ENV: Final = "GRADFABRIC_OFFLOAD"  # "0": the native driver sends and reads plainly


def offload(sock: socket.socket) -> dict[str, bool]:
    """Turn on Linux's UDP offloads for the native driver on ``sock``:
    receive coalescing there (UDP_GRO) and segmented sends (UDP_SEGMENT) for
    the process, unless ``GRADFABRIC_OFFLOAD=0``; what it got. Only a socket
    that the native driver alone reads may have them: the reference reads
    datagram by datagram and would take a coalesced train for one."""
    if _UDP is None:
        return {"gro": False, "gso": False}
    want = os.environ.get(OFFLOAD_ENV, "1") != "0"
    bits = int(_UDP.gf_udp_offload(sock.fileno(), int(want)))
    return {"gro": bool(bits & 1), "gso": bool(bits & 2)}


def send_datagrams(sock: socket.socket, to: Address, datagrams: list[bytes]) -> dict[str, int]:
    """Send ``datagrams`` to ``to`` as the native drivers send (a run of one
    length to one place segmented, where ``offload`` turned it on); the
    driver's counts. For the differential tests of the offloads."""
    assert _UDP is not None, UDP_WHY_NOT
    lens = np.array([len(d) for d in datagrams], np.int64)
    c = np.zeros(4, np.int64)
    raw = sockaddr(sock, to)
    _UDP.gf_udp_send(sock.fileno(), raw, len(raw), b"".join(datagrams), lens.ctypes.data,
                     len(datagrams), c.ctypes.data)  # fmt: skip
    return dict(zip(("sent", "refused", "syscalls", "segmented"), c.tolist(), strict=True))


def take_datagrams(sock: socket.socket, most: int = 1024) -> tuple[list[bytes], int]:
    """One read of what ``sock`` holds, cut into datagrams as the native
    drivers cut a coalesced message before their engine sees it; and how
    many messages were coalesced."""
    assert _UDP is not None, UDP_WHY_NOT
    out = np.zeros(most * 2**16, np.uint8)
    lens = np.zeros(most, np.int64)
    coalesced = np.zeros(1, np.int64)
    n = int(_UDP.gf_udp_take(sock.fileno(), out.ctypes.data, out.size, lens.ctypes.data, most,
                             coalesced.ctypes.data))  # fmt: skip
    ends = np.cumsum(lens[:n])
    got = [out[e - k : e].tobytes() for e, k in zip(ends, lens[:n], strict=True)]
    return got, int(coalesced[0])


def taken(take: Callable[[], int], buf: ctypes.Array[ctypes.c_char]) -> list[bytes]:
    """The datagrams a native engine's ``take`` writes into ``buf``, each a
    u32 length and its bytes, taken until a call leaves half of it unused
    (a driver in Python, and the differential harness)."""
    out: list[bytes] = []
    while True:
        size = int(take())
        raw, at = buf.raw[:size], 0
        while at < size:
            n = int.from_bytes(raw[at : at + 4], "little")
            out.append(raw[at + 4 : at + 4 + n])
            at += 4 + n
        if size < len(buf) // 2:
            return out


def unsuitable(engine: ResumableWorker) -> str | None:
    """Why the native node cannot serve ``engine``'s job (None: it can)."""
    if _LIB is None:
        return f"not available: {WHY_NOT}"
    route = engine.route
    if type(route) not in _ROUTES or (isinstance(route, Sharded) and len(route.servers) != 1):
        return f"route {type(route).__name__} is not one of one destination"
    if engine.cfg.helping >= 0 or engine.cfg.max_ahead != 0 or engine.cap is not None:
        return "the worker takes or gives help (SA-ATP)"
    if engine.next_seq != engine.cfg.first_seq or not engine.idle:
        return "the engine has been used already"
    return None


class NativeWorkerNode:
    """``proto.worker_node.WorkerNode`` for ``engine``'s job, in C (see the
    module doc). ``engine`` only configures it: it is not driven."""

    def __init__(
        self, engine: ResumableWorker, token: bytes, priority: int = 0, pace_gbps: float = 0.0
    ) -> None:
        why = unsuitable(engine)
        if why is not None:
            raise ConfigError("native", f"the native worker cannot serve this job: {why}")
        if pace_gbps < 0:
            raise ValueError(f"pace_gbps must be >= 0, got {pace_gbps}")
        assert _LIB is not None
        self.lib, cfg, route = _LIB, engine.cfg, engine.route
        self.vpp = cfg.values_per_packet
        self.w = self.lib.gf_w_new(
            cfg.job_id, cfg.worker_id, cfg.fan_in, _ROUTES[type(route)],
            getattr(route, "slot_base", 0), getattr(route, "slot_count", 0),
            getattr(route, "pool_slots", 0), int(route.resend_flag), cfg.rto_ns,
            cfg.max_retries, cfg.fast_retransmit, int(engine.ecn_window), self.vpp,
            int(cfg.nack), cfg.window, engine.max_cwnd, pace_gbps, token, cfg.first_seq,
        )  # fmt: skip
        if not self.w:
            raise ConfigError("native", "the native worker refused the job's parameters")
        self.lib.gf_w_set_priority(self.w, priority)
        self.ops = int(self.lib.gf_w_ops())
        self.counters = Counters()
        self._state = np.zeros(7, np.int64)
        self._keep: tuple[object, ...] = ()  # the call's arrays, alive while C points into them
        self._buf = ctypes.create_string_buffer(1 << 22)
        self.rto_ns, self.max_retries = cfg.rto_ns, cfg.max_retries

    def close(self) -> None:
        """Free the C node (its counters stay readable)."""
        if self.w:
            self.fold()
            self.lib.gf_w_free(self.w)
            self.w = None

    def set_priority(self, priority: int) -> None:
        self.lib.gf_w_set_priority(self.w, priority)

    # -- as WorkerNode's -------------------------------------------------------
    def push(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64], now_ns: int,
        fused: Fused | None = None,
    ) -> None:  # fmt: skip
        if q.dtype != np.int32 or out.dtype != np.int64 or len(out) != len(q) or not len(q):
            raise ValueError("q: a non-empty int32 array; out: int64 of the same length")
        if not (q.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("q and out: contiguous arrays, out writable")
        x = enc = dec = outf = None
        fns: tuple[int, int] | tuple[None, None] = (None, None)
        if fused is not None:
            n = -(-len(q) // self.vpp)
            f = fused
            funcs = fastquant.functions()
            if funcs is None or not q.flags.writeable:
                raise ValueError("the fused quantiser needs the C quantiser and a writable q")
            if not (len(f.x) == len(f.out) == len(q) and len(f.enc_scale) == len(f.dec_scale)
                    == n and f.x.dtype == np.float32 and f.out.dtype == np.float32
                    and f.enc_scale.dtype == f.dec_scale.dtype == np.float64
                    and all(a.flags.c_contiguous for a in (f.x, f.out, f.enc_scale,
                                                           f.dec_scale))):  # fmt: skip
                raise ValueError("fused: x, out float32 of q's length; a float64 scale per packet")
            x, enc, dec, outf = (a.ctypes.data for a in (f.x, f.enc_scale, f.dec_scale, f.out))
            fns = funcs
        r = self.lib.gf_w_push(self.w, q.ctypes.data, out.ctypes.data, len(q), now_ns, x, enc,
                               dec, outf, *fns)  # fmt: skip
        if r == -2:
            raise ValueError("the previous collective has not finished")
        if r:
            raise MemoryError("the native worker's buffers")
        self._keep = (q, out, fused)

    def replay(self, floor: int, now_ns: int) -> None:
        if self.lib.gf_w_replay(self.w, floor, now_ns):
            raise MemoryError("the native worker's buffers")

    def _read_state(self) -> npt.NDArray[np.int64]:
        self.lib.gf_w_state(self.w, self._state.ctypes.data)
        return self._state

    @property
    def base(self) -> int:
        return int(self._read_state()[0])

    @property
    def next_seq(self) -> int:
        return int(self._read_state()[1])

    @property
    def done(self) -> bool:
        return bool(self._read_state()[2])

    @property
    def quiet(self) -> bool:
        return bool(self._read_state()[3])

    @property
    def failed(self) -> Fail | None:
        """The give-up, as the reference's ``Fail`` (its peer: the one route)."""
        s = int(self._read_state()[4])
        if s < 0:
            return None
        return Fail("switch", f"sequence {s} unanswered after {self.max_retries} retries",
                    self.rto_ns * (self.max_retries + 1))  # fmt: skip

    @property
    def error(self) -> ProtocolError | None:
        st = self._read_state()
        seq, kind = int(st[5]), int(st[6])
        if seq < 0:
            return None
        if kind == 1:
            return ProtocolError(f"result {seq} left the integer domain")
        return ProtocolError(f"result {seq} carries another count than was sent")

    def fold(self) -> Counters:
        """The C counters, moved into ``counters`` (the reference's names)."""
        if not self.w:
            return self.counters
        ptr = self.lib.gf_w_counters(self.w)
        for i, name in enumerate(COUNTERS):
            if ptr[i]:
                self.counters[name] += ptr[i]
                ptr[i] = 0
        return self.counters

    # -- the datagram interface --------------------------------------------------
    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        if self.lib.gf_w_datagram(self.w, data, len(data), now_ns):
            raise MemoryError("the native worker's buffers")

    def datagrams_to_send(self, now_ns: int) -> list[bytes]:
        return taken(lambda: self.lib.gf_w_take(self.w, self._buf, len(self._buf), now_ns),
                     self._buf)  # fmt: skip

    def get_timer(self) -> int | None:
        d = int(self.lib.gf_w_deadline(self.w))
        return None if d < 0 else d

    def handle_timer(self, now_ns: int) -> None:
        d = self.get_timer()
        if d is not None and d <= now_ns:
            r = self.lib.gf_w_timer(self.w, now_ns)
            if r < 0:
                raise MemoryError("the native worker's buffers")

    def read_wait_ns(self, now_ns: int) -> int:
        return int(self.lib.gf_w_read_wait(self.w, now_ns))


Node = WorkerNode | NativeWorkerNode


def run(
    node: Node, sock: socket.socket, peer: bytes | tuple[str, int], deadline_ns: int,
    abort: ctypes.c_int32, group: socket.socket | None = None, quiet: bool = False,
    counters: Counters | None = None,
) -> int:  # fmt: skip
    """Serve ``node`` on ``sock`` (results also on ``group``, the job's
    multicast socket) until its collective is done (``quiet``: and nothing
    is outstanding): ``DONE``; or ``abort`` is raised (``ABORTED``),
    ``deadline_ns`` passes (``TIMEOUT``), it gives up on its peer
    (``FAILED``). ``peer``: the switch, as a raw sockaddr (the native
    driver's) or an address. The driver's counters go to ``counters``."""
    if isinstance(node, NativeWorkerNode):
        assert isinstance(peer, bytes)
        rc = run_native(node.ops, node.w, sock, -1 if group is None else group.fileno(), -1,
                        peer, deadline_ns, abort, quiet, counters)  # fmt: skip
        node.fold()
        return rc
    return _run_python(node, sock, peer, deadline_ns, abort, group, quiet, counters)


def run_native(
    ops: int, engine: int, sock: socket.socket, group_fd: int, wake_fd: int, peer: bytes,
    deadline_ns: int, abort: ctypes.c_int32, quiet: bool, counters: Counters | None,
) -> int:  # fmt: skip
    """``udp.c``'s ``gf_udp_run``: any native engine (``ops``, its
    ``gf_ops``) served on ``sock`` until it is done, with the GIL released;
    its return code as ``run``'s. ``wake_fd``: an eventfd whose write sends
    what another thread gave the engine (-1: none)."""
    assert _UDP is not None
    c = np.zeros(len(DRIVER_COUNTERS), np.int64)
    rc = int(_UDP.gf_udp_run(ops, engine, sock.fileno(), group_fd, wake_fd, peer, len(peer),
                             deadline_ns, ctypes.addressof(abort), int(quiet),
                             c.ctypes.data))  # fmt: skip
    if counters is not None:
        for name, v in zip(DRIVER_COUNTERS, c.tolist(), strict=True):
            counters[name] += v
    return rc


def _run_python(
    node: Node, sock: socket.socket, peer: bytes | tuple[str, int], deadline_ns: int,
    abort: ctypes.c_int32, group: socket.socket | None, quiet: bool, counters: Counters | None,
) -> int:  # fmt: skip
    """``run``'s loop in Python (the reference node's driver)."""
    assert isinstance(node, WorkerNode)
    c = counters if counters is not None else Counters()
    fds = [sock] if group is None else [sock, group]
    poller = select.poll()
    for s in fds:
        poller.register(s, select.POLLIN)

    def send_all() -> None:
        for data in node.datagrams_to_send(time.monotonic_ns()):
            while True:
                try:
                    sock.sendto(data, peer)
                    break
                except BlockingIOError:
                    select.select([], [sock], [], 0.001)
                except OSError:
                    c["socket_error"] += 1
                    break

    send_all()
    while not (node.quiet if quiet else node.done):
        if abort.value:
            return ABORTED
        now = time.monotonic_ns()
        if now >= deadline_ns:
            return TIMEOUT
        d = node.get_timer()
        if d is not None and d <= now:
            node.handle_timer(now)
            if node.failed is not None:
                return FAILED
            send_all()
            continue
        wait = min(deadline_ns - now, ABORT_CHECK_S * 1e9)
        if d is not None:
            wait = min(wait, d - now)
        every = node.read_wait_ns(now)
        if every:
            time.sleep(min(wait, every) / 1e9)
            ready = fds
        else:
            events = dict(poller.poll(wait / 1e6))
            ready = [s for s in fds if s.fileno() in events]
        for s in ready:
            for _ in range(READ_BATCH):
                try:
                    data = s.recv(65_536)
                except BlockingIOError:
                    break
                except OSError:
                    c["socket_error"] += 1
                    break
                node.receive_datagram(data, time.monotonic_ns())
        send_all()
    return DONE
