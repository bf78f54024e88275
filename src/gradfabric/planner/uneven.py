"""The planner's data-parallel part in real PyTorch: DDP with uneven batches.

DDP averages gradients over ranks. A rank holding ``b_r`` of the global
batch ``B`` computes its mean loss and scales it by ``world * b_r / B``; the
average of the ranks' gradients is then exactly the gradient of the mean loss
over all ``B`` samples (``loss_weight``).

``run_uneven`` launches gloo ranks with torchrun whose compute is throttled to
given relative speeds (after its forward pass a rank sleeps ``(1/speed - 1)``
times three forward passes, its compute stretched as on a slower GPU) and
trains the same model side by side with even shares and with the planner's
shares (proportional to speed, as the planner's linear solve gives for
single-stage groups), timing each step.
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

from gradfabric.planner.cost import split


def loss_weight(local: int, total: int, world: int) -> float:
    """Factor on a rank's mean loss so that DDP's averaged gradient equals the
    full-batch mean gradient."""
    return world * local / total


@dataclass(frozen=True)
class UnevenConfig:
    speeds: tuple[float, ...] = (1.0, 0.4)
    batch: int = 1024
    steps: int = 12
    width: int = 2048  # compute-bound on a CPU core, as a GPU step would be
    seed: int = 0


def run_uneven(cfg: UnevenConfig) -> dict[str, Any]:
    from gradfabric.net.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "uneven.json")
        run_ranks(len(cfg.speeds), "gradfabric.planner.uneven", [json.dumps(asdict(cfg)), out])
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
    for k in ("even", "planned"):
        rec[f"{k}_ms"] = statistics.median(rec["times_s"][k][1:]) * 1e3
    rec["speedup"] = rec["even_ms"] / rec["planned_ms"]
    return rec


def _rank_main(cfg: UnevenConfig, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    speed = cfg.speeds[rank]
    shares = {
        "even": split(cfg.batch, [1.0] * world),
        "planned": split(cfg.batch, list(cfg.speeds)),
    }
    g = torch.Generator().manual_seed(cfg.seed)
    x_all = torch.randn(cfg.batch, cfg.width, generator=g)
    y_all = torch.randn(cfg.batch, 1, generator=g)
    models = {}
    for k in shares:
        torch.manual_seed(cfg.seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(cfg.width, cfg.width), torch.nn.ReLU(), torch.nn.Linear(cfg.width, 1)
        )
        models[k] = (DDP(net), torch.optim.SGD(net.parameters(), lr=0.01))
    times: dict[str, list[float]] = {k: [] for k in shares}
    for step in range(cfg.steps):
        for k in shares if step % 2 == 0 else list(reversed(list(shares))):
            ddp, opt = models[k]
            lo = sum(shares[k][:rank])
            x, y = x_all[lo : lo + shares[k][rank]], y_all[lo : lo + shares[k][rank]]
            dist.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            # a device at ``speed``: stretch the pure compute (forward, and the
            # backward at twice it) before the backward's all-reduces start
            time.sleep(3 * (time.perf_counter() - t0) * (1 / speed - 1))
            (loss * loss_weight(len(x), cfg.batch, world)).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            worst = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[k].append(float(worst))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times_s": times, "shares": shares, "config": asdict(cfg)}, f)


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, UnevenConfig(**json.loads(sys.argv[1])), sys.argv[2])
