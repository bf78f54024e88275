"""Flow level: the simulator's scale mode, for every collective scheme.

Packet level (``sim.collective``) moves every packet through every queue; it
is exact and costs an event per packet per hop, so 16,384 workers are out of
its reach. Here a job's traffic is a set of *flow groups* on the links of a
Clos fabric, their rates are max-min fair (water-filling), and a bucket's
all-reduce takes its bytes over its slowest group's rate plus the latency of
its packet pipeline. What is per packet and not a rate stays per packet: the
window (in-network aggregation: a worker's rate is at most ``W`` packets per
round trip to its aggregation root; a PS: whole windows, ``Plan.windowed_ns``).
ATP's pool is priced for a job whose window fits it, where
the pool's hash gives every sequence in flight its own aggregator
(``proto.routes.atp_index``): no collision, no fallback. Jobs that share a
pool (ATP's collisions, ESA's preemptions) are ``sim.multijob``'s: its
hybrid level prices here only the iterations no other job overlaps.

The fabric, its flow groups and their rates are ``sim.fluid``'s.

No loss: where packet level's windows overflow a queue (a PS with fewer
servers than workers at its default 2,048-packet window: incast),
retransmissions take packet level past the flow level's figure, which is
the bandwidth's.

How each scheme becomes flows (``S``: a bucket's bytes on the wire, ``n``
workers):

* ``ring``: rank ``r`` to ``r+1`` in rank order (a rack's ranks adjacent, as
  NCCL orders a ring), ``2(n-1)/n S`` each, one bucket at a time; packets
  forwarded as they arrive, so the ``2(n-1)`` steps' latency (their
  edges' mean) counts only where a chunk is short (``Phase``);
* ``hring``: the hierarchical ring (``proto.ring``): reduce-scatter in the
  rack, all-reduce of a ``1/h`` shard across racks, all-gather in the rack.
* ``ps``: every worker to every server ``S/P`` and back, servers placed as
  packet level places them (``sim.fluid.Fabric``: round-robin over the
  racks); the pattern is the same for every worker of a rack and every
  server, so a rack's workers' NICs are one bundle, its servers' another,
  and groups are (rack, rack) pairs. The servers' shares are dealt by
  sequence (a simulated packet), so a bucket of ``k`` sequences loads the
  busiest server with ``ceil(k / P)`` of them (the last one short of a
  whole sequence where the bucket is): at least that server's NIC time.
  Every worker sends a sequence to its server at the same moment, and the
  server answers once all ``n`` trains crossed its port, sending the result
  to the workers one after another: a sequence's round trip is its two
  paths and ``n + 1`` trains at a host's rate (the fan-out staggers the
  workers, so each then waits one burst, not two), and a worker's window
  of ``W`` trains, spread over the servers, moves at most ``W`` trains a
  round trip. Where the window binds, ``k`` sequences take ``R =
  ceil(k / W)`` windows: each but the last a round trip, and the last
  window's ``m`` sequences follow the results that free them, a train
  apart, so it takes ``m`` trains, not ``m / W`` of a round trip
  (notebook 2026-12-02, #ps-windows). The window runs on across buckets
  (packet level's sequence numbers do), so buckets streamed back to back
  share it: a bucket ends no sooner than the windows of every sequence
  since any earlier bucket's start (``schedule``).
  The last result's fan-out (``n`` trains) ends the bucket.
  Before it the last sequence's burst (``n - 1`` trains more) drains after
  the workers' last send: with a server a worker (its port carries what a
  worker's NIC does) always; with fewer servers, whose ports bind and hold
  a queue all along, the burst is in their time unless the window binds.
  (Bandwidth alone came out 12% under packet level at 1,024 workers in the
  study, ``experiments.flowlevel``, and off by up to 79% in
  ``test_flow.py``'s cases.)
* ``omnireduce``: as ``ps`` with pushes of the non-zero share ``density``
  and results of the share non-zero at any worker, ``u = 1 - (1-density)^n``.
  Blocks go to aggregators by block (``b % A``), and each aggregator sends
  every result it makes to every worker, so the busiest aggregator's NIC
  bounds the bucket: of its ``m`` blocks a Binomial(``m``, ``u``) number
  travel, and the expected most of ``A`` such counts (``busiest``) is
  what it sends. Where ``u`` is near 1 that is ``m``; at sparse densities
  it sets the time (at 64 workers and density 0.001 the busiest of 64
  aggregators sends 1.5x the mean). Before any block, every stream's
  announce round: a round trip, and each aggregator's header-only result
  for each of its streams to every worker.
* in-network (``switchml``, ``atp``, ``esa``, ``saatp``): each worker's
  bucket up to its rack switch and the result back; with several racks each
  rack's partial sum up one link to the job's pod aggregation switch, with
  several pods each pod's up one link to a core: aggregation at every level
  (SwitchML's hierarchy, ATP's two levels made three where a fat-tree has
  them). ATP's sum goes on to its PS, one hop off the top switch (packet
  level lays it so), and the result comes back from there: two more hops
  of latency and the PS's link, one flow each way.
* SA-ATP with stragglers: a straggler's bucket is ready at ``f t_b`` (its
  slowdown ``f``); ATP waits for it; under SA-ATP a replica holder that
  finished its own backward at ``C`` computes it from the replica and sends
  it under the straggler's bit, ready at ``C + load + t_b``: the earlier of
  the two counts (the best a helper can do; packet level's ``takeover``
  policies decide when help is worth it, which this level does not model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.proto.schemes import SCHEMES, InaConfig
from gradfabric.sim.collective import Bucket
from gradfabric.sim.fluid import Clos, Fabric, Groups, max_min, packet_bytes
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, wire_bytes

INA = ("switchml", "atp", "esa", "saatp")
FLOW_SCHEMES = ("ring", "hring", "ps", "omnireduce", *INA)


@dataclass(frozen=True)
class Phase:
    """One phase of a bucket's all-reduce: its slowest group's time per byte
    of the bucket (``ns_per_byte = max(share / rate)``), and for rings their
    ``steps``, each moving ``chunk`` of the bucket's bytes to the next rank
    over a path of ``step_ns`` latency at ``ns_per_byte / share`` a byte.
    Packets are forwarded as they arrive, so a ring's steps overlap: the
    first packet (``packet`` bytes, a whole chunk if smaller) crosses every
    step, and the chunk's other packets follow it; the phase takes that
    or its bytes' time, whichever is longer."""

    ns_per_byte: float
    share: float = 1.0
    steps: int = 0
    step_ns: float = 0.0
    chunk: float = 0.0
    packet: int = 1

    def time_ns(self, wire: int) -> float:
        bw = wire * self.ns_per_byte
        if not self.steps:
            return bw
        per_byte = self.ns_per_byte / self.share
        chunk = self.chunk * wire
        first = min(chunk, self.packet)
        rest = chunk - first
        return max(bw, self.steps * (self.step_ns + first * per_byte) + rest * per_byte)


