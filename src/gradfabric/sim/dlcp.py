"""DLCP on a congested leaf-spine, in the simulator: with a parameter server
or with ring all-reduce.

Workers sit in two racks, the PS in the second; background hosts in both
racks send cross-rack traffic at ``load`` of their link rate (so spine links
and leaves see queues and drops). Each iteration every worker computes for
``compute_ms``, then communicates its gradient tensors (back layers first, as
backward produces them):

- ``ps``: each worker pushes to the PS over DLCP; the PS aggregates a tensor
  once every worker's copy is complete (within ``push_bound``) and sends the
  sum to every worker (within ``pull_bound``). Workers pace their push at
  ``link / workers`` (a converged congestion controller's fair share of the
  PS link); losses then come from the background traffic's queues.
- ``allreduce``: a ring, every hop a DLCP transfer (see ``_RingJob`` for how
  the end-to-end bounds are shared among hops).

A worker starts its next iteration when all its tensors are back.
``push_bound = pull_bound = 0`` is the reliable baseline (it waits for every
packet, retransmitting on NACKs). With ``priority`` switch ports serve
strict-priority queues and drop the least important classes first (per-class
WRED); with ``spray`` switches send each packet over a random spine instead
of hashing flows (ECMP).

Reported: iteration time and the p99 of per-tensor communication time
(gradient ready to the aggregated tensor complete at the worker, over
workers, tensors and iterations).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.cells import Executor, run_cells
from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Send
from gradfabric.proto.dctcp import DctcpReceiver, DctcpSender
from gradfabric.proto.dlcp import DlcpEndpoint, DlcpReceiver, DlcpSender
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.network import LinkSpec, Network
from gradfabric.sim.topology import leaf_spine
from gradfabric.wire.packet import Packet, ina_packet, traffic_class

JOB = 1
BG_JOB = 9
TRANSPORTS: dict[str, tuple[type[DlcpReceiver], type[DlcpSender]]] = {
    "dlcp": (DlcpReceiver, DlcpSender),
    "dctcp": (DctcpReceiver, DctcpSender),
}
# Other traffic shares the queue of DLCP's back layers (its front layers go
# ahead of it), at the drop precedence of DLCP's second-largest quartile.
BG_CLASS = traffic_class(1, 1)


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class DlcpConfig:
    collective: str = "ps"  # or "allreduce" (a ring)
    workers: int = 8
    tensors: tuple[int, ...] = (262_144,) * 8  # values per gradient tensor (8 MB in all)
    push_bound: float = 0.1
    pull_bound: float = 0.02
    priority: bool = True
    spray: bool = True
    load: float = 0.5  # background load, share of a host link
    background_hosts: int = 4  # per rack
    link_gbps: float = 10.0
    queue_bytes: int = 200_000
    spines: int = 4
    iterations: int = 4
    compute_ms: float = 2.0
    per_packet: int = 256
    rto_ns: int = 500_000
    # "dlcp", or "dctcp": the reliable, windowed baseline (proto.dctcp), which
    # ignores the loss bounds and priorities and is not paced
    transport: str = "dlcp"
    # switches mark ECN above this backlog: DCTCP's K for 10 Gbit/s, 65 packets
    ecn_bytes: int = 65 * (32 + 256 * 4)
    seed: int = 0
    horizon_s: float = 2.0  # simulated; a run still unfinished by then is an error
    # "host": the PS behind a host link of its own in the second rack (incast
    # at its port); "leaf": the server in that rack's leaf switch, as the real
    # leaf-spine runs it (its port to the leaf takes every worker's link rate)
    server: str = "host"
    # switch ports' priority queues: one buffer shared (a switch ASIC's), or a
    # buffer of queue_bytes each (the namespaces' htb classes, a FIFO each)
    class_buffers: bool = False

    def __post_init__(self) -> None:
        if self.workers < 2 or not self.tensors or self.iterations < 1:
            raise ConfigError("workers", "need >= 2 workers, >= 1 tensor, >= 1 iteration")
        if self.collective not in ("ps", "allreduce"):
            raise ConfigError("collective", f"ps or allreduce, got {self.collective!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError("transport", f"one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        if not 0 <= self.load < 1:
            raise ConfigError("load", f"must be in [0, 1), got {self.load}")
        if self.server not in ("host", "leaf"):
            raise ConfigError("server", f"host or leaf, got {self.server!r}")


class _Background:
    """A host sending fixed-size packets to random hosts of the other rack."""

    def __init__(self, name: str, peers: list[str], rate_gbps: float, rng: random.Random):
        self.name, self.peers, self.rng = name, peers, rng
        self.counters = Counters()
        size = 32 + 256 * 4
        self.gap_ns = int(size * 8 / rate_gbps) if rate_gbps > 0 else 0
        self.at: int | None = 0 if self.gap_ns else None
        self.flow = rng.randrange(1 << 15)

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        self.counters["bg_received"] += 1
        return []

    def on_timer(self, now_ns: int) -> list[Action]:
        if self.rng.random() < 0.01:  # a new flow now and then
            self.flow = self.rng.randrange(1 << 15)
        # exponential gaps: Poisson arrivals at the configured mean rate
        self.at = now_ns + max(1, int(self.rng.expovariate(1.0) * self.gap_ns))
        dst = self.peers[self.flow % len(self.peers)]
        pkt = ina_packet(job_id=BG_JOB, worker_id=self.flow % 64, seq=0, agg_index=0, bitmap=0,
                         fan_in=1, priority=BG_CLASS, count=256)  # fmt: skip
        return [Send(dst, pkt)]

    def next_deadline(self) -> int | None:
        return self.at

    def stop(self) -> None:
        self.at = None


def _starter(fn: Callable[[int, int], None], w: int, loop: EventLoop) -> Callable[[object], None]:
    return lambda _arg: fn(w, loop.now)


@dataclass
class DlcpResult:
    iteration_ms: float
    p99_comm_ms: float
    mean_comm_ms: float
    lost: float  # share of the workers' gradient values that never reached the sum
    nacks: int
    queue_drops: int
    events: int


class _Job:
    """What the PS and the ring jobs share: the fabric with its background
    hosts, the workers' iteration loop (compute, then communicate every
    tensor, back layers first), and the measurements."""

    def __init__(self, cfg: DlcpConfig) -> None:
        self.cfg = cfg
        self.loop = loop = EventLoop()
        rng = random.Random(cfg.seed)
        # timers on time (``Network``'s default): the background sources' on/off
        # periods are the load model's clock, which slack would slow
        self.net = net = Network(loop, rng, cfg.per_packet, spray=cfg.spray, priority=cfg.priority)
        n = cfg.workers
        self.workers = [f"w{i}" for i in range(n)]
        bg = [[f"bg{r}_{i}" for i in range(cfg.background_hosts)] for r in range(2)]
        ps_host = ["ps"] if cfg.server == "host" else []
        racks = [self.workers[: n // 2] + bg[0], self.workers[n // 2 :] + ps_host + bg[1]]
        link = LinkSpec(link_gbps=cfg.link_gbps, queue_bytes=cfg.queue_bytes,
                        ecn_bytes=cfg.ecn_bytes, class_buffers=cfg.class_buffers)  # fmt: skip
        topo = leaf_spine(net, racks, cfg.spines, link)
        if not ps_host:  # the server in leaf1: one port as fast as every worker's link
            fast = replace(link, link_gbps=cfg.link_gbps * n)
            up, down = net.connect("ps", "leaf1", replace(fast, queue_bytes=0), fast)
            net.node("ps").routes["*"] = [up]
            net.node("leaf1").routes["ps"] = [down]
            for sp in topo.spines:
                net.node(sp).routes["ps"] = net.node(sp).routes["leaf1"]
        for h in [*self.workers, "ps"]:  # ACKs are not stuck behind a host's data
            (nic,) = net.node(h).routes["*"]
            nic.control_first = True
        self.sources: list[_Background] = []
        for r in range(2):
            for h in bg[r]:
                bg_rate = cfg.load * cfg.link_gbps
                src = _Background(h, bg[1 - r], bg_rate, random.Random(rng.random()))
                self.sources.append(src)
                net.bind(h, src)
                net.node(h).rearm()
        nrng = np.random.default_rng(cfg.seed)
        # per-packet gradient norms (lognormal, as gradient magnitudes are) for priority classes
        self.norms = [nrng.lognormal(0, 1, -(-c // cfg.per_packet)) for c in cfg.tensors]
        self.layers = len(cfg.tensors)
        self.rx_cls, self.tx_cls = TRANSPORTS[cfg.transport]
        self.started: dict[tuple[int, int, int], int] = {}
        self.comm: list[int] = []
        self.iter_of = [0] * n
        self.left = [self.layers] * n
        self.done_at = [0] * n
        self.finished = 0

    def tensor_ready(self, w: int, it: int, t: int) -> None:
        self.started[(w, it, t)] = self.loop.now

    def tensor_done(self, w: int, it: int, t: int) -> None:
        """Worker ``w`` holds the aggregated tensor ``t`` of iteration ``it``."""
        loop = self.loop
        self.comm.append(loop.now - self.started[(w, it, t)])
        self.left[w] -= 1
        if self.left[w]:
            return
        self.iter_of[w] += 1
        if self.iter_of[w] < self.cfg.iterations:
            self.left[w] = self.layers
            loop.at(loop.now + int(self.cfg.compute_ms * 1e6), _starter(self.start, w, loop))
            return
        self.done_at[w] = loop.now
        self.finished += 1
        if self.finished == self.cfg.workers:
            for s in self.sources:
                s.stop()
            loop.stop()

    def start(self, w: int, now: int) -> None:
        raise NotImplementedError

    def lost_share(self) -> float:
        """The share of the workers' gradient values that never reached the sum."""
        raise NotImplementedError

    def run(self, hosts: list[DlcpEndpoint]) -> DlcpResult:
        cfg, loop = self.cfg, self.loop
        for i in range(cfg.workers):
            loop.at(int(cfg.compute_ms * 1e6), _starter(self.start, i, loop))
        loop.run(until_ns=int(cfg.horizon_s * 1e9))
        if self.finished != cfg.workers:
            raise RuntimeError(
                f"DLCP {cfg.collective} run unfinished at {loop.now / 1e9:g} s: workers at "
                f"iterations {self.iter_of}, tensors left {self.left}; counters "
                f"{dict(self.net.counters)}"
            )
        return DlcpResult(
            iteration_ms=max(self.done_at) / cfg.iterations / 1e6,
            p99_comm_ms=float(np.percentile(self.comm, 99)) / 1e6,
            mean_comm_ms=float(np.mean(self.comm)) / 1e6,
            lost=self.lost_share(),
            nacks=sum(h.counters.get("nacks", 0) for h in hosts),
            queue_drops=self.net.counters.get("queue_drop", 0),
            events=loop.events,
        )


