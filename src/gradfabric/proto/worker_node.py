"""The worker node: an in-network aggregation worker behind one datagram interface.

Theory of operation
-------------------
``proto.worker.ResumableWorker`` is the protocol (the window, slot reuse,
retransmission timers, fast retransmit, loss notices, ATP's ECN window, the
replay after a switch restart), the engine the simulator runs too. A worker
that meets a real network needs more around it, and ``WorkerNode`` is all of
it, sans-I/O like the engine, as aioquic's connection is at its socket::

    push(q, out, now_ns, fused)         a collective: sum int32 ``q`` into int64 ``out``
    receive_datagram(data, now_ns)      a datagram from the switch (or a multicast group)
    datagrams_to_send(now_ns)           what may leave now, in order, to the one peer
    get_timer() / handle_timer(now_ns)  its one deadline: a retransmission, or the pace
    replay(floor, now_ns)               the switch restarted: resend from the agreed floor

* **The envelope**: every datagram carries the job's token; one that carries
  another is ``drop_bad_token``, one that does not decode ``drop_malformed``
  (``wire.envelope``, ``wire.packet.decode``).
* **Delivery**: a result's values go straight into ``out`` (a result in
  floats, having left the integer domain, or of another count than was sent
  is the call's ``error``); with ``fused``, each packet's block of float
  ``x`` is quantised into ``q`` when it first leaves, and each result
  decoded into float ``out`` when it arrives (``wire.fastquant``), so
  neither waits for the whole tensor.
* **Pacing** (``pace_gbps``, the rate of the worker's link where it is
  known): datagrams leave at that rate, frames included, a little ahead of
  it (``PACE_AHEAD_NS``), with ``PACE_BURST_NS`` of credit after idling;
  a resend goes ahead of every new packet waiting (the loss it repairs
  holds the window), instead of behind a window's burst in the link's
  queue. A resend is any packet of a sequence at or below the highest sent.
* **Reads**: a paced worker's results come at most at its link's rate, so
  its driver may read on a period (``read_wait_ns``) and find a batch,
  instead of waking once a datagram; not while a repair is under way (a
  resend in the last RTO), where each wait would delay the next.
* **Kept contributions**: when a call completes, the contributions the
  engine keeps for a replay are copied out of the caller's tensor, which
  the caller may reuse at once.

The native worker (``net.datapath``) is a second implementation of exactly
this node, held equal to it datagram for datagram by the differential
harness (``tests/property/test_differential.py``). What it does not
implement (SA-ATP's help, a route over several servers) the registry
serves from this one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ProtocolError
from gradfabric.proto.actions import Action, Deliver, Fail, Send
from gradfabric.proto.worker import ResumableWorker
from gradfabric.wire import quant
from gradfabric.wire.envelope import TOKEN_BYTES, drop_reason, seal, unseal
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Flag, Packet, unwrapped

FRAME_BYTES: Final = 42  # Ethernet, IPv4 and UDP headers: what a paced link carries besides
PACE_BURST_NS: Final = 100_000  # credit a paced queue keeps after idling
PACE_AHEAD_NS: Final = 300_000  # how far a paced queue may run ahead of its pace
READ_BATCH: Final = 32  # datagrams a read takes at most
READ_WAIT_MAX_NS: Final = 200_000  # the longest a paced worker leaves its sockets unread
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


def result_error(seq: int, pkt: Packet, sent: int) -> ProtocolError | None:
    """Why result ``seq`` cannot be taken (None: it can): a result is an
    integer sum of the count that was sent; anything else is the call's error."""
    if pkt.flags & Flag.FLOAT or pkt.payload is None:
        return ProtocolError(f"result {seq} left the integer domain")
    if pkt.count != sent:
        return ProtocolError(f"result {seq} carries another count than was sent")
    return None


