"""A reliable, congestion-controlled tensor transport (DCTCP-like), as
sans-I/O engines: the baseline DLCP is judged against.

It carries the same self-describing packets as DLCP (tensor id in ``layer``,
offset in ``agg_index``, length in ``bitmap``), so the receiver places each
packet where it belongs, and it delivers a tensor only when every value is
in. What it adds is what a datacenter TCP does:

- **A congestion window** (packets in flight): slow start from
  ``INITIAL_WINDOW``, then one packet per round trip.
- **ECN reaction as DCTCP** (Alizadeh et al., SIGCOMM 2010): switches mark
  above a queue threshold (``LinkSpec.ecn_bytes``), the receiver echoes the
  mark in the ACK of each packet, the sender keeps ``alpha``, a moving
  average (gain ``DCTCP_G``) of the marked share per window of data, and
  cuts the window by ``alpha / 2`` at most once per window.
- **Fast retransmit** without waiting for a timeout, RACK style (RFC 8985):
  every packet is ACKed on its own (the ACK echoes the packet's transport
  sequence number in ``seq``), so once a packet sent later is ACKed, any
  packet sent more than a reordering window (``REORDER_SHARE`` of the
  minimum RTT) before it is lost; it is re-sent and the window halved once
  per window of data. A time-based rule, not three duplicate ACKs, so
  packet spraying's reordering does not read as loss; and as RACK does, an
  ACK of a copy already re-sent (a spurious retransmission) widens the
  window by another quarter of the min RTT (once per round trip, up to
  the smoothed RTT).
- **A retransmission timeout** from the smoothed RTT (``proto.rto``, RFC 6298's:
  ``srtt + 4 rttvar``, at least ``rto_ns``, doubled per timeout); it re-sends all in
  flight from a window of one.

Every re-send gets a new sequence number, so an ACK always names the copy
that arrived (no retransmission ambiguity for RTT samples). An ACK that
names no copy still unACKed (a duplicate, a stale or a forged one) is a
counted drop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Final

import numpy as np

from gradfabric.proto.actions import Action, Send
from gradfabric.proto.dlcp import DlcpReceiver, DlcpSender, dlcp_control
from gradfabric.proto.rto import Rto
from gradfabric.wire.packet import Flag, Packet

INITIAL_WINDOW: Final = 10  # packets (RFC 6928)
DCTCP_G: Final = 1 / 16  # alpha's gain (the DCTCP paper's g)
REORDER_SHARE: Final = 0.25  # RACK's reordering window, share of the min RTT


@dataclass(slots=True)
class _Sent:
    tensor: int
    lo: int
    sent_ns: int
    resent: bool


class DctcpSender(DlcpSender):
    """Sends tensors in order within a congestion window; see the module
    docstring for the window, ECN, fast retransmit and timeout rules."""

    congestion_controlled: ClassVar[bool] = True  # its window finds its share of a bottleneck

    def __init__(
        self, name: str, job_id: int, rank: int, receiver: str, per_packet: int = 256,
        rto_ns: int = 200_000,
    ) -> None:  # fmt: skip
        super().__init__(name, job_id, rank, receiver, per_packet, rto_ns)
        self.queue: deque[tuple[int, int, bool]] = deque()  # (tensor, lo, a re-send)
        self.flight: dict[int, _Sent] = {}  # seq -> packet, in sending order
        self.lost: dict[int, tuple[int, int]] = {}  # seq -> (tensor, offset): declared lost
        self.unacked: dict[int, set[int]] = {}  # tensor -> offsets of packets not ACKed
        self.seq = 0  # last sequence number used
        self.cwnd = float(INITIAL_WINDOW)
        self.ssthresh = float("inf")
        self.alpha = 1.0  # DCTCP starts pessimistic
        self.acked = self.marked = 0  # in the current observation window
        self.window_end = 0  # the window ends when this sequence number is ACKed
        self.recover = 0  # no second cut until a packet sent after the last is ACKed
        self.rto = Rto(rto_ns)
        self.min_rtt = float("inf")
        self.rto_at: int | None = None
        self.reorder_steps = 1  # the reordering window in quarters of the min RTT
        self.widened_at = 0  # no second widening until a later packet is ACKed

    def send(self, tensor: int, count: int, layer: int, layers: int,
             values: np.ndarray | None = None, norms: np.ndarray | None = None,
             now_ns: int = 0) -> list[Action]:  # fmt: skip
        """Queue a whole tensor, in order (a byte stream's order: no
        priorities), and send what the window allows."""
        self._register(tensor, count, layer, layers, values, norms, now_ns)
        offsets = range(0, count, self.per_packet)
        self.unacked[tensor] = set(offsets)
        self.queue.extend((tensor, lo, False) for lo in offsets)
        return self._pump(now_ns)

    def _pump(self, now_ns: int) -> list[Action]:
        out: list[Action] = []
        while self.queue and len(self.flight) < int(self.cwnd):
            tensor, lo, resent = self.queue.popleft()
            left = self.unacked.get(tensor)
            if left is None or lo not in left:  # ACKed meanwhile: the loss was spurious
                continue
            self.seq += 1
            self.flight[self.seq] = _Sent(tensor, lo, now_ns, resent)
            hi = min(self.tensors[tensor].count, lo + self.per_packet)
            out.append(self._packet(tensor, lo, hi, seq=self.seq))
            if resent:
                self.counters["retransmits"] += 1
        if self.flight and self.rto_at is None:
            self.rto_at = now_ns + self.rto.ns()
        return out

    def _requeue(self, seqs: list[int]) -> None:
        """Put lost packets back at the head of the queue, oldest first."""
        gone = [self.flight.pop(s) for s in seqs]
        self.lost.update((s, (f.tensor, f.lo)) for s, f in zip(seqs, gone, strict=True))
        self.queue.extendleft((f.tensor, f.lo, True) for f in reversed(gone))

    def _cut(self, factor: float) -> None:
        """Shrink the window by ``factor``, once per window of data."""
        self.cwnd = max(1.0, self.cwnd * factor)
        self.ssthresh = max(2.0, self.cwnd)
        self.recover = self.seq

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.job_id != self.job_id or not pkt.flags & Flag.ACK:
            self.counters["drop_foreign"] += 1
            return []
        sent = self.flight.get(pkt.seq)
        copy = (sent.tensor, sent.lo) if sent is not None else self.lost.get(pkt.seq)
        if copy != (pkt.layer, pkt.agg_index):  # names no packet of ours still unACKed
            self.counters["drop_stale_ack"] += 1
            return []
        # (looked up first, removed only now: re-inserting would break the sending order)
        if sent is not None:
            del self.flight[pkt.seq]
        else:
            del self.lost[pkt.seq]
        left = self.unacked[pkt.layer]
        left.discard(pkt.agg_index)
        if not left:  # the whole tensor is in: forget it and its spurious re-sends
            del self.unacked[pkt.layer], self.tensors[pkt.layer]
            for seq in [q for q, f in self.flight.items() if f.tensor == pkt.layer]:
                del self.flight[seq]
            for seq in [q for q, (t, _) in self.lost.items() if t == pkt.layer]:
                del self.lost[seq]
        if sent is None:  # the ACK of a copy already declared lost: reordering, not loss
            self.counters["late_acks"] += 1
            if pkt.seq > self.widened_at:  # the reordering was deeper than the window
                self.reorder_steps += 1
                self.widened_at = self.seq
            return self._pump(now_ns)
        if not sent.resent:  # RFC 6298 estimators
            rtt = now_ns - sent.sent_ns
            self.min_rtt = min(self.min_rtt, rtt)
            self.rto.sample(rtt)
        self.rto.progress()
        self.rto_at = now_ns + self.rto.ns() if self.flight else None
        marked = bool(pkt.flags & Flag.ECN)
        self.acked += 1
        self.marked += marked
        if pkt.seq >= self.window_end:  # a window of data is ACKed: update alpha
            self.alpha += DCTCP_G * (self.marked / self.acked - self.alpha)
            self.acked = self.marked = 0
            self.window_end = self.seq + 1
        if marked and pkt.seq > self.recover:
            self.counters["ecn_cuts"] += 1
            self._cut(1 - self.alpha / 2)
        elif not marked:
            self.cwnd += 1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd
        reorder = min(self.reorder_steps * REORDER_SHARE * self.min_rtt, self.rto.srtt)
        lost: list[int] = []
        for seq, f in self.flight.items():  # sending order
            if f.sent_ns > sent.sent_ns - reorder:
                break
            lost.append(seq)
        if lost:
            self.counters["fast_retransmits"] += len(lost)
            if lost[-1] > self.recover:
                self._cut(0.5)
            self._requeue(lost)
        return self._pump(now_ns)

    def on_timer(self, now_ns: int) -> list[Action]:
        if self.rto_at is None or now_ns < self.rto_at:
            return []
        self.counters["timeouts"] += 1
        self.ssthresh = max(2.0, self.cwnd / 2)
        self.cwnd = 1.0
        self.recover = self.seq
        self._requeue(list(self.flight))
        self.rto.expired()
        self.rto_at = None
        return self._pump(now_ns)

    def next_deadline(self) -> int | None:
        return self.rto_at


class DctcpReceiver(DlcpReceiver):
    """Assembles tensors exactly (every value) and ACKs every data packet,
    echoing its sequence number, offset and ECN mark. Recovery is the
    sender's: the receiver never asks."""

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        t = self._incoming(pkt, now_ns)
        if t is None:
            return []
        # per packet: ``about`` echoes its sequence, ``offset`` its first value
        ack = dlcp_control(
            job_id=self.job_id, sender=self.rank, flags=Flag.ACK | (pkt.flags & Flag.ECN),
            tensor=pkt.layer, about=pkt.seq, offset=pkt.agg_index,
        )  # fmt: skip
        out: list[Action] = [Send(self.senders[pkt.worker_id], ack)]
        if self._store(pkt, t):
            done = self._complete(pkt.worker_id, pkt.layer, t)
            if done is not None:
                out.append(done)
        return out

    def on_timer(self, now_ns: int) -> list[Action]:
        return []

    def next_deadline(self) -> int | None:
        return None

    def expect(self, sender: int, tensor: int, count: int, bound: float, now_ns: int,
               values: bool = True) -> None:  # fmt: skip
        """Announce a tensor; a reliable transport takes every value (``bound`` is ignored)."""
        super().expect(sender, tensor, count, 0.0, now_ns, values)
