"""A small real training job whose gradients are summed as fixed point.

The pieces every real-training experiment through the switch shares: the
catalog's digits MLP (``mlp``: 64-256-128-10, SGD with momentum), a data
shard per worker and a seeded micro-batch per (step, shard), the gradient of
a micro-batch, its int32 fixed point, and ``reference``: the same job
replayed in one process, which a run through the switch must equal bit for
bit.

The fixed point is the per-block quantiser ``ina_hook`` users get
(``wire.fastquant``, a scale per block of the daemon's packet), with each
block's exponent carried from the previous step's sum, which every worker
holds (``wire.carried``: the same code as ``InaClient(exponents="carried")``)
instead of agreed in a round each step, which would wait for the slowest
worker; a value beyond its block's range is clipped and counted.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from gradfabric.core.errors import ConfigError
from gradfabric.runtime.switchd import SwitchConfig
from gradfabric.wire.carried import CarriedExponents

MODEL = "mlp"  # the catalog's digits MLP (64-256-128-10): the simulator models it too
# The daemon settings these jobs run under, which a simulation of the same job
# reads too: the studies of SA-ATP and ESA are laid out in packets (a window
# of 32 datagrams of 1024 values; ESA's scarce pool holds fewer than two
# jobs' windows), so those are fixed here rather than the daemon's defaults
# chosen from the MTU; results unicast, as the SA-ATP helpers take them.
DAEMON = SwitchConfig(values_per_packet=1024, job_slots=32, multicast=False)


def daemon_flags(window: int = DAEMON.job_slots) -> tuple[str, ...]:
    """``DAEMON``'s settings as a daemon's flags, with a job's ``window``."""
    return ("--values-per-packet", str(DAEMON.values_per_packet), "--no-multicast",
            "--job-slots", str(window))  # fmt: skip


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
    @property
    def shards(self) -> str: ...


@cache
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: (x, y, x_test, y_test), loaded once per process."""
    from gradfabric.workloads.digits import digits_data

    return digits_data()


# How the training set is cut into one shard per worker: ``interleaved``,
# shard ``s`` the rows ``s, s + n, s + 2n, ...`` (every shard the same mix of
# classes, as a sampler deals a shuffled set); ``by-label``, the rows sorted by
# label (stably) and cut into ``n`` runs, so each shard holds a few classes
# (data kept where it was made: a worker whose gradient is dropped takes its
# classes out of the step).
SHARDS = ("interleaved", "by-label")


def check_shards(shards: str) -> None:
    """A config's ``shards``, refused (``ConfigError``) unless one of ``SHARDS``."""
    if shards not in SHARDS:
        raise ConfigError("shards", f"{shards!r}; valid: {', '.join(SHARDS)}")


@cache
def _shard_rows(workers: int, shards: str) -> tuple[np.ndarray, ...]:
    check_shards(shards)
    n = len(data()[1])
    if shards == "interleaved":
        cut = [np.arange(s, n, workers) for s in range(workers)]
    else:
        cut = np.array_split(np.argsort(data()[1].numpy(), kind="stable"), workers)
    for rows in cut:
        rows.flags.writeable = False  # (cached: every caller shares them)
    return tuple(cut)


def shard_batch(cfg: Job, step: int, shard: int) -> np.ndarray:
    """The training-set rows of shard ``shard``'s micro-batch in ``step``,
    drawn from the rows the shard holds (``SHARDS``)."""
    rows = _shard_rows(cfg.workers, cfg.shards)[shard]
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
    """One worker's copy of the job: its model, optimizer and its quantiser
    (exponents carried from sum to sum, ``wire.carried``). ``gradient`` is a
    shard's float32 gradient, ``share`` the same as int32; ``step`` applies a
    step's int64 sum, ``step_sum`` its decoded float32 sum (what
    ``Session.allreduce`` returns)."""

    def __init__(self, cfg: Job, values: int = 0) -> None:
        """``values``: a share's length (padded past the parameters; 0: none)."""
        self.cfg, self.net = cfg, model(cfg)
        self.opt = optimizer(cfg, self.net)
        self.params = sum(p.numel() for p in self.net.parameters())
        self.values = max(values, self.params)
        self.quant = CarriedExponents(cfg.workers, DAEMON.values_per_packet)

    @property
    def clipped(self) -> int:
        return self.quant.clipped

    def gradient(self, step: int, shard: int) -> tuple[np.ndarray, float]:
        """Shard ``shard``'s float32 gradient in ``step`` (zero-padded to
        ``values``) and its micro-batch loss."""
        g, loss = gradient(self.net, shard_batch(self.cfg, step, shard))
        out = np.zeros(self.values, dtype=np.float32)
        out[: self.params] = g.numpy()
        return out, loss

    def share(self, step: int, shard: int) -> tuple[np.ndarray, float]:
        """Shard ``shard``'s int32 share of ``step`` and its micro-batch loss."""
        g, loss = self.gradient(step, shard)
        return self.quant.encode(g), loss

    def step(self, total: np.ndarray) -> None:
        """Apply the step whose int32 shares summed to ``total``."""
        decoded = self.quant.decode(total)
        self.quant.carry(decoded)
        self.step_sum(decoded)

    def step_sum(self, total: np.ndarray) -> None:
        """Apply the step whose decoded sum is ``total`` (float32): its mean,
        in float32 as ``ina_hook`` averages."""
        mean = total[: self.params] / np.float32(self.cfg.workers)
        apply(self.net, self.opt, torch.from_numpy(mean))


def _replay(cfg: Job) -> dict[str, Any]:
    one, losses, accs = Replica(cfg), [], []
    for step in range(cfg.steps):
        total = np.zeros(one.params, dtype=np.int64)
        step_losses = []
        for s in range(cfg.workers):
            q, loss = one.share(step, s)
            total += q
            step_losses.append(loss)
        losses.append(sum(step_losses) / cfg.workers)
        one.step(total)
        accs.append(accuracy(one.net))
    return {
        "loss": losses,
        "accs": accs,
        "weights": fingerprint(one.net),
        "accuracy": accuracy(one.net),
    }
