"""DLCP: loss-tolerant, prioritised gradient transport, as sans-I/O engines.

Every packet carries what it is (tensor id in ``layer``, first value in
``agg_index``, ``count`` values, priority class in ``priority``, sender in
``worker_id``), so arrival order never matters: the receiver writes each
packet where it belongs. A tensor of ``n`` values completes once at least
``(1 - p) n`` of its values have arrived (``p``: the tensor's loss bound);
the missing ones read as zero. Below the bound the receiver waits: after
``rto_ns`` without a new packet of an incomplete tensor it asks for the
missing ranges (``RESEND`` packets naming their offsets), and the sender
re-sends only those. ``p = 0`` is the reliable mode: every value, exactly.

Priority classes (``classify``): the paper protects front layers (their
gradients are needed first in the next forward pass) and large gradients
(they carry most of the update). A packet's class mixes both: magnitude
quantile of the packet within its tensor (``MAG_CLASSES``) and layer position
(front half first); class 0 is the most important. Switch egress queues
drop the highest class first (``proto.dlcp`` does not model queues: the
simulator's links and ``drop_policy`` do).

``drop_policy`` chooses which packets a congested network loses up to a
bound: ``magnitude`` (DLCP: lowest priority first), ``random``, ``largest``
(the inverse, for contrast); the convergence study uses it on real gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Send
from gradfabric.wire.packet import Flag, Packet

MAG_CLASSES = 4


def packet_norms(values: np.ndarray, per_packet: int) -> np.ndarray:
    """L2 norm of each ``per_packet`` slice of ``values``."""
    n = len(values)
    pad = (-n) % per_packet
    v = np.concatenate([values, np.zeros(pad, dtype=values.dtype)]) if pad else values
    return np.asarray(np.sqrt((v.reshape(-1, per_packet).astype(np.float64) ** 2).sum(axis=1)))


def classify(norms: np.ndarray, layer: int, layers: int) -> np.ndarray:
    """Priority class per packet (0 = most important): magnitude quartile
    within the tensor (largest first), then front half of the model before
    the back half."""
    if len(norms) == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.argsort(np.argsort(-norms, kind="stable"), kind="stable")
    mag = rank * MAG_CLASSES // len(norms)
    back = 1 if layers > 1 and layer >= layers / 2 else 0
    return np.asarray(mag * 2 + back, dtype=np.int64)


Policy = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]
POLICIES: Registry[Policy] = Registry("drop policy")


def drop_policy(name: str, norms: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the packets lost when the network drops ``bound`` of them
    under policy ``name``."""
    if not 0 <= bound < 1:
        raise ConfigError("loss_bound", f"must be in [0, 1), got {bound}")
    k = int(bound * len(norms))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(POLICIES.get(name)(norms, k, rng), dtype=np.int64)


POLICIES.add("magnitude", lambda norms, k, rng: np.argsort(norms, kind="stable")[:k])
POLICIES.add("random", lambda norms, k, rng: rng.choice(len(norms), k, replace=False))
POLICIES.add("largest", lambda norms, k, rng: np.argsort(-norms, kind="stable")[:k])


# ------------------------------------------------------------------ engines


@dataclass
class _Incoming:
    count: int
    bound: float
    values: np.ndarray | None
    have: np.ndarray  # bool per value
    received: int = 0
    last_ns: int = 0
    done: bool = False


