"""DLCP: loss-tolerant, prioritised gradient transport, as sans-I/O engines.

Every packet carries what it is (tensor id in ``layer``, first value in
``agg_index``, ``count`` values, the tensor's length in ``bitmap`` with
``fan_in`` 64, priority class in ``priority``, sender in ``worker_id``), so
arrival order never matters: the receiver writes each
packet where it belongs. A tensor of ``n`` values completes once at least
``(1 - p) n`` of its values have arrived (``p``: the tensor's loss bound);
the missing ones read as zero, and the receiver ACKs the tensor. Below the
bound the receiver waits: once a sender has been silent for ``rto_ns`` (no
packet of any of its tensors: it is done sending, or its packets are lost)
it asks for the missing ranges of that sender's started, incomplete tensors
(``RESEND`` packets naming their offsets), and the sender re-sends only
those. A sender whose tensor is not ACKed ``rto_ns`` after its last packet
re-sends that packet marked as a probe (``seq = PROBE``); the receiver answers
a probe at once with its missing ranges, or the ACK again, so a tensor lost
whole, a lost ACK or a lost request is recovered too. Silent rounds double
the wait (up to ``MAX_BACKOFF`` rto), so recovery cannot flood a congested
network. ``p = 0`` is the reliable mode: every value,
exactly.

Priority classes (``classify``): the paper serves front layers first (their
gradients are needed first in the next forward pass) and drops small
gradients first (large ones carry most of the update). So a packet's
traffic class (``wire.packet.traffic_class``) has two parts: the egress
queue from its layer (front half of the model in queue 0, back half in
queue 1, served in strict priority) and the drop precedence from its
magnitude quartile within its tensor (``MAG_CLASSES``; largest 0, dropped
last). ``proto.dlcp`` does not model queues: the simulator's links and
``drop_policy`` do.

``drop_policy`` chooses which packets a congested network loses up to a
bound: ``magnitude`` (DLCP: lowest priority first), ``random``, ``largest``
(the inverse, for contrast); the convergence study uses it on real gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Send
from gradfabric.wire.packet import MAX_FAN_IN, Flag, Packet, result_packet, traffic_class


def dlcp_data(
    *, job_id: int, sender: int, tensor: int, offset: int, length: int, priority: int,
    count: int, values: np.ndarray | None, seq: int = 0,
) -> Packet:  # fmt: skip
    """A DLCP data packet: ``count`` values of ``tensor`` (``length`` values in
    all) from ``offset``; ``seq`` is ``PROBE`` on a probe (module doc)."""
    return Packet(job_id, sender, seq, offset, length, MAX_FAN_IN, Flag.FLOAT, priority, tensor,
                  count, values)  # fmt: skip


def dlcp_control(
    *, job_id: int, sender: int, flags: int, tensor: int, about: int, offset: int = 0,
    span: int = 0,
) -> Packet:  # fmt: skip
    """An ACK or a RESEND request about ``tensor`` (to ``about``'s stream); a
    request names the missing range ``[offset, offset + span)``, carried in
    the header's aggregator and bitmap fields (so with fan-in 64)."""
    return Packet(job_id, sender, about, offset, span, MAX_FAN_IN if span else 1, flags, 0, tensor)


MAG_CLASSES = 4
# The most values a server takes in one tensor (a quarter of a GiB of
# float32, ten of DDP's default 25 MB buckets): an announcement of more is a
# counted drop (``drop_too_long``), not gigabytes held for a stranger.
MAX_TENSOR = 1 << 26
PROBE = 1  # ``seq`` of a data packet re-sent as a probe (0 otherwise)
MAX_BACKOFF = 64  # silent rounds double the wait, up to this many rto


def packet_norms(values: np.ndarray, per_packet: int) -> np.ndarray:
    """L2 norm of each ``per_packet`` slice of ``values``."""
    n = len(values)
    pad = (-n) % per_packet
    v = np.concatenate([values, np.zeros(pad, dtype=values.dtype)]) if pad else values
    return np.asarray(np.sqrt((v.reshape(-1, per_packet).astype(np.float64) ** 2).sum(axis=1)))


def classify(norms: np.ndarray, layer: int, layers: int) -> np.ndarray:
    """Traffic class per packet: queue 0 for the front half of the model, 1
    for the back half; drop precedence by magnitude quartile within the
    tensor (the largest quarter 0, dropped last)."""
    if len(norms) == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.argsort(np.argsort(-norms, kind="stable"), kind="stable")
    mag = rank * MAG_CLASSES // len(norms)
    back = 1 if layers > 1 and layer >= layers / 2 else 0
    return np.asarray(traffic_class(back, 0) + mag, dtype=np.int64)


Policy = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]
DROP_POLICIES: Registry[Policy] = Registry("drop policy")