class _PsJob(_Job):
    """Push to the PS within ``push_bound``, pull the sum within ``pull_bound``."""

    def __init__(self, cfg: DlcpConfig) -> None:
        super().__init__(cfg)
        n, net = cfg.workers, self.net
        # Workers pace their push at a fair share of the PS's link (what a
        # congestion-controlled transport converges to); without it the push is an
        # n-to-1 incast that no transport survives without a window.
        # (At a leaf there is no PS link to share: a worker's own link paces it.)
        fair = cfg.link_gbps / n
        paced = not self.tx_cls.congestion_controlled and cfg.server == "host"
        for w in self.workers if paced else ():  # DCTCP finds it
            (uplink,) = net.node(w).routes["*"]
            uplink.pace(fair)
        rto = cfg.rto_ns
        self.wk = [
            DlcpEndpoint(
                w,
                self.rx_cls(w, JOB, i, ["ps"], rto),
                [self.tx_cls(w, JOB, i, "ps", cfg.per_packet, rto)],
            )
            for i, w in enumerate(self.workers)
        ]
        self.ps = DlcpEndpoint(
            "ps",
            self.rx_cls("ps", JOB, 0, self.workers, rto),
            [self.tx_cls("ps", JOB, 0, w, cfg.per_packet, rto) for w in self.workers],
        )
        net.bind("ps", self.ps)
        net.nodes["ps"].on_deliver = self.ps_deliver
        for i, eng in enumerate(self.wk):
            net.bind(eng.name, eng)
            net.nodes[eng.name].on_deliver = self.worker_deliver(i)
        self.arrived: dict[int, int] = {}  # tensor -> workers' copies complete at the PS

    def start(self, w: int, now: int) -> None:
        cfg, layers, it = self.cfg, self.layers, self.iter_of[w]
        base = it * layers
        for t in range(layers):
            self.ps.rx.expect(w, base + t, cfg.tensors[t], cfg.push_bound, now, values=False)
            self.wk[w].rx.expect(0, base + t, cfg.tensors[t], cfg.pull_bound, now, values=False)
        acts: list[Action] = []
        for t in reversed(range(layers)):  # backward produces the back layers first
            self.tensor_ready(w, it, t)
            acts += (
                self.wk[w]
                .tx[0]
                .send(base + t, cfg.tensors[t], t, layers, norms=self.norms[t], now_ns=now)
            )
        self.net.kick(self.workers[w], acts)

    def ps_deliver(self, d: Deliver) -> None:
        tensor = d.seq
        self.arrived[tensor] = self.arrived.get(tensor, 0) + 1
        if self.arrived[tensor] < self.cfg.workers:
            return
        t = tensor % self.layers
        acts: list[Action] = []
        for tx in self.ps.tx:
            acts += tx.send(
                tensor, self.cfg.tensors[t], t, self.layers, norms=self.norms[t],
                now_ns=self.loop.now,
            )  # fmt: skip
        self.net.kick("ps", acts)

    def worker_deliver(self, w: int) -> Callable[[Deliver], None]:
        return lambda d: self.tensor_done(w, *divmod(d.seq, self.layers))

    def lost_share(self) -> float:
        pushed = self.cfg.workers * self.cfg.iterations * sum(self.cfg.tensors)
        return self.ps.counters.get("values_lost", 0) / pushed

    def result(self) -> DlcpResult:
        return self.run([self.ps, *self.wk])


