"""Many training jobs sharing switches' aggregator pools; job completion times.

Jobs arrive (Poisson, or a trace file of ``arrival_s,model,workers,iterations``
rows), wait for free hosts (and, under SwitchML, for a free static slot
partition in one rack), then train for their iterations on those hosts. Every
rack's ToR (the one switch of a star, or a leaf of a leaf-spine) has its own
aggregator pool, shared by the jobs placed in that rack; each job has its own
PS hosts, which may sit in another rack. Under ATP and ESA a job that fits no
rack spans several (the fewest that hold it): ATP's two levels, its racks'
switches then ``spine0``, whose pool every spanning job shares (and ESA
preempts in, as at the racks: the paper's rule at both levels). A job's completion time (JCT) runs
from its arrival to its last result, queueing included. Under ESA, workers
stamp every packet with their job's priority (``proto/priority.py``), recomputed at each iteration.

Two levels (``TenancyConfig.level``). ``packet`` moves every packet.
``hybrid`` keeps packets where contention is per packet and prices the rest
by the flow level (``sim.flow``): once every worker of a job on a star has
begun an iteration (its starts drawn as at packet level), the iteration is
priced by the job's flow plan, ending when the plan's schedule of its
buckets (each from its last worker) ends, wherever no other job can hold a
pool meanwhile (``_Tenancy.overlapped``: another job's packet-level
iteration, a flow-level one or the next it can start, or a job still to be
placed); else its packets move, each worker's from its own start and
priority, once the last has begun (``tests/unit/test_hybrid.py``). On a
leaf-spine (a job's PS shards in other racks), or where a job's window
does not fit the pool, it is packet level; a job waiting for hosts keeps
every job's packets. Pool use and counters count packet iterations only.
"""

from __future__ import annotations

import csv
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.priority import PRIORITIES
from gradfabric.proto.schemes import SCHEMES, InaConfig, Placement, worker_input
from gradfabric.proto.switch import PoolStats, SwitchEngine
from gradfabric.proto.worker import WorkerEngine
from gradfabric.sim.collective import Bucket, FabricConfig, deliver_into
from gradfabric.sim.flow import Plan, plan, schedule
from gradfabric.sim.fluid import Clos
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.network import Network
from gradfabric.sim.topology import leaf_spine, star
from gradfabric.wire.packet import MAX_FAN_IN
from gradfabric.workloads.catalog import check_model, model_spec
from gradfabric.workloads.compute import Timeline, device, timeline

TENANCY_SCHEMES = ("esa", "atp", "switchml")
LEVELS = ("packet", "hybrid")
NEVER = float("inf")


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class JobSpec:
    job_id: int
    arrival_ns: int
    model: str
    workers: int
    iterations: int


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class TenancyConfig:
    scheme: str = "esa"
    priority: str = "srpt-aging"
    aging_s: float = 0.05
    pool_slots: int = 4096  # real aggregators (one per 256-value packet) in the shared pool
    hosts: int = 48  # per rack
    racks: int = 1  # 1: a star (one ToR); more: a leaf-spine (a job in one rack if it fits)
    jobs: int = 12
    load: float = 0.7  # offered load: arrival rate x mean isolated work / host capacity
    models: tuple[str, ...] = ("resnet50", "bert-base")
    workers_choices: tuple[int, ...] = (4, 8)
    iterations_range: tuple[int, int] = (2, 5)
    batch: int = 32
    device: str = "v100"
    bucket_mb: float = 25.0
    trace_file: str = ""
    # an iteration's forward and backward in ms where it is known (an emulated
    # device's deadline); 0: from the device and the model's FLOPs
    compute_ms: float = 0.0
    seed: int = 0
    # ATP's fallback parameter server: sharded by sequence over this many PS
    # hosts per job (0: one per worker, as ATP deploys it, BytePS style; 1: a
    # single PS), each merging partial aggregates at ``ps_merge_gbps``
    ps_shards: int = 0
    ps_merge_gbps: float = 80.0
    # Workers out of lockstep: each iteration's compute starts up to this late
    # (uniform, per worker), and every packet crosses each link up to
    # ``packet_jitter_ns`` late, so aggregators are held partly filled
    iteration_jitter_us: float = 0.0
    packet_jitter_ns: int = 0
    fabric: FabricConfig = field(default_factory=FabricConfig)
    ina: InaConfig = field(default_factory=lambda: InaConfig(train_packets=64))
    # "packet", or "hybrid": an iteration no other job can overlap in the
    # pools is priced at flow level (module doc)
    level: str = "packet"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError("level", f"unknown {self.level!r}; valid: {', '.join(LEVELS)}")
        if self.ps_shards < 0 or self.ps_merge_gbps <= 0:
            raise ConfigError("ps_shards", "ps_shards must be >= 0 and ps_merge_gbps > 0")
        if self.iteration_jitter_us < 0 or self.packet_jitter_ns < 0 or self.compute_ms < 0:
            raise ConfigError("iteration_jitter_us", "jitter and compute_ms must be >= 0")
        if self.scheme not in TENANCY_SCHEMES:
            raise ConfigError(
                "scheme", f"unknown {self.scheme!r}; valid: {', '.join(TENANCY_SCHEMES)}"
            )
        PRIORITIES.get(self.priority)
        for m in self.models:
            check_model(m, "models")
        device(self.device)
        if self.racks < 1:
            raise ConfigError("racks", f"must be >= 1, got {self.racks}")
        # a job spans at most 64 racks (ATP's second level is one bitmap word)
        room = self.hosts if self.scheme == "switchml" else self.hosts * min(self.racks, 64)
        if not 1 <= self.hosts <= 64 or max(self.workers_choices) > room:
            raise ConfigError("hosts", "need 1..64 hosts per rack and room for every job "
                              "(in one rack under SwitchML)")  # fmt: skip
        if self.load <= 0 or self.jobs < 1 or self.pool_slots < 1:
            raise ConfigError("load", "load, jobs and pool_slots must be > 0")


