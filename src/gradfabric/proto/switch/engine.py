"""Switch engine: validates packets, then hands them to an allocation policy.

Everything that arrives is checked against the job table before any state is
touched: an unknown job, a worker index outside the job, a bitmap that is not
the sender's own bit, an aggregator index outside the job's range, or a
payload of the wrong shape is a counted drop (``counters['drop_<reason>']``).
A packet therefore can only ever change aggregators its own job may use.

Policies (``ALLOCATORS``, by name) own the aggregator pool; see ``switchml.py``
and ``atp.py`` for their slot lifecycles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters, NullSink, TraceSink
from gradfabric.proto.actions import Action, NoTimers
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.proto.switch.straggler import HelpConfig, StragglerMonitor
from gradfabric.wire.packet import Flag, Packet


@dataclass
class PoolStats:
    """Aggregator-time accounting (ns) for switch memory utilisation.

    ``busy_ns``: from an aggregator's first packet until its aggregate is
    complete. ``held_ns``: from claim until its result is known (for ATP, until
    the PS result passes back and frees it; for SwitchML, until the result is
    multicast, after which the copy only shadows it for retransmissions).
    """

    aggregators: int
    busy_ns: int = 0
    held_ns: int = 0
    claims: int = 0

    @classmethod
    def total(cls, stats: Iterable[PoolStats]) -> PoolStats:
        out = cls(aggregators=0)
        for st in stats:
            out.aggregators += st.aggregators
            out.busy_ns += st.busy_ns
            out.held_ns += st.held_ns
            out.claims += st.claims
        return out


class Policy(Protocol):
    name: str
    stats: PoolStats

    def on_gradient(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]: ...

    def on_result(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]: ...

    def on_lower(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        """A packet of a lower level (a rack's fallback, ATP's second level)
        passing through on its way to the PS."""
        ...

    def result_fan_in(self, job: SwitchJob) -> int:
        """The fan-in a legitimate result for ``job`` carries at this switch."""
        ...

    def admit(self, job: SwitchJob) -> None:
        """The control plane installs ``job``: clear whatever state it may use."""
        ...

    def retire(self, job: SwitchJob) -> None:
        """``job`` left: release everything it holds."""
        ...

    def missing(self, job: SwitchJob) -> int:
        """Bitmap of children some partly filled aggregator of ``job`` waits on."""
        ...


class PolicyFactory(Protocol):
    def __call__(self, pool_slots: int, counters: Counters) -> Policy: ...


ALLOCATORS: Registry[PolicyFactory] = Registry("allocation policy")


@dataclass
class SwitchEngine(NoTimers):
    """A programmable switch running in-network aggregation for many jobs."""

    name: str
    policy: Policy
    counters: Counters
    jobs: dict[int, SwitchJob] = field(default_factory=dict)
    trace: TraceSink = field(default_factory=NullSink)

    def __post_init__(self) -> None:
        self.on_gradient = self.policy.on_gradient
        self.monitors: dict[int, StragglerMonitor] = {}

    def watch(self, job_id: int, cfg: HelpConfig) -> None:
        """Enable SA-ATP straggler help for ``job_id`` at this switch."""
        self.monitors[job_id] = StragglerMonitor(cfg, self.jobs[job_id], self.counters)

    @classmethod
    def build(
        cls, name: str, policy: str, pool_slots: int, jobs: tuple[SwitchJob, ...] = ()
    ) -> SwitchEngine:
        if pool_slots < 1:
            raise ConfigError("pool_slots", f"must be >= 1, got {pool_slots}")
        counters = Counters()
        eng = cls(name, ALLOCATORS.get(policy)(pool_slots, counters), counters)
        for job in jobs:
            eng.add_job(job)
        return eng

    def add_job(self, job: SwitchJob) -> None:
        if job.job_id in self.jobs:
            raise ConfigError("job_id", f"job {job.job_id} already registered at {self.name}")
        if self.name in job.children or self.name == job.parent:
            raise ConfigError("children", f"{self.name} cannot be its own child or parent")
        self.policy.admit(job)
        self.jobs[job.job_id] = job

    def remove_job(self, job_id: int) -> None:
        """Unregister a finished job and release its aggregators."""
        job = self.jobs.pop(job_id)
        self.monitors.pop(job_id, None)
        self.policy.retire(job)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        job = self.jobs.get(pkt.job_id)
        if job is None:
            return self._drop("unknown_job", pkt, now_ns)
        if pkt.payload is not None and len(pkt.payload) != pkt.count:
            return self._drop("bad_payload", pkt, now_ns)
        if pkt.flags & Flag.ACK:
            if pkt.fan_in != self.policy.result_fan_in(job) or pkt.bitmap != (1 << pkt.fan_in) - 1:
                return self._drop("bad_result", pkt, now_ns)
            return self.policy.on_result(job, pkt, now_ns)
        if (job.below or job.group) and pkt.layer != job.group:  # ATP's levels (``SwitchJob``)
            if not job.below or not self._lower_ok(job, pkt):
                return self._drop("bad_level", pkt, now_ns)
            self.counters["rx_lower"] += 1
            return self.policy.on_lower(job, pkt, now_ns)
        fan_in = job.fan_in
        if pkt.fan_in != fan_in or pkt.worker_id >= fan_in or pkt.bitmap != 1 << pkt.worker_id:
            # A helper may send one other worker's share, flagged HELP (SA-ATP).
            bit = pkt.bitmap
            if not (
                pkt.flags & Flag.HELP
                and pkt.fan_in == fan_in
                and pkt.worker_id < fan_in
                and bit
                and not bit & (bit - 1)
                and bit >> fan_in == 0
            ):
                return self._drop("bad_worker", pkt, now_ns)
            self.counters["rx_help"] += 1
        self.counters["rx_gradient"] += 1
        actions = self.on_gradient(job, pkt, now_ns)
        if self.monitors:
            mon = self.monitors.get(pkt.job_id)
            if mon is not None:
                actions += mon.observe(pkt)
        return actions

    @staticmethod
    def _lower_ok(job: SwitchJob, pkt: Packet) -> bool:
        """A packet of group ``layer - 1`` below: contributions of that group's
        workers, sent by one of them (or by its rack switch)."""
        g = pkt.layer - 1
        if g >= len(job.below) or pkt.fan_in != job.below[g]:
            return False
        return 0 < pkt.bitmap < 1 << pkt.fan_in and pkt.worker_id < pkt.fan_in

    def missing_peers(self, job_id: int | None = None) -> list[str]:
        """Children some partly filled aggregator waits on, of ``job_id`` or
        of every job."""
        jobs = self.jobs if job_id is None else [j for j in (job_id,) if j in self.jobs]
        return [c for j in jobs for c in self.missing_children(j)]

    def missing_children(self, job_id: int) -> list[str]:
        """Children that partly filled aggregators of ``job_id`` still wait on
        (who to blame when a collective stalls)."""
        job = self.jobs[job_id]
        bits = self.policy.missing(job)
        return [c for i, c in enumerate(job.children) if bits >> i & 1]

    def _drop(self, reason: str, pkt: Packet, now_ns: int) -> list[Action]:
        self.counters["drop_" + reason] += 1
        self.trace.emit(
            "drop",
            now_ns,
            switch=self.name,
            reason=reason,
            job=pkt.job_id,
            worker=pkt.worker_id,
            seq=pkt.seq,
        )
        return []
