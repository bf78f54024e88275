"""SA-ATP carrying a real training job, against what a user would run instead.

Four ranks train an MLP on scikit-learn's digits (the catalog's ``mlp``:
real forward and backward passes, SGD with momentum) on a global batch of
``workers`` micro-batches per step, one per data shard. One rank's device
is ``slowdown`` times slower: a *deadline* throttle (as the planner's
runtime emulates devices) gives a micro-batch ``compute_ms`` of device time
at speed 1; the real compute runs first, then the rank waits out the rest
of its device time. The slow rank is fixed, or moves
to the next rank every ``move_every`` steps (transient contention, which is
what SA-ATP is for).

Modes, each the same model, data, throttle and step count:

- ``atp``: gradients through the switch daemon (policy ``atp``), every rank
  pushes its own share, the step waits for the slowest;
- ``saatp``: the same job registered for SA-ATP. Shard ``s`` is replicated
  on ranks ``s+1 .. s+replicas`` (``holders``); when the switch flags a
  straggler, a holder that finished its own backward runs the straggler's
  micro-batch with the same parameters and sends those gradients under the
  straggler's bit through a shadow stream. The first copy of each packet
  counts, and both copies are bitwise equal (same parameters, inputs and
  code), so every sum is the synchronous one: the loss curve and weights
  equal ``atp``'s bit for bit, and both equal ``reference``, an in-process
  replay of the same quantised steps;
- ``default``: gloo's all-reduce of the float gradients, what DDP's default
  hook does (the model is one DDP bucket);
- ``proportional``: the global batch split across ranks in proportion to
  their speeds as measured on the previous step (the planner's uneven data
  parallelism, re-balanced every step), gloo all-reduce of loss-weighted
  gradients.

Through the switch, gradients travel as int32 fixed point. The scale is a
power of two agreed without a message: every rank derives it from the
previous step's sum (which all hold), with ``HEADROOM`` times the largest
mean gradient seen then before a sum of ``workers`` shares could overflow; a
value beyond it is clipped and counted. An exponent all-reduce each step (as
``ina_hook`` does) would wait for the straggler and undo the help.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cache
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gradfabric.core.errors import ConfigError
from gradfabric.core.stats import mean_ci
from gradfabric.emu.client import Ticket
from gradfabric.emu.saatp import HelpedWorker, iteration_times, run_hosts
from gradfabric.proto.switch.straggler import holders

MODES = ("atp", "saatp", "default", "proportional", "backup")
HEADROOM = 64.0
FIRST_MAX = 1.0  # the largest mean gradient assumed before any step


@dataclass(frozen=True)
class SaatpTrainConfig:
    workers: int = 4
    steps: int = 16
    micro_batch: int = 32
    compute_ms: float = 40.0  # a micro-batch's forward and backward on a speed-1 device
    slowdown: float = 4.0
    straggler: int = 1
    move_every: int = 0  # 0: the straggler stays; k: it moves to the next rank every k steps
    replicas: int = 2
    lag_packets: int = 16  # below a step's packets (50 at 1,024 values each)
    lr: float = 0.3
    seed: int = 0
    timeout_s: float = 60.0
    # a fault to inject: the first helper asked at or after this step dies (exit 17)
    kill_helper_at: int = -1

    def __post_init__(self) -> None:
        if self.workers < 3 or not 0 <= self.straggler < self.workers:
            raise ConfigError("workers", "need >= 3 workers and a straggler among them")
        if self.slowdown < 1 or self.steps < 2 or self.micro_batch < 1 or self.compute_ms <= 0:
            raise ConfigError("slowdown", "slowdown >= 1, >= 2 steps, micro_batch >= 1")
        if self.move_every < 0 or not 1 <= self.replicas < self.workers:
            raise ConfigError("replicas", "replicas in 1..workers-1, move_every >= 0")

    def straggler_at(self, step: int) -> int:
        if self.move_every == 0:
            return self.straggler
        return (self.straggler + step // self.move_every) % self.workers

    def device_s(self, rank: int, step: int, samples: int) -> float:
        """Rank ``rank``'s device time for ``samples`` samples in ``step``."""
        slow = self.slowdown if rank == self.straggler_at(step) else 1.0
        return self.compute_ms / 1e3 * samples / self.micro_batch * slow