def job_trace(cfg: TenancyConfig) -> list[JobSpec]:
    """The jobs of a run: from ``trace_file`` or Poisson arrivals at ``load``."""
    if cfg.trace_file:
        return _trace_file(Path(cfg.trace_file))
    rng = random.Random(cfg.seed)
    draws = [
        (
            rng.choice(cfg.models),
            rng.choice(cfg.workers_choices),
            rng.randint(*cfg.iterations_range),
        )
        for _ in range(cfg.jobs)
    ]
    dev = device(cfg.device)
    work = [
        it
        * n
        * _iteration_ns(
            timeline(model_spec(m), cfg.batch, dev, cfg.bucket_mb),
            model_spec(m).params,
            cfg.fabric.link.link_gbps,
        )
        for m, n, it in draws
    ]
    rate = cfg.load * cfg.hosts * cfg.racks / float(np.mean(work))  # jobs per ns
    t, jobs = 0.0, []
    for i, (m, n, it) in enumerate(draws):
        jobs.append(JobSpec(i + 1, int(t), m, n, it))
        t += rng.expovariate(rate)
    return jobs


def _iteration_ns(tl: Timeline, params: int, gbps: float) -> float:
    return max(tl.compute_ns, tl.forward_ns + params * 32 / gbps)


def _ps_names(job: JobSpec, cfg: TenancyConfig) -> list[str]:
    n = cfg.ps_shards or job.workers
    return [f"ps{job.job_id}"] if n == 1 else [f"ps{job.job_id}.{k}" for k in range(n)]


def _trace_file(path: Path) -> list[JobSpec]:
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except OSError as e:
        raise ConfigError("trace_file", str(e)) from None
    jobs = []
    for i, row in enumerate(rows):
        try:
            arrival_s, model, n, it = float(row[0]), row[1].strip(), int(row[2]), int(row[3])
        except (ValueError, IndexError):
            raise ConfigError(
                "trace_file", f"line {i + 1}: want arrival_s,model,workers,iterations"
            ) from None
        check_model(model, "trace_file")
        jobs.append(JobSpec(i + 1, int(arrival_s * 1e9), model, n, it))
    return sorted(jobs, key=lambda j: j.arrival_ns)


