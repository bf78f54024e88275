"""The switch node: everything a switch daemon runs, behind one datagram interface.

Theory of operation
-------------------
A switch daemon hosts, for any number of jobs, the engines its scheme builds
(``proto.schemes``): the switch engine with its allocation policy (SwitchML,
ATP, ESA) and each job's servers (ATP's fallback parameter server, the PS
baseline's, OmniReduce's aggregator, DLCP's server). ``SwitchNode`` is all of
them at the datagram, as aioquic's connection is at its socket::

    receive_datagram(data, now_ns)      a datagram from some worker
    datagrams_to_send(now_ns)           [(job_id, rank, bytes)]; rank ALL: every
                                        worker of the job (the driver sends it
                                        to the job's multicast group, or once
                                        per worker)
    get_timer() / handle_timer(now_ns)  its one deadline

A datagram is checked before any hosted engine sees it (``accept``): the job
it names must be registered (else ``drop_unknown_job``, the node's counter)
and its token must be that job's (else ``drop_bad_token``, the job's), its
packet must decode (``drop_malformed``), and a job restored after a restart
takes nothing until its workers agreed where to replay from
(``drop_resyncing``). The engines then check worker index, bitmap, fan-in
and slot range against the job (their own ``drop_*`` counters), so a
stranger's datagram is a counted drop, never a crash and never another job's
data.

The hosted engines hand packets to each other by call, through one first-in
first-out queue (no recursion; the order the native node keeps too): what a
packet causes runs after it, in order. What leaves for a worker is sealed
with its job's token at once (a later packet cannot change an earlier
answer). Two links a deployment would have are modelled here, in virtual
time, so that the daemon's clock only says when: DLCP's shaped egress port
into the job servers (strict priority with WRED, ``proto.qos``, served at
``port_mbps``), and ATP's fallback PS behind links of its own
(``ps_link_mbps``: one shard per worker, each link a FIFO each way, as
``ModelledLinks`` says).

What stays with the driver: the socket, the clock, the workers' addresses
(a rank that never said hello is the driver's ``drop_no_address``) and
impairments of the network itself. The control plane (``runtime.control``)
adds and removes jobs, marks them resynchronising, and asks whom a job
waits on. The native node (``net.switchpath``) is a second implementation
of exactly this engine, held equal to it datagram for datagram by the
differential harness (``tests/property/test_differential.py``).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from gradfabric.core.errors import ConfigError, ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Fail
from gradfabric.proto.dispatch import Port
from gradfabric.proto.interface import Aggregator, Engine
from gradfabric.proto.qos import PortQueues
from gradfabric.proto.schemes import SCHEMES, Placement, Scheme
from gradfabric.proto.switch import SwitchEngine
from gradfabric.proto.switch.atp import FREE
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES, drop_reason, job_of, seal, unseal
from gradfabric.wire.packet import (
    HEADER_BYTES,
    MAX_FAN_IN,
    MAX_WIRE_VALUES,
    VALUE_BYTES,
    Packet,
    unwrapped,
)

SWITCH: Final = "sw"  # the hosted switch engine's name
ALL: Final = -1  # the rank of a datagram for every worker of its job
BACKGROUND: Final = "background"  # a DLCP job kind: traffic that only loads the port
BURST_NS: Final = 1_000_000  # the DLCP port's credit after idling
IP_UDP_BYTES: Final = 28  # what a modelled link carries besides the datagram
UP, DOWN = 0, 1  # a modelled link's directions: out of its server, into it
LINK_HOLD: Final = 16384  # packets the modelled links hold, all together (then counted drops)
NODE_SCHEMES: Final = ("switchml", "atp", "esa", "dlcp", "ps", "omni")
# Datagrams waiting for the driver at most: a driver takes them after each
# batch it reads (a few hundred); one that does not has the rest refused,
# counted (``drop_outbox_full``), never grown without bound.
OUTBOX_CAP: Final = 4096
MAX_RTO_NS: Final = 1 << 40  # about 18 minutes: a DLCP server's waits, 64 of them, stay in int64

Outgoing = tuple[int, int, bytes]  # (job id, rank or ALL, datagram)
Then = Callable[[str, Packet], None]  # what a modelled link does with a packet once across


def worker_name(job_id: int, rank: int) -> str:
    return f"j{job_id}w{rank}"


def server_name(job_id: int) -> str:
    return f"j{job_id}ps"


@dataclass(frozen=True)
class NodeConfig:
    """What a switch node runs: its scheme and what every job there shares."""

    scheme: str = "atp"
    slots: int = 4096  # aggregators in the pool
    job_slots: int = 32  # SwitchML: slots per job; ATP/ESA: the window
    values_per_packet: int = 1024
    rto_ns: int = 20_000_000  # the workers' (a DLCP server's retransmissions)
    omni_streams: int = 16
    push_bound: float = 0.1  # DLCP
    port_mbps: float = 0.0  # DLCP: the shaped port into the job servers (0: none)
    port_buffer_kb: int = 256
    ps_link_mbps: float = 0.0  # ATP, ESA: the fallback PS behind links of this rate (0: none)
    seed: int = 0  # the port's WRED draws

    def __post_init__(self) -> None:
        if self.scheme not in NODE_SCHEMES:
            raise ConfigError("policy", f"one of {', '.join(NODE_SCHEMES)}; got {self.scheme!r}")
        if not 1 <= self.job_slots <= self.slots:
            raise ConfigError("job_slots", f"must be in 1..slots ({self.slots})")
        if not 1 <= self.values_per_packet <= MAX_WIRE_VALUES:
            raise ConfigError("values_per_packet", f"must be in 1..{MAX_WIRE_VALUES}")
        if not 0 < self.rto_ns <= MAX_RTO_NS:
            raise ConfigError("rto_ns", f"must be in 1..{MAX_RTO_NS} ns")
        if not (self.ps_link_mbps == 0 or 1 <= self.ps_link_mbps < float("inf")):
            raise ConfigError("ps_link_mbps", f"0 (none) or >= 1, got {self.ps_link_mbps}")
        if self.port_mbps < 0 or self.port_buffer_kb < 1:
            raise ConfigError("port_mbps", "must be >= 0, with a buffer of >= 1 KB")
        if not 0 <= self.push_bound < 1:
            raise ConfigError("push_bound", f"must be in [0, 1), got {self.push_bound}")

    @property
    def ps_window(self) -> int:
        """The results a hosted PS keeps: a Python PS answers late
        retransmissions for four windows."""
        return 4 * self.job_slots


@dataclass
class NodeJob:
    job_id: int
    token: bytes
    kind: str
    placement: Placement
    entry: str  # the hosted engine the job's datagrams go to
    shaped: bool = False  # its datagrams cross the shaped, prioritised port
    resyncing: bool = False  # restored after a restart: nothing taken until it resumes
    counters: Counters = field(default_factory=Counters)  # datagrams that named this job
    largest: int = -1  # the largest sequence a datagram of the job named (``unwrap``'s reference)

    @property
    def workers(self) -> int:
        return len(self.placement.workers)


class _Hosted(Port):
    """A hosted engine's port: what it sends goes through the node."""

    __slots__ = ("name", "node")

    def __init__(self, node: SwitchNode, name: str, engine: Engine) -> None:
        super().__init__(engine)
        self.node, self.name = node, name

    def send(self, dst: str, pkt: Packet) -> None:
        self.node.send(self.name, dst, pkt)

    def multicast(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        self.node.multicast(self.name, dsts, pkt)

    def schedule(self, deadline_ns: int) -> None:
        pass  # the node asks every port for ``timer_at`` (``get_timer``)

    def now(self) -> int:
        return self.node.now_ns

    def on_fail(self, fail: Fail) -> None:
        self.node.gave_up(fail)


class ModelledLinks:
    """A hosted server's modelled links (ATP's fallback PS as ATP deploys
    it, BytePS style: one shard per worker, sequence ``s`` on shard ``s mod
    shards``): each shard's link in each direction a FIFO served at the
    rate; a packet goes on once its last byte has crossed."""

    def __init__(self, shards: int, mbps: float) -> None:
        self.free = [[0, 0] for _ in range(shards)]  # when each way is free, ns
        self.ns_per_byte = 8e3 / mbps

    def cross(self, pkt: Packet, way: int, now_ns: int) -> int:
        """When ``pkt``, offered at ``now_ns``, has crossed."""
        free = self.free[pkt.seq % len(self.free)]
        size = IP_UDP_BYTES + HEADER_BYTES + VALUE_BYTES * pkt.count
        free[way] = max(now_ns, free[way]) + round(size * self.ns_per_byte)
        return free[way]


class SwitchNode:
    """The reference switch node (see the module doc)."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.scheme: Scheme = SCHEMES.get(cfg.scheme)
        # Where the scheme keeps no switch state (PS, OmniReduce, DLCP) the
        # switch engine idles with an empty ATP pool.
        self.switch = SwitchEngine.build(SWITCH, self.scheme.policy or "atp", cfg.slots)
        self.counters = Counters()
        self.jobs: dict[int, NodeJob] = {}
        self.ports: dict[str, _Hosted] = {SWITCH: _Hosted(self, SWITCH, self.switch)}
        self.book: dict[str, tuple[NodeJob, int]] = {}  # worker name -> its job, its rank
        self.failed: dict[int, set[str]] = {}  # job -> workers a hosted engine gave up on
        self.links: dict[str, ModelledLinks] = {}
        self.now_ns = 0
        self._work: deque[tuple[str, Packet]] = deque()  # packets between hosted engines
        self._out: list[Outgoing] = []
        # what a modelled link holds: (when it arrives, order, what then, with what)
        self._later: list[tuple[int, int, Then, str, Packet]] = []
        self._n = 0
        self.port: PortQueues[tuple[NodeJob, Packet]] = PortQueues(
            cfg.port_buffer_kb * 1024, self.counters
        )
        self._rng = random.Random(cfg.seed)
        self._port_clock = 0  # when the port is free, ns
        self._port_wake: int | None = None

    # -- the control plane's calls -------------------------------------------
    def add_job(
        self, job_id: int, token: bytes, workers: int, slot_base: int = 0, kind: str | None = None,
        help: HelpConfig | None = None, resyncing: bool = False,
    ) -> NodeJob:  # fmt: skip
        """Install a job of ``workers`` (its engines from the scheme registry)."""
        cfg, scheme = self.cfg, self.scheme
        if job_id in self.jobs:
            raise ConfigError("job_id", f"job {job_id} is registered already")
        if not 1 <= job_id <= 0xFFFF or len(token) != TOKEN_BYTES:
            raise ConfigError("job_id", "a job id in 1..65535 and a token of 8 bytes")
        if not 1 <= workers <= MAX_FAN_IN:
            raise ConfigError("workers", f"must be in 1..{MAX_FAN_IN}")
        kind = kind or scheme.job_kinds[0]
        if kind not in scheme.job_kinds:
            kinds = ", ".join(scheme.job_kinds)
            raise ConfigError("kind", f"the {cfg.scheme} switch takes {kinds} jobs")
        names = tuple(worker_name(job_id, r) for r in range(workers))
        p = Placement(
            job_id, names, {SWITCH: names}, servers=(server_name(job_id),),
            window=cfg.job_slots, pool_slots=cfg.slots, slot_base=slot_base,
            keep_results=cfg.ps_window, rto_ns=cfg.rto_ns,
            values_per_packet=cfg.values_per_packet, streams=cfg.omni_streams,
            push_bound=cfg.push_bound, help=help,
        )  # fmt: skip
        if kind != BACKGROUND:
            for name, engine in scheme.attach(p, self.switch).items():
                self.ports[name] = _Hosted(self, name, engine)
            if cfg.ps_link_mbps and scheme.policy in ("atp", "esa"):
                self.links[server_name(job_id)] = ModelledLinks(workers, cfg.ps_link_mbps)
        job = NodeJob(job_id, token, kind, p, scheme.entry(p), resyncing=resyncing,
                      shaped=scheme.shaped_port and cfg.port_mbps > 0)  # fmt: skip
        self.jobs[job_id] = job
        for r, name in enumerate(names):
            self.book[name] = (job, r)
        return job

    def remove_job(self, job_id: int) -> None:
        """The job left: what it held is released."""
        job = self.jobs.pop(job_id)
        self.scheme.detach(job.placement, self.switch)
        self.ports.pop(server_name(job_id), None)
        if self.links.pop(server_name(job_id), None) is not None:  # what they held goes too
            self._later = [e for e in self._later if e[4].job_id != job_id]
            heapq.heapify(self._later)
        for name in job.placement.workers:
            self.book.pop(name, None)
        self.failed.pop(job_id, None)

    def resync(self, job_id: int, on: bool, floor: int = 0) -> None:
        """Whether ``job_id`` waits for its workers to agree on a floor; off,
        the floor they agreed on (its sequences go on from there)."""
        job = self.jobs[job_id]
        job.resyncing = on
        if not on:
            job.largest = max(job.largest, floor - 1)

    def missing(self, job_id: int) -> list[int]:
        """Ranks some hosted engine waits on, or gave up on."""
        job = self.jobs[job_id]
        names = set(self.failed.get(job_id, ()))
        for port in self.ports.values():
            if isinstance(port.engine, Aggregator):
                names |= set(port.engine.missing_peers(job_id))
        return [r for r, w in enumerate(job.placement.workers) if w in names]

    def occupancy(self) -> int:
        """Aggregators now held by some job (ATP and ESA's pool; SwitchML's ranges)."""
        pool = getattr(self.switch.policy, "pool", None)
        if pool is not None:
            return sum(1 for a in pool if a.state != FREE)
        return len(self.jobs) * self.cfg.job_slots

    def engines(self) -> list[Engine]:
        return [p.engine for p in self.ports.values() if p.engine is not None]

    def counter_groups(self) -> dict[str, object]:
        """Every counter, where it was counted: the node's, each job's (the
        datagrams that named it), the switch engine's, each job's server's."""
        servers = {j: self.ports[server_name(j)].engine for j in self.jobs
                   if server_name(j) in self.ports}  # fmt: skip
        return {
            "node": self.counters,
            "jobs": {j: job.counters for j, job in self.jobs.items()},
            "switch": self.switch.counters,
            "servers": {j: e.counters for j, e in servers.items() if e is not None},
        }

    # -- the datagram interface ------------------------------------------------
    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        self.now_ns = now_ns
        self.counters["rx_datagrams"] += 1
        got = self.accept(data)
        if got is None:
            return
        job, pkt = got
        if job.shaped:
            self.port.offer((job, pkt), len(data), pkt.priority, self._rng.random())
            if self._port_wake is None:
                self._port_wake = max(now_ns, self._port_clock)
        else:
            self._arrive(job, pkt)

    def datagrams_to_send(self, now_ns: int) -> list[Outgoing]:
        out, self._out = self._out, []
        return out

    def get_timer(self) -> int | None:
        times = [p.timer_at for p in self.ports.values() if p.timer_at is not None]
        if self._later:
            times.append(self._later[0][0])
        if self._port_wake is not None:
            times.append(self._port_wake)
        return min(times, default=None)

    def handle_timer(self, now_ns: int) -> None:
        self.now_ns = now_ns
        while self._later and self._later[0][0] <= now_ns:
            _, _, then, dst, pkt = heapq.heappop(self._later)
            then(dst, pkt)
        if self._port_wake is not None and self._port_wake <= now_ns:
            self._serve_port(now_ns)
        for port in list(self.ports.values()):
            if port.timer_at is not None and port.timer_at <= now_ns:
                port.fire(port.timer_at)

    # -- inside ------------------------------------------------------------------
    def accept(self, data: bytes) -> tuple[NodeJob, Packet] | None:
        """The checks before any engine sees a datagram (see the module doc):
        its job and packet, or None and a counted drop."""
        job = None
        try:
            job = self.jobs.get(job_of(data))
            if job is None:
                self.counters["drop_unknown_job"] += 1
                return None
            pkt = unseal(data, job.token)
        except ProtocolError as e:
            (self.counters if job is None else job.counters)[drop_reason(e)] += 1
            return None
        job.counters["rx_datagrams"] += 1
        if job.resyncing:
            job.counters["drop_resyncing"] += 1
            return None
        # the wire's 32 bits of the sequence, nearest the job's newest (a job
        # numbers its packets without bound: wire.packet.unwrap)
        unwrapped(pkt, pkt.seq if job.largest < 0 else job.largest + 1)
        job.largest = max(job.largest, pkt.seq)
        return job, pkt

    def _arrive(self, job: NodeJob, pkt: Packet) -> None:
        if job.kind == BACKGROUND:
            self.counters["bg_delivered"] += 1
        else:
            self.deliver(job.entry, pkt)

    def _serve_port(self, now_ns: int) -> None:
        """DLCP's port: on each wake-up everything its virtual clock allows,
        most urgent queue first; idle time gives at most BURST_NS of credit."""
        self._port_clock = max(self._port_clock, now_ns - BURST_NS)
        ns_per_byte = 8e3 / self.cfg.port_mbps
        while self._port_clock <= now_ns:
            nxt = self.port.take()
            if nxt is None:
                break
            (job, pkt), size = nxt
            self._port_clock += round(size * ns_per_byte)
            self.counters["port_served"] += 1
            if job.job_id in self.jobs:
                self._arrive(job, pkt)
        self._port_wake = max(now_ns, self._port_clock) if self.port.backlog > 0 else None

    def deliver(self, name: str, pkt: Packet) -> None:
        """Feed ``pkt`` to the hosted engine ``name``, then every packet that
        hands on to other hosted engines, in order."""
        self._work.append((name, pkt))
        if len(self._work) > 1:
            return  # an outer call is draining
        while self._work:
            name, pkt = self._work[0]
            port = self.ports.get(name)
            if port is None or port.engine is None:
                self.counters["drop_no_engine"] += 1
            else:
                port.execute(port.engine.on_packet(pkt, self.now_ns))
            self._work.popleft()

    def send(self, src: str, dst: str, pkt: Packet) -> None:
        links = self.links.get(src)
        if links is not None:
            self._after(links.cross(pkt, UP, self.now_ns), self._on, dst, pkt)
        else:
            self._on(dst, pkt)

    def multicast(self, src: str, dsts: tuple[str, ...], pkt: Packet) -> None:
        hit = self.book.get(dsts[0]) if dsts and src not in self.links else None
        if hit is not None and dsts == hit[0].placement.workers:  # once, for every worker
            self._emit(hit[0], ALL, pkt)
            return
        for d in dsts:
            self.send(src, d, pkt)

    def _on(self, dst: str, pkt: Packet) -> None:
        """``pkt`` goes on to ``dst``: a hosted engine (through its links,
        if it has them) or a worker."""
        if dst in self.ports:
            links = self.links.get(dst)
            if links is not None:
                self._after(links.cross(pkt, DOWN, self.now_ns), self.deliver, dst, pkt)
            else:
                self.deliver(dst, pkt)
            return
        hit = self.book.get(dst)
        if hit is None:
            self.counters["drop_no_address"] += 1
            return
        self._emit(hit[0], hit[1], pkt)

    def _after(self, at_ns: int, then: Then, dst: str, pkt: Packet) -> None:
        if len(self._later) >= LINK_HOLD:  # a flood the links cannot carry: never grown
            self.counters["drop_link_full"] += 1
            return
        self._n += 1
        heapq.heappush(self._later, (at_ns, self._n, then, dst, pkt))

    def _emit(self, job: NodeJob, rank: int, pkt: Packet) -> None:
        """Out to ``rank`` of ``job`` (or ALL), sealed with its token now."""
        if len(self._out) >= OUTBOX_CAP:
            self.counters["drop_outbox_full"] += 1
            return
        try:
            self._out.append((job.job_id, rank, seal(job.token, pkt)))
        except ValueError:  # an engine built a packet the wire cannot carry
            self.counters["drop_unencodable"] += 1

    def gave_up(self, fail: Fail) -> None:
        self.counters["gave_up"] += 1
        for job in self.jobs.values():
            if fail.peer in job.placement.workers:
                self.failed.setdefault(job.job_id, set()).add(fail.peer)

