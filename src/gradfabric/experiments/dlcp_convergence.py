"""DLCP's premise on real training: bounded gradient loss, and which loss.

A student MLP learns the seeded teacher task (``workloads.teacher``: 50,000
training and 20,000 test examples, a known best accuracy) with 4
data-parallel workers through a parameter server, in one process. Every
step each worker's gradient, layer by layer, is cut into packets of
``per_packet`` values; the network loses ``loss_bound`` of them on the push
under a drop policy (``magnitude``: DLCP's priorities, the smallest-norm
packets go first; ``random``; ``largest``: the inverse) and the receiver
zero-fills the holes; the averaged gradient is pulled back through a tighter
bound (``loss_bound * pull_share``) under the same policy. Lossless training
on the same seeds (same initialisation, same batches) is the reference.

Reported per policy and bound, over ``seeds``: final test accuracy (mean and
95% interval), its difference from lossless paired by seed (mean and 95%
interval), and time to accuracy: the steps until the test accuracy (measured
every ``eval_every`` steps) first reaches ``target`` (lossless runs' mean
final accuracy less ``target_gap_pp``), with how many seeds reached it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradfabric.core.cells import Executor, run_cells
from gradfabric.core.stats import mean_ci
from gradfabric.experiments.registry import at_target
from gradfabric.proto.dlcp import drop_policy, packet_norms
from gradfabric.workloads.teacher import TeacherTask


@dataclass(frozen=True)
class ConvergenceConfig:
    policies: tuple[str, ...] = ("magnitude", "random", "largest")
    bounds: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
    seeds: tuple[int, ...] = tuple(range(10))
    workers: int = 4
    batch: int = 256
    epochs: int = 4
    per_packet: int = 32
    pull_share: float = 0.2
    lr: float = 0.1
    eval_every: int = 50  # steps
    target_gap_pp: float = 1.0
    task: TeacherTask = field(default_factory=TeacherTask)

    @classmethod
    def default(cls) -> ConvergenceConfig:
        """``experiment dlcp`` without flags: three of the bounds, every seed;
        the constructor's study is ``--full`` and ``reproduce``'s."""
        return cls(bounds=(0.1, 0.3, 0.5))

    @classmethod
    def quick(cls) -> ConvergenceConfig:
        return cls(bounds=(0.1, 0.3), seeds=tuple(range(5)), epochs=2)


@dataclass
class Run:
    accuracy: float  # final test accuracy
    curve: list[tuple[int, float]]  # (step, test accuracy) every eval_every steps

    def steps_to(self, target: float) -> int | None:
        return next((s for s, a in self.curve if at_target(a, target)), None)


def _lossy(g: np.ndarray, policy: str, bound: float, per_packet: int,
           rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """``g`` after the network lost ``bound`` of its packets under ``policy``."""
    lost = drop_policy(policy, packet_norms(g, per_packet), bound, rng)
    pad = (-len(g)) % per_packet
    out = np.concatenate([g, np.zeros(pad, dtype=g.dtype)])
    out.reshape(-1, per_packet)[lost] = 0
    return out[: len(g)]


def train(cfg: ConvergenceConfig, policy: str, bound: float, seed: int) -> Run:
    """One training run (``bound = 0``: lossless), on one thread: a model this
    small runs no faster on more, and spinning threads stall on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(cfg, policy, bound, seed)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: ConvergenceConfig, policy: str, bound: float, seed: int) -> Run:
    xtr, ytr, xte, yte = cfg.task.data()
    torch.manual_seed(seed)
    model = cfg.task.student()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    rng = np.random.default_rng(seed)
    order_rng = torch.Generator().manual_seed(seed)
    params = list(model.parameters())

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean())

    curve: list[tuple[int, float]] = []
    step = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(len(xtr), generator=order_rng)
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
            step += 1
            if step % cfg.eval_every == 0:
                curve.append((step, accuracy()))
    return Run(accuracy(), curve)


def _row(
    policy: str, bound: float, runs: list[Run], base: list[Run], target: float
) -> dict[str, Any]:
    acc = mean_ci([r.accuracy for r in runs])
    delta = mean_ci([(r.accuracy - b.accuracy) * 100 for r, b in zip(runs, base, strict=True)])
    reached = [s for r in runs if (s := r.steps_to(target)) is not None]
    tta = mean_ci(reached) if reached else None
    return {
        "policy": policy,
        "loss_bound": bound,
        "accuracy": acc.mean,
        "accuracy_ci": acc.half,
        "delta_pp": delta.mean,
        "delta_ci_pp": delta.half,
        "target": target,
        "steps_to_target": None if tta is None else tta.mean,
        "steps_to_target_ci": None if tta is None else tta.half,
        "reached": f"{len(reached)}/{len(runs)}",
        "seeds": len(runs),
    }


@dataclass(frozen=True)
class Cell:
    """One seeded training run of the study (``policy`` ``none``: lossless)."""

    cfg: ConvergenceConfig
    policy: str
    bound: float
    seed: int

    def __str__(self) -> str:
        return "lossless" if self.policy == "none" else f"{self.policy}, p = {self.bound:g}"


def run_cell(c: Cell) -> Run:
    return train(c.cfg, c.policy, c.bound, c.seed)


def _arms(cfg: ConvergenceConfig) -> list[tuple[str, float]]:
    """(policy, bound) of each row: lossless first, then each policy and bound."""
    return [("none", 0.0), *((p, b) for p in cfg.policies for b in cfg.bounds)]


def cells(cfg: ConvergenceConfig) -> list[Cell]:
    """Every arm's runs, one per seed, arm by arm."""
    return [Cell(cfg, p, b, s) for p, b in _arms(cfg) for s in cfg.seeds]


def run_convergence(
    cfg: ConvergenceConfig, tick: Any = None, where: Executor | int = 1
) -> list[dict[str, Any]]:
    """The study's rows; its seeded runs are independent cells, run ``where``
    says (the same runs, so the same rows, wherever they run)."""
    runs = run_cells(run_cell, cells(cfg), where, tick)
    n = len(cfg.seeds)
    by_arm = [runs[i : i + n] for i in range(0, len(runs), n)]
    base = by_arm[0]
    target = float(np.mean([r.accuracy for r in base])) - cfg.target_gap_pp / 100
    return [_row("lossless" if p == "none" else p, b, arm, base, target)
            for (p, b), arm in zip(_arms(cfg), by_arm, strict=True)]  # fmt: skip