class _Job:
    """One job's engines, schedule and bookkeeping on the shared fabric."""

    def __init__(self, spec: JobSpec, cfg: TenancyConfig, values: bool) -> None:
        self.spec = spec
        self.tl = timeline(model_spec(spec.model), cfg.batch, device(cfg.device), cfg.bucket_mb)
        if cfg.compute_ms:
            self.tl = self.tl.scaled(round(cfg.compute_ms * 1e6))
        self.J = len(self.tl.buckets)
        vpp = cfg.ina.values_per_sim_packet
        counts = [b.values for b in self.tl.buckets] * spec.iterations
        self.counts = counts
        self.npk = [max(1, -(-c // vpp)) for c in counts]
        self.first_seq = [0, *np.cumsum(self.npk)[:-1].tolist()]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        self.vpp = vpp
        self.bytes_per_iteration = 4 * sum(b.values for b in self.tl.buckets)
        self.hosts: list[str] = []
        self.engines: list[WorkerEngine] = []
        self.left: list[list[int]] = []
        self.done_iters: list[int] = []
        self.start_ns = -1
        self.end_ns = -1
        self.partition = -1
        self.racks: list[_Rack] = []
        self.placement: Placement | None = None
        self.inputs: list[np.ndarray] | None = None
        self.results: list[np.ndarray] | None = None
        # the hybrid level's (``_Tenancy.decide``): the flow plan of a job in
        # one rack (None: packets only); each worker's start of the iteration
        # being begun; when the job may hold a pool: [lo, hi), and from next_lo on
        self.plan: Plan | None = None
        self.t0: dict[int, tuple[int, int]] = {}  # worker: its start and priority
        self.lo, self.hi, self.next_lo = NEVER, NEVER, NEVER
        self.flowed = 0  # iterations priced at flow level
        if values:
            n, total = spec.workers, int(self.offsets[-1])
            self.inputs = [
                worker_input(cfg.seed * 7919 + spec.job_id, w, n, total) for w in range(n)
            ]
            self.results = [np.zeros(total, dtype=np.int64) for _ in range(n)]


@dataclass
class TenancyResult:
    jobs: list[dict[str, Any]]
    makespan_ns: int
    mem_util: float
    mem_held: float
    events: int
    wall_s: float
    counters: dict[str, int]
    exact: bool | None = None
    flowed: int = 0  # iterations the hybrid level priced at flow level

    @property
    def avg_jct_s(self) -> float:
        return float(np.mean([j["jct_s"] for j in self.jobs]))

    @property
    def p99_jct_s(self) -> float:
        return float(np.percentile([j["jct_s"] for j in self.jobs], 99))


@dataclass
class _Rack:
    switch: SwitchEngine
    free: list[str]
    partitions: list[bool]


class _Tenancy:
    def __init__(self, cfg: TenancyConfig, jobs: list[JobSpec], values: bool) -> None:
        self.cfg = cfg
        self.loop = EventLoop()
        slack = cfg.fabric.timer_slack_ns
        self.net = Network(self.loop, random.Random(cfg.seed), cfg.ina.values_per_packet,
                           timer_slack_ns=slack, slack_seed=cfg.seed)  # fmt: skip
        racks = [[f"h{r * cfg.hosts + i}" for i in range(cfg.hosts)] for r in range(cfg.racks)]
        # job j's PS shard k is a host of its own in rack (j - 1 + k) mod racks,
        # placed before the job lands (without regard to its workers): spread as
        # BytePS spreads its servers over machines; all in one rack, a spanning
        # job's fallbacks (a scarce pool's all but every packet) shared that
        # rack's one link from the second level, and its workers gave up
        self.shards = {j.job_id: _ps_names(j, cfg) for j in jobs}
        for j in jobs:
            for k, name in enumerate(self.shards[j.job_id]):
                racks[(j.job_id - 1 + k) % cfg.racks].append(name)
        link = replace(cfg.fabric.link, jitter_ns=cfg.packet_jitter_ns or cfg.fabric.link.jitter_ns)
        up = cfg.fabric.uplink and replace(cfg.fabric.uplink, jitter_ns=link.jitter_ns)
        if cfg.racks == 1:
            topo = star(self.net, racks[0], link, up)
        else:
            topo = leaf_spine(self.net, racks, cfg.fabric.spines, link, cfg.fabric.fabric_link, up)
        for names in self.shards.values():  # idle hosts where the scheme needs no PS
            for name in names:
                self.net.serve_at(name, cfg.ps_merge_gbps)
        self.jitter_rng = random.Random(cfg.seed * 7919 + 17)
        ina = cfg.ina
        self.pool = max(1, cfg.pool_slots // ina.train_packets)  # simulated aggregators
        self.scheme = scheme = SCHEMES.get(cfg.scheme)
        self.window = scheme.window(ina)
        policy = scheme.policy
        assert policy is not None  # TENANCY_SCHEMES all keep state at the switch
        # One pool per rack switch; SwitchML splits it into static partitions of
        # 2 x window (the shadow copies).
        self.racks: list[_Rack] = []
        for hosts in racks:
            name = topo.first_hop[hosts[0]]
            sw = SwitchEngine.build(name, policy, self.pool)
            self.net.bind(name, sw)
            self.racks.append(
                _Rack(
                    sw,
                    [h for h in hosts if h.startswith("h")],
                    [True] * (self.pool // (2 * self.window)),
                )
            )
        if scheme.static_slots and not self.racks[0].partitions:
            raise ConfigError("pool_slots", "too small for one SwitchML partition")
        self.rack_of = {h: r for r in self.racks for h in r.free}
        self.switches = {r.switch.name: r.switch for r in self.racks}
        # ATP's second level for jobs that span racks: a pool at spine0
        self.root: SwitchEngine | None = None
        self.spanned = False  # a job used it (its pool counts in memory use from then)
        if cfg.racks > 1 and not scheme.static_slots:
            self.root = SwitchEngine.build(topo.spines[0], policy, self.pool)
            self.net.bind(self.root.name, self.root)
            self.switches[self.root.name] = self.root
        self.hybrid = cfg.level == "hybrid"
        if self.hybrid and values:
            raise ConfigError("level", "the hybrid level prices iterations, not values")
        self.waiting: list[_Job] = []
        self.jobs = {j.job_id: _Job(j, cfg, values) for j in jobs}
        self.finished = 0
        for j in jobs:
            self.loop.at(j.arrival_ns, self.arrive, j.job_id)

    def arrive(self, job_id: int) -> None:
        self.waiting.append(self.jobs[job_id])
        self.admit()

    def admit(self) -> None:
        while self.waiting:  # first come, first served; first rack that fits
            job = self.waiting[0]
            sml = self.scheme.static_slots
            rack = next(
                (
                    r
                    for r in self.racks
                    if len(r.free) >= job.spec.workers and (not sml or True in r.partitions)
                ),
                None,
            )
            racks = [rack] if rack is not None else self._spanning(job.spec.workers)
            if not racks:
                return
            if sml:
                job.partition = racks[0].partitions.index(True)
                racks[0].partitions[job.partition] = False
            self.waiting.pop(0)
            self.start(job, racks)

    def _spanning(self, workers: int) -> list[_Rack]:
        """The fewest racks that hold ``workers`` together, fullest first
        (none: not enough free hosts, or no second level to span with)."""
        if self.root is None:
            return []
        out: list[_Rack] = []
        room = 0
        for r in sorted(self.racks, key=lambda r: -len(r.free)):
            if room >= workers or not r.free or len(out) == MAX_FAN_IN:
                break
            out.append(r)
            room += len(r.free)
        return out if room >= workers else []

    def start(self, job: _Job, racks: list[_Rack]) -> None:
        spec, ina = job.spec, self.cfg.ina
        job.racks = racks
        left = spec.workers
        layout: dict[str, tuple[str, ...]] = {}
        for r in racks:
            take = min(left, len(r.free))
            layout[r.switch.name] = tuple(r.free[:take])
            del r.free[:take]
            left -= take
        job.hosts = [h for hosts in layout.values() for h in hosts]
        self.spanned |= len(layout) > 1
        job.start_ns = self.loop.now
        scheme = self.scheme
        p = job.placement = Placement(
            spec.job_id, tuple(job.hosts), layout,
            root=None if self.root is None else self.root.name,
            servers=tuple(self.shards[spec.job_id]),
            window=self.window, pool_slots=self.pool,
            slot_base=max(0, job.partition) * 2 * self.window,
            keep_results=2 * sum(job.npk[: job.J]), rto_ns=ina.rto_ns, values_per_packet=job.vpp,
            # the workers' own repairs, as a single job's placement gives them
            nack=ina.nack,
            fast_retransmit=ina.fast_retransmit_trains,
        )  # fmt: skip
        for ps, engine in scheme.attach(p, switches=self.switches).items():
            self.net.bind(ps, engine)
        for i, h in enumerate(job.hosts):
            eng = scheme.worker(p, i)
            assert isinstance(eng, WorkerEngine)
            job.engines.append(eng)
            self.net.bind(h, eng)
            node = self.net.nodes[h]
            node.timer_at = None
            node.on_deliver = self._deliverer(job, i)
        job.left = [list(job.npk) for _ in range(spec.workers)]
        job.done_iters = [0] * spec.workers
        # on a star, a job alone is the flow level's on a star (on a leaf-spine
        # its PS shards sit in other racks, a path the star's plan does not price)
        # (and where its window fits the pool: else it collides with itself)
        fits = scheme.static_slots or self.window <= self.pool
        if self.hybrid and self.cfg.racks == 1 and fits:
            clos = Clos(hosts_per_rack=spec.workers, link=self.cfg.fabric.link)
            ina_cfg = replace(ina, atp_pool_slots=self.pool * ina.train_packets)
            job.plan = plan(self.cfg.scheme, clos, spec.workers, ina_cfg,
                            server_gbps=self.cfg.ps_merge_gbps)  # fmt: skip
        for i in range(spec.workers):
            self.begin(job, i, 0)

    def priority(self, job: _Job, it: int) -> int:
        remaining = (job.spec.iterations - it) * job.bytes_per_iteration
        age_s = (self.loop.now - job.spec.arrival_ns) / 1e9
        return PRIORITIES.get(self.cfg.priority)(remaining, age_s, self.cfg.aging_s)

    def begin(self, job: _Job, w: int, it: int) -> None:
        t0 = self.loop.now
        if self.cfg.iteration_jitter_us:
            t0 += int(self.jitter_rng.uniform(0, self.cfg.iteration_jitter_us * 1e3))
        prio = self.priority(job, it)
        if job.plan is None:  # packet level, or a job the hybrid level cannot price
            self.pushes(job, w, it, t0, prio)
            return
        # until every worker has begun, the others may still be in the last
        # iteration: the job may hold a pool from its last start on
        job.hi = NEVER
        job.lo = min(job.lo, t0 + job.tl.buckets[0].ready_ns)
        job.t0[w] = (t0, prio)
        if len(job.t0) == job.spec.workers:
            self.decide(job, it)

    def pushes(self, job: _Job, w: int, it: int, t0: int, prio: int) -> None:
        """Worker ``w``'s buckets of iteration ``it`` at packet level, its
        compute started at ``t0``, stamped ``prio``."""
        g = it * job.J
        eng = job.engines[w]
        if eng.next_seq < job.first_seq[g]:  # iterations priced at flow level sent nothing
            eng.skip_to(job.first_seq[g])
        for j, b in enumerate(job.tl.buckets):
            self.loop.at(max(self.loop.now, t0 + b.ready_ns), self._push, (job, w, g + j, prio))

    def decide(self, job: _Job, it: int) -> None:
        """The hybrid level: iteration ``it`` of ``job`` (every worker's start
        known) at flow level where the job has a plan and no other job can
        hold a pool while it runs, else at packet level. At flow level each
        bucket leaves when the last worker has it, and every worker has the
        iteration's results when the plan's schedule ends."""
        begun = [job.t0[w] for w in range(job.spec.workers)]
        starts = [t for t, _ in begun]
        job.t0 = {}
        buckets = job.tl.buckets
        lo = min(starts) + buckets[0].ready_ns
        if job.plan is not None:  # always, here (``begin``)
            flows = [Bucket(max(t + b.ready_ns for t in starts) - lo, b.values) for b in buckets]
            end = lo + schedule(job.plan, flows)
            if not self.overlapped(job, lo, end):
                last = it + 1 == job.spec.iterations
                job.lo, job.hi = float(lo), end
                job.next_lo = NEVER if last else end + buckets[0].ready_ns
                job.flowed += 1
                self.loop.at(math.ceil(end), self._flowed, (job, it))
                return
        job.lo, job.hi, job.next_lo = float(lo), NEVER, NEVER  # until the next begins
        for w, (t0, prio) in enumerate(begun):
            self.pushes(job, w, it, t0, prio)

    def overlapped(self, job: _Job, lo: float, end: float) -> bool:
        """Whether another job may hold a pool in [``lo``, ``end``): one at
        packet level (until its iteration is done), one at flow level in its
        iteration or its next, or one not yet placed that arrives before
        ``end`` or waits for hosts (it starts when some job finishes)."""
        for other in self.jobs.values():
            if other is job or other.end_ns >= 0:
                continue
            if other.start_ns < 0:
                if other.spec.arrival_ns < end:
                    return True
            elif (other.lo < end and other.hi > lo) or other.next_lo < end:
                return True
        return False

    def _flowed(self, arg: tuple[_Job, int]) -> None:
        """Iteration ``it`` of ``job``, priced at flow level, is done."""
        job, it = arg
        last = it * job.J + job.J - 1
        for w in range(job.spec.workers):
            job.left[w][it * job.J : last + 1] = [0] * job.J
            self.bucket_done(job, w, last)

    def _push(self, arg: tuple[_Job, int, int, int]) -> None:
        job, w, g, prio = arg
        payload = None
        if job.inputs is not None:
            payload = job.inputs[w][job.offsets[g] : job.offsets[g + 1]]
        eng = job.engines[w]
        self.net.kick(
            job.hosts[w],
            eng.push(job.counts[g], self.loop.now, payload, priority=prio, at_seq=job.first_seq[g]),
        )

    def _deliverer(self, job: _Job, w: int) -> Any:
        def on_deliver(d: Any) -> None:
            results = None if job.results is None else job.results[w]
            g = deliver_into(d, job.first_seq, job.offsets, job.vpp, results, job.left[w])
            if g is not None:
                self.bucket_done(job, w, g)

        return on_deliver

    def bucket_done(self, job: _Job, w: int, g: int) -> None:
        it = g // job.J
        if any(job.left[w][it * job.J : (it + 1) * job.J]):
            return
        job.done_iters[w] = it + 1
        if it + 1 < job.spec.iterations:
            self.begin(job, w, it + 1)
        elif all(d == job.spec.iterations for d in job.done_iters):
            self.finish(job)

    def finish(self, job: _Job) -> None:
        job.end_ns = self.loop.now
        self.finished += 1
        assert job.placement is not None
        self.scheme.detach(job.placement, None, self.switches)
        for h in job.hosts:
            self.rack_of[h].free.append(h)
        if job.partition >= 0:
            job.racks[0].partitions[job.partition] = True
        if self.finished == len(self.jobs):
            self.loop.stop()
        self.admit()


def run_tenancy(
    cfg: TenancyConfig,
    jobs: list[JobSpec] | None = None,
    values: bool = False,
    horizon_ns: int = 10**13,
) -> TenancyResult:
    jobs = jobs if jobs is not None else job_trace(cfg)
    ten = _Tenancy(cfg, jobs, values)
    t0 = time.perf_counter()
    ten.loop.run(until_ns=horizon_ns)
    wall = time.perf_counter() - t0
    if ten.finished != len(jobs):
        raise RuntimeError(f"{len(jobs) - ten.finished} jobs did not finish")
    makespan = max(j.end_ns for j in ten.jobs.values()) - min(j.arrival_ns for j in jobs)
    # the racks' pools, and spine0's where a job spanned racks (else memory use
    # would count a pool no job could touch)
    used = [r.switch for r in ten.racks] + ([ten.root] if ten.root and ten.spanned else [])
    pool = PoolStats.total(sw.policy.stats for sw in used)
    held = pool.held_ns
    if ten.scheme.static_slots:  # a static partition is held for the job's whole life
        held = sum((j.end_ns - j.start_ns) * 2 * ten.window for j in ten.jobs.values())
    counters = Counters()
    for sw in ten.switches.values():
        counters.update(sw.counters)
    exact = None
    if values:
        exact = all(
            np.array_equal(res, np.sum([x.astype(np.int64) for x in j.inputs or []], axis=0))
            for j in ten.jobs.values()
            for res in j.results or []
        )
    rows = [
        {
            "job": j.spec.job_id,
            "model": j.spec.model,
            "workers": j.spec.workers,
            "iterations": j.spec.iterations,
            "arrival_s": j.spec.arrival_ns / 1e9,
            "queued_s": (j.start_ns - j.spec.arrival_ns) / 1e9,
            "jct_s": (j.end_ns - j.spec.arrival_ns) / 1e9,
        }
        for j in ten.jobs.values()
    ]
    return TenancyResult(
        jobs=rows,
        makespan_ns=makespan,
        mem_util=pool.busy_ns / (pool.aggregators * max(1, makespan)),
        mem_held=held / (pool.aggregators * max(1, makespan)),
        events=ten.loop.events,
        wall_s=wall,
        counters=counters.as_dict(),
        exact=exact,
        flowed=sum(j.flowed for j in ten.jobs.values()),
    )
