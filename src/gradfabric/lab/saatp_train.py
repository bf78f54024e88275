"""SA-ATP carrying a real training job through the switch daemon.

Ranks train the catalog's digits MLP (``lab.job``: real forward and
backward passes, SGD with momentum) on a global batch of ``workers``
micro-batches per step, one per data shard. One rank's device is
``slowdown`` times slower: a *deadline* throttle (as the planner's runtime
emulates devices) gives a micro-batch ``compute_ms`` of device time at speed
1; the real compute runs first, then the rank waits out the rest of its
device time. The slow rank is fixed, or moves to the next rank every
``move_every`` steps (transient contention, which is what SA-ATP is for).

``run_switch`` runs the job through a daemon with policy ``atp``: every rank
pushes its own share and the step waits for the slowest; with ``help`` the
job is registered for SA-ATP. Shard ``s`` is replicated on ranks ``s+1 ..
s+replicas`` (``holders``); when the switch flags a straggler, a holder that
finished its own backward runs the straggler's micro-batch with the same
parameters and sends those gradients under the straggler's bit through a
shadow stream. The first copy of each packet counts, and both copies are
bitwise equal (same parameters, inputs and code), so every sum is the
synchronous one: the loss curve and weights equal ATP's bit for bit, and
both equal ``lab.job.reference``, an in-process replay of the same
fixed-point steps. The baselines a user would run instead (gloo's
all-reduce, speed-proportional shares, backup workers) and the study are in
``experiments.saatp_train``.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from gradfabric.core.errors import ConfigError
from gradfabric.lab.job import (
    DAEMON,
    Replica,
    accuracy,
    check_shards,
    daemon_flags,
    data,
    fingerprint,
    model,
)
from gradfabric.lab.saatp_udp import HelpedWorker
from gradfabric.net.hostpath import check_path
from gradfabric.net.launch import run_hosts
from gradfabric.proto.switch.straggler import holders
from gradfabric.runtime.client import Ticket


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
    backups: int = 1  # backup workers: the server steps on the first workers - backups
    lag_packets: int = 16  # below a step's packets (50 at 1,024 values each)
    lr: float = 0.3
    seed: int = 0
    shards: str = "interleaved"  # how the data is cut into shards (``lab.job.SHARDS``)
    timeout_s: float = 60.0
    # a fault to inject: the first helper asked at or after this step dies (exit 17)
    kill_helper_at: int = -1
    host: str = "auto"  # the helped hosts' implementation (``net.hostpath.HOSTS``)

    def __post_init__(self) -> None:
        if self.workers < 3 or not 0 <= self.straggler < self.workers:
            raise ConfigError("workers", "need >= 3 workers and a straggler among them")
        if self.slowdown < 1 or self.steps < 2 or self.micro_batch < 1 or self.compute_ms <= 0:
            raise ConfigError("slowdown", "slowdown >= 1, >= 2 steps, micro_batch >= 1")
        if self.move_every < 0 or not 1 <= self.replicas < self.workers:
            raise ConfigError("replicas", "replicas in 1..workers-1, move_every >= 0")
        if not 1 <= self.backups < self.workers:
            raise ConfigError("backups", "backups in 1..workers-1")
        check_shards(self.shards)
        check_path(self.host)

    def straggler_at(self, step: int) -> int:
        if self.move_every == 0:
            return self.straggler
        return (self.straggler + step // self.move_every) % self.workers

    def device_s(self, rank: int, step: int, samples: int) -> float:
        """Rank ``rank``'s device time for ``samples`` samples in ``step``."""
        slow = self.slowdown if rank == self.straggler_at(step) else 1.0
        return self.compute_ms / 1e3 * samples / self.micro_batch * slow


# ------------------------------------------------- through the switch


class _Trainer(HelpedWorker):
    """A rank training through the switch; under SA-ATP also a helper."""

    def __init__(self, cfg: SaatpTrainConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
        torch.set_num_threads(1)
        data()
        self.cfg, self.replica = cfg, Replica(cfg)
        packets = -(-self.replica.params // ticket.values_per_packet)
        super().__init__(ticket, rank, conn, cfg.steps, packets, cfg.timeout_s, cfg.host)
        self.replica.values = self.P * self.vpp
        # the shards this rank can compute: its own and those it holds replicas of
        self.shards = {rank} | {
            s for s in range(cfg.workers) if rank in holders(s, cfg.workers, cfg.replicas)
        }
        self.pool = ThreadPoolExecutor(1)  # compute in order, off the event loop
        self.losses: list[float] = []
        self.accs: list[float] = []  # test accuracy after each step

    def _share(self, step: int, shard: int) -> tuple[np.ndarray, float]:
        if shard not in self.shards:
            raise RuntimeError(f"rank {self.rank} holds no replica of shard {shard}")
        return self.replica.share(step, shard)

    async def _compute(self, step: int, shard: int) -> tuple[np.ndarray, float, float]:
        """Shard ``shard``'s share on this rank's device: (share, loss, deadline)."""
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        q, loss = await loop.run_in_executor(self.pool, self._share, step, shard)
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
        self.replica.step(self.sums[it])
        self.accs.append(accuracy(self.replica.net))

    def report(self) -> dict[str, Any]:
        self.pool.shutdown()
        net, held = self.replica.net, len(self.shards) - 1
        return {"losses": self.losses, "accs": self.accs, "weights": fingerprint(net),
                "accuracy": accuracy(net),
                "clipped": self.replica.clipped, "replica_shards": held}  # fmt: skip


def _trainer_main(cfg: SaatpTrainConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
    try:
        conn.send(asyncio.run(_Trainer(cfg, ticket, rank, conn).run()))
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"rank {rank}: {e!r}")


def run_switch(cfg: SaatpTrainConfig, help: bool) -> dict[str, Any]:
    """The job through a switch daemon (``atp``; with ``help``, registered for
    SA-ATP): each rank's records, the help counts and the switch's counters."""
    from gradfabric.lab.daemon import switch_daemon

    total_s = cfg.timeout_s + cfg.steps * cfg.device_s(0, 0, cfg.micro_batch) * cfg.slowdown * 2
    vpp = DAEMON.values_per_packet
    with switch_daemon("--policy", "atp", *daemon_flags()) as sw:  # SA-ATP's monitor: native
        sa = None
        if help:
            packets = -(-sum(p.numel() for p in model(cfg).parameters()) // vpp)
            sa = {"lag_packets": cfg.lag_packets, "replicas": cfg.replicas,
                  "iteration_packets": packets}  # fmt: skip
        ticket = Ticket.register(sw.control, cfg.workers, help=sa)
        recs = run_hosts(
            _trainer_main, [(cfg, ticket, r) for r in range(cfg.workers)], cfg.timeout_s, total_s
        )  # fmt: skip
    n = cfg.workers
    return {
        "recs": recs,
        "loss": [sum(r["losses"][i] for r in recs) / n for i in range(cfg.steps)],
        "helps": sum(r["helps"] for r in recs),
        "abandoned": sum(r["abandoned"] for r in recs),
        "clipped": sum(r["clipped"] for r in recs),
        "replica_shards": recs[0]["replica_shards"],
        "switch": sw.final.get("counters", {}),
    }
