"""A small real training job whose gradients are summed as fixed point.

The pieces every real-training experiment through the switch shares: the
catalog's digits MLP (``mlp``: 64-256-128-10, SGD with momentum), a data
shard per worker and a seeded micro-batch per (step, shard), the gradient of
a micro-batch, int32 fixed point at a scale every worker derives from the
previous step's sum, and ``reference``: the same job replayed in one
process, which a run through the switch must equal bit for bit.

The scale is a power of two agreed without a message: every worker derives
it from the previous step's sum (which all hold), with ``HEADROOM`` times
the largest mean gradient seen then before a sum of ``workers`` shares could
overflow; a value beyond it is clipped and counted. (An exponent all-reduce
each step, as ``ina_hook`` does, would wait for the slowest worker.)
"""

from __future__ import annotations

import hashlib
import math
from functools import cache
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from gradfabric.emu.switchd import SwitchConfig

HEADROOM = 64.0
FIRST_MAX = 1.0  # the largest mean gradient assumed before any step
MODEL = "mlp"  # the catalog's digits MLP (64-256-128-10): the simulator models it too
# The daemon settings these jobs run under (its defaults: the window, the
# packet size, the workers' RTO), which a simulation of the same job reads too
DAEMON = SwitchConfig()


class Job(Protocol):
    """What a job's data, model and steps follow (configs carry these fields)."""

    @property
    def workers(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def seed(self) -> int: ...


@cache
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: (x, y, x_test, y_test), loaded once per process."""
    from gradfabric.workloads.digits import digits_data

    return digits_data()


def shard_batch(cfg: Job, step: int, shard: int) -> np.ndarray:
    """The training-set rows of shard ``shard``'s micro-batch in ``step``
    (shard ``s`` is rows ``s, s + n, s + 2n, ...``)."""
    rows = np.arange(shard, len(data()[0]), cfg.workers)
    return np.random.default_rng([cfg.seed, step, shard]).choice(rows, cfg.micro_batch, False)


def model(cfg: Job) -> torch.nn.Module:
    from gradfabric.workloads.models import BUILDERS

    torch.manual_seed(cfg.seed)
    return BUILDERS[MODEL]()[0]


def gradient(
    net: torch.nn.Module, rows: np.ndarray, weight: float = 1.0
) -> tuple[torch.Tensor, float]:
    """The flat gradient of ``weight`` x the mean loss over ``rows``, and that loss."""
    x, y = data()[0][rows], data()[1][rows]
    loss = F.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss * weight, list(net.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]), float(loss.detach())


def apply(net: torch.nn.Module, opt: torch.optim.Optimizer, mean_grad: torch.Tensor) -> None:
    at = 0
    for p in net.parameters():
        p.grad = mean_grad[at : at + p.numel()].view_as(p).clone()
        at += p.numel()
    opt.step()


def optimizer(cfg: Job, net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9)


def fingerprint(net: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def accuracy(net: torch.nn.Module) -> float:
    _, _, xt, yt = data()
    with torch.no_grad():
        return float((net(xt).argmax(1) == yt).float().mean())


# ------------------------------------------------------- fixed-point sums


def next_scale(largest_mean: float, workers: int) -> float:
    """A power of two under which ``HEADROOM`` x ``largest_mean`` from each of
    ``workers`` shares sums inside int32."""
    limit = (2**31 - 1) // workers
    return float(2.0 ** math.floor(math.log2(limit / (HEADROOM * max(largest_mean, 1e-30)))))


def quantise(g: torch.Tensor, scale: float, workers: int, values: int) -> tuple[np.ndarray, int]:
    """``g`` as int32 at ``scale``, zero-padded to ``values``; and how many clipped."""
    limit = (2**31 - 1) // workers
    q = np.rint(g.double().numpy() * scale)
    clipped = int(np.count_nonzero(np.abs(q) > limit))
    out = np.zeros(values, dtype=np.int32)
    out[: len(q)] = np.clip(q, -limit, limit)
    return out, clipped


def mean_of(total: np.ndarray, scale: float, workers: int, params: int) -> torch.Tensor:
    return torch.from_numpy(total[:params] / (scale * workers)).float()


def reference(cfg: Job) -> dict[str, Any]:
    """The quantised synchronous job replayed in one process: every shard's
    gradient in turn, their int64 sum, the same step. What ``atp`` and
    ``saatp`` must equal bit for bit (on one thread, as each rank computes:
    a reduction's order follows the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(cfg)
    finally:
        torch.set_num_threads(threads)


class Replica:
    """One worker's copy of the job: its model, optimizer and the agreed
    scale. ``share`` computes a shard's int32 share at this step's scale,
    ``step`` applies a step's int64 sum and derives the next scale."""

    def __init__(self, cfg: Job, values: int = 0) -> None:
        """``values``: a share's length (padded past the parameters; 0: none)."""
        self.cfg, self.net = cfg, model(cfg)
        self.opt = optimizer(cfg, self.net)
        self.params = sum(p.numel() for p in self.net.parameters())
        self.values = max(values, self.params)
        self.scale = next_scale(FIRST_MAX, cfg.workers)
        self.clipped = 0

    def share(self, step: int, shard: int) -> tuple[np.ndarray, float]:
        """Shard ``shard``'s int32 share of ``step`` and its micro-batch loss."""
        g, loss = gradient(self.net, shard_batch(self.cfg, step, shard))
        q, clipped = quantise(g, self.scale, self.cfg.workers, self.values)
        self.clipped += clipped
        return q, loss

    def step(self, total: np.ndarray) -> None:
        """Apply the step whose shares summed to ``total``."""
        mean = mean_of(total, self.scale, self.cfg.workers, self.params)
        apply(self.net, self.opt, mean)
        self.scale = next_scale(float(mean.abs().max()), self.cfg.workers)


def _replay(cfg: Job) -> dict[str, Any]:
    one, losses = Replica(cfg), []
    for step in range(cfg.steps):
        total = np.zeros(one.params, dtype=np.int64)
        step_losses = []
        for s in range(cfg.workers):
            q, loss = one.share(step, s)
            total += q
            step_losses.append(loss)
        losses.append(sum(step_losses) / cfg.workers)
        one.step(total)
    return {"loss": losses, "weights": fingerprint(one.net), "accuracy": accuracy(one.net)}