# ---------------------------------------------------------------- the job


@cache
def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from gradfabric.workloads.digits import digits_data

    return digits_data()


def shard_batch(cfg: SaatpTrainConfig, step: int, shard: int) -> np.ndarray:
    """The training-set rows of shard ``shard``'s micro-batch in ``step``
    (shard ``s`` is rows ``s, s + n, s + 2n, ...``)."""
    rows = np.arange(shard, len(_data()[0]), cfg.workers)
    return np.random.default_rng([cfg.seed, step, shard]).choice(rows, cfg.micro_batch, False)


MODEL = "mlp"  # the catalog's digits MLP (64-256-128-10): the simulator models it too


def model(cfg: SaatpTrainConfig) -> torch.nn.Module:
    from gradfabric.workloads.models import BUILDERS

    torch.manual_seed(cfg.seed)
    return BUILDERS[MODEL]()[0]


def gradient(
    net: torch.nn.Module, rows: np.ndarray, weight: float = 1.0
) -> tuple[torch.Tensor, float]:
    """The flat gradient of ``weight`` x the mean loss over ``rows``, and that loss."""
    x, y = _data()[0][rows], _data()[1][rows]
    loss = F.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss * weight, list(net.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]), float(loss.detach())


def apply(net: torch.nn.Module, opt: torch.optim.Optimizer, mean_grad: torch.Tensor) -> None:
    at = 0
    for p in net.parameters():
        p.grad = mean_grad[at : at + p.numel()].view_as(p).clone()
        at += p.numel()
    opt.step()


def optimizer(cfg: SaatpTrainConfig, net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9)


