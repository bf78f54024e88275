"""Parameter server engine: merges contributions by bitmap.

Used two ways: as ATP's fallback aggregator behind the switch (results go
back *through* the switch, which frees the aggregator as the result passes),
and as the server of the BytePS-style sharded PS baseline (results go
straight to the workers).

Every packet carries the set of contributions it holds (``bitmap``). A packet
disjoint from what the PS already has is merged; one wholly contained in it
is a duplicate; one that overlaps only partly cannot be split (it is a sum)
and is dropped: each of its new contributors is still waiting for the result
and will retransmit its own packet, which then merges alone. A packet of
every contribution (of the same length) is the sum itself, whatever is
merged: it replaces the partial merge (``partial_superseded``). Without
that rule a switch's complete aggregate, which ATP's switches send again
after resends of its key, lost to a partial merge of the same sequence
here, and a contributor still missing from it (a worker whose resends kept
reaching a congested port behind everybody else's) held the sequence until
its workers gave up. So no contribution is
ever counted twice and none is lost.

Completed results are kept to answer retransmissions for ``window``
sequences, then forgotten; anything at or below the forgotten floor is stale.
So are the merges under way bounded: at most ``4 * window`` sequences of
a job wait for contributions at once (what its workers may have in flight
spans two of their windows, each at most ``window``: no worker runs more
than a window ahead of another); a packet that would open one more (and
not complete it at once) is refused and counted (``drop_pending_full``), whatever a token holder
sends, so the server's memory stays within a few windows of every job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Multicast, NoTimers, Send
from gradfabric.wire.packet import MAX_FAN_IN, Flag, Packet, ina_packet


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class PsJob:
    """One job at a server. ``groups``: a job of more workers than one bitmap
    holds, in groups of at most 64 (``workers`` in group order): a packet of
    group ``g`` carries ``layer = g + 1`` and bits over that group's workers,
    one of ``layer = 0`` bits over whole groups (ATP's second level, whose
    aggregators count racks). Without groups, every packet's bits are over
    ``workers`` (at most 64) and ``layer`` is not read."""

    job_id: int
    workers: tuple[str, ...]
    via: str | None = None
    window: int = 256
    scale: float = 1e6
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.workers)
        if self.groups:
            if not (
                1 <= len(self.groups) <= MAX_FAN_IN
                and all(1 <= g <= MAX_FAN_IN for g in self.groups)
                and sum(self.groups) == n
            ):
                raise ConfigError("groups", f"1..{MAX_FAN_IN} groups of 1..{MAX_FAN_IN} "
                                  "workers, summing to the job's")  # fmt: skip
        elif not 1 <= n <= MAX_FAN_IN:
            raise ConfigError("workers", f"need 1..{MAX_FAN_IN} workers (more: in groups), got {n}")
        if self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")


PENDING_WINDOWS = 4  # merges under way a job may hold, in windows (``PsJob.window``)


class _Acc:
    __slots__ = ("agg_index", "bitmap", "flags", "fvals", "ivals", "nvalues")

    def __init__(self, pkt: Packet) -> None:
        self.bitmap = 0
        self.flags = 0
        self.nvalues = pkt.count
        self.agg_index = pkt.agg_index
        self.ivals: np.ndarray | None = None
        self.fvals: np.ndarray | None = None


@dataclass
class _JobState:
    # a grouped job's masks: group g's workers among all, and its offset
    group_masks: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    accs: dict[int, _Acc] = field(default_factory=dict)
    results: dict[int, Packet] = field(default_factory=dict)
    done_heap: list[int] = field(default_factory=list)
    floor: int = -1


class ParameterServer(NoTimers):
    def __init__(self, name: str, jobs: tuple[PsJob, ...] = ()) -> None:
        self.name = name
        self.counters = Counters()
        self.jobs: dict[int, PsJob] = {}
        self.state: dict[int, _JobState] = {}
        for job in jobs:
            self.add_job(job)

    def add_job(self, job: PsJob) -> None:
        if job.job_id in self.jobs:
            raise ConfigError("job_id", f"job {job.job_id} already registered at {self.name}")
        self.jobs[job.job_id] = job
        offs = tuple(accumulate(job.groups[:-1], initial=0)) if job.groups else ()  # first workers
        masks = tuple(((1 << g) - 1) << o for g, o in zip(job.groups, offs, strict=True))
        self.state[job.job_id] = _JobState(masks, offs)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        job = self.jobs.get(pkt.job_id)
        if job is None:
            return self._drop("unknown_job")
        n = len(job.workers)
        full = (1 << n) - 1
        st = self.state[pkt.job_id]
        bits = self._bits(job, st, pkt)
        if pkt.flags & Flag.ACK or bits == 0:
            return self._drop("bad_packet")
        if pkt.payload is not None and len(pkt.payload) != pkt.count:
            return self._drop("bad_payload")
        if pkt.seq <= st.floor:
            return self._drop("stale")
        done = st.results.get(pkt.seq)
        if done is not None:
            # one worker (or its helper) asking again; a grouped job's layer 0
            # carries whole racks, never one worker
            if pkt.bitmap & (pkt.bitmap - 1) == 0 and (pkt.layer or not job.groups):
                self.counters["resend_answered"] += 1
                return [self._unicast(job, st, done, pkt)]
            return self._drop("late_partial")
        acc = st.accs.get(pkt.seq)
        carried = 0  # ECN marks of a partial merge a whole sum supersedes
        if acc is not None and bits == full and pkt.count == acc.nvalues:
            del st.accs[pkt.seq]
            carried = acc.flags & Flag.ECN
            acc = None
            self.counters["partial_superseded"] += 1
        if acc is None:
            # (a packet of every contribution opens nothing that stays)
            if len(st.accs) >= PENDING_WINDOWS * job.window and bits != full:
                return self._drop("pending_full")
            acc = st.accs[pkt.seq] = _Acc(pkt)
        if acc.bitmap & bits:
            return self._drop("duplicate" if acc.bitmap & bits == bits else "overlap")
        if pkt.count != acc.nvalues:
            return self._drop("count_mismatch")
        self.counters["merged"] += 1
        acc.bitmap |= bits
        acc.flags |= (pkt.flags | carried) & Flag.ECN
        if not pkt.flags & (Flag.COLLISION | Flag.RESEND | Flag.OVERFLOW):
            acc.agg_index = pkt.agg_index
        if pkt.payload is not None:
            if pkt.flags & Flag.FLOAT:
                acc.fvals = pkt.payload.astype(np.float64) + (0 if acc.fvals is None else acc.fvals)
            elif acc.ivals is None:
                acc.ivals = pkt.payload.astype(np.int64)
            else:
                acc.ivals += pkt.payload
        if acc.bitmap != full:
            return []
        del st.accs[pkt.seq]
        result = self._result(job, pkt.seq, acc)
        st.results[pkt.seq] = result
        heapq.heappush(st.done_heap, pkt.seq)
        while st.done_heap[0] <= pkt.seq - job.window:
            old = heapq.heappop(st.done_heap)
            st.results.pop(old, None)
            st.floor = max(st.floor, old)
        if job.via is not None:
            return [Send(job.via, result)]
        return [Multicast(job.workers, result)]

    def missing_peers(self, job_id: int | None = None) -> list[str]:
        """Workers partly merged sequences wait on, of ``job_id`` or of every job."""
        jobs = self.jobs if job_id is None else [j for j in (job_id,) if j in self.jobs]
        return [w for j in jobs for w in self.missing_workers(j)]

    def missing_workers(self, job_id: int) -> list[str]:
        """Workers that partly merged sequences of ``job_id`` still wait on."""
        job = self.jobs[job_id]
        full = (1 << len(job.workers)) - 1
        bits = 0
        for acc in self.state[job_id].accs.values():
            bits |= full & ~acc.bitmap
        return [w for i, w in enumerate(job.workers) if bits >> i & 1]

    @staticmethod
    def _bits(job: PsJob, st: _JobState, pkt: Packet) -> int:
        """The workers ``pkt`` holds, as bits over all of the job's (0: a
        header that does not fit the job)."""
        b, f = pkt.bitmap, pkt.fan_in
        if not job.groups:
            n = len(job.workers)
            return b if f == n and pkt.worker_id < n and not b >> n else 0
        if not pkt.layer:  # whole groups
            if f != len(job.groups) or pkt.worker_id >= f or b >> f:
                return 0
            masks = st.group_masks
            return sum(masks[g] for g in range(f) if b >> g & 1)
        g = pkt.layer - 1
        if g >= len(job.groups) or f != job.groups[g] or pkt.worker_id >= f or b >> f:
            return 0
        return b << st.offsets[g]

    def _result(self, job: PsJob, seq: int, acc: _Acc) -> Packet:
        n = len(job.groups) or len(job.workers)
        flags = Flag.ACK | acc.flags
        payload: np.ndarray | None = None
        if acc.fvals is not None:
            ints = 0 if acc.ivals is None else acc.ivals / job.scale
            payload = (acc.fvals + ints).astype(np.float32)
            flags |= Flag.FLOAT | Flag.OVERFLOW
        elif acc.ivals is not None:
            if np.any(np.abs(acc.ivals) > np.iinfo(np.int32).max):
                payload = (acc.ivals / job.scale).astype(np.float32)
                flags |= Flag.FLOAT | Flag.OVERFLOW
            else:
                payload = acc.ivals.astype(np.int32)
        return ina_packet(
            job_id=job.job_id, worker_id=0, seq=seq, agg_index=acc.agg_index,
            bitmap=(1 << n) - 1, fan_in=n, flags=flags, count=acc.nvalues, values=payload,
        )  # fmt: skip

    def _unicast(self, job: PsJob, st: _JobState, result: Packet, asked: Packet) -> Action:
        """``result`` for the one worker that ``asked`` again (of its group,
        in ``layer``, where the job has groups)."""
        pkt = result.clone()
        pkt.worker_id = asked.worker_id
        pkt.layer = asked.layer if job.groups else 0
        if job.via is not None:
            pkt.flags |= Flag.RESEND
            return Send(job.via, pkt)
        first = st.offsets[asked.layer - 1] if job.groups else 0
        return Send(job.workers[first + asked.worker_id], pkt)

    def _drop(self, reason: str) -> list[Action]:
        self.counters["drop_" + reason] += 1
        return []
