"""End-to-end DDP training with ``omnireduce_hook`` against the default hook.

``run_e2e`` launches ``ranks`` gloo processes with torchrun (on loopback, or
each in its own network namespace behind a tbf-shaped link) that train four
replicas of NeuMF on the synthetic click log side by side: one with DDP's
default all-reduce, one with ``nn.Embedding(sparse=True)`` under plain DDP
(what a PyTorch user with embeddings tries first: DDP all-reduces the sparse
gradients as index/value tensors), one with ``omnireduce_hook`` and one with
``rows_hook`` (dense gradients, exchanged as the rows the batch looked up). All start
from the same weights and see the same batches; each step times all three
(rotating which goes first) and records the global mean loss. The result: the
loss curves, the per-iteration times, the hook's traffic statistics, and how
far apart the replicas' weights ended.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.collectives.fast import register_hook
from gradfabric.collectives.rows import RowState, rows_hook
from gradfabric.collectives.sparse import OmniState, omnireduce_hook
from gradfabric.core.records import compare_sides, loss_gap, median_ms
from gradfabric.workloads.ctr import ClickLog, ClickLogConfig, NeuMF

# DDP's default hook; nn.Embedding(sparse=True) under plain DDP; omnireduce_hook;
# rows_hook (the looked-up rows of dense embedding gradients)
REPLICAS = ("default", "sparse-embedding", "omnireduce", "rows")


@dataclass(frozen=True)
class E2EConfig:
    ranks: int = 2
    link_gbps: float | None = 1.0
    steps: int = 40
    batch: int = 1024  # per rank
    users: int = 400_000
    items: int = 100_000
    dim: int = 16
    lr: float = 0.2
    seed: int = 0

    @classmethod
    def quick(cls) -> E2EConfig:
        return cls(steps=15, users=200_000, items=50_000)


def run_e2e(cfg: E2EConfig) -> dict[str, Any]:
    """Train both replicas on ``cfg.ranks`` processes; returns rank 0's record."""
    from gradfabric.net.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "e2e.json")
        run_ranks(
            cfg.ranks,
            "gradfabric.lab.sparse_e2e",
            [json.dumps(asdict(cfg)), out],
            link_gbps=cfg.link_gbps,
        )
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
    rec["config"] = asdict(cfg)
    compare_sides(rec, "default", "omnireduce")
    for side in ("sparse-embedding", "rows"):
        rec[f"{side}_ms"] = median_ms(rec, side)
        rec[f"{side.replace('-', '_')}_loss_diff"] = loss_gap(rec, "default", side)
    rec["rows_vs_sparse_embedding"] = rec["sparse-embedding_ms"] / rec["rows_ms"]
    rec["speedup"] = rec["default_ms"] / rec["omnireduce_ms"]
    rec["speedup_vs_sparse_embedding"] = rec["sparse-embedding_ms"] / rec["omnireduce_ms"]
    return rec


def _rank_main(cfg: E2EConfig, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    log = ClickLog(ClickLogConfig(users=cfg.users, items=cfg.items, seed=cfg.seed))
    replicas = {}
    state = OmniState()
    for name in REPLICAS:
        torch.manual_seed(cfg.seed)
        net = NeuMF(cfg.users, cfg.items, cfg.dim, sparse=name == "sparse-embedding")
        model = DDP(net)
        if name == "omnireduce":
            register_hook(model, state, omnireduce_hook)  # dense buckets' calls in C++
        if name == "rows":
            model.register_comm_hook(RowState.track(net), rows_hook)
        replicas[name] = (model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9))
    loss_log: dict[str, list[float]] = {k: [] for k in replicas}
    times: dict[str, list[float]] = {k: [] for k in replicas}
    for step in range(cfg.steps):
        users, items, clicks = log.batch(cfg.batch, rank, step)
        names = list(replicas)
        k = step % len(names)
        order = names[k:] + names[:k]  # each goes first in turn
        for name in order:
            model, opt = replicas[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(users, items), clicks)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - t0, loss.item()], dtype=torch.float64)
            # the slowest rank's time, the global mean loss
            worst = elapsed[:1].clone()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            dist.all_reduce(elapsed[1:])
            times[name].append(float(worst))
            loss_log[name].append(float(elapsed[1]) / world)
    # how far apart the two replicas ended, and whether the hooked replicas agree
    a, b = (replicas[k][0].module for k in ("default", "omnireduce"))
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    gap = max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)
    spread = torch.tensor([0.0])
    for p in b.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        spread = torch.maximum(spread, (p.detach() - ref).abs().max().reshape(1))
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if rank == 0:
        rec = {
            "loss": loss_log,
            "times_s": times,
            "weights_max_diff": gap,
            "replica_spread": float(spread),
            "bytes_ratio": state.bytes_sent / max(1, state.bytes_dense),
            "sparse_calls": state.sparse_calls,
            "calls": state.calls,
            "density_median": statistics.median(state.density_seen) if state.density_seen else 1,
            "grad_mb": sum(p.numel() for p in a.parameters()) * 4 / 2**20,
        }
        with open(out, "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, E2EConfig(**json.loads(sys.argv[1])), sys.argv[2])