def drop_policy(name: str, norms: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the packets lost when the network drops ``bound`` of them
    under policy ``name``."""
    if not 0 <= bound < 1:
        raise ConfigError("loss_bound", f"must be in [0, 1), got {bound}")
    k = int(bound * len(norms))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(DROP_POLICIES.get(name)(norms, k, rng), dtype=np.int64)


DROP_POLICIES.add("magnitude", lambda norms, k, rng: np.argsort(norms, kind="stable")[:k])
DROP_POLICIES.add("random", lambda norms, k, rng: rng.choice(len(norms), k, replace=False))
DROP_POLICIES.add("largest", lambda norms, k, rng: np.argsort(-norms, kind="stable")[:k])


# ------------------------------------------------------------------ engines


@dataclass
class _Incoming:
    count: int
    bound: float
    values: np.ndarray | None
    have: np.ndarray  # bool per value
    received: int = 0
    started: bool = False
    done: bool = False
    late: np.ndarray | None = None  # bool per value: arrived after completion


class DlcpReceiver:
    """Receives tensors from one or more senders with per-tensor loss bounds.

    ``expect(sender, tensor, count, bound)`` announces a tensor (a server's
    first packet of one announces it, up to ``max_values``); the receiver
    delivers it (``Deliver(seq=tensor, pkt.payload=values,
    pkt.worker_id=sender)``) once at least ``(1 - bound) count`` values are
    in, zeros elsewhere."""

    def __init__(
        self, name: str, job_id: int, rank: int, senders: list[str], rto_ns: int = 200_000,
        accept_bound: float | None = None, keep_done: int = 4096, max_values: int = MAX_TENSOR,
    ) -> None:  # fmt: skip
        self.name, self.job_id, self.rank, self.senders = name, job_id, rank, senders
        self.rto_ns = rto_ns
        # A server does not know what is coming: with ``accept_bound`` the first
        # packet of an unknown tensor announces it (its length rides in every
        # packet) under that bound. Finished tensors are forgotten after
        # ``keep_done`` newer ones finish, on a worker too (a late duplicate of
        # an older one is then a counted drop, not a new tensor, nor a
        # worker's memory growing with every step).
        self.accept_bound, self.keep_done, self.max_values = accept_bound, keep_done, max_values
        self.finished: dict[tuple[int, int], None] = {}
        self.counters = Counters()
        self.tensors: dict[tuple[int, int], _Incoming] = {}
        self.heard: dict[int, int] = {}  # sender -> when a packet of it last arrived
        self.backoff: dict[int, int] = {}  # sender -> rto multiplier (doubles per silent round)
        self.tick: int | None = None

    def expect(self, sender: int, tensor: int, count: int, bound: float, now_ns: int,
               values: bool = True) -> None:  # fmt: skip
        if not 0 <= bound < 1:
            raise ConfigError("loss_bound", f"must be in [0, 1), got {bound}")
        vals = np.zeros(count, dtype=np.float32) if values else None
        self.finished.pop((sender, tensor), None)  # (an id used again: a new tensor)
        self.tensors[(sender, tensor)] = _Incoming(count, bound, vals, np.zeros(count, dtype=bool))
        self.heard.setdefault(sender, now_ns)
        if self.tick is None:
            self.tick = now_ns + self.rto_ns

    def forget(self, sender: int, tensor: int) -> None:
        """Give ``tensor`` up (its caller timed out): neither awaited nor asked
        for again; a packet of it is then foreign."""
        self.finished.pop((sender, tensor), None)
        self.tensors.pop((sender, tensor), None)

    def lost_fraction(self, sender: int, tensor: int) -> float:
        t = self.tensors[(sender, tensor)]
        return 1 - t.received / max(1, t.count)

    def from_sender(self, pkt: Packet) -> bool:
        """A packet of this job from one of its senders."""
        return pkt.job_id == self.job_id and 0 <= pkt.worker_id < len(self.senders)

    def _incoming(self, pkt: Packet, now_ns: int) -> _Incoming | None:
        """The tensor a data packet belongs to (announced by it on a server),
        or None for a foreign packet (counted)."""
        key = (pkt.worker_id, pkt.layer)
        t = self.tensors.get(key)
        if (
            t is None
            and self.accept_bound is not None
            and self.from_sender(pkt)
            and not pkt.flags & (Flag.RESEND | Flag.ACK)
            and pkt.bitmap > 0
            and key not in self.finished
        ):
            if pkt.bitmap > self.max_values:
                self.counters["drop_too_long"] += 1
                return None
            self.expect(pkt.worker_id, pkt.layer, pkt.bitmap, self.accept_bound, now_ns)
            t = self.tensors[key]
        if pkt.job_id != self.job_id or t is None or pkt.flags & (Flag.RESEND | Flag.ACK):
            self.counters["drop_foreign"] += 1
            return None
        if pkt.agg_index + pkt.count > t.count:
            self.counters["drop_malformed"] += 1
            return None
        return t

    def _store(self, pkt: Packet, t: _Incoming) -> bool:
        """Write the packet's values the tensor does not have yet; False for a duplicate."""
        lo, hi = pkt.agg_index, pkt.agg_index + pkt.count
        fresh = ~t.have[lo:hi]
        n_new = int(fresh.sum())
        if t.done and n_new and t.late is not None:
            # values the completed tensor went without, arriving now: the loss
            # the bound applied, by the packet's drop precedence (each counted once)
            late = fresh & ~t.late[lo:hi]
            self.counters[f"late_values_p{pkt.priority & 0xF}"] += int(late.sum())
            t.late[lo:hi] |= fresh
        if t.done or n_new == 0:
            self.counters["duplicate"] += 1
            return False
        if t.values is not None and pkt.payload is not None:
            t.values[lo:hi][fresh] = pkt.payload[fresh]
        t.have[lo:hi] = True
        t.received += n_new
        return True

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        t = self._incoming(pkt, now_ns)
        if t is None:
            return []
        t.started = True
        if pkt.seq == PROBE:  # "what do you miss?": answer at once
            self.counters["probes_answered"] += 1
            if t.done:  # our ACK was lost
                return [self._ack(pkt.worker_id, pkt.layer)]
            return self._request(pkt.worker_id, pkt.layer, t)
        self.heard[pkt.worker_id] = now_ns
        self.backoff[pkt.worker_id] = 1
        if not self._store(pkt, t):
            return []
        done = self._complete(pkt.worker_id, pkt.layer, t)
        return [] if done is None else [done, self._ack(pkt.worker_id, pkt.layer)]

    def _ack(self, sender: int, tensor: int) -> Send:
        ack = dlcp_control(
            job_id=self.job_id, sender=self.rank, flags=Flag.ACK, tensor=tensor, about=sender
        )
        return Send(self.senders[sender], ack)

    def _complete(self, sender: int, tensor: int, t: _Incoming) -> Deliver | None:
        """Deliver the tensor once its bound is met (once)."""
        if t.done or t.received < (1 - t.bound) * t.count - 1e-9:
            return None
        t.done = True
        t.late = np.zeros(t.count, dtype=bool)
        self.counters["completed"] += 1
        self.finished[(sender, tensor)] = None  # forget old tensors
        while len(self.finished) > self.keep_done:
            old = next(iter(self.finished))
            del self.finished[old]
            self.tensors.pop(old, None)
        self.counters["values_lost"] += t.count - t.received
        res = result_packet(
            job_id=self.job_id, sender=sender, seq=tensor, count=t.count, values=t.values
        )
        return Deliver(tensor, res)

    def _request(self, sender: int, tensor: int, t: _Incoming) -> list[Action]:
        """Ask ``sender`` for the missing ranges of ``tensor``, one RESEND packet
        per range: from me (``worker_id``) about sender ``seq``'s tensor, the
        range's length in ``bitmap`` (``fan_in`` 64: no contributor bits)."""
        missing = np.flatnonzero(~t.have)
        if len(missing) == 0:
            return []
        self.counters["nacks"] += 1
        breaks = np.flatnonzero(np.diff(missing) != 1)
        starts = np.concatenate([[missing[0]], missing[breaks + 1]])
        ends = np.concatenate([missing[breaks], [missing[-1]]]) + 1
        return [
            Send(
                self.senders[sender],
                dlcp_control(
                    job_id=self.job_id,
                    sender=self.rank,
                    flags=Flag.RESEND,
                    tensor=tensor,
                    about=sender,
                    offset=a,
                    span=b - a,
                ),
            )
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ]

    def on_timer(self, now_ns: int) -> list[Action]:
        self.tick = None
        out: list[Action] = []
        silent = {
            s for s, at in self.heard.items() if now_ns - at >= self.rto_ns * self.backoff.get(s, 1)
        }
        for (sender, tensor), t in self.tensors.items():
            if t.done or not t.started or sender not in silent:
                continue
            out += self._request(sender, tensor, t)
        for sender in silent:  # one request round per silence, then back off
            self.heard[sender] = now_ns
            self.backoff[sender] = min(MAX_BACKOFF, 2 * self.backoff.get(sender, 1))
        if any(not t.done for t in self.tensors.values()):
            self.tick = now_ns + self.rto_ns
        return out

    def next_deadline(self) -> int | None:
        return self.tick


@dataclass
class _Outgoing:
    values: np.ndarray | None
    count: int
    priority: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    last_ns: int = 0
    backoff: int = 1


class DlcpSender:
    """Sends tensors as self-describing packets with priority classes, most
    important first, answers ``RESEND`` requests for ranges, and probes tensors whose ACK has
    not come."""

    congestion_controlled: ClassVar[bool] = False  # sends as fast as its caller paces it

    def __init__(
        self, name: str, job_id: int, rank: int, receiver: str, per_packet: int = 256,
        rto_ns: int = 200_000,
    ) -> None:  # fmt: skip
        self.name, self.job_id, self.rank, self.receiver = name, job_id, rank, receiver
        self.per_packet, self.rto_ns = per_packet, rto_ns
        self.counters = Counters()
        self.tensors: dict[int, _Outgoing] = {}  # sent, not yet ACKed
        self.tick: int | None = None

    def send(self, tensor: int, count: int, layer: int, layers: int,
             values: np.ndarray | None = None, norms: np.ndarray | None = None,
             now_ns: int = 0) -> list[Action]:  # fmt: skip
        """Send a whole tensor; its packets carry their priority class (from
        the values, or from given packet norms in timing-only runs)."""
        order = self._register(tensor, count, layer, layers, values, norms, now_ns)
        if self.tick is None:
            self.tick = now_ns + self.rto_ns
        pp = self.per_packet
        return [self._packet(tensor, i * pp, min(count, (i + 1) * pp)) for i in order]

    def _register(self, tensor: int, count: int, layer: int, layers: int,
                  values: np.ndarray | None, norms: np.ndarray | None,
                  now_ns: int) -> list[int]:  # fmt: skip
        """Keep the tensor until it is ACKed; its packets' indices, most
        important first (a tensor completed early at its bound misses its
        tail, and the tail is the least important packets)."""
        pp = self.per_packet
        if norms is None and values is not None:
            norms = packet_norms(values, pp)
        if norms is not None:
            prio = classify(norms, layer, layers)
        else:
            prio = np.full(-(-count // pp), traffic_class(0, MAG_CLASSES // 2), dtype=np.int64)
        self.tensors[tensor] = _Outgoing(values, count, prio, now_ns)
        return np.argsort(prio, kind="stable").tolist()  # type: ignore[no-any-return]

    def _packet(self, tensor: int, lo: int, hi: int, seq: int = 0) -> Send:
        t = self.tensors[tensor]
        vals = None if t.values is None else t.values[lo:hi]
        prio = int(t.priority[lo // self.per_packet])
        pkt = dlcp_data(
            job_id=self.job_id, sender=self.rank, tensor=tensor, offset=lo, length=t.count,
            priority=prio, count=hi - lo, values=vals, seq=seq,
        )  # fmt: skip
        self.counters["packets"] += 1
        return Send(self.receiver, pkt)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        t = self.tensors.get(pkt.layer)
        if pkt.job_id != self.job_id or not pkt.flags & (Flag.RESEND | Flag.ACK) or t is None:
            self.counters["drop_foreign"] += 1
            return []
        if pkt.has(Flag.ACK):
            del self.tensors[pkt.layer]
            return []
        lo, hi = pkt.agg_index, min(t.count, pkt.agg_index + pkt.bitmap)
        t.last_ns, t.backoff = now_ns, 1
        self.counters["resent_ranges"] += 1
        pp = self.per_packet
        return [self._packet(pkt.layer, a, min(hi, a + pp)) for a in range(lo, hi, pp)]

    def on_timer(self, now_ns: int) -> list[Action]:
        self.tick = None
        out: list[Action] = []
        for tensor, t in self.tensors.items():
            if now_ns - t.last_ns >= self.rto_ns * t.backoff:  # no ACK: probe, back off
                t.last_ns = now_ns
                t.backoff = min(MAX_BACKOFF, 2 * t.backoff)
                self.counters["probes"] += 1
                last = (t.count - 1) // self.per_packet * self.per_packet
                out.append(self._packet(tensor, last, t.count, seq=PROBE))
        if self.tensors:
            self.tick = now_ns + self.rto_ns
        return out

    def next_deadline(self) -> int | None:
        return self.tick


class DlcpEndpoint:
    """A DLCP host: one receiver and its senders on one node. ACKs and range
    requests go to the sender they name (``worker_id`` of the peer that sent
    them); data goes to the receiver."""

    def __init__(self, name: str, rx: DlcpReceiver, tx: list[DlcpSender]) -> None:
        self.name, self.rx, self.tx = name, rx, tx
        self.counters = Counters()
        self.engines: list[DlcpReceiver | DlcpSender] = [rx, *tx]
        for e in self.engines:
            e.counters = self.counters

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.flags & (Flag.RESEND | Flag.ACK):
            if not 0 <= pkt.worker_id < len(self.tx) and len(self.tx) > 1:
                self.counters["drop_foreign"] += 1
                return []
            return self.tx[pkt.worker_id if len(self.tx) > 1 else 0].on_packet(pkt, now_ns)
        return self.rx.on_packet(pkt, now_ns)

    def on_timer(self, now_ns: int) -> list[Action]:
        out: list[Action] = []
        for e in self.engines:
            d = e.next_deadline()
            if d is not None and d <= now_ns:
                out += e.on_timer(now_ns)
        return out

    def next_deadline(self) -> int | None:
        ds = [d for e in self.engines if (d := e.next_deadline()) is not None]
        return min(ds) if ds else None


class DlcpServer(DlcpEndpoint):
    """A parameter server over DLCP: it takes each worker's copy of a tensor
    (announced by its first packet) within ``push_bound``, and once every
    worker's copy is complete sends the float64-accumulated sum to every
    worker (each of whom expects it within its pull bound). The pull keeps
    the push's layer half, read from the packets' traffic class."""

    def __init__(
        self, name: str, job_id: int, workers: list[str], push_bound: float,
        per_packet: int = 256, rto_ns: int = 200_000, max_values: int = MAX_TENSOR,
    ) -> None:  # fmt: skip
        rx = DlcpReceiver(name, job_id, 0, workers, rto_ns, accept_bound=push_bound,
                          max_values=max_values)  # fmt: skip
        tx = [DlcpSender(name, job_id, 0, w, per_packet, rto_ns) for w in workers]
        super().__init__(name, rx, tx)
        # tensor -> the sum so far, the workers in it, the values every one of them had
        self.sums: dict[int, tuple[np.ndarray, set[int], np.ndarray]] = {}
        self.back: dict[int, int] = {}  # tensor -> layer half (0 front, 1 back)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if self.rx.from_sender(pkt) and not pkt.flags & (Flag.RESEND | Flag.ACK):
            self.back.setdefault(pkt.layer, pkt.priority >> 4)
        out: list[Action] = []
        for a in super().on_packet(pkt, now_ns):
            if isinstance(a, Deliver):
                out += self._merge(a, now_ns)
            else:
                out.append(a)
        return out

    def missing_peers(self, job_id: int | None = None) -> list[str]:
        """Workers whose copy of some tensor is still incomplete here."""
        if job_id not in (None, self.rx.job_id):
            return []
        ranks = sorted({w for (w, _), t in self.rx.tensors.items() if not t.done})
        return [self.rx.senders[r] for r in ranks]

    def _merge(self, d: Deliver, now_ns: int) -> list[Action]:
        tensor, w, vals = d.seq, d.pkt.worker_id, d.pkt.payload
        if vals is None:
            return []
        acc, seen, whole = self.sums.setdefault(
            tensor, (np.zeros(len(vals)), set(), np.ones(len(vals), dtype=bool))
        )
        if w in seen or len(acc) != len(vals):
            self.counters["drop_mismatch"] += 1
            return []
        acc += vals
        seen.add(w)
        # the copy as summed (the receiver may forget it, and take another, before the
        # sum is whole)
        copy = self.rx.tensors.get((w, tensor))  # (just completed: the newest it keeps)
        if copy is not None:
            whole &= copy.have
        if len(seen) < len(self.tx):
            return []
        del self.sums[tensor]
        self.counters["values_incomplete"] += len(whole) - int(whole.sum())  # missing some copy
        total = acc.astype(np.float32)
        layer = self.back.pop(tensor, 0)
        self.counters["sums"] += 1
        out: list[Action] = []
        for tx in self.tx:
            out += tx.send(tensor, len(total), layer, 2, values=total, now_ns=now_ns)
        return out
