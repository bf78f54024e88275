"""Spawned ranks in network namespaces: each rank on its own shaped link.

The transfer bound is a lower one (bytes over the link's rate): a busy host
only makes the collective slower, so noise cannot make it fail, while ranks
that talked over loopback instead of their links would beat it by far."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradfabric.net import netns
from gradfabric.net.launch import spawn

pytestmark = pytest.mark.skipif(not netns.usable(), reason="needs root and network namespaces")

RATE_GBPS = 0.1
VALUES = 625_000  # 2.5 MB of float32


def _rank(rank: int, world: int, out: str) -> None:
    x = torch.ones(VALUES)
    dist.all_reduce(x)  # (connections made)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    took = time.perf_counter() - t0
    with open(os.path.join(out, f"{rank}"), "w") as f:
        f.write(f"{os.readlink('/proc/self/ns/net')} {os.environ['GLOO_SOCKET_IFNAME']} {took}"
                f" {float(x[0])}")  # fmt: skip


def test_each_rank_runs_behind_its_own_shaped_link(tmp_path: object) -> None:
    out = str(tmp_path)
    with netns.shaped_star(2, RATE_GBPS) as hosts:
        spawn(_rank, 2, (out,), hosts=hosts, deadline_s=120)
    got = [Path(out, f"{r}").read_text().split() for r in range(2)]
    here = os.readlink("/proc/self/ns/net")
    assert len({g[0] for g in got} | {here}) == 3  # two namespaces, neither this one
    assert all(g[1] == h.ifname for g, h in zip(got, hosts, strict=True))
    assert all(float(g[3]) == 4.0 for g in got)  # the sum of two ranks' 1 + 1, twice
    # gloo's ring for 2 ranks: each sends half the tensor, and the other half
    # of the sum back, over links of RATE_GBPS
    floor_s = 2 * (VALUES // 2) * 4 * 8 / (RATE_GBPS * 1e9)
    assert all(float(g[2]) >= 0.9 * floor_s for g in got)


def test_a_host_per_rank() -> None:
    with pytest.raises(ValueError, match="hosts"):
        spawn(_rank, 2, ("",), hosts=[])


def test_a_star_left_behind_by_a_killed_run_neither_blocks_a_new_one_nor_is_deleted() -> None:
    """A SIGKILLed run deletes nothing; the next star (in the same process, so
    its first-choice tag) takes a free tag, and its exit deletes its own
    namespaces only."""
    tag = os.getpid() % 250
    stale = f"gf{tag}sw"
    subprocess.run(["ip", "netns", "add", stale], check=True, capture_output=True)
    try:
        with netns.shaped_star(1, RATE_GBPS) as hosts:
            assert hosts[0].netns != f"gf{tag}h0" and hosts[0].netns in netns.listed()
            mine = {hosts[0].netns}
        # its own gone, the stale one kept (a concurrent run's are not counted)
        assert not netns.left_behind() and not mine & netns.listed() and stale in netns.listed()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert stale not in netns.listed()


FAILING_RANK = """
import os, sys
if os.environ["RANK"] == "1":
    sys.exit(3)  # before its group forms: rank 0 waits for it there
from gradfabric.net.launch import init_group
init_group()
"""


def test_a_rank_that_dies_before_its_group_forms_is_named_and_ends_the_others(
    tmp_path: Path,
) -> None:
    """One torchrun per namespace; rank 1 exits at once while rank 0 waits
    for it in the group's rendezvous: the run fails naming rank 1 first (not
    a timeout after the launch's deadline), and rank 0's torchrun and rank
    are ended, not left running."""
    from gradfabric.net.launch import run_on_hosts

    (tmp_path / "failing_rank.py").write_text(FAILING_RANK)
    env = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    with (
        netns.shaped_star(2, RATE_GBPS) as hosts,
        pytest.raises(RuntimeError, match=r"torchrun failed: rank 1 .*first: rank 1"),
    ):
        run_on_hosts(hosts, "failing_rank", [], timeout_s=600, extra_env=env)
    left = subprocess.run(["pgrep", "-f", "failing_rank"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
