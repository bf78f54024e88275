"""The namespace leaf-spine (``net.fabric``): routes between racks, hashes
a flow onto one spine, sprays a marked port's datagrams over all of them,
and leaves nothing behind (root and nftables; skipped elsewhere)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.net import fabric, netns
from tests.namespaces import needs_nft_namespaces

# Sent from a host: ``count`` datagrams of 1,000 bytes from one socket (one
# flow) to ``port``, paced well under the link; the receiver counts them.
SEND = """
import socket, sys, time
dst, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(count):
    s.sendto(bytes(1000), (dst, port))
    time.sleep(0.0005)
"""
RECEIVE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # every datagram, however late we read
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
s.settimeout(3.0)
n = 0
try:
    while True:
        s.recv(2048)
        n += 1
except TimeoutError:
    print(n)
"""


def _flow(
    fab: fabric.Fabric, src: netns.NsHost, dst: netns.NsHost, leaf: int, port: int, count: int
) -> tuple[int, list[int]]:
    """``count`` datagrams from ``src`` to ``dst``: how many arrived, and the
    bytes leaf ``leaf`` sent up each spine meanwhile."""
    before = fabric.spine_bytes(fab)[leaf]
    rx = subprocess.Popen(["ip", "netns", "exec", dst.netns, sys.executable, "-c", RECEIVE,
                           str(port)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert rx.stdout is not None and rx.stdout.readline() == "ready\n"  # bound before we send
    subprocess.run(["ip", "netns", "exec", src.netns, sys.executable, "-c", SEND, dst.ip,
                    str(port), str(count)], check=True, timeout=60)  # fmt: skip
    out, _ = rx.communicate(timeout=30)
    after = fabric.spine_bytes(fab)[leaf]
    return int(out), [b - a for a, b in zip(before, after, strict=True)]


@pytest.mark.long  # (11 s of namespaces: in CI's second pass, outside the default 10 minutes)
@needs_nft_namespaces
def test_a_flow_keeps_one_spine_and_a_sprayed_port_takes_them_all() -> None:
    count, spines = 400, 2
    with fabric.leaf_spine([2, 2], spines, 50.0, 50.0, queue_kb=64) as fab:
        names = {h.netns for h in fab.nodes}
        a, b = fab.racks[0][0], fab.racks[1][0]
        got, up = _flow(fab, a, b, 0, 5_001, count)
        assert got == count
        # ECMP hashes the flow: its datagrams all leave by one spine
        assert max(up) >= count * 1000 > 50 * min(up)
        fabric.spray(fab, 5_002)
        share = count // spines * 1000
        # sprayed: each datagram by the next spine, so an equal share each
        # (within the few control packets that ride along), forwarded from a
        # host and sent by a process in the leaf itself (a server there)
        for src, dst, leaf in ((a, b, 0), (fab.leaves[1], a, 1)):
            got, up = _flow(fab, src, dst, leaf, 5_002, count)
            assert got == count
            assert all(share <= x <= share * 1.05 for x in up), (src, up)
    assert not names & netns.listed()  # every namespace deleted


def test_a_fabric_refuses_what_it_cannot_build() -> None:
    for racks, spines in (([4], 2), ([2, 0], 2), ([2, 2], 0), ([2, 2], 9)):
        with pytest.raises(ConfigError), fabric.leaf_spine(racks, spines, 50.0, 50.0):
            pass


def test_the_training_study_refuses_a_load_its_background_cannot_make() -> None:
    from gradfabric.lab.dlcp_train import DlcpTrainConfig

    DlcpTrainConfig(fabric="leaf-spine", load=0.8)  # two hosts a rack on 0.8 of the time
    with pytest.raises(ConfigError, match="cannot load"):
        DlcpTrainConfig(fabric="leaf-spine", load=0.8, bg_hosts=1)
    with pytest.raises(ConfigError, match="fabric"):
        DlcpTrainConfig(fabric="mesh")