@dataclass(frozen=True)
class Plan:
    """What one bucket of ``values`` costs a scheme on a fabric: its phases
    one after another, then its packet pipeline's fill (``latency_ns``); a
    PS's window is priced across buckets (``windowed_ns``, ``schedule``)."""

    phases: tuple[Phase, ...]
    latency_ns: float
    serial: bool  # buckets one at a time (a ring) or streamed back to back
    vpp: int
    groups: int = 0
    # a PS deals a bucket's sequences round-robin over ``servers``
    # (``proto.routes.Sharded``): the busiest holds ``ceil(k / servers)`` of
    # ``k``, and its NIC moves each to or from every worker (``seq_ns``);
    # where a sequence travels only with chance ``seq_share`` (OmniReduce's
    # blocks), the expected busiest count (``busiest``)
    servers: int = 0
    seq_values: int = 1
    seq_ns: float = 0.0
    seq_share: float = 1.0  # the chance a sequence travels at all (OmniReduce's union)
    # a PS's last sequence's burst after the workers' last send, in
    # ``latency_ns`` (module doc): a busiest server's time holds its own
    burst_ns: float = 0.0
    # a PS worker's window (``window`` sequences in flight, 0: none): whole
    # windows a ``round_ns`` each, the last one's sequences a train apart
    window: int = 0
    round_ns: float = 0.0
    train_ns: float = 0.0

    def sequences(self, values: int) -> int:
        return -(-values // self.seq_values)

    def windowed_ns(self, sequences: int) -> float:
        """The least time ``sequences`` take through an empty window, up to
        ``latency_ns``: whole windows a round trip each, the last one's
        sequences a train apart, and the last sequence's burst where
        ``latency_ns`` does not hold it (fewer servers than workers)."""
        whole = (sequences - 1) // self.window  # the windows before the last
        last = sequences - whole * self.window
        burst = self.seq_ns - self.train_ns - self.burst_ns
        return whole * self.round_ns + last * self.train_ns + burst

    def bandwidth_ns(self, values: int) -> float:
        wire = wire_bytes(values, self.vpp)
        even = sum(p.time_ns(wire) for p in self.phases)
        if not self.servers:
            return even
        if self.seq_share < 1:
            most = busiest(self.servers, -(-self.sequences(values) // self.servers),
                           self.seq_share)  # fmt: skip
        else:  # dealt whole, the last sequence short (to the server after the last full one)
            full, rest = divmod(values, self.seq_values)
            most = full // self.servers + (1 if full % self.servers else rest / self.seq_values)
        return max(even, most * self.seq_ns - self.burst_ns)


def busiest(servers: int, each: int, p: float) -> float:
    """The expected largest of ``servers`` independent Binomial(``each``,
    ``p``) counts, exactly: ``sum over k of 1 - F(k)^servers`` with ``F``
    the binomial CDF (``each`` at ``p = 1``, as a PS's dealt share is)."""
    if p >= 1 or each == 0:
        return float(each)
    if p <= 0:
        return 0.0
    k = np.arange(each + 1)
    steps = np.log((each - k[:-1]) / (k[:-1] + 1.0))  # log C(each, k+1) - log C(each, k)
    log_pmf = np.concatenate([[0.0], np.cumsum(steps)]) + k * math.log(p) + (
        each - k) * math.log1p(-p)  # fmt: skip
    cdf = np.minimum(np.cumsum(np.exp(log_pmf)), 1.0)
    return float(np.sum(1.0 - cdf[:-1] ** servers))


def _rings(
    fab: Fabric, ina: InaConfig, rings: Sequence[Sequence[int]], chunk: float, rounds: int
) -> tuple[Groups, Phase, float]:
    """Rings running side by side, each rank sending ``chunk`` of the bucket
    to the next at each of ``rounds`` times its ring's steps (2: an
    all-reduce, 1: a reduce-scatter or all-gather); returns the groups, the
    phase (before its rates) and the longest step's latency."""
    g = Groups()
    hops: list[int] = []
    steps = 0
    for ring in rings:
        steps = max(steps, len(ring) - 1)
    share = rounds * steps * chunk
    for ring in rings:
        for i, r in enumerate(ring):
            s = ring[(i + 1) % len(ring)]
            mid = fab.between(int(fab.rack[r]), int(fab.rack[s]))
            hops.append(2 + len(mid))
            g.add(share, fab.rate(bool(mid)),
                  [(fab.host_up(r), 1), *((x, 1) for x in mid), (fab.host_down(s), 1)])  # fmt: skip
    # a packet crosses the steps one edge after another: the edges' mean latency
    step = fab.path_ns(float(np.mean(hops)), ina)
    phase = Phase(0.0, share, rounds * steps, step, chunk, fab.train_bytes(ina))
    return g, phase, fab.path_ns(max(hops), ina)


def _solved(fab: Fabric, g: Groups, phase: Phase) -> Phase:
    rates = max_min(fab.cap, g)
    worst = max(float(s / r) for s, r in zip(g.share, rates, strict=True) if s > 0)
    return replace(phase, ns_per_byte=worst)


def _hierarchical(fab: Fabric, ina: InaConfig) -> tuple[list[Phase], float, int]:
    """A rack's ranks reduce-scatter in a ring, the ranks of one local index
    all-reduce their shard across racks in a ring, the rack all-gathers (the
    2D ring of NCCL's and Horovod's hierarchical all-reduce); phases whose
    rings have one rank are left out."""
    by_rack: dict[int, list[int]] = {}
    for w in range(fab.n):
        by_rack.setdefault(int(fab.rack[w]), []).append(w)
    local = list(by_rack.values())
    h, racks = max(map(len, local)), len(local)
    if min(map(len, local)) != h:
        raise ConfigError("workers", "a hierarchical ring wants every rack's workers alike "
                          f"(racks of {sorted({len(x) for x in local})})")  # fmt: skip
    across = [[rk[j] for rk in local if j < len(rk)] for j in range(h)]
    phases: list[Phase] = []
    latency, groups = 0.0, 0
    inner = [(local, 1 / h, 1)] if h > 1 else []
    outer = [(across, 1 / (racks * h), 2)] if racks > 1 else []
    for rings, chunk, rounds in [*inner, *outer, *inner]:
        g, phase, lat = _rings(fab, ina, rings, chunk, rounds)
        phases.append(_solved(fab, g, phase))
        latency, groups = latency + lat, groups + len(g.share)
    return phases, latency, groups


def _span(fab: Fabric) -> int:
    """The most links between a worker and a server (or two workers)."""
    racks = set(fab.rack.tolist())
    if len(racks) == 1:
        return 2
    return 6 if len({r // fab.clos.racks_per_pod for r in racks}) > 1 else 4


def _sharded(fab: Fabric, servers: int, push: float, pull: float) -> Groups:
    """Every worker to every server (``push`` of the bytes in all) and back
    (``pull``), each flow at most its path's rate, grouped by (rack, rack).
    A PS's window is not a rate here: ``Plan.bandwidth_ns`` prices it by
    whole windows."""
    g, n = Groups(), fab.n
    wr = np.bincount(fab.rack[:n], minlength=fab.clos.racks)
    sr = np.bincount(fab.rack[n:], minlength=fab.clos.racks)
    for a in np.nonzero(wr)[0]:
        for b in np.nonzero(sr)[0]:
            m = float(wr[a] * sr[b])  # flows from rack a's workers to rack b's servers
            mid = fab.between(int(a), int(b))
            rate = fab.rate(bool(mid))
            g.add(push / servers, rate, [(fab.nic_up(int(a)), m),
                  *((x, m) for x in mid), (fab.nic_down(int(b), servers=True), m)])  # fmt: skip
            back = fab.between(int(b), int(a))
            g.add(pull / servers, rate, [(fab.nic_up(int(b), servers=True), m),
                  *((x, m) for x in back), (fab.nic_down(int(a)), m)])  # fmt: skip
    return g


def _ina_tree(fab: Fabric, g: Groups, window: Callable[[int], float]) -> int:
    """In-network aggregation up the fabric and the result back down, each
    flow at most its link's rate and ``window(levels)``; returns the levels:
    the links from a worker to the job's aggregation root."""
    n = fab.n
    racks = sorted(set(fab.rack[:n].tolist()))
    pods = sorted({r // fab.clos.racks_per_pod for r in racks})
    up = 1 + (len(racks) > 1) + (len(pods) > 1)
    cap = min(fab.rate(up > 1), window(up))  # the job's pipeline runs at its slowest
    hosts = range(len(fab.rack))  # the workers, and ATP's PS: the sum in, the result out
    links = [fab.host_up(h) for h in hosts] + [fab.host_down(h) for h in hosts]
    if len(racks) > 1:  # each rack's partial sum up one link, the result back down
        links += [fab.rack_up(r) for r in racks] + [fab.rack_down(r) for r in racks]
    if len(pods) > 1:
        links += [fab.pod_up(p) for p in pods] + [fab.pod_down(p) for p in pods]
    for link in links:
        g.add(1.0, cap, [(link, 1)])
    return up


def servers_of(scheme: str, workers: int, ina: InaConfig) -> int:
    """The hosts ``scheme``'s job needs besides its workers."""
    return len(SCHEMES.get(scheme).servers(workers, ina))


def plan(
    scheme: str, clos: Clos, workers: int, ina: InaConfig, density: float = 1.0,
    server_gbps: float = 0.0,
) -> Plan:  # fmt: skip
    """The flow groups of ``scheme`` on ``clos``, solved: see the module doc.
    ``server_gbps``: where ATP's PS works through a sum's values at a finite
    rate (``sim.multijob``'s ``ps_merge_gbps``), each result waits on it too
    (0: at once, as ``sim.collective``'s PS)."""
    if scheme not in FLOW_SCHEMES:
        valid = ", ".join(FLOW_SCHEMES)
        raise ConfigError("scheme", f"{scheme!r} has no flow model; valid: {valid}")
    sch = SCHEMES.get(scheme)
    servers = servers_of(scheme, workers, ina)
    fab = Fabric(clos, workers, servers)
    vpp = ina.values_per_packet
    train = fab.train_bytes(ina) / fab.host_rate  # a host takes a simulated packet whole
    if scheme == "hring":
        phases, latency, groups = _hierarchical(fab, ina)
        return Plan(tuple(phases), latency, True, vpp, groups)
    if scheme == "ring":
        ring = list(range(workers))
        g, phase, latency = _rings(fab, ina, [ring], 1 / workers, 2)
        return Plan((_solved(fab, g, phase),), latency, True, vpp, len(g.share))
    if scheme in ("ps", "omnireduce"):
        path = fab.path_ns(_span(fab), ina)
        if scheme == "ps":
            # every worker sends a sequence to its server at once, and the
            # server answers once all ``workers`` of them crossed its port, a
            # result a worker out of it: a window's round trip (the fan-out
            # staggers the workers, so each waits about one burst; the window
            # spreads over every server), the last sequence's burst where the
            # workers' NICs bind (module doc), and the last fan-out
            round_ns = 2 * path + (workers + 1) * train
            window = sch.window(ina)
            pull = 1.0
            g = _sharded(fab, servers, 1.0, pull)
            burst = (workers - 1) * train if servers >= workers else 0.0
            latency = 2 * path + workers * train + burst
        else:
            pull = 1 - (1 - density) ** workers
            g = _sharded(fab, servers, density, pull)
            # every stream's announce round first: headers only (an
            # aggregator's results to every worker; a worker's announces to
            # every aggregator)
            announces = ina.omni_streams * max(workers, servers)
            latency = 4 * path + train + announces * HEADER_BYTES / fab.host_rate
            burst = round_ns = 0.0
            window = 0
        solved = _solved(fab, g, Phase(0.0))
        return Plan(
            (solved,), latency, False, vpp, len(g.share), servers=servers,
            seq_values=ina.values_per_sim_packet, seq_ns=workers * train, seq_share=pull,
            burst_ns=burst, window=window, round_ns=round_ns, train_ns=train,
        )  # fmt: skip
    window = sch.window(ina) * ina.train_packets  # in real packets
    if scheme != "switchml" and window > ina.atp_pool_slots:
        raise ConfigError(
            "atp_window", "the flow level prices a job whose window fits ATP's pool "
            "(a job never collides with itself then: proto.routes.atp_index); "
            "run a larger window at packet level",
        )  # fmt: skip
    g = Groups()
    pkt = packet_bytes(ina)

    # ATP's results come from its PS, one host link off the top switch and
    # back; the PS, a host, takes the sum whole before it answers
    host = clos.link
    merge = ina.values_per_sim_packet * VALUE_BYTES * 8 / server_gbps if server_gbps else 0.0
    ps_leg = 2 * (host.prop_delay_ns + pkt / fab.host_rate) + train + merge if servers else 0.0

    def rtt(up: int) -> float:  # up to the root (and the PS) and back, the result taken whole
        return fab.path_ns(2 * up, ina) + pkt / fab.host_rate + train + ps_leg

    levels = _ina_tree(fab, g, lambda up: window * pkt / rtt(up))
    latency = rtt(levels)
    return Plan((_solved(fab, g, Phase(0.0)),), latency, False, vpp, len(g.share))


def schedule(
    p: Plan, buckets: Sequence[Bucket], ready: Callable[[int], float] | None = None
) -> float:
    """When the last bucket is everywhere: each bucket's bytes follow the
    previous bucket's on the same flows (a ring also waits for its latency),
    from when every worker has it (``ready(b)``, default its ``ready_ns``).
    A PS's window runs on across buckets: a bucket ends no sooner than the
    sequences of it and every bucket back to any earlier one take through
    the window from that one's start (``Plan.windowed_ns``)."""
    free = 0.0  # when the flows are free for the next bucket's bytes
    done = 0.0
    starts: list[tuple[float, int]] = []  # (start, sequences) of each bucket so far
    for b, bk in enumerate(buckets):
        at = float(bk.ready_ns) if ready is None else ready(b)
        start = max(at, free)
        bw = p.bandwidth_ns(bk.count)
        end = start + bw
        if p.window:
            starts.append((start, p.sequences(bk.count)))
            since = 0
            for t, k in reversed(starts):
                since += k
                end = max(end, t + p.windowed_ns(since))
        done = max(done, end + p.latency_ns)
        free = start + bw + (p.latency_ns if p.serial else 0.0)
    return done


def iteration_ns(
    p: Plan, buckets: Sequence[Bucket], compute_ns: int, slowdowns: Sequence[float] = (),
    helped: bool = False, help_delay_ns: int = 0,
) -> float:  # fmt: skip
    """One data-parallel step: compute, buckets as they are ready at the
    slowest worker (``slowdowns``: the stragglers' factors), or, ``helped``,
    at the earlier of the straggler and a helper that starts once its own
    compute is done (``help_delay_ns``: loading the straggler's batch)."""
    f = max([1.0, *slowdowns])

    def ready(b: int) -> float:
        t = buckets[b].ready_ns
        late = f * t
        if helped and f > 1:
            late = min(late, compute_ns + help_delay_ns + t)
        return late

    return max(float(compute_ns), schedule(p, buckets, ready))


__all__ = [
    "FLOW_SCHEMES",
    "Clos",
    "Plan",
    "busiest",
    "iteration_ns",
    "plan",
    "schedule",
    "servers_of",
]
