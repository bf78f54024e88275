"""Run one collective (all-reduce of a sequence of buckets) on a simulated fabric.

``run_collective`` builds the topology, builds the job's engines through the
scheme registry (``proto.schemes``), binds them to nodes, releases each bucket at its ready
time (as DDP's backward pass does) and runs to completion. In values mode
every worker's data is seeded int32 and every delivered result is kept, so
callers can check each sum; in timing mode packets carry only a count.
``density < 1`` makes each worker's buckets block-sparse (each block of
``values_per_packet`` values non-zero with that probability, at seeded random
positions per worker), the same tensors for every scheme: dense schemes move
them whole, OmniReduce only their non-zero blocks.

Granularity: ``train_packets > 1`` makes one simulated packet stand for a
train of that many real packets (same bytes and headers on the wire, one
event), trading fidelity for speed at thousands of workers.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Deliver
from gradfabric.proto.host import HostEngine
from gradfabric.proto.interface import Aggregator
from gradfabric.proto.schemes import SCHEMES, collective, worker_input
from gradfabric.proto.schemes import InaConfig as InaConfig
from gradfabric.proto.switch import PoolStats, SwitchEngine
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.proto.worker import WorkerEngine
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.network import TIMER_SLACK_NS, LinkSpec, Network
from gradfabric.sim.topology import Topology, leaf_spine, star

TOPOLOGIES = ("star", "leaf_spine")


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class FabricConfig:
    topology: str = "star"
    hosts_per_rack: int = 32
    spines: int = 4
    link: LinkSpec = field(default_factory=LinkSpec)
    fabric_link: LinkSpec | None = None
    uplink: LinkSpec | None = None  # hosts toward their first switch (None: ``link``)
    timer_slack_ns: int = TIMER_SLACK_NS  # a host's timer fires up to this late (0: on time)

    def __post_init__(self) -> None:
        if self.timer_slack_ns < 0:
            raise ConfigError("timer_slack_ns", f"must be >= 0, got {self.timer_slack_ns}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(
                "topology", f"unknown {self.topology!r}; valid: {', '.join(TOPOLOGIES)}"
            )
        if self.hosts_per_rack < 1 or self.spines < 1:
            raise ConfigError("hosts_per_rack", "hosts_per_rack and spines must be >= 1")


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
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


def deliver_into(
    d: Deliver,
    first_seq: list[int],
    offsets: np.ndarray,
    vpp: int,
    results: np.ndarray | None,
    left: list[int],
) -> int | None:
    """Account one delivered sequence to its bucket (and, in values mode, copy
    its payload into place). Returns the bucket if that completed it; raises
    if a bucket is delivered more often than it has sequences."""
    b = bisect.bisect_right(first_seq, d.seq) - 1
    if results is not None and d.pkt.payload is not None:
        off = int(offsets[b]) + (d.seq - first_seq[b]) * vpp
        results[off : off + d.pkt.count] = d.pkt.payload
    left[b] -= 1
    if left[b] < 0:
        raise RuntimeError(f"bucket {b} was delivered more than once")
    return b if left[b] == 0 else None


class CollectiveRun:
    """Shared state of one run (the training simulator drives one too)."""

    def __init__(
        self,
        scheme: str,
        workers: int,
        buckets: list[Bucket],
        fabric: FabricConfig,
        ina: InaConfig,
        seed: int,
        values: bool,
        density: float = 1.0,
    ) -> None:
        self.scheme, self.n, self.buckets, self.fabric, self.ina = (
            scheme,
            workers,
            buckets,
            fabric,
            ina,
        )
        self.loop = EventLoop()
        self.net = Network(self.loop, random.Random(seed), ina.values_per_packet,
                           timer_slack_ns=fabric.timer_slack_ns, slack_seed=seed)  # fmt: skip
        self.vpp = ina.values_per_sim_packet
        self.workers = [f"w{i}" for i in range(workers)]
        self.offsets = np.concatenate([[0], np.cumsum([b.count for b in buckets])]).astype(int)
        self.total = int(self.offsets[-1])
        self.inputs: list[np.ndarray] | None = None
        self.results: list[np.ndarray] | None = None
        block = ina.values_per_packet
        # masks[w][b]: which blocks of bucket b are non-zero at worker w
        self.masks = [
            [
                np.random.default_rng((seed, w, b, 1)).random(-(-bk.count // block)) < density
                for b, bk in enumerate(buckets)
            ]
            for w in range(workers)
        ]
        if values:
            self.inputs = [worker_input(seed, w, workers, self.total) for w in range(workers)]
            self.results = [np.zeros(self.total, dtype=np.int64) for _ in range(workers)]
            if density < 1:
                for w, x in enumerate(self.inputs):
                    for b, bk in enumerate(buckets):
                        keep = np.repeat(self.masks[w][b], block)[: bk.count]
                        x[self.offsets[b] : self.offsets[b + 1]] *= keep
        self.done = [[-1] * len(buckets) for _ in range(workers)]
        self.left = [[0] * len(buckets) for _ in range(workers)]
        self.finished = 0
        self.switches: list[SwitchEngine] = []
        self.worker_engines: list[WorkerEngine] = []
        self.hosts: list[HostEngine] = []
        self.npk = [max(1, -(-b.count // self.vpp)) for b in buckets]
        self.first_seq: list[int] = [0, *np.cumsum(self.npk)[:-1].tolist()]
        # Set by a multi-iteration driver: buckets per iteration, a hook called
        # as each (worker, bucket) completes, and SA-ATP's help settings.
        self.iteration_buckets = len(buckets)
        self.bucket_hook: Callable[[int, int], None] | None = None
        self.help = HelpConfig()
        # each worker's rack, in ranks: a switch names a worker by its place
        # in its rack (ATP's two levels: SA-ATP's help requests)
        self.rack_peers: list[list[int]] = []

    def place_in_rack(self, w: int) -> int:
        """Worker ``w``'s index among its rack's workers (how its switch names it)."""
        return self.rack_peers[w].index(w)

    def payload(self, w: int, b: int) -> np.ndarray | None:
        if self.inputs is None:
            return None
        return self.inputs[w][self.offsets[b] : self.offsets[b + 1]]

    def topology(self, extra: list[str]) -> Topology:
        """The fabric with the workers in rank order and the job's servers
        ``extra``: round-robin over the workers' racks, or, where the scheme
        keeps its servers at its top switch and there are racks, off spine0."""
        f = self.fabric
        hosts = self.workers + extra
        if f.topology == "star":
            return star(self.net, hosts, f.link, f.uplink)
        racks = [self.workers[i : i + f.hosts_per_rack] for i in range(0, self.n, f.hosts_per_rack)]
        if SCHEMES.get(self.scheme).servers_at_root and len(racks) > 1:
            return leaf_spine(self.net, racks, f.spines, f.link, f.fabric_link, f.uplink,
                              tuple(extra))  # fmt: skip
        for i, h in enumerate(extra):
            racks[i % len(racks)].append(h)
        return leaf_spine(self.net, racks, f.spines, f.link, f.fabric_link, f.uplink)

    def bucket_done(self, w: int, b: int) -> None:
        self.done[w][b] = self.loop.now
        self.finished += 1
        if self.bucket_hook is not None:
            self.bucket_hook(w, b)
        if self.finished == self.n * len(self.buckets):
            self.loop.stop()

    def seq_deliverer(self, w: int) -> Callable[[Deliver], None]:
        """Map delivered sequences back to buckets (INA and PS schemes)."""

        def on_deliver(d: Deliver) -> None:
            results = None if self.results is None else self.results[w]
            b = deliver_into(d, self.first_seq, self.offsets, self.vpp, results, self.left[w])
            if b is not None:
                self.bucket_done(w, b)

        return on_deliver

    def bucket_deliverer(self, w: int) -> Callable[[Deliver], None]:
        """For engines that deliver whole buckets (``seq`` = bucket, as the
        ring and OmniReduce do): keep the result, mark the bucket done."""

        def on_deliver(d: Deliver) -> None:
            b = d.seq
            if self.results is not None and d.pkt.payload is not None:
                self.results[w][self.offsets[b] : self.offsets[b + 1]] = d.pkt.payload
            self.bucket_done(w, b)

        return on_deliver

    def build(self) -> Callable[[int, int], None]:
        """Lay the job out on the fabric, build its engines through the scheme
        registry and bind them; returns the bucket starter ``start(w, b)``."""
        scheme = SCHEMES.get(self.scheme)
        f = self.fabric
        links = [f.link, *(x for x in (f.uplink, f.fabric_link) if x is not None)]
        if scheme.lossless and any(link.loss or link.dup for link in links):
            raise ConfigError(
                "link.loss",
                f"{scheme.name} assumes a lossless, duplicate-free network "
                "(loss and dup must be 0)",
            )
        servers = scheme.servers(self.n, self.ina)
        topo = self.topology(list(servers))
        racks: dict[str, list[str]] = {}
        for name in self.workers:
            racks.setdefault(topo.first_hop[name], []).append(name)
        rank = {name: w for w, name in enumerate(self.workers)}
        self.rack_peers = [[rank[k] for k in racks[topo.first_hop[name]]] for name in self.workers]
        per_iteration = sum(self.npk[: self.iteration_buckets])
        p = scheme.place(
            tuple(self.workers), {k: tuple(v) for k, v in racks.items()}, self.ina,
            root=topo.spines[0] if topo.spines else None, servers=servers,
            help=replace(self.help, iteration_packets=per_iteration),
        )  # fmt: skip
        engines = scheme.engines(p, self.ina)
        for name, eng in engines.items():
            self.net.bind(name, eng)
            if isinstance(eng, SwitchEngine):
                self.switches.append(eng)
        workers = [engines[n] for n in self.workers]
        for w, eng in enumerate(workers):
            if isinstance(eng, HostEngine):
                self.hosts.append(eng)
                eng = eng.own
            if isinstance(eng, WorkerEngine):
                self.worker_engines.append(eng)
            node = self.net.nodes[self.workers[w]]
            for nic in node.routes["*"] if self.ina.paced else ():
                nic.resends_first = True
            node.on_deliver = (
                self.bucket_deliverer(w) if scheme.per_bucket else self.seq_deliverer(w)
            )
            self.left[w] = list(self.npk)

        def start(w: int, b: int) -> None:
            acts = scheme.start(
                workers[w], b, self.buckets[b].count, self.loop.now, self.payload(w, b),
                self.first_seq[b], self.masks[w][b],
            )  # fmt: skip
            self.net.kick(self.workers[w], acts)

        return start


def missing(run: CollectiveRun, goal: int) -> RuntimeError:
    """Why a run ended with ``goal - run.finished`` deliveries missing: for a
    lossless scheme, the packets its queues dropped, if any."""
    lost = run.net.counters.get("queue_drop", 0)
    why = ""
    if lost and SCHEMES.get(run.scheme).lossless:  # a ring has no retransmission
        why = (f"; {lost} packets dropped at full queues, and {run.scheme} assumes a "
               "lossless fabric (give its oversubscribed ports room)")  # fmt: skip
    return RuntimeError(
        f"{run.scheme}: {goal - run.finished} bucket deliveries missing at "
        f"t={run.loop.now} ns (heap entries left: {run.loop.pending}){why}"
    )


def _blame(run: CollectiveRun, e: PeerTimeoutError) -> PeerTimeoutError:
    """Name the workers a stalled switch still waits on, if it knows them."""
    missing = {
        peer
        for node in run.net.nodes.values()
        if isinstance(node.engine, Aggregator)
        for peer in node.engine.missing_peers()
    }
    missing &= set(run.workers)  # a leaf's own bit at the root is not a worker
    missing_list = sorted(missing, key=lambda w: int(w[1:]))
    if not missing_list:
        return e
    err = PeerTimeoutError(", ".join(missing_list), e.timeout_s)
    err.args = (f"{e}; aggregation still waits on {', '.join(missing_list)}",)
    return err


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
    dead_workers: frozenset[int] = frozenset(),
    density: float = 1.0,
) -> CollectiveResult:
    """All-reduce ``buckets`` across ``workers`` with ``scheme``; see module doc."""
    if workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {workers}")
    if not buckets:
        raise ConfigError("buckets", "need at least one bucket")
    if not 0 <= density <= 1:
        raise ConfigError("density", f"must be in [0, 1], got {density}")
    collective(scheme)
    run = CollectiveRun(
        scheme,
        workers,
        buckets,
        fabric or FabricConfig(),
        ina or InaConfig(),
        seed,
        values,
        density,
    )
    start = run.build()
    for b, bk in enumerate(buckets):
        for w in range(workers):
            if w not in dead_workers:  # a dead worker never contributes
                run.loop.at(bk.ready_ns, _starter(start, w, b))
    goal = workers * len(buckets)
    t0 = time.perf_counter()
    try:
        run.loop.run(until_ns=horizon_ns)
    except PeerTimeoutError as e:
        raise _blame(run, e) from None
    wall = time.perf_counter() - t0
    if run.finished != goal:
        raise missing(run, goal)
    counters = Counters(run.net.counters)
    for sw in run.switches:
        counters.update(sw.counters)
    pool = PoolStats.total(sw.policy.stats for sw in run.switches)
    for node in run.net.nodes.values():
        if node.engine is not None and not isinstance(node.engine, SwitchEngine):
            counters.update(
                {f"{type(node.engine).__name__}.{k}": v for k, v in node.engine.counters.items()}
            )
    sent = sum(e.next_seq for e in run.worker_engines) if run.worker_engines else 0
    fallback = sum(counters.get(k, 0) for k in ("ps_collision", "ps_overflow", "ps_resend"))
    if SCHEMES.get(scheme).server_only:
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
