"""ESA with several real training jobs sharing one switch daemon.

A seeded trace of jobs (each: 2 or 3 workers, a number of steps, an arrival
time) trains the catalog's digits MLP (``emu.job``) through one switch
daemon whose aggregator pool is too small for every job's window at once.
Each worker computes its micro-batch under a deadline throttle
(``compute_ms`` of device time per step), sums its gradient as int32 fixed
point through the switch (``InaClient``) and steps. Workers stamp each
step's packets with ESA's ``srpt-aging`` priority from their job's
remaining bytes and age. The same trace runs with the daemon's ``atp``
policy (collisions fall back to its parameter server) and ``esa``
(preemption by priority); a job's completion time (JCT) runs from its
arrival to its last worker's last step. Every job's loss curve and weights
must equal its solo replay (``emu.job.reference``) bit for bit.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from gradfabric.core.errors import ConfigError
from gradfabric.emu.client import InaClient, Ticket
from gradfabric.emu.job import Replica, data, fingerprint, reference
from gradfabric.emu.saatp import run_hosts
from gradfabric.proto.priority import srpt_aging

POLICIES = ("atp", "esa")
AGING_S = 1.0


@dataclass(frozen=True)
class EsaJob:
    """One job of a trace (its fields are ``emu.job.Job``'s)."""

    workers: int
    steps: int
    arrival_s: float
    micro_batch: int = 32
    compute_ms: float = 20.0
    lr: float = 0.3
    seed: int = 0


@dataclass(frozen=True)
class EsaTrainConfig:
    jobs: int = 3
    pool_slots: int = 40  # aggregators in the daemon's pool
    window: int = 32  # each job's window: two jobs at once overfill 40
    mean_gap_s: float = 0.1  # Poisson arrivals
    steps: tuple[int, ...] = (8, 16, 32)  # a job's length, drawn per job
    compute_ms: float = 5.0  # a step's device time (forward and backward)
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.pool_slots < 1 or self.window < 1 or self.mean_gap_s < 0:
            raise ConfigError("jobs", "jobs, pool_slots and window >= 1, mean_gap_s >= 0")


def trace(cfg: EsaTrainConfig) -> list[EsaJob]:
    """The seeded jobs: sizes and Poisson arrivals (the first at 0)."""
    rng = np.random.default_rng([cfg.seed, 17])
    gaps = rng.exponential(cfg.mean_gap_s, cfg.jobs)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return [
        EsaJob(workers=int(rng.choice([2, 3])), steps=int(rng.choice(cfg.steps)),
               arrival_s=float(a), compute_ms=cfg.compute_ms, seed=cfg.seed * 100 + j)
        for j, a in enumerate(arrivals)
    ]  # fmt: skip


def _worker(job: EsaJob, ticket: Ticket, rank: int, conn: Connection) -> None:
    try:
        torch.set_num_threads(1)
        data()
        replica = Replica(job)
        client = InaClient(ticket, rank, timeout_s=60.0)
        losses = []
        conn.send("ready")
        conn.recv()
        t0 = time.monotonic()
        for step in range(job.steps):
            began = time.monotonic()
            q, loss = replica.share(step, rank)
            time.sleep(max(0.0, began + job.compute_ms / 1e3 - time.monotonic()))
            left = (job.steps - step) * replica.params * 4
            client.set_priority(srpt_aging(left, time.monotonic() - t0, AGING_S))
            replica.step(client.allreduce_ints(q))
            losses.append(loss)
        end = time.monotonic()
        client.close()
        conn.send({"t0": t0, "end": end, "losses": losses,
                   "weights": fingerprint(replica.net), "clipped": replica.clipped})  # fmt: skip
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"job {job.seed} rank {rank}: {e!r}")


def run_trace(cfg: EsaTrainConfig, policy: str) -> dict[str, Any]:
    """The trace through one daemon with ``policy``: per job its JCT, and
    whether its loss curve and weights equal its solo replay."""
    from gradfabric.emu.harness import switch_daemon

    if policy not in POLICIES:
        raise ConfigError("policy", f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    jobs = trace(cfg)
    results: list[Any] = [None] * len(jobs)
    flags = ("--policy", policy, "--slots", str(cfg.pool_slots), "--job-slots", str(cfg.window))
    with switch_daemon(*flags) as sw:
        start = time.monotonic()

        def one(j: int, job: EsaJob) -> None:
            time.sleep(max(0.0, start + job.arrival_s - time.monotonic()))
            ticket = Ticket.register(sw.control, job.workers)
            try:
                total = cfg.timeout_s + job.steps * 2.0
                args = [(job, ticket, r) for r in range(job.workers)]
                results[j] = run_hosts(_worker, args, cfg.timeout_s, total)
            except Exception as e:
                results[j] = e

        threads = [threading.Thread(target=one, args=(j, job)) for j, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = []
    for job, recs in zip(jobs, results, strict=True):
        if isinstance(recs, Exception):
            raise RuntimeError(f"job {job.seed}: {recs}") from recs
        ref = reference(job)
        loss = [sum(r["losses"][i] for r in recs) / job.workers for i in range(job.steps)]
        rows.append({
            "job": job.seed, "workers": job.workers, "steps": job.steps,
            "arrival_s": job.arrival_s,
            "jct_s": max(r["end"] for r in recs) - min(r["t0"] for r in recs),
            "exact": loss == ref["loss"] and all(r["weights"] == ref["weights"] for r in recs),
            "clipped": sum(r["clipped"] for r in recs),
        })  # fmt: skip
    jct = [r["jct_s"] for r in rows]
    return {
        "policy": policy, "seed": cfg.seed, "jobs": rows,
        "mean_jct_s": statistics.fmean(jct), "p99_jct_s": float(np.percentile(jct, 99)),
        "counters": sw.final.get("counters", {}),
    }  # fmt: skip
