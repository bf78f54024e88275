"""DLCP with a parameter server on a congested leaf-spine, in the simulator.

Workers sit in two racks, the PS in the second; background hosts in both
racks send cross-rack traffic at ``load`` of their link rate (so spine links
and the PS's leaf see queues and drops). Each iteration every worker computes
for ``compute_ms``, then pushes its gradient tensors (back layers first, as
backward produces them) to the PS over DLCP; the PS aggregates a tensor once
every worker's copy is complete (within ``push_bound``) and sends the sum to
every worker (within ``pull_bound``); a worker starts its next iteration
when all its tensors are back. ``push_bound = pull_bound = 0`` is the
reliable baseline (it waits for every packet, retransmitting on NACKs).
Switches can drop low-priority classes first (``priority``) and spray packets
over the spines (``spray``) instead of hashing flows (ECMP).

Workers pace their push at ``link / workers`` (a converged congestion
controller's fair share of the PS link); losses then come from the
background traffic's queues on the spines and leaves.

Reported: mean iteration time and the p99 of per-tensor communication time
(push start to the pulled tensor complete, over workers, tensors and
iterations).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action, Deliver, Send
from gradfabric.proto.dlcp import DlcpReceiver, DlcpSender
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.network import LinkSpec, Network
from gradfabric.sim.topology import leaf_spine
from gradfabric.wire.packet import Flag, Packet

JOB = 1
BG_JOB = 9


@dataclass(frozen=True)
class DlcpConfig:
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
    rto_us: float = 500.0
    seed: int = 0
    horizon_s: float = 2.0  # simulated; a run still unfinished by then is an error

    def __post_init__(self) -> None:
        if self.workers < 2 or not self.tensors or self.iterations < 1:
            raise ConfigError("workers", "need >= 2 workers, >= 1 tensor, >= 1 iteration")
        if not 0 <= self.load < 1:
            raise ConfigError("load", f"must be in [0, 1), got {self.load}")


class _Background:
    """A host sending fixed-size packets to random hosts of the other rack."""

    deadlines_only_grow = True

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
        return [Send(dst, Packet(BG_JOB, self.flow % 64, 0, 0, 0, 1, 0, 4, 0, 256, None))]

    def next_deadline(self) -> int | None:
        return self.at

    def stop(self) -> None:
        self.at = None


class _Host:
    """A DLCP endpoint: one receiver and its senders on one node. ACKs and
    range requests go to the sender they name (``worker_id`` of the peer
    that sent them); data goes to the receiver."""

    deadlines_only_grow = False  # the senders' and the receiver's ticks interleave

    def __init__(self, name: str, rx: DlcpReceiver, tx: list[DlcpSender]) -> None:
        self.name, self.rx, self.tx = name, rx, tx
        self.counters = Counters()
        self.engines: list[DlcpReceiver | DlcpSender] = [rx, *tx]
        for e in self.engines:
            e.counters = self.counters

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        if pkt.flags & (Flag.RESEND | Flag.ACK):
            if not 0 <= pkt.worker_id < len(self.tx) and len(self.tx) > 1:
                self.counters["drop_foreign"] += 1
                return []
            return self.tx[pkt.worker_id if len(self.tx) > 1 else 0].on_packet(pkt, now_ns)
        return self.rx.on_packet(pkt, now_ns)

    def on_timer(self, now_ns: int) -> list[Action]:
        out: list[Action] = []
        for e in self.engines:
            d = e.next_deadline()
            if d is not None and d <= now_ns:
                out += e.on_timer(now_ns)
        return out

    def next_deadline(self) -> int | None:
        ds = [d for e in self.engines if (d := e.next_deadline()) is not None]
        return min(ds) if ds else None


def _starter(fn: Callable[[int, int], None], w: int, loop: EventLoop) -> Callable[[object], None]:
    return lambda _arg: fn(w, loop.now)


@dataclass
class DlcpResult:
    iteration_ms: float
    p99_comm_ms: float
    mean_comm_ms: float
    lost_push: float  # share of pushed values lost (zero-filled) at the PS
    nacks: int
    queue_drops: int
    events: int


def run_dlcp(cfg: DlcpConfig) -> DlcpResult:
    loop = EventLoop()
    rng = random.Random(cfg.seed)
    net = Network(loop, rng, cfg.per_packet, spray=cfg.spray, priority_drop=cfg.priority)
    n = cfg.workers
    workers = [f"w{i}" for i in range(n)]
    bg = [[f"bg{r}_{i}" for i in range(cfg.background_hosts)] for r in range(2)]
    racks = [workers[: n // 2] + bg[0], workers[n // 2 :] + ["ps"] + bg[1]]
    link = LinkSpec(link_gbps=cfg.link_gbps, queue_bytes=cfg.queue_bytes)
    leaf_spine(net, racks, cfg.spines, link)
    # Workers pace their push at a fair share of the PS's link (what a
    # congestion-controlled transport converges to); without it the push is an
    # n-to-1 incast that no transport survives without a window.
    fair = cfg.link_gbps / n
    for w in workers:
        (uplink,) = net.node(w).routes["*"]
        uplink.ps_per_byte = 8e12 / (fair * 1e9)
    rto = int(cfg.rto_us * 1000)
    wk = [
        _Host(
            w,
            DlcpReceiver(w, JOB, i, ["ps"], rto),
            [DlcpSender(w, JOB, i, "ps", cfg.per_packet, rto)],
        )
        for i, w in enumerate(workers)
    ]
    ps = _Host(
        "ps",
        DlcpReceiver("ps", JOB, 0, workers, rto),
        [DlcpSender("ps", JOB, 0, w, cfg.per_packet, rto) for w in workers],
    )
    net.bind("ps", ps)
    for eng in wk:
        net.bind(eng.name, eng)
    sources = []
    for r in range(2):
        for h in bg[r]:
            src = _Background(h, bg[1 - r], cfg.load * cfg.link_gbps, random.Random(rng.random()))
            sources.append(src)
            net.bind(h, src)
            net.node(h).arm_timer()
    layers = len(cfg.tensors)
    nrng = np.random.default_rng(cfg.seed)
    # per-packet gradient norms (lognormal, as gradient magnitudes are) for priority classes
    norms = [nrng.lognormal(0, 1, -(-c // cfg.per_packet)) for c in cfg.tensors]
    compute_ns = int(cfg.compute_ms * 1e6)
    started: dict[tuple[int, int, int], int] = {}
    comm: list[int] = []
    arrived: dict[tuple[int, int], int] = {}
    iter_of = [0] * n
    left = [layers] * n
    done_at = [0] * n
    finished = [0]

    def start_iteration(w: int, now: int) -> None:
        it = iter_of[w]
        left[w] = layers
        base = it * layers
        for t in range(layers):
            ps.rx.expect(w, base + t, cfg.tensors[t], cfg.push_bound, now, values=False)
            wk[w].rx.expect(0, base + t, cfg.tensors[t], cfg.pull_bound, now, values=False)
        acts: list[Action] = []
        for t in reversed(range(layers)):  # backward produces the back layers first
            started[(w, it, t)] = now
            acts += (
                wk[w].tx[0].send(base + t, cfg.tensors[t], t, layers, norms=norms[t], now_ns=now)
            )
        net.kick(workers[w], acts)

    def ps_deliver(d: Deliver) -> None:
        tensor, w = d.seq, d.pkt.worker_id
        arrived[(tensor, w)] = loop.now
        if sum(1 for x in range(n) if (tensor, x) in arrived) == n:
            t = tensor % layers
            acts: list[Action] = []
            for x in range(n):
                acts += ps.tx[x].send(
                    tensor, cfg.tensors[t], t, layers, norms=norms[t], now_ns=loop.now
                )
            net.kick("ps", acts)

    def worker_deliver(w: int) -> Callable[[Deliver], None]:
        def on_deliver(d: Deliver) -> None:
            it, t = divmod(d.seq, layers)
            comm.append(loop.now - started[(w, it, t)])
            left[w] -= 1
            if left[w] == 0:
                iter_of[w] += 1
                if iter_of[w] == cfg.iterations:
                    done_at[w] = loop.now
                    finished[0] += 1
                    if finished[0] == n:
                        for s in sources:
                            s.stop()
                        loop.stop()
                else:
                    loop.at(loop.now + compute_ns, _starter(start_iteration, w, loop))

        return on_deliver

    net.nodes["ps"].on_deliver = ps_deliver
    for i, name in enumerate(workers):
        net.nodes[name].on_deliver = worker_deliver(i)
        loop.at(compute_ns, _starter(start_iteration, i, loop))
    loop.run(until_ns=int(cfg.horizon_s * 1e9))
    if finished[0] != n:
        raise RuntimeError(
            f"DLCP run unfinished at {loop.now / 1e9:g} s: workers at iterations {iter_of}, "
            f"tensors left {left}; counters {dict(net.counters)} {dict(ps.counters)}"
        )
    pushed = n * cfg.iterations * sum(cfg.tensors)
    return DlcpResult(
        iteration_ms=max(done_at) / cfg.iterations / 1e6,
        p99_comm_ms=float(np.percentile(comm, 99)) / 1e6,
        mean_comm_ms=float(np.mean(comm)) / 1e6,
        lost_push=ps.counters.get("values_lost", 0) / pushed,
        nacks=ps.counters.get("nacks", 0) + sum(e.counters.get("nacks", 0) for e in wk),
        queue_drops=net.counters.get("queue_drop", 0),
        events=loop.events,
    )


# scheme -> overrides of DlcpConfig; "reliable" is the baseline every row names
SCHEMES: dict[str, dict[str, Any]] = {
    "reliable": {"push_bound": 0.0, "pull_bound": 0.0, "priority": False, "spray": False},
    "dlcp": {},
    "dlcp-no-priority": {"priority": False},
    "dlcp-ecmp": {"spray": False},
    "reliable+spray": {"push_bound": 0.0, "pull_bound": 0.0, "priority": False},
}


def run_grid(
    base: DlcpConfig, loads: tuple[float, ...], tick: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Every scheme at every background load, side by side on the same seed."""
    rows: list[dict[str, Any]] = []
    for load in loads:
        for scheme, over in SCHEMES.items():
            if tick is not None:
                tick(f"{scheme}, load {load:g}")
            r = run_dlcp(replace(base, load=load, **over))
            rows.append(
                {
                    "scheme": scheme,
                    "baseline": "reliable",
                    "load": load,
                    "iter_time_ms": r.iteration_ms,
                    "p99_comm_ms": r.p99_comm_ms,
                    "mean_comm_ms": r.mean_comm_ms,
                    "lost_push": r.lost_push,
                    "queue_drops": r.queue_drops,
                }
            )
    return rows
