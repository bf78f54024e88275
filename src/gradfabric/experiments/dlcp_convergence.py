"""DLCP's premise on real training: bounded gradient loss, and which loss.

A 64-128-64-10 MLP learns scikit-learn's digits (1,797 8x8 images; 80/20
split, fixed) with 4 data-parallel workers through a parameter server, in one
process. Every step each worker's gradient, layer by layer, is cut into
packets of ``per_packet`` values; the network loses ``loss_bound`` of them
on the push under a drop policy (``magnitude``: DLCP's priorities, the
smallest-norm packets go first; ``random``; ``largest``: the inverse) and the
receiver zero-fills the holes; the averaged gradient is pulled back through a
tighter bound (``loss_bound * pull_share``) under the same policy. Lossless
training on the same seeds is the reference. Reported: final test accuracy,
mean over seeds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradfabric.proto.dlcp import drop_policy, packet_norms
from gradfabric.workloads.digits import digits_data, digits_mlp


@dataclass(frozen=True)
class ConvergenceConfig:
    policies: tuple[str, ...] = ("magnitude", "random", "largest")
    bounds: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    workers: int = 4
    batch: int = 128
    epochs: int = 30
    per_packet: int = 32
    pull_share: float = 0.2
    lr: float = 0.05

    @classmethod
    def quick(cls) -> ConvergenceConfig:
        return cls(bounds=(0.1, 0.3), seeds=(0, 1, 2), epochs=20)


def _lossy(g: np.ndarray, policy: str, bound: float, per_packet: int,
           rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """``g`` after the network lost ``bound`` of its packets under ``policy``."""
    lost = drop_policy(policy, packet_norms(g, per_packet), bound, rng)
    out = g.copy()
    for i in lost.tolist():
        out[i * per_packet : (i + 1) * per_packet] = 0
    return out


def train(cfg: ConvergenceConfig, policy: str, bound: float, seed: int) -> float:
    """Final test accuracy of one run (``bound = 0``: lossless)."""
    xtr, ytr, xte, yte = digits_data()
    torch.manual_seed(seed)
    model = digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    rng = np.random.default_rng(seed)
    params = list(model.parameters())
    for _ in range(cfg.epochs):
        order = torch.randperm(len(xtr))
        for lo in range(0, len(order) - cfg.batch + 1, cfg.batch):
            idx = order[lo : lo + cfg.batch].chunk(cfg.workers)
            total = [np.zeros(p.numel(), dtype=np.float32) for p in params]
            for shard in idx:
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(xtr[shard]), ytr[shard]).backward()  # type: ignore[no-untyped-call]
                for j, p in enumerate(params):
                    assert p.grad is not None
                    g = p.grad.numpy().ravel()
                    total[j] += _lossy(g, policy, bound, cfg.per_packet, rng) if bound else g
            for j, p in enumerate(params):
                avg = total[j] / cfg.workers
                if bound:
                    avg = _lossy(avg, policy, bound * cfg.pull_share, cfg.per_packet, rng)
                p.grad = torch.from_numpy(avg.reshape(p.shape))
            opt.step()
    with torch.no_grad():
        return float((model(xte).argmax(1) == yte).float().mean())


def run_convergence(cfg: ConvergenceConfig, tick: Any = None) -> list[dict[str, Any]]:
    base = [train(cfg, "none", 0.0, s) for s in cfg.seeds]
    rows = [
        {"policy": "lossless", "loss_bound": 0.0, "accuracy": statistics.fmean(base),
         "accuracy_min": min(base), "delta_pp": 0.0}
    ]  # fmt: skip
    for policy in cfg.policies:
        for bound in cfg.bounds:
            if tick is not None:
                tick(f"{policy}, p = {bound:g}")
            acc = [train(cfg, policy, bound, s) for s in cfg.seeds]
            rows.append(
                {
                    "policy": policy,
                    "loss_bound": bound,
                    "accuracy": statistics.fmean(acc),
                    "accuracy_min": min(acc),
                    "delta_pp": (statistics.fmean(acc) - statistics.fmean(base)) * 100,
                }
            )
    return rows