@dataclass(frozen=True)
class Fused:
    """A float sum with the quantiser in the node: ``x`` quantised with
    ``enc_scale`` (one a packet) into ``q`` as each packet first leaves,
    each result decoded with ``dec_scale`` into ``out``."""

    x: F32
    enc_scale: F64
    dec_scale: F64
    out: F32


class WorkerNode:
    """The reference worker node (see the module doc)."""

    def __init__(
        self, engine: ResumableWorker, token: bytes, priority: int = 0, pace_gbps: float = 0.0
    ) -> None:
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a token of {TOKEN_BYTES} bytes")
        if pace_gbps < 0:
            raise ValueError(f"pace_gbps must be >= 0, got {pace_gbps}")
        self.engine, self.token, self.priority = engine, token, priority
        self.counters = engine.counters  # one set: the engine's and the envelope's
        self.ns_per_byte = 8.0 / pace_gbps if pace_gbps else 0.0
        self.vpp = engine.cfg.values_per_packet
        self._txq: deque[Packet] = deque()
        self._next_tx = 0
        self._sent = -1  # the highest sequence sent
        self._repairs = -1  # resends counted when last looked at
        self._repairing_until = 0
        self.failed: Fail | None = None
        self.error: ProtocolError | None = None
        self._first, self._n = 0, 0
        self._q: I32 = np.zeros(0, np.int32)
        self._out: I64 = np.zeros(0, np.int64)
        self._fused: Fused | None = None

    # -- the application's side ---------------------------------------------
    def push(self, q: I32, out: I64, now_ns: int, fused: Fused | None = None) -> None:
        """Sum ``q`` over the job into ``out`` (int64, ``len(q)``); with
        ``fused``, ``q`` is filled from ``fused.x`` packet by packet."""
        if not self.done:
            raise ValueError("the previous collective has not finished")
        if q.dtype != np.int32 or out.dtype != np.int64 or len(out) != len(q) or not len(q):
            raise ValueError("q: a non-empty int32 array; out: int64 of the same length")
        n = -(-len(q) // self.vpp)
        if fused is not None and not (
            len(fused.x) == len(fused.out) == len(q) and len(fused.enc_scale) == n
            and len(fused.dec_scale) == n and q.flags.writeable
        ):  # fmt: skip
            raise ValueError("fused: x and out of q's length, a scale per packet, q writable")
        self._first, self._n = self.engine.next_seq, n
        self._q, self._out, self._fused = q, out, fused
        self.error = None
        self._repairs = -1  # a call's reads start on the period (``read_wait_ns``)
        self._take(self.engine.push(len(q), now_ns, q, priority=self.priority), now_ns)

    @property
    def done(self) -> bool:
        """Every result of the last collective is in, and nothing waits to leave."""
        return self.engine.idle and not self._txq

    @property
    def quiet(self) -> bool:
        """Done, and nothing outstanding at all (a replay's included)."""
        return self.done and not self.engine.out

    @property
    def next_seq(self) -> int:
        return self.engine.next_seq

    def set_priority(self, priority: int) -> None:
        """The header priority of the next collectives (ESA preempts on it)."""
        self.priority = priority

    @property
    def base(self) -> int:
        """The oldest sequence without a result (what a restart resumes from)."""
        return self.engine.base

    def replay(self, floor: int, now_ns: int) -> None:
        """The switch restarted empty: resend what the job may need from ``floor``."""
        self._take(self.engine.replay(floor, now_ns), now_ns)

    # -- the datagram interface -----------------------------------------------
    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        try:
            pkt = unseal(data, self.token)
        except ProtocolError as e:
            self.counters[drop_reason(e)] += 1
            return
        # what can come lies within a window of base: the wire's 32 bits, unwrapped near it
        self._take(self.engine.on_packet(unwrapped(pkt, self.engine.base), now_ns), now_ns)

    def datagrams_to_send(self, now_ns: int) -> list[bytes]:
        txq, out = self._txq, []
        if not self.ns_per_byte:
            out = [self._seal(p) for p in txq]
            txq.clear()
            return out
        self._next_tx = max(self._next_tx, now_ns - PACE_BURST_NS)
        while txq and self._next_tx <= now_ns + PACE_AHEAD_NS:
            pkt = txq.popleft()
            out.append(self._seal(pkt))
            self._next_tx += int(self.ns_per_byte * self._wire_bytes(pkt))
        return out

    def get_timer(self) -> int | None:
        d = self.engine.next_deadline()
        if self._txq and self.ns_per_byte:
            pace = self._next_tx - PACE_AHEAD_NS
            d = pace if d is None else min(d, pace)
        return d

    def handle_timer(self, now_ns: int) -> None:
        d = self.engine.next_deadline()
        if d is not None and d <= now_ns:
            self._take(self.engine.on_timer(now_ns), now_ns)

    def read_wait_ns(self, now_ns: int) -> int:
        """How long the driver may leave the sockets unread (0: read on each
        arrival): the link time of half a read's batch of the largest
        datagrams, at most READ_WAIT_MAX_NS, where paced and no repair is
        under way (a resend within the last RTO)."""
        if not self.ns_per_byte:
            return 0
        c = self.counters
        repairs = c["retransmits"] + c["fast_retransmits"] + c["nack_resends"]
        if repairs != self._repairs:
            if self._repairs >= 0:
                self._repairing_until = now_ns + self.engine.cfg.rto_ns
            self._repairs = repairs
        if now_ns < self._repairing_until:
            return 0
        half = READ_BATCH // 2 * (TOKEN_BYTES + HEADER_BYTES + FRAME_BYTES + VALUE_BYTES * self.vpp)
        return min(int(half * self.ns_per_byte), READ_WAIT_MAX_NS)

    # -- inside ------------------------------------------------------------------
    def _take(self, actions: list[Action], now_ns: int) -> None:
        """The engine's actions: sends queued (resends first, where paced),
        results delivered, a give-up kept."""
        for a in actions:
            if isinstance(a, Send):
                self._queue(a.pkt)
            elif isinstance(a, Deliver):
                self._deliver(a.seq, a.pkt)
            elif isinstance(a, Fail) and self.failed is None:
                self.failed = a
        if self.engine.idle and self._n:  # complete: the caller may reuse ``q`` now
            self.engine.own_kept()
            self._n = 0

    def _queue(self, pkt: Packet) -> None:
        if pkt.seq > self._sent:  # a new packet: quantised now, with the fused quantiser
            self._sent = pkt.seq
            f = self._fused
            if f is not None:
                i = pkt.seq - self._first
                lo, hi = i * self.vpp, i * self.vpp + pkt.count
                self._q[lo:hi] = quant.encode_block(f.x[lo:hi], f.enc_scale[i])
            self._txq.append(pkt)
        elif self.ns_per_byte:
            self._txq.appendleft(pkt)
        else:
            self._txq.append(pkt)

    def _deliver(self, seq: int, pkt: Packet) -> None:
        """A result into ``out`` (``runtime.client``'s rule, which the native
        node keeps too): an integer result of the count that was sent."""
        i = seq - self._first
        if not 0 <= i < self._n:
            return
        lo = i * self.vpp
        sent = min(self.vpp, len(self._out) - lo)
        if (wrong := result_error(seq, pkt, sent)) is not None:
            self.error = self.error or wrong
        else:
            assert pkt.payload is not None  # (result_error saw to it)
            self._out[lo : lo + sent] = pkt.payload
            f = self._fused
            if f is not None:
                block = self._out[lo : lo + sent]
                f.out[lo : lo + sent] = quant.decode_block(block, f.dec_scale[i])

    def _seal(self, pkt: Packet) -> bytes:
        return seal(self.token, pkt)

    @staticmethod
    def _wire_bytes(pkt: Packet) -> int:
        return TOKEN_BYTES + HEADER_BYTES + FRAME_BYTES + VALUE_BYTES * pkt.count