class _RingJob(_Job):
    """Ring all-reduce, every hop a DLCP transfer to the right neighbour.

    A tensor is cut into ``n`` chunks on packet boundaries; in ``n - 1``
    reduce-scatter steps each worker forwards a partial sum to its right
    neighbour, in ``n - 1`` all-gather steps the reduced chunks go round. A
    worker forwards step ``s + 1`` when step ``s`` has arrived from its left.

    Losses compound along the ring: a value lost at reduce-scatter hop ``s``
    loses ``s + 1`` workers' contributions, one lost at an all-gather hop is
    zero at every worker after it. So each hop gets a share of the end-to-end
    bounds: ``2 push_bound / (n - 1)`` per reduce-scatter hop keeps the lost
    share of contributions within ``push_bound`` (sum over hops of
    ``q (s + 1) / n``), and ``pull_bound / (n - 1)`` per all-gather hop keeps
    any worker's lost share of the result within ``pull_bound``."""

    def __init__(self, cfg: DlcpConfig) -> None:
        super().__init__(cfg)
        n, pp = cfg.workers, cfg.per_packet
        if min(cfg.tensors) < n * pp:
            raise ConfigError("tensors", f"a ring of {n} needs tensors of >= {n * pp} values")
        rto = cfg.rto_ns
        ws = self.workers
        self.hosts = [
            DlcpEndpoint(
                w,
                self.rx_cls(w, JOB, 0, [ws[(i - 1) % n]], rto),
                [self.tx_cls(w, JOB, 0, ws[(i + 1) % n], pp, rto)],
            )
            for i, w in enumerate(ws)
        ]
        for i, h in enumerate(self.hosts):
            self.net.bind(h.name, h)
            self.net.nodes[h.name].on_deliver = self.hop_done(i)
        self.steps = 2 * (n - 1)
        self.hop_bound = [2 * cfg.push_bound / (n - 1)] * (n - 1) + [cfg.pull_bound / (n - 1)] * (
            n - 1
        )
        # chunk k of tensor t: its first packet and its packets (on packet boundaries)
        self.chunks = [np.array_split(np.arange(len(nm)), n) for nm in self.norms]
        self.lost_contrib = 0

    def _chunk(self, t: int, k: int) -> tuple[int, np.ndarray]:
        pkts = self.chunks[t][k]
        pp = self.cfg.per_packet
        count = min(self.cfg.tensors[t], (int(pkts[-1]) + 1) * pp) - int(pkts[0]) * pp
        return count, self.norms[t][pkts]

    def _chunk_at(self, w: int, s: int) -> int:
        """The chunk worker ``w`` sends at step ``s``."""
        n = self.cfg.workers
        return (w - s) % n if s < n - 1 else (w + 1 - (s - (n - 1))) % n

    def _id(self, it: int, t: int, s: int) -> int:
        return (it * self.layers + t) * self.steps + s

    def _send(self, w: int, it: int, t: int, s: int, now: int) -> list[Action]:
        count, norms = self._chunk(t, self._chunk_at(w, s))
        return (
            self.hosts[w]
            .tx[0]
            .send(self._id(it, t, s), count, t, self.layers, norms=norms, now_ns=now)
        )

    def start(self, w: int, now: int) -> None:
        it, rx = self.iter_of[w], self.hosts[w].rx
        n = self.cfg.workers
        for t in range(self.layers):
            for s in range(self.steps):
                count, _ = self._chunk(t, self._chunk_at((w - 1) % n, s))
                rx.expect(0, self._id(it, t, s), count, self.hop_bound[s], now, values=False)
        acts: list[Action] = []
        for t in reversed(range(self.layers)):
            self.tensor_ready(w, it, t)
            acts += self._send(w, it, t, 0, now)
        self.net.kick(self.workers[w], acts)

    def hop_done(self, w: int) -> Callable[[Deliver], None]:
        def on_deliver(d: Deliver) -> None:
            rest, s = divmod(d.seq, self.steps)
            it, t = divmod(rest, self.layers)
            n = self.cfg.workers
            if s < n - 1:  # a lost partial sum loses s + 1 workers' contributions
                got = self.hosts[w].rx.tensors[(0, d.seq)]
                self.lost_contrib += (got.count - got.received) * (s + 1)
            if s == self.steps - 1:
                self.tensor_done(w, it, t)
            else:  # add (reduce-scatter) or keep (all-gather), and pass on
                self.net.kick(self.workers[w], self._send(w, it, t, s + 1, self.loop.now))

        return on_deliver

    def lost_share(self) -> float:
        return self.lost_contrib / (self.cfg.workers * self.cfg.iterations * sum(self.cfg.tensors))

    def result(self) -> DlcpResult:
        return self.run(self.hosts)