def fingerprint(net: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def accuracy(net: torch.nn.Module) -> float:
    _, _, xt, yt = _data()
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


def reference(cfg: SaatpTrainConfig) -> dict[str, Any]:
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


def _replay(cfg: SaatpTrainConfig) -> dict[str, Any]:
    net = model(cfg)
    opt = optimizer(cfg, net)
    n, params = cfg.workers, sum(p.numel() for p in net.parameters())
    scale, losses = next_scale(FIRST_MAX, n), []
    for step in range(cfg.steps):
        total = np.zeros(params, dtype=np.int64)
        step_losses = []
        for s in range(n):
            g, loss = gradient(net, shard_batch(cfg, step, s))
            total += quantise(g, scale, n, params)[0]
            step_losses.append(loss)
        losses.append(sum(step_losses) / n)
        mean = mean_of(total, scale, n, params)
        apply(net, opt, mean)
        scale = next_scale(float(mean.abs().max()), n)
    return {"loss": losses, "weights": fingerprint(net), "accuracy": accuracy(net)}


# ------------------------------------------------- through the switch


class _Trainer(HelpedWorker):
    """A rank training through the switch; under SA-ATP also a helper."""

    def __init__(self, cfg: SaatpTrainConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
        torch.set_num_threads(1)
        _data()
        self.cfg, self.net = cfg, model(cfg)
        self.opt = optimizer(cfg, self.net)
        self.params = sum(p.numel() for p in self.net.parameters())
        packets = -(-self.params // ticket.values_per_packet)
        super().__init__(ticket, rank, conn, cfg.steps, packets, cfg.timeout_s)
        # the shards this rank can compute: its own and those it holds replicas of
        self.shards = {rank} | {
            s for s in range(cfg.workers) if rank in holders(s, cfg.workers, cfg.replicas)
        }
        self.pool = ThreadPoolExecutor(1)  # compute in order, off the event loop
        self.scale = next_scale(FIRST_MAX, cfg.workers)
        self.losses: list[float] = []
        self.clipped = 0

    def _gradient(self, step: int, shard: int) -> tuple[np.ndarray, float]:
        if shard not in self.shards:
            raise RuntimeError(f"rank {self.rank} holds no replica of shard {shard}")
        g, loss = gradient(self.net, shard_batch(self.cfg, step, shard))
        q, clipped = quantise(g, self.scale, self.cfg.workers, self.P * self.vpp)
        self.clipped += clipped
        return q, loss

    async def _compute(self, step: int, shard: int) -> tuple[np.ndarray, float, float]:
        """Shard ``shard``'s share on this rank's device: (share, loss, deadline)."""
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        q, loss = await loop.run_in_executor(self.pool, self._gradient, step, shard)
        return q, loss, t0 + self.cfg.device_s(self.rank, step, self.cfg.micro_batch)

    async def own_share(self, it: int) -> np.ndarray | None:
        q, loss, deadline = await self._compute(it, self.rank)
        self.losses.append(loss)
        return None if await self.until_done(it, deadline - time.monotonic()) else q

    async def other_share(self, it: int, straggler: int) -> np.ndarray | None:
        if 0 <= self.cfg.kill_helper_at <= it:
            os._exit(17)  # a helper host lost mid-help, without a word
        q, _, deadline = await self._compute(it, straggler)
        return None if await self.until_done(it, deadline - time.monotonic()) else q

    async def finish(self, it: int) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self._step, it)

    def _step(self, it: int) -> None:
        mean = mean_of(self.sums[it], self.scale, self.cfg.workers, self.params)
        apply(self.net, self.opt, mean)
        self.scale = next_scale(float(mean.abs().max()), self.cfg.workers)

    def report(self) -> dict[str, Any]:
        self.pool.shutdown()
        return {"losses": self.losses, "weights": fingerprint(self.net),
                "accuracy": accuracy(self.net), "clipped": self.clipped,
                "replica_shards": len(self.shards) - 1}  # fmt: skip


def _trainer_main(cfg: SaatpTrainConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
    try:
        conn.send(asyncio.run(_Trainer(cfg, ticket, rank, conn).run()))
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"rank {rank}: {e!r}")


# ------------------------------------------------------------ over gloo


def _gloo_main(cfg: SaatpTrainConfig, mode: str, store: str, rank: int, conn: Connection) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        _data()
        n = cfg.workers
        world = n + 1 if mode == "backup" else n  # backup workers: rank n is the server
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        conn.send("ready")
        conn.recv()
        if rank == n:
            conn.send(_backup_server(cfg))
        else:
            conn.send(_GlooRank(cfg, mode, rank).run())
        dist.destroy_process_group()
    except Exception as e:
        conn.send(f"rank {rank}: {e!r}")


class _GlooRank:
    """A rank of a baseline over gloo: the default hook's all-reduce, speed-
    proportional shares, or a backup worker of a parameter server."""

    def __init__(self, cfg: SaatpTrainConfig, mode: str, rank: int) -> None:
        self.cfg, self.mode, self.rank = cfg, mode, rank
        self.net = model(cfg)
        self.opt = optimizer(cfg, self.net)
        self.rates = [1.0] * cfg.workers
        self.shares: list[list[int]] = []
        self.stale = 0

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        losses, ends = [], []
        for step in range(self.cfg.steps):
            rows, weight = self.rows(step)
            began = time.monotonic()
            if len(rows):
                g, loss = gradient(self.net, rows, weight)
            else:
                g, loss = torch.zeros(sum(p.numel() for p in self.net.parameters())), 0.0
            deadline = began + self.cfg.device_s(self.rank, step, len(rows))
            if self.mode == "backup":
                mean, mean_loss = self.through_server(step, g, loss, deadline)
            else:
                mean, mean_loss = self.all_reduce(g, loss, len(rows), deadline, began)
            apply(self.net, self.opt, mean)
            losses.append(mean_loss)
            ends.append(time.monotonic())
        net = self.net
        return {"t0": t0, "ends": ends, "loss": losses, "weights": fingerprint(net),
                "accuracy": accuracy(net), "shares": self.shares, "stale": self.stale}  # fmt: skip

    def rows(self, step: int) -> tuple[np.ndarray, float]:
        """This rank's rows of the step's global batch and its loss weight."""
        from gradfabric.planner.cost import split
        from gradfabric.planner.runtime import loss_weight

        n, m = self.cfg.workers, self.cfg.micro_batch
        if self.mode != "proportional":
            return shard_batch(self.cfg, step, self.rank), 1.0
        batch = np.concatenate([shard_batch(self.cfg, step, s) for s in range(n)])
        share = split(n * m, self.rates)  # by the speeds measured on the step before
        self.shares.append(share)
        lo = sum(share[: self.rank])
        return batch[lo : lo + share[self.rank]], loss_weight(share[self.rank], n * m, n)

    def all_reduce(
        self, g: torch.Tensor, loss: float, rows: int, deadline: float, began: float
    ) -> tuple[torch.Tensor, float]:
        import torch.distributed as dist

        n = self.cfg.workers
        time.sleep(max(0.0, deadline - time.monotonic()))
        # one all-reduce a step, as DDP's: the gradient, the step's mean loss
        # and (proportional) each rank's measured samples per second
        extra = torch.zeros(1 + n, dtype=g.dtype)
        extra[0] = loss * rows / (n * self.cfg.micro_batch)
        extra[1 + self.rank] = max(rows, 1) / (time.monotonic() - began)
        flat = torch.cat([g, extra])
        dist.all_reduce(flat)
        self.rates = flat[len(g) + 1 :].tolist()
        return flat[: len(g)] / n, float(flat[len(g)])

    def through_server(
        self, step: int, g: torch.Tensor, loss: float, deadline: float
    ) -> tuple[torch.Tensor, float]:
        """Send the gradient to the server, which steps on the first n - 1; a
        rank whose step came back before its compute ended drops that compute
        (its late gradient, sent anyway, is counted stale there)."""
        import torch.distributed as dist

        server = self.cfg.workers
        result = torch.zeros(len(g) + 1)
        arrived = threading.Event()

        def fetch() -> None:
            dist.recv(result, src=server, tag=_RESULT + step)
            arrived.set()

        threading.Thread(target=fetch, daemon=True).start()
        if arrived.wait(max(0.0, deadline - time.monotonic())):
            self.stale += 1
        dist.send(torch.cat([g, torch.tensor([loss])]), dst=server, tag=step)
        if not arrived.wait(self.cfg.timeout_s):
            raise TimeoutError(f"the parameter server (rank {server}) sent no step {step}")
        return result[: len(g)], float(result[len(g)])


_RESULT = 1 << 20  # tags of the server's replies (a step's gradients carry the step)


def _backup_server(cfg: SaatpTrainConfig) -> dict[str, Any]:
    """Backup workers' parameter server: each step averages the first
    ``workers - 1`` gradients to arrive and sends the mean (and the mean loss
    of those micro-batches) to every rank; later ones are dropped, counted."""
    import torch.distributed as dist

    n = cfg.workers
    size = sum(p.numel() for p in model(cfg).parameters()) + 1
    arrivals: queue.Queue[tuple[int, int, torch.Tensor]] = queue.Queue()

    def reader(w: int) -> None:  # every rank sends once per step, late or not
        for step in range(cfg.steps):
            buf = torch.zeros(size)
            dist.recv(buf, src=w, tag=step)
            arrivals.put((step, w, buf))

    threads = [threading.Thread(target=reader, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    dropped, used = 0, []
    for step in range(cfg.steps):
        got: dict[int, torch.Tensor] = {}
        while len(got) < n - 1:
            s, w, buf = arrivals.get(timeout=cfg.timeout_s)
            if s == step:
                got[w] = buf
            else:
                dropped += 1
        mean = torch.stack([got[w] for w in sorted(got)]).mean(0)
        used.append(sorted(got))
        for w in dist.get_process_group_ranks(dist.group.WORLD)[:n]:
            dist.send(mean, dst=w, tag=_RESULT + step)
    for t in threads:
        t.join(cfg.timeout_s)
    return {"dropped": dropped + arrivals.qsize(), "used": used}


# ------------------------------------------------------------------ runs


def run_mode(cfg: SaatpTrainConfig, mode: str) -> dict[str, Any]:
    """One training run in ``mode``: its step times, loss curve, weights'
    fingerprint (one per rank: they must agree) and test accuracy."""
    if mode not in MODES:
        raise ConfigError("mode", f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    total_s = (
        cfg.timeout_s + cfg.steps * cfg.device_s(0, 0, cfg.workers * cfg.micro_batch) * cfg.slowdown
    )
    extra: dict[str, Any] = {}
    if mode in ("atp", "saatp"):
        from gradfabric.emu.harness import switch_daemon

        vpp = VALUES_PER_PACKET
        with switch_daemon(
            "--policy", "atp", "--values-per-packet", str(vpp), "--job-slots", str(WINDOW)
        ) as sw:  # fmt: skip
            help = None
            if mode == "saatp":
                packets = -(-sum(p.numel() for p in model(cfg).parameters()) // vpp)
                help = {"lag_packets": cfg.lag_packets, "replicas": cfg.replicas,
                        "iteration_packets": packets}  # fmt: skip
            ticket = Ticket.register(sw.control, cfg.workers, help=help)
            recs = run_hosts(
                _trainer_main, [(cfg, ticket, r) for r in range(cfg.workers)], cfg.timeout_s,
                total_s,
            )  # fmt: skip
        n = cfg.workers
        loss = [sum(r["losses"][i] for r in recs) / n for i in range(cfg.steps)]
        extra = {"helps": sum(r["helps"] for r in recs),
                 "abandoned": sum(r["abandoned"] for r in recs),
                 "clipped": sum(r["clipped"] for r in recs),
                 "replica_shards": recs[0]["replica_shards"],
                 "switch": sw.final.get("counters", {})}  # fmt: skip
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the ranks meet in a file store
            store = f"file://{tmp}/store"
            world = cfg.workers + (mode == "backup")
            recs = run_hosts(
                _gloo_main, [(cfg, mode, store, r) for r in range(world)], cfg.timeout_s, total_s
            )  # fmt: skip
        if mode == "backup":
            server, recs = recs[-1], recs[:-1]
            extra = {"dropped": server["dropped"], "used": server["used"],
                     "stale": sum(r["stale"] for r in recs)}  # fmt: skip
        else:
            extra = {"shares": recs[0]["shares"][-1] if recs[0]["shares"] else None}
        loss = recs[0]["loss"]
    its = iteration_times(recs)
    return {
        "mode": mode,
        "step_ms": [x * 1e3 for x in its],
        "median_step_ms": statistics.median(its[1:]) * 1e3,  # the first warms up
        "loss": loss,
        "weights": recs[0]["weights"],
        "replicas_agree": len({r["weights"] for r in recs}) == 1,
        "accuracy": recs[0]["accuracy"],
    } | extra


def predicted_ms(cfg: SaatpTrainConfig, mode: str) -> float:
    """The step time the straggler model predicts, compute only (the
    communication is the same few milliseconds in every mode): ATP and the
    default hook wait for the slow rank; SA-ATP's helper computes its own
    micro-batch and the straggler's; backup workers wait for the fastest
    ``n - 1``; proportional shares take
    ``n / (n - 1 + 1/k)`` micro-batches' time once balanced, and after a move
    the new straggler computes a fast rank's share at its slow speed."""
    c, k, n = cfg.compute_ms, cfg.slowdown, cfg.workers
    if mode == "backup":  # the (n-1)th rank to finish is a fast one
        return c
    if mode in ("atp", "default"):
        return c * k
    if mode == "saatp":
        return c * min(k, 2.0)
    balanced = c * n / (n - 1 + 1 / k)
    if cfg.move_every == 0:
        return balanced
    return ((cfg.move_every - 1) * balanced + balanced * k) / cfg.move_every


SIMULATED = {"atp": "atp", "saatp": "saatp", "default": "ring"}
WINDOW = 32  # the daemon's ATP window (its default job_slots)
VALUES_PER_PACKET = 1024
RTO_NS = 20_000_000  # the daemon's default retransmission timeout


def simulated_ms(cfg: SaatpTrainConfig, mode: str) -> float | None:
    """The simulator's mean step time for the same job (model, micro-batch,
    device time, straggler pattern, window, packet size, SA-ATP's lag and
    replicas; a 100 Gbit/s star for loopback, replicas in memory), steps
    after the first; None for the modes it has no scheme for."""
    from gradfabric.proto.schemes import InaConfig
    from gradfabric.proto.switch.straggler import HelpConfig
    from gradfabric.sim.stragglers import StragglerConfig
    from gradfabric.sim.training import TrainingConfig, run_training

    if mode not in SIMULATED:
        return None
    stragglers = StragglerConfig(
        model="moving" if cfg.move_every else "fixed", workers=(cfg.straggler,),
        slowdown=cfg.slowdown, move_every=max(cfg.move_every, 1),
    )  # fmt: skip
    tc = TrainingConfig(
        scheme=SIMULATED[mode], model=MODEL, workers=cfg.workers, iterations=cfg.steps,
        batch=cfg.micro_batch, compute_ms=cfg.compute_ms, load_gbps=1000.0, seed=cfg.seed,
        stragglers=stragglers, help=HelpConfig(lag_packets=cfg.lag_packets, replicas=cfg.replicas),
        ina=InaConfig(values_per_packet=VALUES_PER_PACKET, atp_window=WINDOW, rto_ns=RTO_NS),
    )  # fmt: skip
    return statistics.fmean(run_training(tc).iteration_ns[1:]) / 1e6


# ------------------------------------------------------------------ study

SETTINGS = {"steady": 0, "moving": 2}  # move_every: the straggler moves every 2 steps


def study(
    cfg: SaatpTrainConfig, repeats: int, settings: dict[str, int] = SETTINGS,
    tick: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:  # fmt: skip
    """Every mode in each setting, ``repeats`` runs, the modes interleaved
    within a run so that a repeat's ratios are paired. Per mode: the mean
    step time (over steps after the first, then over runs, 95% interval), the
    prediction, accuracy; SA-ATP's speed-up over each mode as the mean of the
    paired per-run ratios; ``atp`` and ``saatp`` checked bit for bit against
    ``reference``."""
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}  # setting -> mode -> the first run's loss
    for name, move in settings.items():
        c = replace(cfg, move_every=move)
        ref = reference(c)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        curves[name] = {"reference": ref["loss"]}
        for rep in range(repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                tick(f"{name}: {mode}, run {rep + 1}/{repeats}")
                runs[mode].append(run_mode(c, mode))
                curves[name].setdefault(mode, runs[mode][-1]["loss"])
        step = {m: [statistics.fmean(r["step_ms"][1:]) for r in rs] for m, rs in runs.items()}
        for mode, rs in runs.items():
            ours = mean_ci([x / y for x, y in zip(step[mode], step["saatp"], strict=True)])
            rows.append({
                "setting": name, "move_every": move, "mode": mode,
                "step_ms": mean_ci(step[mode]).mean, "step_ms_half": mean_ci(step[mode]).half,
                "predicted_ms": predicted_ms(c, mode),
                "simulated_ms": simulated_ms(c, mode),
                "saatp_speedup": ours.mean, "saatp_speedup_half": ours.half,
                "accuracy": statistics.fmean(r["accuracy"] for r in rs),
                "final_loss": statistics.fmean(r["loss"][-1] for r in rs),
                "replicas_agree": all(r["replicas_agree"] for r in rs),
                "bitwise_reference": all(
                    r["loss"] == ref["loss"] and r["weights"] == ref["weights"] for r in rs
                ) if mode in ("atp", "saatp") else None,
                "helps": (helps := sum(r.get("helps", 0) for r in rs)),
                # each help is one more micro-batch's forward and backward
                "extra_compute": helps / (len(rs) * c.steps * c.workers),
                "abandoned": sum(r.get("abandoned", 0) for r in rs),
                "clipped": sum(r.get("clipped", 0) for r in rs),
                "dropped": sum(r.get("dropped", 0) for r in rs),
                "replica_shards": rs[0].get("replica_shards"),
                "runs": len(rs),
            })  # fmt: skip
    return {"rows": rows, "curves": curves,
            "config": asdict(cfg) | {"repeats": repeats, "settings": settings}}  # fmt: skip