class DlcpReceiver:
    """Receives tensors from one or more senders with per-tensor loss bounds.

    ``expect(sender, tensor, count, bound)`` announces a tensor; the
    receiver delivers it (``Deliver(seq=tensor, pkt.payload=values,
    pkt.worker_id=sender)``) once at least ``(1 - bound) count`` values are
    in, zeros elsewhere."""

    deadlines_only_grow = True

    def __init__(self, name: str, job_id: int, senders: list[str], rto_ns: int = 200_000) -> None:
        self.name, self.job_id, self.senders, self.rto_ns = name, job_id, senders, rto_ns
        self.counters = Counters()
        self.tensors: dict[tuple[int, int], _Incoming] = {}
        self.tick: int | None = None

    def expect(self, sender: int, tensor: int, count: int, bound: float, now_ns: int,
               values: bool = True) -> None:  # fmt: skip
        if not 0 <= bound < 1:
            raise ConfigError("loss_bound", f"must be in [0, 1), got {bound}")
        vals = np.zeros(count, dtype=np.float32) if values else None
        self.tensors[(sender, tensor)] = _Incoming(
            count, bound, vals, np.zeros(count, dtype=bool), last_ns=now_ns
        )
        if self.tick is None:
            self.tick = now_ns + self.rto_ns

    def lost_fraction(self, sender: int, tensor: int) -> float:
        t = self.tensors[(sender, tensor)]
        return 1 - t.received / max(1, t.count)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        t = self.tensors.get((pkt.worker_id, pkt.layer))
        if pkt.job_id != self.job_id or t is None or pkt.has(Flag.RESEND):
            self.counters["drop_foreign"] += 1
            return []
        lo, hi = pkt.agg_index, pkt.agg_index + pkt.count
        if hi > t.count:
            self.counters["drop_malformed"] += 1
            return []
        fresh = ~t.have[lo:hi]
        n_new = int(fresh.sum())
        if n_new == 0:
            self.counters["duplicate"] += 1
            return []
        if t.values is not None and pkt.payload is not None:
            t.values[lo:hi][fresh] = pkt.payload[fresh]
        t.have[lo:hi] = True
        t.received += n_new
        t.last_ns = now_ns
        return self._maybe_done(pkt.worker_id, pkt.layer, t)

    def _maybe_done(self, sender: int, tensor: int, t: _Incoming) -> list[Action]:
        if t.done or t.received < (1 - t.bound) * t.count - 1e-9:
            return []
        t.done = True
        self.counters["completed"] += 1
        self.counters["values_lost"] += t.count - t.received
        res = Packet(self.job_id, sender, tensor, 0, 0, 1, 0, 0, tensor, t.count, t.values)
        return [Deliver(tensor, res)]

    def on_timer(self, now_ns: int) -> list[Action]:
        self.tick = None
        out: list[Action] = []
        for (sender, tensor), t in self.tensors.items():
            if t.done or now_ns - t.last_ns < self.rto_ns:
                continue
            t.last_ns = now_ns
            self.counters["nacks"] += 1
            # ask for the missing ranges, one RESEND packet per range
            missing = np.flatnonzero(~t.have)
            if len(missing) == 0:
                continue
            breaks = np.flatnonzero(np.diff(missing) != 1)
            starts = np.concatenate([[missing[0]], missing[breaks + 1]])
            ends = np.concatenate([missing[breaks], [missing[-1]]]) + 1
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
                # ``bitmap`` carries the range's length (``fan_in`` 64: no contributor bits)
                req = Packet(self.job_id, sender, 0, a, b - a, 64, Flag.RESEND, 0, tensor, 0, None)
                out.append(Send(self.senders[sender], req))
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


class DlcpSender:
    """Sends tensors as self-describing packets with priority classes and
    answers ``RESEND`` requests for ranges."""

    def __init__(self, name: str, job_id: int, rank: int, receiver: str, per_packet: int = 256):
        self.name, self.job_id, self.rank, self.receiver = name, job_id, rank, receiver
        self.per_packet = per_packet
        self.counters = Counters()
        self.tensors: dict[int, _Outgoing] = {}

    def send(self, tensor: int, count: int, layer: int, layers: int,
             values: np.ndarray | None = None) -> list[Action]:  # fmt: skip
        """Send a whole tensor; its packets carry their priority class."""
        pp = self.per_packet
        if values is not None:
            prio = classify(packet_norms(values, pp), layer, layers)
        else:
            prio = np.full(-(-count // pp), 2 * (MAG_CLASSES // 2), dtype=np.int64)
        self.tensors[tensor] = _Outgoing(values, count, prio)
        return [self._packet(tensor, lo, min(count, lo + pp)) for lo in range(0, count, pp)]

    def _packet(self, tensor: int, lo: int, hi: int) -> Send:
        t = self.tensors[tensor]
        vals = None if t.values is None else t.values[lo:hi]
        prio = int(t.priority[lo // self.per_packet])
        pkt = Packet(self.job_id, self.rank, 0, lo, 0, 1, Flag.FLOAT, prio, tensor, hi - lo, vals)
        self.counters["packets"] += 1
        return Send(self.receiver, pkt)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        t = self.tensors.get(pkt.layer)
        if pkt.job_id != self.job_id or not pkt.has(Flag.RESEND) or t is None:
            self.counters["drop_foreign"] += 1
            return []
        lo, hi = pkt.agg_index, min(t.count, pkt.agg_index + pkt.bitmap)
        self.counters["resent_ranges"] += 1
        return [
            self._packet(pkt.layer, a, min(hi, a + self.per_packet))
            for a in range(lo, hi, self.per_packet)
        ]

    def on_timer(self, now_ns: int) -> list[Action]:
        return []

    def next_deadline(self) -> int | None:
        return None
