"""The workers' native datapath: a ``ResumableWorker``'s collective in C.

A sum through the switch costs a worker a few Python calls per datagram
(decode, engine, encode, the event loop), which on 64 KB datagrams was most
of its CPU besides the quantiser (NOTEBOOK.md). ``_datapath.c`` runs the
same engine over the same socket for one whole collective: batched reads
and writes (recvmmsg, sendmmsg), each datagram gathered from a header and
the int32 tensor in place, results written straight into the int64 sum, the
clock and the waiting in C with the GIL released (ctypes releases it).

One protocol, one truth: the C core mirrors ``proto.worker`` line by line
(see the theory of operation at the top of ``_datapath.c``) and is sans-I/O
like it, so ``tests/property/test_datapath.py`` drives both with the same
seeded datagrams and times and requires the same datagrams out, counters,
sums and final state. The Python engine stays the one the simulator runs and
the one that serves wherever the library is not built (``GRADFABRIC_PURE``,
no compiler): ``PATH`` says which (``gradfabric --version``).

The engine's state is the reference's at every call boundary: ``start``
reads the window, the fast-retransmit marks and the next sequence from the
engine, ``finish`` writes them back together with whatever is still
outstanding, unsent or answered (as ``out``, ``timers``, ``queue``,
``done_above`` and ``kept``), so the Python engine can take a call over
midway (after a switch restart it replays; after a timeout it keeps
retransmitting, exactly as if it had served the call from the start).

Serves a worker that takes no help (SA-ATP's helped workers and shadow
streams stay on the reference) on a route of one destination: SwitchML's
static slots, ATP's and ESA's hashed pool, a parameter server.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.errors import ProtocolError
from gradfabric.proto.routes import HashedPool, Sharded, StaticSlots
from gradfabric.proto.worker import ResumableWorker
from gradfabric.wire import fastquant
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import Flag, Packet, ina_packet

SOURCE = Path(__file__).with_name("_datapath.c")
# The C core's counters, in its order; the first twelve are the reference engine's.
COUNTERS: Final = (
    "results", "retransmits", "fast_retransmits", "drop_duplicate_result", "drop_foreign",
    "ecn_halvings", "drop_malformed", "drop_bad_token", "socket_error", "timer_rearmed",
    "nack_resends", "drop_stale_nack",
    "native_tx_datagrams", "native_rx_datagrams", "native_syscalls",
)  # fmt: skip
ENGINE_COUNTERS: Final = COUNTERS[:12]
UNSENT, OUTSTANDING, DONE = 0, 1, 2
DONE_RUN, ABORTED, TIMEOUT, FAILED, OUT_OF_MEMORY = range(5)
_ROUTES: Final = {StaticSlots: 0, HashedPool: 1, Sharded: 2}

_i64, _f64, _p = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class _Worker(ctypes.Structure):
    """``gf_worker`` of ``_datapath.c``, field for field."""

    _fields_ = [
        *((n, _i64) for n in (
            "job", "worker", "fan_in", "bitmap", "priority", "route", "slot_base", "slot_count",
            "pool_slots", "resend_flag", "rto_ns", "max_retries", "fast_k", "ecn_window", "vpp",
            "nack",
        )),
        ("max_cwnd", _f64),
        ("token", ctypes.c_uint8 * TOKEN_BYTES),
        ("first", _i64), ("npkts", _i64), ("nvalues", _i64),
        ("q", _p), ("out", _p), ("st", _p), ("deadline", _p), ("tries", _p),
        *((n, _i64) for n in (
            "base", "next", "highest", "fast_seq", "fast_from", "recover_seq", "push_end",
        )),
        ("cwnd", _f64),
        ("fail_seq", _i64), ("error_seq", _i64), ("error_kind", _i64),
        ("counters", _i64 * len(COUNTERS)),
        ("x", _p), ("enc_scale", _p), ("dec_scale", _p), ("outf", _p), ("enc", _p), ("dec", _p),
        ("fifo", _p), ("fifo_cap", _i64), ("fifo_head", _i64), ("fifo_len", _i64),
        ("outbox", _p), ("outbox_cap", _i64), ("outbox_len", _i64),
        ("rx", _p),
        ("txq", _p), ("txq_cap", _i64), ("txq_head", _i64), ("txq_len", _i64),
        ("pace_ns_per_byte", _f64), ("next_tx", _i64),
    ]  # fmt: skip


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    ref = ctypes.POINTER(_Worker)
    lib, why = native.load(SOURCE.with_suffix(""), [SOURCE], (
        ("gf_w_size", [], _i64),
        ("gf_w_init", [ref], ctypes.c_int), ("gf_w_free", [ref], None),
        ("gf_w_start", [ref, _i64], ctypes.c_int),
        ("gf_w_datagram", [ref, ctypes.c_char_p, _i64, _i64], ctypes.c_int),
        ("gf_w_deadline", [ref], _i64), ("gf_w_timer", [ref, _i64], ctypes.c_int),
        ("gf_w_take", [ref, _p, _i64], _i64),
        ("gf_w_run", [ref, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, _i64, _i64, _p],
         ctypes.c_int),
    ))  # fmt: skip
    if lib is not None and lib.gf_w_size() != ctypes.sizeof(_Worker):
        return None, "the library's worker layout differs from this module's"
    return lib, why


_LIB, WHY_NOT = _load()
PATH = native.COMPILED if _LIB is not None else native.PYTHON


def unsuitable(engine: ResumableWorker) -> str | None:
    """Why the native path cannot serve ``engine``'s next call (None: it can)."""
    if _LIB is None:
        return f"not available: {WHY_NOT}"
    route = engine.route
    if type(route) not in _ROUTES or (isinstance(route, Sharded) and len(route.servers) != 1):
        return f"route {type(route).__name__} is not one of one destination"
    if engine.cfg.helping >= 0 or engine.cfg.max_ahead != 0 or engine.cap is not None:
        return "the worker takes or gives help (SA-ATP)"
    if not engine.idle or engine.queue or engine.out or engine.replaying:
        return "the engine is mid-call or replaying"
    return None


