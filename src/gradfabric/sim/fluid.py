"""The flow level's fabric: a Clos network as link capacities and paths, flow
groups on its links, and their max-min fair rates (``sim.flow`` turns each
collective scheme into groups and times a bucket by them).

The fabric (``Clos``) is a star, a two-tier leaf-spine or a three-tier
fat-tree: ``hosts_per_rack`` under each rack switch, ``racks_per_pod`` rack
switches under each pod's ``rack_uplinks`` aggregation switches, ``pods``
pods under the cores (``pod_uplinks`` links up from each aggregation
switch). Oversubscription is ``hosts_per_rack / rack_uplinks`` at the racks
and ``racks_per_pod / pod_uplinks`` at the pods. The links of one tier above a
switch are one *bundle* (ECMP taken as a perfect fluid split, exact for
per-packet spraying; per-flow hashing can collide where few large flows
cross a tier, which packet level shows and this level does not: measured in
``experiments.flowcheck``); a single flow never exceeds one link's rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import FabricConfig
from gradfabric.sim.network import LinkSpec
from gradfabric.wire.packet import wire_bytes


@dataclass(frozen=True)
class Clos:
    """A star, leaf-spine or fat-tree (module doc); ``rack_uplinks = 0`` is a
    star (one switch, every host under it)."""

    hosts_per_rack: int = 32
    racks_per_pod: int = 1
    pods: int = 1
    rack_uplinks: int = 0
    pod_uplinks: int = 0
    link: LinkSpec = field(default_factory=LinkSpec)
    fabric: LinkSpec | None = None  # switch-to-switch links (None: ``link``)
    # the job's servers round-robin over the workers' racks, past
    # ``hosts_per_rack`` (packet level's leaf-spine lays them so:
    # ``sim.collective.CollectiveRun.topology``; ATP's PS, off spine0, is
    # priced by its own links: ``sim.flow.plan``)
    servers_join_racks: bool = False

    def __post_init__(self) -> None:
        for name in ("hosts_per_rack", "racks_per_pod", "pods"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.rack_uplinks < 0 or self.pod_uplinks < 0:
            raise ConfigError("rack_uplinks", "uplinks must be >= 0")
        if self.racks > 1 and self.rack_uplinks == 0:
            raise ConfigError("rack_uplinks", "several racks need uplinks")
        if self.pods > 1 and self.pod_uplinks == 0:
            raise ConfigError("pod_uplinks", "several pods need uplinks to the cores")

    @staticmethod
    def fat_tree(k: int, link: LinkSpec | None = None) -> Clos:
        """The k-ary fat-tree: ``k`` pods of ``k/2`` racks of ``k/2`` hosts, full bisection."""
        if k < 2 or k % 2:
            raise ConfigError("k", f"a fat-tree needs an even k >= 2, got {k}")
        h = k // 2
        return Clos(h, h, k, h, h, link or LinkSpec())

    @staticmethod
    def holding(hosts: int, link: LinkSpec | None = None) -> Clos:
        """The smallest k-ary fat-tree with room for ``hosts``."""
        k = 2
        while k**3 // 4 < hosts:
            k += 2
        return Clos.fat_tree(k, link)

    @staticmethod
    def of(fabric: FabricConfig, hosts: int) -> Clos:
        """The packet level's fabric as a Clos: a star is one rack; a
        leaf-spine one pod whose aggregation switches are the spines."""
        if fabric.topology == "star":
            return Clos(hosts_per_rack=max(1, hosts), link=fabric.link)
        racks = -(-hosts // fabric.hosts_per_rack)
        return Clos(
            fabric.hosts_per_rack, racks, 1, fabric.spines, 0, fabric.link, fabric.fabric_link,
            servers_join_racks=True,
        )  # fmt: skip

    @property
    def racks(self) -> int:
        return self.racks_per_pod * self.pods

    @property
    def hosts(self) -> int:
        return self.hosts_per_rack * self.racks

    @property
    def fabric_link(self) -> LinkSpec:
        return self.fabric or self.link


def gbps_to_bytes_per_ns(gbps: float) -> float:
    return gbps / 8


def packet_bytes(ina: InaConfig) -> int:
    """One real packet on the wire."""
    return wire_bytes(ina.values_per_packet, ina.values_per_packet)


class Fabric:
    """Link capacities (bytes/ns) and paths of a Clos: workers in rank order
    (worker ``w`` in rack ``w // hosts_per_rack``), then the job's servers on
    free hosts, round-robin over the racks that have one (or, with
    ``servers_join_racks``, round-robin over the workers' racks whether or
    not they have one). A star's one switch has a port for every host
    (packet level's star); a rack of a leaf-spine or fat-tree has
    ``hosts_per_rack``."""

    def __init__(self, clos: Clos, workers: int, servers: int = 0) -> None:
        per = clos.hosts_per_rack
        star = clos.rack_uplinks == 0
        join = clos.servers_join_racks
        if not star and workers + (0 if join else servers) > clos.hosts:
            raise ConfigError(
                "workers", f"{workers} workers and {servers} servers exceed the fabric's "
                f"{clos.hosts} hosts",
            )  # fmt: skip
        self.clos = clos
        self.n = workers
        rack = [0 if star else w // per for w in range(workers)]
        free = [0] * clos.racks if star else [per - rack.count(r) for r in range(clos.racks)]
        for i in range(servers):
            if star or join:
                rack.append(0 if star else i % -(-workers // per))
                continue
            r = next(r for k in range(clos.racks) if free[r := (i + k) % clos.racks] > 0)
            free[r] -= 1
            rack.append(r)
        self.rack = np.array(rack, dtype=np.int64)
        h, r, p = len(rack), clos.racks, clos.pods
        workers_in = np.bincount(self.rack[:workers], minlength=r)
        servers_in = np.bincount(self.rack[workers:], minlength=r)
        host = gbps_to_bytes_per_ns(clos.link.link_gbps)
        up = gbps_to_bytes_per_ns(clos.fabric_link.link_gbps)
        # index space: host up, host down; a rack's workers' NICs and its
        # servers' NICs as bundles, up and down; rack uplink bundles up and
        # down; pod uplink bundles up and down
        self.base = np.cumsum([0, h, h, r, r, r, r, r, r, p, p])
        self.cap = np.concatenate([
            np.full(2 * h, host),
            np.tile(workers_in * host, 2), np.tile(servers_in * host, 2),
            np.full(2 * r, clos.rack_uplinks * up),
            np.full(2 * p, clos.rack_uplinks * clos.pod_uplinks * up),
        ]).astype(float)  # fmt: skip
        self.host_rate = host
        self.fabric_rate = up

    def host_up(self, i: int) -> int:
        return int(self.base[0] + i)

    def host_down(self, i: int) -> int:
        return int(self.base[1] + i)

    def nic_up(self, rack: int, servers: bool = False) -> int:
        """The NICs of a rack's workers (or ``servers``), as one bundle."""
        return int(self.base[4 if servers else 2] + rack)

    def nic_down(self, rack: int, servers: bool = False) -> int:
        return int(self.base[5 if servers else 3] + rack)

    def rack_up(self, rack: int) -> int:
        return int(self.base[6] + rack)

    def rack_down(self, rack: int) -> int:
        return int(self.base[7] + rack)

    def pod_up(self, pod: int) -> int:
        return int(self.base[8] + pod)

    def pod_down(self, pod: int) -> int:
        return int(self.base[9] + pod)

    def between(self, ra: int, rb: int) -> list[int]:
        """The tier bundles between racks ``ra`` and ``rb`` (none within a rack)."""
        if ra == rb:
            return []
        pa, pb = ra // self.clos.racks_per_pod, rb // self.clos.racks_per_pod
        mid = [] if pa == pb else [self.pod_up(pa), self.pod_down(pb)]
        return [self.rack_up(ra), *mid, self.rack_down(rb)]

    def rate(self, crosses: bool) -> float:
        """The most one flow takes: its slowest link's rate (a host's, and a
        fabric link's where it leaves the rack)."""
        return min(self.host_rate, self.fabric_rate) if crosses else self.host_rate

    def path_ns(self, links: float, ina: InaConfig) -> float:
        """A packet's latency over ``links`` links (two of them a host's, the
        rest the fabric's) beyond its own serialisation: propagation on
        each, and at each switch the one real packet it waits for on the
        link it came in on (packet level's switches start on a train when
        its first packet is in)."""
        host, fabric = self.clos.link, self.clos.fabric_link
        inner = max(0.0, links - 2)
        prop = min(links, 2) * host.prop_delay_ns + inner * fabric.prop_delay_ns
        pkt = packet_bytes(ina)
        wait = pkt / self.host_rate + max(0.0, links - 2) * pkt / self.fabric_rate
        return prop + (wait if links > 1 else 0.0)

    def train_bytes(self, ina: InaConfig) -> int:
        """A simulated packet's bytes: a host takes it whole (packet level's
        trains, ``ina.train_packets`` real packets; 1 at packet granularity)."""
        return packet_bytes(ina) * ina.train_packets


@dataclass
class Groups:
    """Flow groups: ``members`` identical flows each, ``share`` of the bucket's
    wire bytes per member; ``entries`` (group, link, members crossing it)."""

    share: list[float] = field(default_factory=list)
    cap: list[float] = field(default_factory=list)
    entries: list[tuple[int, int, float]] = field(default_factory=list)

    def add(self, share: float, cap: float, links: Sequence[tuple[int, float]]) -> None:
        g = len(self.share)
        self.share.append(share)
        self.cap.append(cap)
        self.entries.extend((g, link, k) for link, k in links)


def max_min(cap: np.ndarray, groups: Groups) -> np.ndarray:
    """Each group's per-member rate under max-min fairness (water-filling):
    raise every unfrozen rate alike until a link fills or a group meets its
    cap, freeze those, repeat."""
    e = np.array(groups.entries, dtype=float).reshape(-1, 3)
    eg, el, ek = e[:, 0].astype(np.int64), e[:, 1].astype(np.int64), e[:, 2]
    gcap = np.array(groups.cap, dtype=float)
    rate = np.zeros(len(gcap))
    frozen = np.zeros(len(gcap), dtype=bool)
    residual = cap.astype(float).copy()
    while not frozen.all():
        live = ~frozen[eg]
        demand = np.bincount(el[live], weights=ek[live], minlength=len(cap))
        used = demand > 0
        step = float(np.min(gcap[~frozen] - rate[~frozen]))
        if used.any():
            step = min(step, float(np.min(residual[used] / demand[used])))
        rate[~frozen] += step
        residual -= demand * step
        full = used & (residual <= 1e-9 * cap)
        hit = np.zeros(len(gcap), dtype=bool)
        hit[eg[live & full[el]]] = True
        frozen |= hit | (rate >= gcap * (1 - 1e-12))
    return rate


__all__ = ["Clos", "Fabric", "Groups", "gbps_to_bytes_per_ns", "max_min", "packet_bytes"]
