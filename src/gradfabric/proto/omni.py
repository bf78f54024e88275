"""OmniReduce's streaming sparse aggregation, as sans-I/O engines.

A bucket of ``count`` values is cut into blocks of ``block`` values (one
packet each). Block ``b`` goes to aggregator ``b % A`` and, inside it, to
stream ``(b // A) % S``, at position ``b // (A * S)``: each aggregator runs
``S`` independent streams so that ``S`` blocks are in flight per RTT.

One stream, as in the paper:

- every worker first *announces* the position of its first non-zero block
  (or none);
- the aggregator waits for one packet from every worker whose announced next
  position is the current target, sums their blocks, and multicasts the sum
  with the *minimum* next position any worker announced;
- a worker that holds the block at that position sends it with the position
  of its following non-zero block; the others only write the result;
- a result whose next position is "none" ends the stream. Blocks that are zero
  at every worker never travel.

Loss: results carry their position and the next one, so a worker knows
which result it expects. A worker that sees no progress on a stream for its
timeout retransmits the block it owes (if any) and sends a ``RESEND``
request naming the last position it applied. A round waits on every
worker's packet and every result goes to every worker, so at hundreds of
workers rounds outlast any fixed timeout a small job would choose, and a
fixed one re-sends blocks nobody lost into the queues that made the rounds
slow. The timeout follows the rounds instead (``proto.rto``, at least
``rto_ns``): its samples are a stream's times from one result to the next
(not the announce round's, which also measures how far apart the ranks
began the bucket), taken only where the stream sent nothing twice and the
round ended inside the stream's timeout (Karn's rule, and a round that
waited on another worker's recovery is longer than that); a stream's
timeout doubles with each of its silent checks and stays doubled until it
gives a sample. A worker gives up on a stream ``max_tries * rto_ns`` after
its last result, however its timeout grew, and no timeout exceeds
``1/GIVE_UP_TRIES`` of that (nor ``MAX_BACKOFF * rto_ns``): every worker re-sends at
least every ceiling plus one timeout (its check's period), so none gives
up on a peer that has yet to re-send. The aggregator keeps each
stream's results until every worker has acknowledged them (a data packet for
position ``q`` acknowledges everything before ``q``, a request everything up
to its position) and re-sends what the requester lacks. Duplicates are counted
and ignored. A worker that gives up fails naming the aggregator (and forgets
the bucket); the aggregator reports which workers a stream still waits on.

Fields (the common 32-byte header): ``layer`` = bucket, ``seq`` = stream,
``agg_index`` = position + 1 (0: the announce round), ``bitmap`` = the next
non-zero position (``NONE``: no more), ``worker_id`` = sender, ``fan_in`` = 64
(the bitmap carries a position, not contributor bits), ``ACK`` = a result,
``RESEND`` = a retransmission request. Sums are exact int64 in values mode, as
in the ring baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Fail, Multicast, NoTimers, Send
from gradfabric.proto.rto import MAX_BACKOFF, Rto
from gradfabric.wire.packet import MAX_FAN_IN, MAX_SENDERS, Flag, Packet, result_packet

NONE = (1 << 64) - 1  # "no further non-zero block"
GIVE_UP_TRIES = 32  # a silent stream is re-sent at least this often before it is given up


def omni_packet(
    *, job_id: int, sender: int, bucket: int, stream: int, position: int, next_position: int,
    flags: int = 0, count: int = 0, values: np.ndarray | None = None,
) -> Packet:  # fmt: skip
    """OmniReduce's header (module doc, Fields): ``position`` is the header's
    position + 1 (0: the announce round)."""
    return Packet(job_id, sender, stream, position, next_position, MAX_FAN_IN, flags, 0, bucket,
                  count, values)  # fmt: skip


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class OmniLayout:
    """How blocks map to aggregators, streams and positions."""

    aggregators: list[str]
    streams: int = 16
    block: int = 256

    def __post_init__(self) -> None:
        if not self.aggregators or self.streams < 1 or self.block < 1:
            raise ConfigError("streams", "need >= 1 aggregator, >= 1 stream, block >= 1")

    @property
    def width(self) -> int:
        return len(self.aggregators) * self.streams

    def where(self, b: int) -> tuple[int, int]:
        """(stream, position) of block ``b``; stream ``g`` lives on aggregator ``g // S``."""
        a = len(self.aggregators)
        return (b % a) * self.streams + (b // a) % self.streams, b // self.width

    def block_of(self, g: int, pos: int) -> int:
        a = len(self.aggregators)
        return pos * self.width + (g % self.streams) * a + g // self.streams


def block_mask(values: np.ndarray, block: int) -> np.ndarray:
    """Which blocks of ``values`` hold a non-zero value."""
    nb = -(-len(values) // block)
    padded = np.zeros(nb * block, dtype=values.dtype)
    padded[: len(values)] = values
    return np.asarray(padded.reshape(nb, block).any(axis=1))


# ---------------------------------------------------------------- aggregator


@dataclass
class _AggStream:
    nxt: list[int | None]  # each worker's announced next position (None: not yet)
    target: int = -1  # position being summed (-1: the announce round)
    complete: bool = False
    waiting: set[int] = field(default_factory=set)
    acc: np.ndarray | None = None
    count: int = 0
    history: list[tuple[int, Packet]] = field(default_factory=list)  # (position, result)
    acked: list[int] = field(default_factory=list)  # worker has every result before this


class OmniAggregator(NoTimers):
    """One OmniReduce aggregator: sums its streams' non-zero blocks."""

    def __init__(
        self, name: str, job_id: int, index: int, workers: list[str], streams: int
    ) -> None:
        if not 1 <= len(workers) <= MAX_SENDERS:
            raise ConfigError("workers", f"need 1..{MAX_SENDERS} workers (the header's u16)")
        self.name, self.job_id, self.index, self.workers = name, job_id, index, workers
        self.first_stream, self.end_stream = index * streams, (index + 1) * streams
        self.counters = Counters()
        self.streams: dict[tuple[int, int], _AggStream] = {}

    def missing_peers(self, job_id: int | None = None) -> list[str]:
        """Workers some open stream waits on (this aggregator serves one job)."""
        return self.missing_workers() if job_id in (None, self.job_id) else []

    def missing_workers(self) -> list[str]:
        """Workers some open stream waits on."""
        return sorted({self.workers[w] for st in self.streams.values() for w in st.waiting})

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        n = len(self.workers)
        if pkt.job_id != self.job_id or pkt.worker_id >= n or pkt.has(Flag.ACK):
            self.counters["drop_foreign"] += 1
            return []
        if not self.first_stream <= pkt.seq < self.end_stream:
            self.counters["drop_bad_stream"] += 1  # not one of this aggregator's streams
            return []
        key = (pkt.layer, pkt.seq)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = _AggStream([None] * n, waiting=set(range(n)), acked=[-1] * n)
        w, q = pkt.worker_id, pkt.agg_index - 1
        if pkt.has(Flag.RESEND):  # the worker expects the result at position q
            return self._resend(st, w, q)
        if st.complete or q < st.target:
            # a worker repeating old data missed the result that followed it
            self.counters["duplicate"] += 1
            return self._resend(st, w, q)
        if q > st.target or w not in st.waiting:
            self.counters["duplicate" if q == st.target else "drop_bad_position"] += 1
            return []
        if (st.count and pkt.count != st.count) or (q >= 0) != (pkt.count > 0):
            self.counters["drop_malformed"] += 1  # block length differs from the others'
            return []
        if q >= 0 and pkt.payload is not None:
            if st.acc is None:
                st.acc = np.zeros(pkt.count, dtype=np.int64)
            st.acc += pkt.payload
        st.count = max(st.count, pkt.count)
        st.nxt[w] = pkt.bitmap
        st.waiting.discard(w)
        self._ack(st, w, q)
        if st.waiting:
            return []
        return [self._finish_round(st, pkt)]

    def _finish_round(self, st: _AggStream, pkt: Packet) -> Multicast:
        nxt = min(p for p in st.nxt if p is not None)
        res = omni_packet(
            job_id=self.job_id, sender=self.index, bucket=pkt.layer, stream=pkt.seq,
            position=st.target + 1, next_position=nxt, flags=Flag.ACK,
            count=st.count if st.target >= 0 else 0, values=st.acc if st.target >= 0 else None,
        )  # fmt: skip
        st.history.append((st.target, res))
        self.counters["results"] += 1
        st.complete = nxt == NONE
        st.target = nxt
        st.waiting = {w for w, p in enumerate(st.nxt) if p == nxt and nxt != NONE}
        st.acc, st.count = None, 0
        return Multicast(tuple(self.workers), res)

    def _ack(self, st: _AggStream, w: int, upto: int) -> None:
        """Worker ``w`` holds every result before position ``upto``; results
        every worker holds are forgotten."""
        st.acked[w] = max(st.acked[w], upto)
        low = min(st.acked)
        while st.history and st.history[0][0] < low:
            st.history.pop(0)

    def _resend(self, st: _AggStream, w: int, after: int) -> list[Action]:
        """Send worker ``w`` every kept result at a position >= ``after``."""
        self._ack(st, w, after)
        out: list[Action] = []
        for pos, res in st.history:
            if pos >= after:
                out.append(Send(self.workers[w], res.clone()))
        self.counters["resent"] += len(out)
        return out


# -------------------------------------------------------------------- worker


@dataclass
class _Stream:
    nz: list[int]  # this worker's non-zero positions, ascending
    ptr: int = 0  # next of them to send
    expect: int = -1  # position of the next result (-1: the announce round's)
    done: bool = False
    owed: Packet | None = None  # the packet whose round has not completed
    last_ns: int = 0  # the last result, or the last timeout since
    tries: int = 0  # timeouts since the last result (Karn's rule)
    since_ns: int = 0  # the last result (or the bucket's start)
    backoff: int = 1  # the stream's timeout in the worker's (``Rto``), doubled per timeout


@dataclass
class _OBucket:
    count: int
    data: np.ndarray | None
    result: np.ndarray | None
    streams: list[_Stream]
    open: int


class OmniWorker:
    """One worker's side of OmniReduce streaming aggregation."""

    def __init__(
        self,
        name: str,
        job_id: int,
        rank: int,
        layout: OmniLayout,
        rto_ns: int = 200_000,
        max_tries: int = 50,
    ) -> None:
        self.name, self.job_id, self.rank, self.layout = name, job_id, rank, layout
        self.rto_ns, self.max_tries = rto_ns, max_tries
        self.rto = Rto(rto_ns)
        self.give_up_ns = max_tries * rto_ns  # since a stream's last result
        self.ceiling_ns = max(rto_ns, min(MAX_BACKOFF * rto_ns, self.give_up_ns // GIVE_UP_TRIES))
        self.counters = Counters()
        self.buckets: dict[int, _OBucket] = {}
        self.tick: int | None = None

    def start(
        self,
        b: int,
        count: int,
        now_ns: int,
        payload: np.ndarray | None = None,
        mask: np.ndarray | None = None,
    ) -> list[Action]:
        """Begin bucket ``b``: its values (values mode) or only its non-zero
        block mask (timing mode)."""
        if b in self.buckets:
            raise ValueError(f"bucket {b} already started")
        lay = self.layout
        if mask is None:
            if payload is None:
                raise ValueError("need the payload or the block mask")
            mask = block_mask(payload, lay.block)
        streams = [_Stream([], last_ns=now_ns, since_ns=now_ns) for _ in range(lay.width)]
        for blk in np.flatnonzero(mask).tolist():
            g, pos = lay.where(blk)
            streams[g].nz.append(pos)
        result = None if payload is None else np.zeros(count, dtype=np.int64)
        self.buckets[b] = _OBucket(count, payload, result, streams, lay.width)
        out: list[Action] = []
        for g, st in enumerate(streams):
            st.owed = self._packet(b, g, -1, st.nz[0] if st.nz else NONE, None, 0)
            out.append(Send(lay.aggregators[g // lay.streams], st.owed))
        self._arm(now_ns)
        return out

    def _packet(
        self, b: int, g: int, pos: int, nxt: int, vals: np.ndarray | None, count: int
    ) -> Packet:
        return omni_packet(
            job_id=self.job_id, sender=self.rank, bucket=b, stream=g, position=pos + 1,
            next_position=nxt, count=count, values=vals,
        )  # fmt: skip

    def _timeout(self, rto: int, st: _Stream) -> int:
        """Stream ``st``'s timeout, backed off, never past the ceiling
        (module doc)."""
        return min(self.ceiling_ns, rto * st.backoff)

    def _arm(self, now_ns: int) -> None:
        self._wake_by(now_ns + min(self.ceiling_ns, self.rto.ns()))  # (not backed off)

    def _wake_by(self, due: int) -> None:
        """The timer fires at ``due`` or earlier."""
        if self.tick is None or due < self.tick:
            self.tick = due

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        bk = self.buckets.get(pkt.layer)
        if pkt.job_id != self.job_id or not pkt.has(Flag.ACK) or bk is None:
            self.counters["drop_foreign"] += 1
            return []
        if not 0 <= pkt.seq < len(bk.streams):
            self.counters["drop_bad_stream"] += 1
            return []
        st = bk.streams[pkt.seq]
        pos = pkt.agg_index - 1
        lay = self.layout
        lo = lay.block_of(pkt.seq, pos) * lay.block
        if pkt.count != (min(bk.count, lo + lay.block) - lo if pos >= 0 else 0) or lo >= bk.count:
            self.counters["drop_malformed"] += 1
            return []
        if st.done or pos != st.expect:
            # a duplicate, or a result after a lost one: the timer recovers it
            self.counters["out_of_order" if pos > st.expect and not st.done else "duplicate"] += 1
            return []
        if pos >= 0 and bk.result is not None and pkt.payload is not None:
            bk.result[lo : lo + pkt.count] = pkt.payload
        rtt, timeout = now_ns - st.since_ns, self._timeout(self.rto.ns(), st)
        if not st.tries and rtt < timeout and st.expect >= 0:  # a clean round (module doc)
            self.rto.sample(rtt)
            st.backoff = 1
        st.expect, st.owed, st.last_ns, st.since_ns, st.tries = pkt.bitmap, None, now_ns, now_ns, 0
        self._wake_by(now_ns + self._timeout(self.rto.ns(), st))
        out: list[Action] = []
        if pkt.bitmap == NONE:
            st.done = True
            bk.open -= 1
            if bk.open == 0:
                del self.buckets[pkt.layer]
                # int64 sums, as the ring delivers them
                res = result_packet(
                    job_id=self.job_id, sender=self.rank, seq=pkt.layer, count=bk.count,
                    values=bk.result,
                )  # fmt: skip
                out.append(Deliver(pkt.layer, res))
        elif st.ptr < len(st.nz) and st.nz[st.ptr] == pkt.bitmap:
            p = st.nz[st.ptr]
            st.ptr += 1
            blk = lay.block_of(pkt.seq, p)
            lo, hi = blk * lay.block, min(bk.count, (blk + 1) * lay.block)
            vals = None if bk.data is None else bk.data[lo:hi]
            nxt = st.nz[st.ptr] if st.ptr < len(st.nz) else NONE
            st.owed = self._packet(pkt.layer, pkt.seq, p, nxt, vals, hi - lo)
            out.append(Send(lay.aggregators[pkt.seq // lay.streams], st.owed))
        return out

    def on_timer(self, now_ns: int) -> list[Action]:
        self.tick = None
        out: list[Action] = []
        lay, rto = self.layout, min(self.ceiling_ns, self.rto.ns())
        for b, bk in self.buckets.items():
            for g, st in enumerate(bk.streams):
                if st.done:
                    continue
                agg = lay.aggregators[g // lay.streams]
                if now_ns - st.since_ns >= self.give_up_ns:
                    return self._give_up(b, g, agg, now_ns - st.since_ns, now_ns)
                due = st.last_ns + self._timeout(rto, st)
                if now_ns < due:
                    self._wake_by(min(due, st.since_ns + self.give_up_ns))
                    continue
                st.tries += 1
                st.last_ns = now_ns
                st.backoff = min(MAX_BACKOFF, 2 * st.backoff)
                self._wake_by(min(now_ns + self._timeout(rto, st), st.since_ns + self.give_up_ns))
                self.counters["timeouts"] += 1
                if st.owed is not None:
                    out.append(Send(agg, st.owed.clone()))
                req = self._packet(b, g, st.expect, NONE, None, 0)
                req.flags = Flag.RESEND  # "send me every result from ``expect`` on"
                out.append(Send(agg, req))
        tick = self.next_deadline()  # (what the scan's ``_wake_by`` calls set)
        if tick is not None:  # a scan of every stream at most once a timeout
            self.tick = max(tick, now_ns + rto)
        return out

    def _give_up(self, b: int, g: int, agg: str, waited: int, now_ns: int) -> list[Action]:
        """Fail bucket ``b`` (its stream ``g`` silent for ``waited`` ns) and
        forget it; the timer goes on for the other buckets alone."""
        del self.buckets[b]
        self.tick = None
        if self.buckets:
            self._arm(now_ns)
        return [Fail(agg, f"stream {g} of bucket {b} made no progress", waited)]

    def next_deadline(self) -> int | None:
        return self.tick
