"""DLCP in real training over strict-priority namespace links (root,
namespaces and nftables; skipped elsewhere)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from gradfabric.net import netns
from tests.namespaces import needs_nft_namespaces

pytestmark = needs_nft_namespaces

# Sent from a host namespace: DLCP datagrams of each class to the server's
# port (16 Mbit/s), each followed by 8 KB of unmarked UDP (128 Mbit/s): the
# 50 Mbit/s link is offered three times its rate.
SENDER = """
import socket, sys, time
from gradfabric.proto.dlcp import dlcp_data
from gradfabric.wire.envelope import seal
from gradfabric.wire.packet import traffic_class
import numpy as np
dst, port, per_class = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
vals, bg = np.zeros(256, dtype=np.float32), bytes(4000)
for queue in (0, 1):
    for drop in range(4):
        pkt = dlcp_data(job_id=7, sender=0, tensor=1, offset=0, length=256,
                        priority=traffic_class(queue, drop), count=256, values=vals)
        raw = seal(bytes(8), pkt)
        for _ in range(per_class):
            s.sendto(raw, (dst, port))
            s.sendto(bg, (dst, 9))
            s.sendto(bg, (dst, 9))
            time.sleep(0.0005)
"""


@pytest.mark.parametrize("push_bound", [0.1, 0.25])
def test_priority_ports_place_dlcp_datagrams_by_their_header(push_bound: float) -> None:
    from gradfabric.lab.dlcp_train import BOTTOM, TOP, dlcp_rules

    port, per_class = 40_000, 50
    with netns.tor_star(1, 0.05, classes=True, queue_kb=64) as (hosts, tor):
        (h,) = hosts
        netns.prioritise(h, dlcp_rules(port, push_bound))
        subprocess.run(["ip", "netns", "exec", h.netns, sys.executable, "-c", SENDER, tor.ip,
                        str(port), str(per_class)], check=True, timeout=60)  # fmt: skip
        up = netns.class_stats(h, h.ifname)
    droppable = per_class * 2 if push_bound >= 0.25 else 0  # precedence 3, both queues
    assert up[BOTTOM]["sent"] + up[BOTTOM]["dropped"] == droppable
    # every DLCP datagram of the other precedences in the top class, none lost
    # though the link was offered twice its rate meanwhile
    assert up[TOP] == {"sent": per_class * 8 - droppable, "dropped": 0}
    assert up[netns.DEFAULT_CLASS]["dropped"] > 0  # the overload fell on the unmarked class


@pytest.mark.long
@pytest.mark.parametrize("fabric", ["star", "leaf-spine"])
def test_dlcp_training_over_congested_priority_links(fabric: str) -> None:
    """Reliable mode equals the in-process float64 replay bit for bit (the
    loss curve), also sprayed over two spines (datagrams reordered;
    ``test_fabric`` holds the spraying itself); bounded mode stays within
    its bounds and learns."""
    from gradfabric.lab.dlcp_train import DlcpTrainConfig, replay, run_dlcp_training

    cfg = DlcpTrainConfig(scheme="reliable", steps=6, load=0.5, eval_every=3, fabric=fabric)
    rel = run_dlcp_training(cfg)
    want = replay(cfg)
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(rel["loss"], want, strict=True))
    assert rel["lost_push"] == rel["lost_pull"] == rel["incomplete"] == 0
    assert rel["classes"]["1:10"]["sent"] > 0 and rel["background"]["sent"] > 0

    dl = run_dlcp_training(replace(cfg, scheme="dlcp"))
    c = dl["config"]
    assert 0 < dl["lost_push"] <= c["push_bound"] and dl["lost_pull"] <= c["pull_bound"]
    assert dl["loss"][-1] < dl["loss"][0] and dl["evals"][-1][1] > 0.5
