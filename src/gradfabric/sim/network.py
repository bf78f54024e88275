"""Links, nodes and topologies.

A link is a FIFO output queue plus a wire. Instead of one event per enqueue
and dequeue it keeps ``busy_until`` (when its last accepted byte leaves, in
picoseconds so serialisation never accumulates rounding): the backlog at any
instant is ``(busy_until - now) * rate``, which gives tail drop at
``queue_bytes`` and ECN marking above ``ecn_bytes`` exactly as a FIFO would,
at one event per packet per hop (its arrival at the far end).

A link delivers in the order it accepts unless a packet overtakes the wire
(jitter, a control packet or a resend sent ahead of the queue). So once a
deep backlog forms, its packets in flight wait in its own FIFO (``Link.flight``)
and only the first of them is on the event heap, under the sequence number
it was given when sent: ties break as if every packet were on the heap, so
a run is the same event for event, and the heap stays about as deep as the
links in use, not as the packets in the fabric's queues
(docs/notebook/2026-12-02.md#sim-speed-again). The backlog decides only
when a FIFO starts (``FIFO_BACKLOG_BYTES``): until then each packet goes on
the heap directly, since the FIFO's bookkeeping costs more than it saves
where few packets are in flight; once it has started, every packet joins it
until it drains, but for one that lands before its tail, which goes on the
heap. Any mix is exact, since each entry keeps its key.

A simulated packet may stand for a train of real packets (coarse
granularity): it occupies the link for the whole train. A switch starts on it
when the train's first packet is in, as the real packets would pipeline
through it (forwarding and per-packet aggregation alike); a host's engine
gets it when its last packet is in, since it has the train's data only then.

Loss, duplication and reordering (a uniform extra delay up to ``jitter_ns``)
draw from the network's seeded RNG; a host timer's lateness (its slack,
``Network.timer_slack_ns``) from a generator of its own (``slack_seed``), so
turning the slack on or off leaves every loss and delay draw as it was.
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from heapq import heappush

from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action
from gradfabric.proto.dispatch import Port
from gradfabric.proto.interface import Engine
from gradfabric.proto.qos import PortQueues
from gradfabric.proto.switch import SwitchEngine
from gradfabric.sim.loop import Event, EventLoop
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, Flag, Packet


@cache
def _name_hash(name: str) -> int:
    # Python's str hash is salted per process; ECMP must be reproducible.
    return zlib.crc32(name.encode())


PS_PER_NS = 1000
# A port whose backlog passes this starts a FIFO of its packets in flight
# (module doc): about 60 packets of 1 KB, past which the heap entries saved
# outweigh the FIFO's own cost per packet.
FIFO_BACKLOG_BYTES = 64_000


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link. ``queue_bytes=0`` means an unbounded queue (a host NIC)."""

    link_gbps: float = 100.0
    prop_delay_ns: int = 500
    queue_bytes: int = 1_000_000
    ecn_bytes: int = 0
    loss: float = 0.0
    dup: float = 0.0
    jitter_ns: int = 0
    # a priority port's queues: one shared buffer of queue_bytes (False), or one
    # each (``proto.qos.PortQueues``' per_queue)
    class_buffers: bool = False

    def __post_init__(self) -> None:
        if self.link_gbps <= 0:
            raise ConfigError("link_gbps", f"must be > 0, got {self.link_gbps}")
        if self.prop_delay_ns < 0 or self.jitter_ns < 0:
            raise ConfigError("prop_delay_ns", "delays must be >= 0")
        for name in ("loss", "dup"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {v}")
        if self.queue_bytes < 0 or self.ecn_bytes < 0:
            raise ConfigError("queue_bytes", "must be >= 0")


class Link:
    __slots__ = (
        "arrive",
        "busy_until_ps",
        "bytes_sent",
        "control_first",
        "counters",
        "dst",
        "dst_name",
        "dup",
        "ecn_bytes",
        "flight",
        "highest_seq",
        "jitter",
        "loop",
        "loss",
        "name",
        "net",
        "prop",
        "ps_per_byte",
        "queue_bytes",
        "resends_first",
        "rng",
        "spec",
        "take",
        "vpp",
    )

    def __init__(self, net: Network, src: str, dst: Node, spec: LinkSpec) -> None:
        self.net = net
        self.dst = dst
        self.arrive = dst.arrive
        self.take = dst.take  # the far end's own engine path, for the last hop
        self.dst_name = dst.name
        self.spec = spec
        self.name = f"{src}->{dst.name}"
        self.ps_per_byte = 8e12 / (spec.link_gbps * 1e9)
        self.busy_until_ps = 0
        self.bytes_sent = 0
        # A host NIC whose scheduler (fq, or a priority band) sends control
        # packets (no values: ACKs, requests) ahead of the data queued before them.
        self.control_first = False
        # A worker host whose sender paces to its link and sends a resend (a
        # sequence it sent before: new ones go in rising order) ahead of the
        # data it holds, as the emulator's workers do: the resend leaves now and
        # the data behind it waits its length more (a fluid pacer).
        self.resends_first = False
        self.highest_seq = -1
        self.flight: deque[Event] = deque()  # on the wire, in arrival order (module doc)
        self.counters = net.counters
        # Hot-path copies of the spec (attribute chains cost on every packet).
        self.loop, self.rng, self.vpp = net.loop, net.rng, net.values_per_packet
        self.loss, self.dup, self.jitter = spec.loss, spec.dup, spec.jitter_ns
        self.queue_bytes, self.ecn_bytes, self.prop = (
            spec.queue_bytes,
            spec.ecn_bytes,
            spec.prop_delay_ns,
        )

    def pace(self, gbps: float) -> None:
        """Serialise at ``gbps`` (a sender pacing itself below its line rate)."""
        self.ps_per_byte = 8e12 / (gbps * 1e9)

    def slow_down(self, factor: float) -> None:
        """Serialise at the spec's rate divided by ``factor`` (a straggling NIC)."""
        self.ps_per_byte = 8e12 / (self.spec.link_gbps * 1e9) * factor

    def send(self, dst: str, pkt: Packet) -> None:
        # The simulator's hottest function: locals instead of attribute chains.
        count = pkt.count
        vpp = self.vpp
        size = (-(-count // vpp) if count else 1) * HEADER_BYTES + count * VALUE_BYTES
        if self.loss and self.rng.random() < self.loss:
            self.counters["link_loss"] += 1
            return
        loop = self.loop
        ps_per_byte = self.ps_per_byte
        now_ps = loop.now * PS_PER_NS
        start = self.busy_until_ps
        deep = False  # a backlog worth a FIFO (module doc)
        if not count and self.control_first:
            start = now_ps  # ahead of the queue; the data behind it is not delayed
        elif start > now_ps and self.resends_first and pkt.seq <= self.highest_seq:
            self.busy_until_ps = start + int(size * ps_per_byte)
            start = now_ps
        elif start > now_ps:
            backlog = (start - now_ps) / ps_per_byte
            if self.queue_bytes and backlog + size > self.queue_bytes:
                self.counters["queue_drop"] += 1
                return
            if self.ecn_bytes and backlog > self.ecn_bytes:
                pkt.flags |= Flag.ECN
            deep = backlog > FIFO_BACKLOG_BYTES
        else:
            start = now_ps
        if self.resends_first and pkt.seq > self.highest_seq:
            self.highest_seq = pkt.seq
        finish = start + int(size * ps_per_byte)
        if finish > self.busy_until_ps:
            self.busy_until_ps = finish
        self.bytes_sent += size
        last_hop = dst == self.dst_name
        if count > vpp and (not last_hop or self.dst.cut_through):
            # A train into a switch: its packets pipeline through it, so the switch
            # starts on it when its first packet is in (cut-through of the train),
            # while this link stays busy for the whole train.
            finish = start + int((HEADER_BYTES + vpp * VALUE_BYTES) * ps_per_byte)
        arrive = -(-finish // PS_PER_NS) + self.prop
        if self.jitter:
            arrive += self.rng.randrange(self.jitter + 1)
        loop.seq += 1  # EventLoop.push, inlined
        if deep or self.flight:
            self._queue(arrive, loop.seq, dst, pkt, last_hop)
        elif last_hop:  # no forwarding decision at the far end: its engine takes it
            heappush(loop.heap, (arrive, loop.seq, self.take, pkt))
        else:
            heappush(loop.heap, (arrive, loop.seq, self.arrive, (dst, pkt)))
        if self.dup and self.rng.random() < self.dup:
            self.counters["link_dup"] += 1
            loop.at(arrive + self.rng.randrange(self.jitter + 1), self.arrive, (dst, pkt.clone()))

    def _queue(self, arrive: int, seq: int, dst: str, pkt: Packet, last_hop: bool) -> None:
        """``send``'s event behind a deep backlog: at the FIFO's tail (its head
        on the heap), or on the heap if it lands before the tail."""
        event: Event = ((arrive, seq, self.take, pkt) if last_hop
                        else (arrive, seq, self.arrive, (dst, pkt)))  # fmt: skip
        flight = self.flight
        if not flight:
            flight.append(event)
            heappush(self.loop.heap, (arrive, seq, self.land, None))
        elif arrive >= flight[-1][0]:
            flight.append(event)
        else:  # it overtakes the wire
            heappush(self.loop.heap, event)

    def land(self, _arg: object) -> None:
        """The first packet on the wire arrives; the next one's event goes
        on the heap under its own time and sequence number."""
        flight = self.flight
        _, _, fn, arg = flight.popleft()
        if flight:
            t, seq, _, _ = flight[0]
            heappush(self.loop.heap, (t, seq, self.land, None))
        fn(arg)


class PriorityLink(Link):
    """A switch egress port with strict-priority queues and WRED by drop
    precedence (``proto.qos.PortQueues``: the priority byte as
    ``wire.packet.traffic_class`` writes it); a packet in service finishes.
    ECN marks above ``ecn_bytes`` as the FIFO does.

    Unlike the FIFO ``Link`` this needs an event per dequeue (the order of
    departure depends on what arrives later), so it is used only where
    priorities are on."""

    __slots__ = ("busy", "port")

    def __init__(self, net: Network, src: str, dst: Node, spec: LinkSpec) -> None:
        super().__init__(net, src, dst, spec)
        self.port: PortQueues[tuple[str, Packet]] = PortQueues(
            spec.queue_bytes, net.counters, spec.class_buffers
        )
        self.busy = False

    def send(self, dst: str, pkt: Packet) -> None:
        count = pkt.count
        size = (-(-count // self.vpp) if count else 1) * HEADER_BYTES + count * VALUE_BYTES
        if self.loss and self.rng.random() < self.loss:
            self.counters["link_loss"] += 1
            return
        if not self.busy:
            self._start(dst, pkt, size, self.loop.now * PS_PER_NS)
            return
        if self.ecn_bytes and self.port.backlog > self.ecn_bytes:
            pkt.flags |= Flag.ECN
        self.port.offer((dst, pkt), size, pkt.priority, self.rng.random())

    def _start(self, dst: str, pkt: Packet, size: int, start_ps: int) -> None:
        self.busy = True
        finish = start_ps + int(size * self.ps_per_byte)
        self.busy_until_ps = finish
        self.bytes_sent += size
        done = -(-finish // PS_PER_NS)
        arrive = done + self.prop
        if self.jitter:
            arrive += self.rng.randrange(self.jitter + 1)
        loop = self.loop
        loop.push(arrive, self.arrive, (dst, pkt))
        if self.dup and self.rng.random() < self.dup:
            self.counters["link_dup"] += 1
            loop.push(arrive + self.rng.randrange(self.jitter + 1), self.arrive, (dst, pkt.clone()))
        loop.push(done, self._next, None)

    def _next(self, _arg: object) -> None:
        self.busy = False
        nxt = self.port.take()
        if nxt is not None:
            (dst, pkt), size = nxt
            # back to back with the previous packet, in picoseconds
            self._start(dst, pkt, size, self.busy_until_ps)


class Node(Port):
    """A host or switch. Packets addressed to it go to its engine (if any);
    others are forwarded along ``routes`` (several links = ECMP, hashed per
    flow). Its engine's actions go through the shared dispatcher (``Port``):
    ``Fail`` raises ``PeerTimeoutError`` out of the run."""

    __slots__ = (
        "cut_through",
        "direct",
        "loop",
        "name",
        "net",
        "routes",
        "serve_free_ps",
        "serve_ps_per_byte",
    )

    def __init__(self, net: Network, name: str) -> None:
        super().__init__()
        self.net = net
        self.loop = net.loop
        self.name = name
        self.routes: dict[str, list[Link]] = {}
        self.direct: dict[str, Link] = {}
        self.cut_through = False  # a switch: trains pipeline through it
        # a host whose engine works through its packets' bytes at a finite rate
        # (a PS merging on its CPU): packets wait their turn (FIFO) first
        self.serve_ps_per_byte = 0.0
        self.serve_free_ps = 0

    def arrive(self, arg: tuple[str, Packet]) -> None:
        dst, pkt = arg
        if dst != self.name:
            (self.direct.get(dst) or self.link_to(dst, pkt)).send(dst, pkt)
            return
        self.take(pkt)

    def take(self, pkt: Packet) -> None:
        """A packet addressed here: to the engine (after its turn, if it serves
        at a finite rate)."""
        eng = self.engine
        if eng is None:
            self.net.counters["drop_no_engine"] += 1
            return
        if self.serve_ps_per_byte:
            now_ps = self.loop.now * PS_PER_NS
            start = max(now_ps, self.serve_free_ps)
            self.serve_free_ps = start + int(pkt.count * VALUE_BYTES * self.serve_ps_per_byte)
            self.loop.at(-(-self.serve_free_ps // PS_PER_NS), self._served, pkt)
            return
        self.execute(eng.on_packet(pkt, self.loop.now))

    def _served(self, pkt: Packet) -> None:
        if self.engine is not None:
            self.execute(self.engine.on_packet(pkt, self.loop.now))

    def link_to(self, dst: str, pkt: Packet) -> Link:
        links = self.routes.get(dst)
        if links is None:
            links = self.routes.get("*")
            if links is None:
                raise ConfigError("route", f"{self.name} has no route to {dst}")
        if len(links) == 1:
            self.direct[dst] = links[0]
            return links[0]
        if self.net.spray:  # per-packet spraying over the equal-cost paths
            return links[self.net.rng.randrange(len(links))]
        return links[(pkt.job_id * 40503 + pkt.worker_id * 9973 + _name_hash(dst)) % len(links)]

    def send(self, dst: str, pkt: Packet) -> None:
        # ``direct``: dst -> its one link, learnt by link_to (not ECMP)
        (self.direct.get(dst) or self.link_to(dst, pkt)).send(dst, pkt)

    def multicast(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        direct = self.direct  # as ``send``, per copy, without a call per destination
        for d in dsts:
            p = pkt.clone()
            (direct.get(d) or self.link_to(d, p)).send(d, p)

    def schedule(self, deadline_ns: int) -> None:
        # A host's timer fires up to its slack late (``Network.timer_slack_ns``)
        net = self.net
        late = int(net.slack_rng.random() * net.timer_slack_ns) if net.timer_slack_ns else 0
        self.loop.at(deadline_ns + late, self.fire, deadline_ns)

    def now(self) -> int:
        return self.loop.now


# How late a host's timer may fire, at most: a model of host timer jitter
# (50 us, Linux's default timer slack for a normal thread, as its bound).
# Timers that fired exactly on time kept workers that lost trains together
# retransmitting together: an incast that overfilled the same queue on every
# retry, the same workers losing every time until they gave up (two ATP jobs'
# fallbacks to one PS shard did). Real hosts' timers never line up to the
# nanosecond. ``FabricConfig`` defaults to it; a bare ``Network`` keeps
# timers on time.
TIMER_SLACK_NS = 50_000


@dataclass
class Network:
    loop: EventLoop
    rng: random.Random
    values_per_packet: int = 256
    spray: bool = False  # per-packet path choice instead of per-flow ECMP
    priority: bool = False  # switch egress: strict-priority queues, per-class WRED
    timer_slack_ns: int = 0  # each timer fires up to this late (0: on time)
    slack_seed: int = 0  # the lateness's own generator (loss and delay keep ``rng``)
    slack_rng: random.Random = field(init=False, repr=False)
    nodes: dict[str, Node] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        if self.timer_slack_ns < 0:
            raise ConfigError("timer_slack_ns", f"must be >= 0, got {self.timer_slack_ns}")
        self.slack_rng = random.Random(self.slack_seed)

    def node(self, name: str) -> Node:
        n = self.nodes.get(name)
        if n is None:
            n = self.nodes[name] = Node(self, name)
        return n

    def connect(self, a: str, b: str, a_to_b: LinkSpec, b_to_a: LinkSpec) -> tuple[Link, Link]:
        na, nb = self.node(a), self.node(b)
        ab, ba = self._link(a, nb, a_to_b), self._link(b, na, b_to_a)
        self.links += [ab, ba]
        return ab, ba

    def _link(self, src: str, dst: Node, spec: LinkSpec) -> Link:
        if self.priority and spec.queue_bytes:  # a switch port (host NICs stay FIFO)
            return PriorityLink(self, src, dst, spec)
        return Link(self, src, dst, spec)

    def bind(self, name: str, engine: Engine) -> None:
        node = self.node(name)
        node.attach(engine)
        node.cut_through = isinstance(engine, SwitchEngine)

    def serve_at(self, name: str, gbps: float) -> None:
        """Node ``name``'s engine takes its packets' values at ``gbps`` (one at a
        time, in arrival order): the cost of work a host does per byte."""
        self.node(name).serve_ps_per_byte = 8e12 / (gbps * 1e9)

    def kick(self, name: str, actions: list[Action]) -> None:
        """Execute actions an engine returned outside a packet event (e.g. a push)."""
        self.nodes[name].execute(actions)
