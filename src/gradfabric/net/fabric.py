"""A leaf-spine of Linux network namespaces (root only): racks of hosts, a
routing leaf namespace per rack, spine namespaces, every link shaped.

``leaf_spine(racks, spines, link_mbps, uplink_mbps)`` makes ``racks[r]``
hosts under leaf ``r`` and ``spines`` spines, every leaf linked to every
spine: more than one path between any two racks. Rack ``r``'s hosts are
``10.78.<r>.<j+1>/24`` behind a bridge in their leaf (``10.78.<r>.254``,
the leaf's own address: a process there sits where the rack's switch
does, as in ``netns.tor_star``); leaf ``r`` and spine ``k`` share
``10.79.<k>.<4r>/30``. Every link's egress, both ways, is a strict-priority
port (``netns.CLASSES``, a ``queue_kb`` FIFO each): hosts' links at
``link_mbps``, leaf-spine links at ``uplink_mbps``.

Routing is what a datacenter's is: leaves hash each flow over the spines
(ECMP on the 5-tuple, ``fib_multipath_hash_policy=1``), so one TCP
connection keeps one path, however loaded; ``spray(fabric, port)`` makes
the leaves send each UDP datagram to or from ``port`` over the next spine
in turn instead (per-packet load balancing, as DLCP's switches do: an
nftables counter marks the packet, the mark picks a routing table that
names one spine). Everything is deleted on exit, also after an error.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gradfabric.core.errors import ConfigError
from gradfabric.net.netns import (
    MTU,
    NsHost,
    bridged,
    check_mtu,
    free_tag,
    ip,
    namespaces,
    nft_available,
    shape,
    sysctl,
    veth,
)

LEAF_HOST = 254  # a leaf's address on its rack's bridge
SPRAY_TABLE = 100  # routing table ``SPRAY_TABLE + k`` sends to every other rack over spine k


@dataclass(frozen=True)
class Fabric:
    racks: list[list[NsHost]]  # the hosts under each leaf
    leaves: list[NsHost]  # each leaf's namespace, as a host on its rack's bridge
    spines: list[str]  # the spines' namespaces

    @property
    def hosts(self) -> list[NsHost]:
        return [h for rack in self.racks for h in rack]

    @property
    def nodes(self) -> list[NsHost]:
        """Every namespace of the fabric, as hosts (``netns.class_totals``)."""
        return [*self.hosts, *self.leaves, *(NsHost(s, "", "") for s in self.spines)]


def _uplink(rack: int, spine: int) -> tuple[str, str]:
    """Leaf ``rack``'s and spine ``spine``'s addresses on their shared /30."""
    return f"10.79.{spine}.{4 * rack + 1}", f"10.79.{spine}.{4 * rack + 2}"


@contextmanager
def leaf_spine(
    racks: list[int], spines: int, link_mbps: float, uplink_mbps: float, queue_kb: int = 256,
    mtu: int = MTU,
) -> Iterator[Fabric]:  # fmt: skip
    if not 2 <= len(racks) <= 64 or not all(1 <= n < LEAF_HOST for n in racks):
        # (64: leaf r's uplink is 10.79.<spine>.<4r + 1>)
        raise ConfigError("racks", f"need 2..64 racks of 1..{LEAF_HOST - 1} hosts, got {racks}")
    if not 1 <= spines <= 8:
        raise ConfigError("spines", f"must be in 1..8, got {spines}")
    if link_mbps <= 0 or uplink_mbps <= 0 or queue_kb <= 0:
        raise ConfigError("link_mbps", "link rates and queues must be > 0")
    check_mtu(mtu)
    tag = free_tag()
    with namespaces() as add:
        spine_ns = [add(f"gf{tag}spine{k}") for k in range(spines)]
        for ns in spine_ns:
            sysctl(ns, *_ROUTER)
        leaves: list[NsHost] = []
        hosts: list[list[NsHost]] = []
        first = 0
        for r, n in enumerate(racks):
            leaf = add(f"gf{tag}leaf{r}")
            sysctl(leaf, *_ROUTER, "net.ipv4.fib_multipath_hash_policy=1")
            ip("-n", leaf, "link", "add", "br0", "type", "bridge")
            ip("-n", leaf, "link", "set", "br0", "up")
            ip("-n", leaf, "addr", "add", f"10.78.{r}.{LEAF_HOST}/24", "dev", "br0")
            leaves.append(NsHost(leaf, f"10.78.{r}.{LEAF_HOST}", "br0"))
            rack = [
                bridged(add(f"gf{tag}h{first + j}"), f"gfh{first + j}", (leaf, f"dn{first + j}"),
                        f"10.78.{r}.{j + 1}", mtu, link_mbps, queue_kb,
                        gateway=f"10.78.{r}.{LEAF_HOST}")
                for j in range(n)
            ]  # fmt: skip
            hosts.append(rack)
            first += n
            for k, sp in enumerate(spine_ns):
                up, down = f"up{k}", f"dn{r}"
                veth((leaf, up), (sp, down), mtu)
                mine, theirs = _uplink(r, k)
                for where, dev, addr in ((leaf, up, mine), (sp, down, theirs)):
                    ip("-n", where, "addr", "add", f"{addr}/30", "dev", dev)
                    ip("-n", where, "link", "set", dev, "up")
                    shape(where, dev, uplink_mbps, mtu, queue_kb)
                ip("-n", sp, "route", "add", f"10.78.{r}.0/24", "via", mine)
        for r, leaf_host in enumerate(leaves):
            for s in range(len(racks)):
                if s == r:
                    continue
                dst, hops = f"10.78.{s}.0/24", []
                for k in range(spines):
                    via = ["via", _uplink(r, k)[1], "dev", f"up{k}"]
                    hops += ["nexthop", *via]
                    # the table a sprayed datagram's mark picks: this spine alone
                    ip("-n", leaf_host.netns, "route", "add", dst, *via,
                        "table", str(SPRAY_TABLE + k))  # fmt: skip
                ip("-n", leaf_host.netns, "route", "add", dst, *hops)
        yield Fabric(hosts, leaves, spine_ns)


# a router: forwards, and takes a packet on whichever uplink it arrives (a
# sprayed or hashed flow comes back over another spine than it left by)
_ROUTER = ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
           "net.ipv4.conf.default.rp_filter=0")  # fmt: skip


def spray(fabric: Fabric, port: int) -> None:
    """Every leaf sends UDP datagrams to or from ``port`` over the spines in
    turn, one datagram each (the rest keeps ECMP's per-flow hash)."""
    if not nft_available():
        raise ConfigError("nft", "nftables is not installed (apt-get install nftables)")
    spines = len(fabric.spines)
    for leaf in fabric.leaves:
        # forwarded datagrams, and the leaf's own (a server in the leaf's
        # namespace): a route chain looks the route up again after the mark
        script = (
            "add table ip gfspray\n"
            "add chain ip gfspray pre { type filter hook prerouting priority mangle; }\n"
            "add chain ip gfspray out { type route hook output priority mangle; }\n"
        )
        for chain in ("pre", "out"):
            for way in ("dport", "sport"):
                script += (f"add rule ip gfspray {chain} udp {way} {port} "
                           f"meta mark set numgen inc mod {spines} offset 1\n")  # fmt: skip
        subprocess.run(["ip", "netns", "exec", leaf.netns, "nft", "-f", "-"],
                       input=script.encode(), check=True, capture_output=True)  # fmt: skip
        for k in range(spines):
            ip("-n", leaf.netns, "rule", "add", "fwmark", str(k + 1), "table",
                str(SPRAY_TABLE + k))  # fmt: skip


def spine_bytes(fabric: Fabric) -> list[list[int]]:
    """Bytes each leaf has sent up to each spine so far (``[leaf][spine]``):
    how evenly traffic spread over the paths."""
    out = []
    for leaf in fabric.leaves:
        row = []
        for k in range(len(fabric.spines)):
            path = f"/sys/class/net/up{k}/statistics/tx_bytes"
            got = subprocess.run(["ip", "netns", "exec", leaf.netns, "cat", path],
                                 check=True, capture_output=True, text=True)  # fmt: skip
            row.append(int(got.stdout))
        out.append(row)
    return out
