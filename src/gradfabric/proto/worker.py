"""Worker transport for aggregation: a window of outstanding packets.

The application ``push``es tensors (int32 arrays, or just a value count in
timing-only simulation); the engine cuts them into packets of
``values_per_packet``, numbers them with consecutive sequence numbers across
the whole job, and keeps at most ``cwnd`` of them outstanding: sequence
``seq`` may leave only while ``seq < base + cwnd``, where ``base`` is the
oldest sequence without a result. With SwitchML's static slots (``cwnd <=
slot_count``) this is exactly the slot-reuse rule: ``seq`` reuses the slot of
``seq - W`` only once that result is in.

Each outstanding packet has a retransmission deadline ``sent + rto_ns``.
With one constant RTO, deadlines are created in increasing order (a
retransmission's new deadline is later than every pending one), so a FIFO
holds them sorted: O(1) per packet instead of a heap. The earliest is
reported through ``next_deadline``. After
``max_retries`` retransmissions of one packet it gives up with ``Fail``.

With ``fast_retransmit = k`` a loss costs about a round trip instead of a
timeout: once a result ``k`` or more sequences past the oldest unanswered
one (``base``) has come back, ``base`` is sent again at once (as TCP does on
three duplicate acks), and again each time results reach ``k`` past the
highest one seen at its last resend (a resend can be lost too); where no
more results come (the window is stuck on it), the timer resends it. A
resend's deadline is ``now + rto_ns``, later than every pending one, so the
FIFO stays sorted. A needless resend is a duplicate the switch answers from
its copy or drops, so sums stay exact either way. Off (0) in the
simulator's schemes unless asked; the emulator's clients turn it on.

With ``nack`` (a switch that sends loss notices: SwitchML, see
``proto.switch.switchml``) every share is flagged ``NACK``, and a notice
from the switch naming an outstanding sequence of this worker's is resent
at once (``nack_resends``). The switch knows whose share a copy lacks, the
workers do not: with notices only the worker that lost a share resends it,
where a fast retransmit has every worker of the stalled copy resend.

With fast retransmit or notices on, a timer that finds several packets due
resends only the lowest sequence and re-arms the others (TCP's rule on a
retransmission timeout): results and notices then repair the rest, and a
window that waits on a slower peer's resend has lost nothing, where
resending it whole would cost every waiting worker a window of link time.
Otherwise the timer is the only repair and resends everything due.

With ``ecn_window`` (ATP) the window reacts to ECN echoed in results: halved
at most once per window of data, otherwise grown by one packet per window.
A result is delivered exactly once; later copies are counted duplicates.

Surviving a switch restart (``ResumableWorker``): a restarted switch is
empty, and a worker may hold a result that another worker never received.
So a resumable worker keeps, besides its outstanding packets, every
contribution whose result came back within the last window (no worker can
be more than a window behind another: ``seq`` completes only once every
worker sent it, so nobody sends ``seq + W`` before everybody sent ``seq``).
Once the job's workers agree on a floor (the smallest ``base`` among them,
while results are held), ``replay(floor)`` sends every kept contribution at
or above it again, retransmitted like any other until its result returns;
that result is then only counted (``replay_answered``), never delivered a
second time; once this worker holds the result of ``seq + W`` or later,
nobody can need ``seq`` any more and its replay stops (``replays_retired``;
the switch may no longer answer it). While replays are outstanding the timer
resends everything due, not only the lowest: a replay the new switch can no
longer answer must not hold back this worker's own resends. Every sequence
some worker still needs is then resent by all workers, and all of them lie
in ``[floor, floor + 2W)``, which SwitchML's two copies per slot (and ATP's
keys) tell apart.

A result still on its way from the old switch must not count as the new
switch's answer (the new one may still need this worker's share), so a
driver replays only once no such result can arrive: the emulator's client
takes a new socket before it reports its ``base`` (``runtime.client``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Fail, Send
from gradfabric.proto.routes import HashedPool as HashedPool
from gradfabric.proto.routes import Route
from gradfabric.proto.routes import Sharded as Sharded
from gradfabric.proto.routes import StaticSlots as StaticSlots
from gradfabric.wire.packet import MAX_FAN_IN, Flag, Packet, ina_packet


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class WorkerConfig:
    job_id: int
    worker_id: int
    fan_in: int
    window: int = 64
    max_window: int = 0
    rto_ns: int = 1_000_000
    max_retries: int = 100
    max_ahead: int = 1 << 24  # how far past the window a (helped) result may be
    helping: int = -1  # SA-ATP shadow stream: send this worker's share, flagged HELP
    values_per_packet: int = 256
    ecn_window: bool = False
    fast_retransmit: int = 0  # resend base once a result this far past it came (0: off)
    nack: bool = False  # ask the switch for loss notices (flag shares NACK) and act on them
    first_seq: int = 0  # where the job's sequences start (every worker of a job alike)
    group: int = 0  # ATP's two levels: rack ``g``'s workers send ``layer = g + 1`` (``SwitchJob``)

    def __post_init__(self) -> None:
        if not 1 <= self.fan_in <= MAX_FAN_IN:
            raise ConfigError("fan_in", f"must be in 1..{MAX_FAN_IN}, got {self.fan_in}")
        if not 0 <= self.worker_id < self.fan_in:
            raise ConfigError("worker_id", f"must be in 0..{self.fan_in - 1}")
        if self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")
        if self.rto_ns <= 0:
            raise ConfigError("rto_ns", f"must be > 0, got {self.rto_ns}")
        if self.values_per_packet < 1:
            raise ConfigError("values_per_packet", "must be >= 1")
        if self.fast_retransmit < 0:
            raise ConfigError("fast_retransmit", f"must be >= 0, got {self.fast_retransmit}")
        if not 0 <= self.first_seq < 1 << 32:  # (the switch takes a new job's first as sent)
            raise ConfigError("first_seq", f"must be in 0..2**32-1, got {self.first_seq}")
        if self.helping >= self.fan_in or self.helping == self.worker_id:
            raise ConfigError("helping", "must name another worker of the job (or -1)")
        if not 0 <= self.group <= MAX_FAN_IN:
            raise ConfigError("group", f"must be in 0..{MAX_FAN_IN}, got {self.group}")


# An outstanding packet: [packet, deadline_ns, retransmissions] (a list: cheaper
# to build per packet than an object).
_PKT, _DEADLINE, _TRIES = range(3)


class WorkerEngine:
    def __init__(
        self, name: str, cfg: WorkerConfig, route: Route, cap: WorkerEngine | None = None
    ) -> None:
        """``cap``: a stream this one never runs ahead of (an SA-ATP host's own,
        for a shadow that sends a straggler's share from it)."""
        if cfg.window > route.max_window:
            raise ConfigError(
                "window",
                f"{cfg.window} > {route.max_window}: a window cannot exceed the "
                "slots the route reuses (SwitchML's static range)",
            )
        self.name = name
        self.cfg = cfg
        self.job_id = cfg.job_id
        self.ecn_window = cfg.ecn_window
        self.route = route
        # What every packet of this stream shares, and the route's lookups,
        # read once here rather than on every packet (the hot path).
        helping = cfg.helping >= 0
        self._header = (
            cfg.job_id, cfg.worker_id, cfg.fan_in,
            1 << (cfg.helping if helping else cfg.worker_id),
            Flag.HELP if helping else Flag.NACK if cfg.nack else 0, cfg.rto_ns, cfg.group,
        )  # fmt: skip
        self._agg_index, self._dst = route.agg_index, route.dst
        self.counters = Counters()
        self.cwnd = float(cfg.window)
        self.max_cwnd = float(cfg.max_window or cfg.window)
        self.base = cfg.first_seq
        self.next_seq = cfg.first_seq
        self.queue: deque[tuple[int, int, np.ndarray | None, int]] = deque()
        self.out: dict[int, list[Any]] = {}
        self.done_above: set[int] = set()
        self.timers: deque[tuple[int, int]] = deque()
        self.recover_seq = 0
        self.cap = cap
        self.fast = cfg.fast_retransmit
        self.lowest_first = bool(cfg.fast_retransmit or cfg.nack)  # the timer's rule
        self.highest = -1  # the highest sequence a result came back for
        self.fast_seq = -1  # the oldest unanswered sequence, and the highest
        self.fast_from = -1  # result when it was last sent (fast retransmit)

    # -- application side -------------------------------------------------
    def push(
        self,
        count: int,
        now_ns: int,
        payload: np.ndarray | None = None,
        priority: int = 0,
        at_seq: int | None = None,
    ) -> list[Action]:
        """Queue ``count`` values (and their int32 ``payload`` in values mode).

        ``at_seq`` numbers them from that sequence: every worker numbers the
        job's tensors alike, so one that skipped a tensor (it was helped, and
        abandoned it) must skip its sequences too. The skipped sequences are
        never sent; their results are expected like any other.
        """
        if payload is not None and len(payload) != count:
            raise ValueError(f"payload has {len(payload)} values, count says {count}")
        if at_seq is not None:
            if at_seq < self.next_seq:
                raise ValueError(f"at_seq {at_seq} is behind the next sequence {self.next_seq}")
            self.next_seq = at_seq
        vpp = self.cfg.values_per_packet
        for off in range(0, count, vpp):
            n = min(vpp, count - off)
            part = None if payload is None else payload[off : off + n]
            self.queue.append((self.next_seq, n, part, priority))
            self.next_seq += 1
        return self._pump(now_ns)

    def skip_to(self, seq: int) -> None:
        """Start this (empty) stream at ``seq``: a helper's shadow of a straggler
        joins the job's sequence space where the help begins."""
        if self.queue or self.out or seq < self.next_seq:
            raise ValueError("skip_to needs an idle stream and a later sequence")
        self.base = self.next_seq = seq
        self.done_above = {x for x in self.done_above if x > seq}

    @property
    def idle(self) -> bool:
        """True once every pushed sequence has its result."""
        return self.base >= self.next_seq  # results may run ahead (SA-ATP help)

    # -- engine interface -------------------------------------------------
    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if not pkt.flags & Flag.ACK or pkt.job_id != self.job_id:
            if pkt.flags & Flag.NACK and self._notice_for_me(pkt):
                return self._on_notice(pkt.seq, now_ns)
            self.counters["drop_foreign"] += 1
            return []
        seq = pkt.seq
        if self.out.pop(seq, None) is None:
            if seq < self.base or seq in self.done_above or seq >= self.base + self.cfg.max_ahead:
                self.counters["drop_duplicate_result"] += 1
                return []
            # A result for a sequence this worker has not sent (yet): someone
            # helped it (SA-ATP). Take it; the sequence is skipped when pushed.
            self.counters["results_ahead"] += 1
        self.counters["results"] += 1
        if seq == self.base:
            base = seq + 1
            done = self.done_above
            while base in done:
                done.discard(base)
                base += 1
            self.base = base
        else:
            self.done_above.add(seq)
        if self.ecn_window:
            self._adjust_window(pkt)
        actions = self._pump(now_ns)
        if self.fast:
            self._fast_retransmit(seq, now_ns, actions)
        actions.append(Deliver(seq, pkt))
        return actions

    def _notice_for_me(self, pkt: Packet) -> bool:
        """A loss notice addressed to this worker (one it asked for)."""
        return (
            self.cfg.nack
            and pkt.job_id == self.job_id
            and pkt.worker_id == self.cfg.worker_id
            and not pkt.flags & Flag.ACK
        )

    def _on_notice(self, seq: int, now_ns: int) -> list[Action]:
        """The switch lacks this worker's share of ``seq``: send it again."""
        o = self.out.get(seq)
        if o is None or o[_TRIES] >= self.cfg.max_retries:  # answered, or the timer's to fail
            self.counters["drop_stale_nack"] += 1
            return []
        o[_TRIES] += 1
        self.counters["nack_resends"] += 1
        return [self._resend(seq, o, now_ns + self.cfg.rto_ns)]

    def _fast_retransmit(self, seq: int, now_ns: int, actions: list[Action]) -> None:
        if seq > self.highest:
            self.highest = seq
        base = self.base
        if self.fast_seq != base:  # a new oldest: count from itself
            self.fast_seq = self.fast_from = base
        if self.highest - self.fast_from < self.fast:
            return
        o = self.out.get(base)
        if o is None or o[_TRIES] >= self.cfg.max_retries:  # answered, or the timer's to fail
            return
        self.fast_from = self.highest  # once more only after k results past this point
        o[_TRIES] += 1
        self.counters["fast_retransmits"] += 1
        actions.append(self._resend(base, o, now_ns + self.cfg.rto_ns))

    def on_timer(self, now_ns: int) -> list[Action]:
        """Resend what is due. With fast retransmit or notices on, only the
        lowest due sequence is resent and the others are re-armed (TCP's
        rule): results and notices repair the rest, and a window that waits
        on a slower peer's resend has nothing lost; without them the timer is
        the only repair."""
        actions: list[Action] = []
        timers, out = self.timers, self.out
        due: list[tuple[int, int]] = []  # (deadline, seq), live
        while timers and timers[0][0] <= now_ns:
            deadline, seq = timers.popleft()
            o = out.get(seq)
            if o is not None and o[_DEADLINE] == deadline:
                due.append((deadline, seq))
        if self.lowest_first and len(due) > 1:
            lowest = min(due, key=lambda x: x[1])
            later = now_ns + self.cfg.rto_ns
            for _, seq in due:
                if seq != lowest[1]:
                    out[seq][_DEADLINE] = later
                    timers.append((later, seq))
            self.counters["timer_rearmed"] += len(due) - 1
            due = [lowest]
        for i, (_, seq) in enumerate(due):
            o = out[seq]
            o[_TRIES] += 1
            if o[_TRIES] > self.cfg.max_retries:
                timers.extendleft(reversed(due[i + 1 :]))  # still due, as they were
                return [
                    Fail(
                        self.route.dst(seq),
                        f"sequence {seq} unanswered after {self.cfg.max_retries} retries",
                        self.cfg.rto_ns * (self.cfg.max_retries + 1),
                    )
                ]
            self.counters["retransmits"] += 1
            actions.append(self._resend(seq, o, now_ns + self.cfg.rto_ns))
        return actions

    def _resend(self, seq: int, o: list[Any], deadline_ns: int) -> Send:
        """``seq`` once more, flagged as a resend where the route says so, due
        again at ``deadline_ns`` (later than every pending deadline)."""
        if o[_DEADLINE] != deadline_ns:  # (a second resend in the same instant: one timer)
            self.timers.append((deadline_ns, seq))
        o[_DEADLINE] = deadline_ns
        pkt = o[_PKT].clone()
        if self.route.resend_flag:
            pkt.flags |= Flag.RESEND
        return Send(self.route.dst(seq), pkt)

    def next_deadline(self) -> int | None:
        timers, out = self.timers, self.out
        while timers:
            deadline, seq = timers[0]
            o = out.get(seq)
            if o is not None and o[_DEADLINE] == deadline:
                return deadline
            timers.popleft()
        return None

    def pump(self, now_ns: int) -> list[Action]:
        """Send what the window now allows (after a capping stream moved on)."""
        return self._pump(now_ns)

    # -- internals --------------------------------------------------------
    def _pump(self, now_ns: int) -> list[Action]:
        actions: list[Action] = []
        queue = self.queue
        limit = self.base + int(self.cwnd)
        if self.cap is not None:  # a shadow never runs ahead of its host's own window
            limit = min(limit, self.cap.base + int(self.cap.cwnd))
        if not queue or queue[0][0] >= limit:
            return actions
        out, timers, done = self.out, self.timers, self.done_above
        job, wid, fan_in, bit, flags, rto_ns, layer = self._header
        deadline = now_ns + rto_ns
        agg_index, dst = self._agg_index, self._dst
        while queue and queue[0][0] < limit:
            seq, n, part, prio = queue.popleft()
            if seq < self.base or seq in done:  # already answered (helped ahead)
                continue
            pkt = ina_packet(
                job_id=job, worker_id=wid, seq=seq, agg_index=agg_index(seq), bitmap=bit,
                fan_in=fan_in, flags=flags, priority=prio, layer=layer, count=n, values=part,
            )  # fmt: skip
            out[seq] = [pkt, deadline, 0]
            timers.append((deadline, seq))
            actions.append(Send(dst(seq), pkt))
        return actions

    def _adjust_window(self, pkt: Packet) -> None:
        if pkt.flags & Flag.ECN:
            if pkt.seq >= self.recover_seq:
                self.cwnd = max(1.0, self.cwnd / 2)
                self.recover_seq = self.next_seq
                self.counters["ecn_halvings"] += 1
        else:
            self.cwnd = min(self.max_cwnd, self.cwnd + 1.0 / self.cwnd)


class ResumableWorker(WorkerEngine):
    """A worker that can replay after its switch restarted (see the module
    doc). Its bookkeeping lives here, off the plain worker's per-result path,
    which the simulator runs millions of times."""

    def __init__(self, name: str, cfg: WorkerConfig, route: Route) -> None:
        super().__init__(name, cfg, route)
        self.keep = max(cfg.window, cfg.max_window)  # sequences of completed contributions
        self.kept: dict[int, Packet] = {}
        self.replaying: set[int] = set()

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        seq = pkt.seq
        o = self.out.get(seq) if pkt.flags & Flag.ACK and pkt.job_id == self.job_id else None
        if o is not None:
            if seq in self.replaying:
                self.replaying.discard(seq)
                if seq < self.base or seq in self.done_above:  # delivered already
                    del self.out[seq]
                    self.counters["replay_answered"] += 1
                    return []
            self._keep(seq, o[_PKT])
        actions = super().on_packet(pkt, now_ns)
        if self.replaying:
            self._retire_replays()
        return actions

    def replay(self, floor: int, now_ns: int) -> list[Action]:
        """The switch restarted empty: send again every kept contribution at or
        above ``floor`` and every outstanding packet, flagged as resends."""
        out = self.out
        low = max(floor, self.base - self.keep)  # below base - W nobody can need it
        for seq, pkt in self.kept.items():
            if seq >= low and seq not in out:
                out[seq] = [pkt, 0, 0]
        self.replaying = set(out)
        self.counters["replays"] += 1
        deadline = now_ns + self.cfg.rto_ns
        actions: list[Action] = []
        for seq in sorted(out):
            out[seq][_TRIES] = 0  # a fresh budget against the new switch
            actions.append(self._resend(seq, out[seq], deadline))
        return actions

    def on_timer(self, now_ns: int) -> list[Action]:
        """While replaying, every due packet is resent: the timer's lowest-first
        rule counts on results and notices to repair the rest, and the lowest
        may be a replay the new switch can no longer answer (its copy moved on,
        a stale drop, silent) while this worker's result of a later sequence
        was lost; resending only it would wait on nothing, forever."""
        if not self.replaying or not self.lowest_first:
            return super().on_timer(now_ns)
        self.lowest_first = False
        try:
            return super().on_timer(now_ns)
        finally:
            self.lowest_first = True

    def _retire_replays(self) -> None:
        """Stop replaying what nobody can need: once this worker holds the
        result of any ``s`` (not only those below ``base``), every worker sent
        ``s``, so every worker held the result of every ``seq <= s - W``."""
        low = max(self.done_above, default=self.base - 1) + 1 - self.keep
        for seq in [s for s in self.replaying if s < low]:
            self.replaying.discard(seq)
            self.out.pop(seq, None)
            self.counters["replays_retired"] += 1

    def own_kept(self) -> None:
        """The kept contributions' values copied out of the arrays they were
        pushed from (a driver calls this once a call is complete: its caller
        may reuse them, and a replay must send what was sent)."""
        for seq, pkt in self.kept.items():
            if pkt.payload is not None and pkt.payload.base is not None:  # a view of theirs
                own = pkt.clone()
                own.payload = pkt.payload.copy()
                self.kept[seq] = own

    def _keep(self, seq: int, pkt: Packet) -> None:
        """Keep ``seq``'s contribution; drop those below ``base - keep`` once
        they make up a third of what is kept (at most ``2 * keep`` lie above)."""
        kept = self.kept
        kept[seq] = pkt
        if len(kept) > 3 * self.keep:
            low = self.base - self.keep
            self.kept = {s: p for s, p in kept.items() if s >= low}
