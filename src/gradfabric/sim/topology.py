"""Topologies: a star (one switch) and a two-tier leaf-spine.

Hosts are named by the caller; switches are ``sw0`` (star) or ``leaf{r}`` and
``spine{s}``. Host NIC queues are unbounded (the host buffers what it has not
sent); switch egress queues use the configured ``queue_bytes``. A host's link
toward its first switch is ``uplink`` where given (a switch that drops a
share of what reaches it: loss on the uplinks only), else ``link``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gradfabric.core.errors import ConfigError
from gradfabric.sim.network import Link, LinkSpec, Network


@dataclass
class Topology:
    net: Network
    hosts: list[str]
    switches: list[str]
    first_hop: dict[str, str] = field(default_factory=dict)
    spines: list[str] = field(default_factory=list)

    def rack_hosts(self, switch: str, among: list[str]) -> list[str]:
        return [h for h in among if self.first_hop[h] == switch]


def star(
    net: Network, hosts: list[str], link: LinkSpec, uplink: LinkSpec | None = None
) -> Topology:
    nic = replace(uplink or link, queue_bytes=0)
    sw = net.node("sw0")
    for h in hosts:
        up, down = net.connect(h, "sw0", nic, link)
        net.node(h).routes["*"] = [up]
        sw.routes[h] = [down]
    return Topology(net, list(hosts), ["sw0"], {h: "sw0" for h in hosts})


def leaf_spine(
    net: Network,
    racks: list[list[str]],
    spines: int,
    link: LinkSpec,
    fabric: LinkSpec | None = None,
    uplink: LinkSpec | None = None,
    at_root: tuple[str, ...] = (),
) -> Topology:
    """``racks[r]`` are the hosts under ``leaf{r}``; every leaf links to every
    spine; ``at_root`` hosts hang off ``spine0`` (ATP's PS beside its second
    level, as the paper's PS beside its rack switch), every leaf reaching them
    through it."""
    if spines < 1 or not racks:
        raise ConfigError("spines", "leaf-spine needs >= 1 spine and >= 1 rack")
    fabric = fabric or link
    nic = replace(uplink or link, queue_bytes=0)
    topo = Topology(net, [h for r in racks for h in r], [], {})
    spine_names = [f"spine{s}" for s in range(spines)]
    topo.spines = spine_names
    leaves = [f"leaf{r}" for r in range(len(racks))]
    topo.switches = leaves + spine_names
    uplinks: dict[str, list[Link]] = {name: [] for name in leaves}
    for r, hosts in enumerate(racks):
        leaf_node = net.node(leaves[r])
        for h in hosts:
            up, down = net.connect(h, leaves[r], nic, link)
            net.node(h).routes["*"] = [up]
            leaf_node.routes[h] = [down]
            topo.first_hop[h] = leaves[r]
        for sp in spine_names:
            lu, ld = net.connect(leaves[r], sp, fabric, fabric)
            uplinks[leaves[r]].append(lu)
            leaf_node.routes[sp] = [lu]
            spn = net.node(sp)
            spn.routes[leaves[r]] = [ld]
            for h in hosts:
                spn.routes[h] = [ld]
    for h in at_root:
        up, down = net.connect(h, spine_names[0], nic, link)
        net.node(h).routes["*"] = [up]
        net.node(spine_names[0]).routes[h] = [down]
        topo.hosts.append(h)
        topo.first_hop[h] = spine_names[0]
        for name in leaves:
            net.node(name).routes[h] = [uplinks[name][0]]
    for name in leaves:
        net.node(name).routes["*"] = uplinks[name]  # ECMP over spines
    for sp in spine_names:  # spine-to-spine traffic goes through a leaf
        net.node(sp).routes["*"] = [net.node(sp).routes[leaves[0]][0]]
    return topo
