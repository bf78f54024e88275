"""Straggler models: per-iteration, per-worker slowdown factors (>= 1), seeded.

``fixed``: chosen workers always ``slowdown`` times slower. ``lognormal``:
every worker, every iteration, ``max(1, exp(N(0, sigma)))``. ``bursts``: each
worker enters a contention burst with probability ``burst_prob`` per
iteration, slowed by ``slowdown`` for ``burst_iterations``. ``trace``: a CSV
file of ``iteration,worker,factor`` rows (others 1). With ``nic`` the factor
slows the worker's NIC (link rate) instead of its compute.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry

Factors = np.ndarray  # shape (iterations, workers), float64 >= 1


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class StragglerConfig:
    model: str = "none"
    workers: tuple[int, ...] = ()
    slowdown: float = 1.0
    sigma: float = 0.3
    burst_prob: float = 0.1
    burst_iterations: int = 2
    nic: bool = False
    trace_file: str = ""
    move_every: int = 2  # "moving": the slow worker changes every this many iterations

    def __post_init__(self) -> None:
        MODELS.get(self.model)
        if self.slowdown < 1.0:
            raise ConfigError("slowdown", f"must be >= 1, got {self.slowdown}")
        if not 0 <= self.burst_prob <= 1 or self.sigma < 0 or self.burst_iterations < 1:
            raise ConfigError(
                "burst_prob", "burst_prob in [0, 1], sigma >= 0, burst_iterations >= 1"
            )


Model = Callable[[StragglerConfig, int, int, np.random.Generator], Factors]
MODELS: Registry[Model] = Registry("straggler model")


@MODELS.register("none")
def _none(cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator) -> Factors:
    return np.ones((iterations, workers))


@MODELS.register("fixed")
def _fixed(
    cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator
) -> Factors:
    f = np.ones((iterations, workers))
    for w in cfg.workers:
        if not 0 <= w < workers:
            raise ConfigError("stragglers.workers", f"worker {w} outside 0..{workers - 1}")
        f[:, w] = cfg.slowdown
    return f


@MODELS.register("moving")
def _moving(
    cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator
) -> Factors:
    """One worker slowed at a time: ``workers[0]`` first, then the next one
    every ``move_every`` iterations (transient contention moving around)."""
    if cfg.move_every < 1 or not cfg.workers:
        raise ConfigError("stragglers.move_every", "need move_every >= 1 and a first worker")
    f = np.ones((iterations, workers))
    for it in range(iterations):
        f[it, (cfg.workers[0] + it // cfg.move_every) % workers] = cfg.slowdown
    return f


@MODELS.register("lognormal")
def _lognormal(
    cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator
) -> Factors:
    return np.maximum(1.0, np.exp(rng.normal(0.0, cfg.sigma, (iterations, workers))))


@MODELS.register("bursts")
def _bursts(
    cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator
) -> Factors:
    f = np.ones((iterations, workers))
    for w in range(workers):
        it = 0
        while it < iterations:
            if rng.random() < cfg.burst_prob:
                f[it : it + cfg.burst_iterations, w] = cfg.slowdown
                it += cfg.burst_iterations
            else:
                it += 1
    return f


@MODELS.register("trace")
def _trace(
    cfg: StragglerConfig, iterations: int, workers: int, rng: np.random.Generator
) -> Factors:
    f = np.ones((iterations, workers))
    try:
        rows = list(csv.reader(Path(cfg.trace_file).read_text().splitlines()))
    except OSError as e:
        raise ConfigError("stragglers.trace_file", str(e)) from None
    for i, row in enumerate(rows):
        try:
            it, w, factor = int(row[0]), int(row[1]), float(row[2])
        except (ValueError, IndexError):
            raise ConfigError(
                "stragglers.trace_file", f"line {i + 1}: want iteration,worker,factor"
            ) from None
        if 0 <= it < iterations and 0 <= w < workers:
            f[it, w] = max(1.0, factor)
    return f


def factors(cfg: StragglerConfig, iterations: int, workers: int, seed: int) -> Factors:
    return MODELS.get(cfg.model)(cfg, iterations, workers, np.random.default_rng((seed, 7)))
