"""``gradfabric bench omnireduce``: sparse vs dense all-reduce, side by side.

Spawns ``ranks`` gloo processes on loopback. For each density, every rank
builds a float32 tensor whose non-zero 256-value blocks sit at random
positions (its own seed), then times ``iters`` calls of ``sparse_allreduce``
and of ``torch.distributed.all_reduce`` after one warm-up each, interleaved,
and checks that both give the same result. Reported: medians, the speedup,
and the sparse path's bytes sent from the busiest rank over what a dense ring
would send (``2(n-1)/n * N * 4``). With ``link_gbps`` the ranks run in network
namespaces on a star shaped with tbf, and ``floor_ratio`` is the measured time
over the data-volume floor (its formula: ``gradfabric bench omnireduce --help``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from gradfabric.collectives.sparse import OmniState, sparse_allreduce
from gradfabric.net.launch import spawn

DENSITIES = (1.0, 0.8, 0.4, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01)


def block_sparse(
    seed: int, values: int, density: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A tensor whose non-zero 256-value blocks sit at random positions, each
    block non-zero with probability ``density`` (OmniReduce's microbenchmark)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-values // 256)
    mask = (torch.rand(blocks, generator=g) < density).repeat_interleave(256)[:values]
    if dtype == torch.int32:
        vals = torch.randint(-1000, 1000, (values,), generator=g, dtype=torch.int32)
    else:
        vals = torch.randn(values, generator=g).to(dtype)
    return vals * mask.to(vals.dtype)


def _measure(
    rank: int, ranks: int, out: str, values: int, densities: list[float], iters: int
) -> None:
    """One rank's timings, in a process group that is already up."""
    rows = []
    for density in densities:
        x = block_sparse(1234 + rank, values, density)
        sparse_t, dense_t = [], []
        state = OmniState()
        for i in range(iters + 1):  # the first round is a warm-up
            a, b = x.clone(), x.clone()
            dist.barrier()
            t0 = time.perf_counter()
            # (alike on every rank by construction: no layout round the dense call skips)
            sparse_allreduce(a, state=state if i == 0 else None, check_layout=False)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            dist.all_reduce(b)
            t3 = time.perf_counter()
            if i:
                sparse_t.append(t1 - t0)
                dense_t.append(t3 - t2)
        err = float((a - b).abs().max())
        rows.append(
            {
                "density": density,
                "sparse_s": sparse_t,
                "dense_s": dense_t,
                "max_abs_diff": err,
                "bytes_sent": state.bytes_sent,
                "bytes_link": state.bytes_busiest_link,
                "bytes_floor": state.bytes_floor,
                "bytes_dense": state.bytes_dense,
                "sparse_path": state.sparse_calls > 0,
            }
        )
    torch.save(rows, f"{out}/{rank}.pt")


def run_bench(
    ranks: int, size_mb: float, densities: list[float], iters: int, link_gbps: float | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark on loopback, or with ``link_gbps`` in network
    namespaces whose links are shaped to that rate (root only)."""
    values = int(size_mb * 2**20) // 4
    # Ranks share the host's cores: one intra-op thread each, or they spin
    # against each other (both paths are timed under the same setting).
    args, threads = (values, densities, iters), _threads(ranks)
    with tempfile.TemporaryDirectory() as tmp:
        if link_gbps is None:
            spawn(_measure, ranks, (tmp, *args), threads=threads, deadline_s=3600)
        else:
            from gradfabric.net.netns import shaped_star

            with shaped_star(ranks, link_gbps) as hosts:
                spawn(_measure, ranks, (tmp, *args), threads=threads, hosts=hosts, deadline_s=3600)
        per_rank = [torch.load(f"{tmp}/{r}.pt") for r in range(ranks)]
    out = []
    for i, density in enumerate(densities):
        # a call ends when its slowest rank does
        sparse = statistics.median(max(r[i]["sparse_s"][k] for r in per_rank) for k in range(iters))
        dense = statistics.median(max(r[i]["dense_s"][k] for r in per_rank) for k in range(iters))
        floor = None
        # The data-volume floor: the fewest non-zero block bytes that must cross
        # the busiest rank's link in its busier direction, over the link rate.
        floor_bytes = per_rank[0][i]["bytes_floor"]
        if link_gbps is not None and floor_bytes:
            floor = sparse / (floor_bytes * 8 / (link_gbps * 1e9))
        out.append(
            {
                "density": density,
                "ranks": ranks,
                "link_gbps": link_gbps,
                "gradfabric_ms": sparse * 1e3,
                "dense_ms": dense * 1e3,
                "speedup": dense / sparse,
                "floor_ratio": floor,
                "path_ratio": per_rank[0][i]["bytes_link"] / floor_bytes if floor_bytes else None,
                "bytes_ratio": max(r[i]["bytes_sent"] for r in per_rank)
                / max(1, per_rank[0][i]["bytes_dense"]),
                "sparse_path": per_rank[0][i]["sparse_path"],
                "max_abs_diff": max(r[i]["max_abs_diff"] for r in per_rank),
            }
        )
    return out


def _threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)