COLLECTIVES: dict[str, type[_PsJob] | type[_RingJob]] = {"ps": _PsJob, "allreduce": _RingJob}


def run_dlcp(cfg: DlcpConfig) -> DlcpResult:
    return COLLECTIVES[cfg.collective](cfg).result()


# scheme -> overrides of DlcpConfig; "reliable" is the baseline of every row
VARIANTS: dict[str, dict[str, Any]] = {
    "reliable": {"push_bound": 0.0, "pull_bound": 0.0, "priority": False, "spray": False},
    "dlcp": {},
    "dlcp-no-priority": {"priority": False},
    "dlcp-ecmp": {"spray": False},
    "bounded-loss-only": {"priority": False, "spray": False},
    "reliable+spray": {"push_bound": 0.0, "pull_bound": 0.0, "priority": False},
    "dctcp": {"transport": "dctcp", "priority": False, "spray": False},
    "dctcp+spray": {"transport": "dctcp", "priority": False},
}
# the reliable baselines (every value, exactly); a headline is against their best
RELIABLE = ("reliable", "reliable+spray", "dctcp", "dctcp+spray")


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class GridCell:
    """One run of the grid: a scheme and its whole config (seed included)."""

    scheme: str
    cfg: DlcpConfig

    def __str__(self) -> str:
        c = self.cfg
        return f"{c.collective}: {self.scheme}, load {c.load:g}, seed {c.seed}"