@dataclass(frozen=True)
class Fused:
    """A float sum with the quantiser in the datapath: each packet's block of
    ``x`` is encoded with ``enc_scale`` as it first leaves, each result decoded
    with ``dec_scale`` into ``out`` as it arrives (``wire.fastquant``'s own C
    functions), so neither pass waits for the whole tensor."""

    x: npt.NDArray[np.float32]
    enc_scale: npt.NDArray[np.float64]
    dec_scale: npt.NDArray[np.float64]
    out: npt.NDArray[np.float32]


class NativeWorker:
    """``engine``'s calls through the C core; the engine stays the record."""

    def __init__(
        self, engine: ResumableWorker, token: bytes, priority: int = 0, pace_gbps: float = 0.0
    ) -> None:
        """``pace_gbps``: the rate of this worker's link where it is known; the
        driver then sends at that pace (frames included), resends ahead of new
        packets, instead of a window's burst into the link's queue (0: off)."""
        why = unsuitable(engine)
        if why is not None:
            raise ValueError(f"the native datapath cannot serve this worker: {why}")
        assert _LIB is not None
        self.lib, self.engine, self.priority = _LIB, engine, priority
        cfg, route = engine.cfg, engine.route
        w = self.w = _Worker()
        if self.lib.gf_w_init(ctypes.byref(w)):
            raise MemoryError("the native datapath's buffers")
        w.job, w.worker, w.fan_in = cfg.job_id, cfg.worker_id, cfg.fan_in
        w.bitmap, w.priority, w.route = 1 << cfg.worker_id, priority, _ROUTES[type(route)]
        if isinstance(route, StaticSlots):
            w.slot_base, w.slot_count = route.slot_base, route.slot_count
        if isinstance(route, HashedPool):
            w.pool_slots = route.pool_slots
        w.resend_flag, w.rto_ns, w.max_retries = route.resend_flag, cfg.rto_ns, cfg.max_retries
        w.fast_k, w.ecn_window, w.vpp, w.nack = (
            cfg.fast_retransmit,
            engine.ecn_window,
            cfg.values_per_packet,
            cfg.nack,
        )
        w.max_cwnd = engine.max_cwnd
        if pace_gbps < 0:
            raise ValueError(f"pace_gbps must be >= 0, got {pace_gbps}")
        w.pace_ns_per_byte = 8.0 / pace_gbps if pace_gbps else 0.0
        w.token[:] = token
        self.q: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.fused: Fused | None = None
        self.out: npt.NDArray[np.int64] = np.zeros(0, np.int64)

    def close(self) -> None:
        self.lib.gf_w_free(ctypes.byref(self.w))

    # -- a call -------------------------------------------------------------
    def start(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64], now_ns: int,
        fused: Fused | None = None,
    ) -> None:  # fmt: skip
        """Push ``q`` (its sum goes to ``out``) from the engine's next sequence;
        with ``fused``, ``q`` is filled from ``fused.x`` packet by packet."""
        e, w = self.engine, self.w
        why = unsuitable(e)
        if why is not None:
            raise ValueError(why)
        if q.dtype != np.int32 or out.dtype != np.int64 or len(out) != len(q) or not len(q):
            raise ValueError("q: a non-empty int32 array; out: int64 of the same length")
        self.q, self.out = np.ascontiguousarray(q), out
        vpp = e.cfg.values_per_packet
        n = -(-len(q) // vpp)
        self.st = np.zeros(n, np.uint8)
        self.deadline = np.zeros(n, np.int64)
        self.tries = np.zeros(n, np.int64)
        w.first, w.npkts, w.nvalues = e.next_seq, n, len(q)
        w.q, w.out = self.q.ctypes.data, out.ctypes.data
        w.st, w.deadline, w.tries = (
            self.st.ctypes.data,
            self.deadline.ctypes.data,
            self.tries.ctypes.data,
        )
        w.highest, w.fast_seq, w.fast_from = e.highest, e.fast_seq, e.fast_from
        w.recover_seq, w.cwnd = e.recover_seq, e.cwnd
        ctypes.memset(w.counters, 0, ctypes.sizeof(w.counters))
        self.fused = fused
        w.x = w.enc_scale = w.dec_scale = w.outf = w.enc = w.dec = None
        if fused is not None:
            fns, f = fastquant.functions(), fused
            if fns is None or not q.flags.writeable:
                raise ValueError("the fused quantiser needs the C quantiser and a writable q")
            if not (len(f.x) == len(f.out) == len(q) and len(f.enc_scale) == len(f.dec_scale)
                    == n and f.x.dtype == np.float32 and f.out.dtype == np.float32
                    and f.enc_scale.dtype == f.dec_scale.dtype == np.float64):  # fmt: skip
                raise ValueError("fused: x, out float32 of q's length; a float64 scale per packet")
            w.x, w.outf = f.x.ctypes.data, f.out.ctypes.data
            w.enc_scale, w.dec_scale = f.enc_scale.ctypes.data, f.dec_scale.ctypes.data
            w.enc, w.dec = fns
        if self.lib.gf_w_start(ctypes.byref(w), now_ns):
            raise MemoryError("the native datapath's buffers")

    def datagram(self, data: bytes, now_ns: int) -> None:
        if self.lib.gf_w_datagram(ctypes.byref(self.w), data, len(data), now_ns):
            raise MemoryError("the native datapath's buffers")

    def on_timer(self, now_ns: int) -> bool:
        """The due retransmissions; True if a packet ran out of them (``fail_seq``)."""
        r = self.lib.gf_w_timer(ctypes.byref(self.w), now_ns)
        if r < 0:
            raise MemoryError("the native datapath's buffers")
        return bool(r)

    def next_deadline(self) -> int | None:
        d = int(self.lib.gf_w_deadline(ctypes.byref(self.w)))
        return None if d < 0 else d

    def take(self) -> list[bytes]:
        """The datagrams queued to send, as bytes (for a driver in Python, and tests)."""
        cap = int(self.w.outbox_len) * (TOKEN_BYTES + 32 + 4 * int(self.w.vpp) + 4)
        buf = ctypes.create_string_buffer(max(cap, 1))
        size = self.lib.gf_w_take(ctypes.byref(self.w), buf, cap)
        raw, out, at = buf.raw, [], 0
        while at < size:
            n = int.from_bytes(raw[at : at + 4], "little")
            out.append(raw[at + 4 : at + 4 + n])
            at += 4 + n
        return out

    def run(
        self, fd: int, addr: bytes, wall_deadline_ns: int, abort: ctypes.c_int32,
        group_fd: int = -1,
    ) -> int:  # fmt: skip
        """Serve the started call on socket ``fd`` (its peer ``addr``, a raw
        sockaddr) until done, aborted, past ``wall_deadline_ns`` or failed;
        results also arrive on ``group_fd`` (the job's multicast group; -1: none)."""
        return int(self.lib.gf_w_run(ctypes.byref(self.w), fd, group_fd, addr, len(addr),
                                     wall_deadline_ns, ctypes.addressof(abort)))  # fmt: skip

    @property
    def done(self) -> bool:
        return bool(self.w.base >= self.w.push_end)

    def error(self) -> ProtocolError | None:
        """What the reference's delivery would have raised for this call."""
        w = self.w
        if w.error_seq < 0:
            return None
        if w.error_kind == 1:
            return ProtocolError(f"result {w.error_seq} left the integer domain")
        return ProtocolError(f"result {w.error_seq} carries another count than was sent")

    @property
    def stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in zip(COUNTERS, self.w.counters, strict=True)}

    def finish(self) -> None:
        """Write the call's state back into the engine (see the module doc)."""
        e, w = self.engine, self.w
        first, vpp = int(w.first), e.cfg.values_per_packet
        e.base, e.next_seq = int(w.base), first + int(w.npkts)
        e.highest, e.fast_seq, e.fast_from = int(w.highest), int(w.fast_seq), int(w.fast_from)
        e.recover_seq, e.cwnd = int(w.recover_seq), float(w.cwnd)
        for name, v in self.stats.items():
            if v:
                e.counters[name] += v
        if self.fused is not None and w.next < w.push_end:  # not quantised yet: now
            lo, f = (int(w.next) - first) * vpp, self.fused
            self.q[lo:] = fastquant.encode(f.x[lo:], vpp, f.enc_scale[lo // vpp :])
        e.out.clear()
        timers = []
        for i in np.flatnonzero(self.st == OUTSTANDING).tolist():
            d = int(self.deadline[i])
            e.out[first + i] = [self.packet(first + i), d, int(self.tries[i])]
            if self.tries[i] <= e.cfg.max_retries:  # else it was given up on: no timer
                timers.append((d, first + i))
        e.timers = deque(sorted(timers))
        e.queue = deque(
            (s, len(p.payload), p.payload, 0, self.priority)
            for s in (first + i for i in np.flatnonzero(self.st == UNSENT).tolist())
            if (p := self.packet(s)).payload is not None
        )
        # answered sequences, filtered in numpy: a call holds thousands, and
        # only those past base (none, once done) and the last window matter
        done = first + np.flatnonzero(self.st == DONE)
        e.done_above = set(done[done > e.base].tolist())
        low = e.base - e.keep
        e.kept = {s: p for s, p in e.kept.items() if s >= low}
        e.kept.update((s, self.packet(s)) for s in done[done >= low].tolist())

    def packet(self, seq: int) -> Packet:
        """Sequence ``seq`` of the call as the reference engine builds it."""
        e, vpp = self.engine, self.engine.cfg.values_per_packet
        lo = (seq - int(self.w.first)) * vpp
        part = self.q[lo : lo + vpp]
        c = e.cfg
        return ina_packet(
            job_id=c.job_id, worker_id=c.worker_id, seq=seq, agg_index=e.route.agg_index(seq),
            bitmap=1 << c.worker_id, fan_in=c.fan_in, priority=self.priority, count=len(part),
            values=part, flags=Flag.NACK if c.nack else 0,
        )  # fmt: skip
