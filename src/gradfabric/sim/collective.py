"""Run one collective (all-reduce of a sequence of buckets) on a simulated fabric.

``run_collective`` builds the topology, binds engines to nodes by scheme
(``SCHEMES``: switchml, atp, ps, ring), releases each bucket at its ready
time (as DDP's backward pass does) and runs to completion. In values mode
every worker's data is seeded int32 and every delivered result is kept, so
callers can check each sum; in timing mode packets carry only a count.

Granularity: ``train_packets > 1`` makes one simulated packet stand for a
train of that many real packets (same bytes and headers on the wire, one
event), trading fidelity for speed at thousands of workers.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Deliver
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.ring import RingEngine
from gradfabric.proto.switch import PoolStats, SwitchEngine, SwitchJob
from gradfabric.proto.worker import HashedPool, Sharded, StaticSlots, WorkerConfig, WorkerEngine
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.network import LinkSpec, Network
from gradfabric.sim.topology import Topology, leaf_spine, star
from gradfabric.wire.quant import INT32_MAX

TOPOLOGIES = ("star", "leaf_spine")


@dataclass(frozen=True)
class FabricConfig:
    topology: str = "star"
    hosts_per_rack: int = 32
    spines: int = 4
    link: LinkSpec = field(default_factory=LinkSpec)
    fabric_link: LinkSpec | None = None

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ConfigError(
                "topology", f"unknown {self.topology!r}; valid: {', '.join(TOPOLOGIES)}"
            )
        if self.hosts_per_rack < 1 or self.spines < 1:
            raise ConfigError("hosts_per_rack", "hosts_per_rack and spines must be >= 1")


@dataclass(frozen=True)
class InaConfig:
    values_per_packet: int = 256
    train_packets: int = 1
    switchml_slots: int = 128
    atp_pool_slots: int = 4096
    atp_window: int = 128
    ps_window: int = 2048
    ps_servers: int = 0
    rto_ns: int = 1_000_000

    def __post_init__(self) -> None:
        for name in (
            "values_per_packet",
            "train_packets",
            "switchml_slots",
            "atp_pool_slots",
            "atp_window",
            "ps_window",
            "rto_ns",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.ps_servers < 0:
            raise ConfigError("ps_servers", "must be >= 0 (0: one server per worker)")

    def windowed(self, packets: int) -> int:
        """A window of ``packets`` real packets, in simulated packets (trains)."""
        return max(1, packets // self.train_packets)


@dataclass(frozen=True)
class Bucket:
    ready_ns: int
    count: int


@dataclass
class CollectiveResult:
    scheme: str
    workers: int
    total_values: int
    start_ns: int
    end_ns: int
    bucket_done_ns: list[list[int]]
    events: int
    wall_s: float
    counters: dict[str, int]
    pool: PoolStats
    worker_packets: int
    fallback_packets: int
    results: list[np.ndarray] | None
    inputs: list[np.ndarray] | None

    @property
    def comm_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def goodput_gbps(self) -> float:
        return self.total_values * 4 * 8 / max(1, self.comm_ns)

    @property
    def mem_util(self) -> float:
        if self.pool.aggregators == 0:
            return 0.0
        return self.pool.busy_ns / (self.pool.aggregators * max(1, self.comm_ns))

    @property
    def mem_held(self) -> float:
        if self.pool.aggregators == 0:
            return 0.0
        return self.pool.held_ns / (self.pool.aggregators * max(1, self.comm_ns))

    @property
    def ps_fallback(self) -> float:
        return self.fallback_packets / max(1, self.worker_packets)


class _Run:
    """Shared state of one run; scheme setups bind engines and return a starter."""

    def __init__(
        self,
        scheme: str,
        workers: int,
        buckets: list[Bucket],
        fabric: FabricConfig,
        ina: InaConfig,
        seed: int,
        values: bool,
    ) -> None:
        self.scheme, self.n, self.buckets, self.fabric, self.ina = (
            scheme,
            workers,
            buckets,
            fabric,
            ina,
        )
        self.loop = EventLoop()
        self.net = Network(self.loop, random.Random(seed), ina.values_per_packet)
        self.vpp = ina.values_per_packet * ina.train_packets
        self.workers = [f"w{i}" for i in range(workers)]
        self.offsets = np.concatenate([[0], np.cumsum([b.count for b in buckets])]).astype(int)
        self.total = int(self.offsets[-1])
        self.inputs: list[np.ndarray] | None = None
        self.results: list[np.ndarray] | None = None
        if values:
            lim = INT32_MAX // workers
            gen = np.random.default_rng(seed)
            self.inputs = [
                gen.integers(-lim, lim, self.total, dtype=np.int32) for _ in range(workers)
            ]
            self.results = [np.zeros(self.total, dtype=np.int64) for _ in range(workers)]
        self.done = [[-1] * len(buckets) for _ in range(workers)]
        self.left = [[0] * len(buckets) for _ in range(workers)]
        self.finished = 0
        self.switches: list[SwitchEngine] = []
        self.worker_engines: list[WorkerEngine] = []
        self.first_seq: list[int] = []

    def payload(self, w: int, b: int) -> np.ndarray | None:
        if self.inputs is None:
            return None
        return self.inputs[w][self.offsets[b] : self.offsets[b + 1]]

    def topology(self, extra: list[str]) -> Topology:
        f = self.fabric
        hosts = self.workers + extra
        if f.topology == "star":
            return star(self.net, hosts, f.link)
        racks = [self.workers[i : i + f.hosts_per_rack] for i in range(0, self.n, f.hosts_per_rack)]
        for i, h in enumerate(extra):
            racks[i % len(racks)].append(h)
        return leaf_spine(self.net, racks, f.spines, f.link, f.fabric_link)

    def bucket_done(self, w: int, b: int) -> None:
        self.done[w][b] = self.loop.now
        self.finished += 1
        if self.finished == self.n * len(self.buckets):
            self.loop.stop()

    def seq_deliverer(self, w: int) -> Callable[[Deliver], None]:
        """Map delivered sequences back to buckets (INA and PS schemes)."""
        first = self.first_seq
        vpp = self.vpp

        def on_deliver(d: Deliver) -> None:
            b = bisect.bisect_right(first, d.seq) - 1
            if self.results is not None and d.pkt.payload is not None:
                off = int(self.offsets[b]) + (d.seq - first[b]) * vpp
                self.results[w][off : off + d.pkt.count] = d.pkt.payload
            self.left[w][b] -= 1
            if self.left[w][b] < 0:
                raise RuntimeError(f"worker {w} was delivered bucket {b} more than once")
            if self.left[w][b] == 0:
                self.bucket_done(w, b)

        return on_deliver

    def windowed_workers(self, make: Callable[[int], WorkerEngine]) -> Callable[[int, int], None]:
        npk = [max(1, -(-b.count // self.vpp)) for b in self.buckets]
        self.first_seq = [0, *np.cumsum(npk)[:-1].tolist()]
        for w, name in enumerate(self.workers):
            eng = make(w)
            self.worker_engines.append(eng)
            self.net.bind(name, eng)
            self.net.nodes[name].on_deliver = self.seq_deliverer(w)
            self.left[w] = list(npk)

        def start(w: int, b: int) -> None:
            eng = self.worker_engines[w]
            acts = eng.push(self.buckets[b].count, self.loop.now, self.payload(w, b))
            self.net.kick(self.workers[w], acts)

        return start

    def worker_cfg(self, w: int, fan_in: int, window: int, ecn: bool = False) -> WorkerConfig:
        return WorkerConfig(
            job_id=1,
            worker_id=w,
            fan_in=fan_in,
            window=window,
            rto_ns=self.ina.rto_ns,
            values_per_packet=self.vpp,
            ecn_window=ecn,
        )


Setup = Callable[[_Run], Callable[[int, int], None]]
SCHEMES: Registry[Setup] = Registry("scheme")


@SCHEMES.register("switchml")
def _switchml(run: _Run) -> Callable[[int, int], None]:
    topo = run.topology([])
    slots = run.ina.windowed(run.ina.switchml_slots)
    leaves = sorted(
        {topo.first_hop[w] for w in run.workers},
        key=lambda s: int(s[4:] or 0) if s.startswith("leaf") else 0,
    )
    root = topo.spines[0] if len(leaves) > 1 else None
    local_index: dict[str, tuple[int, int]] = {}
    for li, leaf in enumerate(leaves):
        kids = topo.rack_hosts(leaf, run.workers)
        for i, h in enumerate(kids):
            local_index[h] = (i, len(kids))
        eng = SwitchEngine.build(
            leaf,
            "switchml",
            slots,
            (
                SwitchJob(
                    1,
                    tuple(kids),
                    parent=root,
                    index_at_parent=li if root else 0,
                    parent_fan_in=len(leaves) if root else 1,
                    slot_count=slots,
                ),
            ),
        )
        run.net.bind(leaf, eng)
        run.switches.append(eng)
    if root is not None:
        eng = SwitchEngine.build(
            root, "switchml", slots, (SwitchJob(1, tuple(leaves), slot_count=slots),)
        )
        run.net.bind(root, eng)
        run.switches.append(eng)

    def make(w: int) -> WorkerEngine:
        name = run.workers[w]
        i, fan = local_index[name]
        cfg = WorkerConfig(
            job_id=1,
            worker_id=i,
            fan_in=fan,
            window=slots,
            rto_ns=run.ina.rto_ns,
            values_per_packet=run.vpp,
        )
        return WorkerEngine(name, cfg, StaticSlots(topo.first_hop[name], 0, slots))

    return run.windowed_workers(make)


@SCHEMES.register("atp")
def _atp(run: _Run) -> Callable[[int, int], None]:
    topo = run.topology(["ps0"])
    sws = {topo.first_hop[w] for w in run.workers}
    if len(sws) != 1 or run.n > 64:
        raise ConfigError(
            "topology",
            "ATP here aggregates at one switch (<= 64 workers in one "
            "rack); use a star or a smaller job",
        )
    sw = sws.pop()
    pool = run.ina.atp_pool_slots
    window = run.ina.windowed(run.ina.atp_window)
    eng = SwitchEngine.build(
        sw, "atp", pool, (SwitchJob(1, tuple(run.workers), parent="ps0", window=window),)
    )
    run.net.bind(sw, eng)
    run.switches.append(eng)
    run.net.bind(
        "ps0", ParameterServer("ps0", (PsJob(1, tuple(run.workers), via=sw, window=window),))
    )
    return run.windowed_workers(
        lambda w: WorkerEngine(
            run.workers[w], run.worker_cfg(w, run.n, window, ecn=True), HashedPool(sw, 1, pool)
        )
    )


@SCHEMES.register("ps")
def _ps(run: _Run) -> Callable[[int, int], None]:
    m = run.ina.ps_servers or run.n
    servers = tuple(f"ps{i}" for i in range(m))
    run.topology(list(servers))
    window = run.ina.windowed(run.ina.ps_window)
    for s in servers:
        run.net.bind(s, ParameterServer(s, (PsJob(1, tuple(run.workers), window=window),)))
    return run.windowed_workers(
        lambda w: WorkerEngine(run.workers[w], run.worker_cfg(w, run.n, window), Sharded(servers))
    )


@SCHEMES.register("ring")
def _ring(run: _Run) -> Callable[[int, int], None]:
    link = run.fabric.link
    if link.loss or link.dup:
        raise ConfigError(
            "link.loss",
            "the ring baseline assumes a lossless, duplicate-free network (loss and dup must be 0)",
        )
    run.topology([])
    engines = [
        RingEngine(w, 1, i, run.n, run.workers[(i + 1) % run.n], run.vpp)
        for i, w in enumerate(run.workers)
    ]
    ready = [[False] * len(run.buckets) for _ in run.workers]
    nxt = [0] * run.n

    def try_start(w: int) -> None:
        b = nxt[w]
        if b < len(run.buckets) and ready[w][b] and (b == 0 or run.done[w][b - 1] >= 0):
            nxt[w] += 1
            run.net.kick(
                run.workers[w],
                engines[w].start(b, run.buckets[b].count, run.loop.now, run.payload(w, b)),
            )

    for w, eng in enumerate(engines):
        run.net.bind(run.workers[w], eng)

        def on_deliver(d: Deliver, w: int = w) -> None:
            b = d.seq
            if run.results is not None and d.pkt.payload is not None:
                run.results[w][run.offsets[b] : run.offsets[b + 1]] = d.pkt.payload
            run.bucket_done(w, b)
            try_start(w)

        run.net.nodes[run.workers[w]].on_deliver = on_deliver

    def start(w: int, b: int) -> None:
        ready[w][b] = True
        try_start(w)

    return start


def _starter(start: Callable[[int, int], None], w: int, b: int) -> Callable[[object], None]:
    return lambda _arg: start(w, b)


def run_collective(
    scheme: str,
    workers: int,
    buckets: list[Bucket],
    fabric: FabricConfig | None = None,
    ina: InaConfig | None = None,
    seed: int = 0,
    values: bool = False,
    horizon_ns: int = 10**13,
) -> CollectiveResult:
    """All-reduce ``buckets`` across ``workers`` with ``scheme``; see module doc."""
    if workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {workers}")
    if not buckets:
        raise ConfigError("buckets", "need at least one bucket")
    run = _Run(scheme, workers, buckets, fabric or FabricConfig(), ina or InaConfig(), seed, values)
    start = SCHEMES.get(scheme)(run)
    for b, bk in enumerate(buckets):
        for w in range(workers):
            run.loop.at(bk.ready_ns, _starter(start, w, b))
    goal = workers * len(buckets)
    t0 = time.perf_counter()
    run.loop.run(until_ns=horizon_ns)
    wall = time.perf_counter() - t0
    if run.finished != goal:
        raise RuntimeError(
            f"{scheme}: {goal - run.finished} bucket deliveries missing at "
            f"t={run.loop.now} ns (events left: {run.loop.pending})"
        )
    counters = Counters(run.net.counters)
    pool = PoolStats(aggregators=0)
    for sw in run.switches:
        counters.update(sw.counters)
        pool.aggregators += sw.policy.stats.aggregators
        pool.busy_ns += sw.policy.stats.busy_ns
        pool.held_ns += sw.policy.stats.held_ns
        pool.claims += sw.policy.stats.claims
    for node in run.net.nodes.values():
        if node.engine is not None and not isinstance(node.engine, SwitchEngine):
            counters.update(
                {f"{type(node.engine).__name__}.{k}": v for k, v in node.engine.counters.items()}
            )
    sent = sum(e.next_seq for e in run.worker_engines) if run.worker_engines else 0
    fallback = sum(counters.get(k, 0) for k in ("ps_collision", "ps_overflow", "ps_resend"))
    if scheme == "ps":
        fallback = sent
    start_ns = min(b.ready_ns for b in buckets)
    return CollectiveResult(
        scheme=scheme,
        workers=workers,
        total_values=run.total,
        start_ns=start_ns,
        end_ns=max(max(d) for d in run.done),
        bucket_done_ns=run.done,
        events=run.loop.events,
        wall_s=wall,
        counters=counters.as_dict(),
        pool=pool,
        worker_packets=sent,
        fallback_packets=fallback,
        results=run.results,
        inputs=run.inputs,
    )