def run_cell(cell: GridCell) -> dict[str, Any]:
    cfg = cell.cfg
    r = run_dlcp(cfg)
    return {
        "scheme": cell.scheme,
        "baseline": cfg.collective,
        "load": cfg.load,
        "seed": cfg.seed,
        "iter_time_ms": r.iteration_ms,
        "p99_comm_ms": r.p99_comm_ms,
        "mean_comm_ms": r.mean_comm_ms,
        "lost": r.lost,
        "queue_drops": r.queue_drops,
    }


def run_grid(
    bases: list[DlcpConfig],
    loads: tuple[float, ...],
    seeds: tuple[int, ...] = (0,),
    tick: Callable[[str], None] | None = None,
    where: Executor | int = 1,
) -> list[dict[str, Any]]:
    """Every scheme at every background load and seed, for each base config
    (a collective), side by side on the same seeds (run ``where`` says).
    ``baseline`` names the collective DLCP carries (``ps`` or ``allreduce``)."""
    cells = [
        GridCell(scheme, replace(base, load=load, seed=seed, **over))
        for base in bases
        for load in loads
        for seed in seeds
        for scheme, over in VARIANTS.items()
    ]
    return run_cells(run_cell, cells, where, tick)


def experiment_configs(quick: bool) -> list[DlcpConfig]:
    """The PS and ring jobs of ``experiment dlcp`` and ``reproduce``: the same
    bytes per iteration, in smaller tensors for the PS (a ring hop needs
    chunks of a few dozen packets before a per-hop bound can spare one)."""
    if quick:
        return [
            DlcpConfig(tensors=(16_384,) * 8, iterations=2),
            DlcpConfig(collective="allreduce", tensors=(131_072,), iterations=2),
        ]
    return [
        DlcpConfig(tensors=(65_536,) * 8),
        DlcpConfig(collective="allreduce", tensors=(131_072,) * 4),
    ]
