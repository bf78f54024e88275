"""ESA with several real training jobs sharing one switch daemon.

A seeded trace of jobs (each: 2 or 3 workers, a number of steps, an arrival
time) trains the catalog's digits MLP (``lab.job``) through one switch
daemon whose aggregator pool is too small for every job's window at once.
Each worker computes its micro-batch under a deadline throttle
(``compute_ms`` of device time per step), sums its gradient as int32 fixed
point through the switch (``InaClient.allreduce`` with exponents carried
from the last step's sum: ``ina_hook``'s path, on one tensor) and steps. ``jitter_ms``: each
step's device time is longer by a seeded uniform draw from ``[0,
jitter_ms]`` per worker (the simulator's ``iteration_jitter_us``): workers
out of lockstep hold aggregators partly filled, which is where ESA's
preemption pays. ``link_gbps``: the daemon in the switch namespace of a
shaped star (``net.netns.tor_star``) and every worker in a namespace of its
own behind one link of that rate (0: loopback); ATP's fallback PS, hosted
in the daemon, sharded per worker behind modelled links of the same rate
(``proto.node.ModelledLinks``), as the simulator places it. Workers stamp each
step's packets with ESA's ``srpt-aging`` priority from their job's
remaining bytes and age. The same trace runs with the daemon's ``atp``
policy (collisions fall back to its parameter server) and ``esa``
(preemption by priority); a job's completion time (JCT) runs from its
arrival to its last worker's last step. Every job's loss curve and weights
must equal its solo replay (``lab.job.reference``) bit for bit.
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
from gradfabric.lab.job import Replica, daemon_flags, data, fingerprint, reference
from gradfabric.net.launch import run_hosts
from gradfabric.net.netns import NsHost, call_in, enter, tor_star
from gradfabric.proto.priority import srpt_aging
from gradfabric.runtime.client import InaClient, Ticket

POLICIES = ("atp", "esa")
AGING_S = 1.0
START_S = 2.0  # the trace's time zero after the daemon is up: every job's workers ready by then


@dataclass(frozen=True)
class EsaJob:
    """One job of a trace (its fields are ``lab.job.Job``'s)."""

    workers: int
    steps: int
    arrival_s: float
    micro_batch: int = 32
    compute_ms: float = 20.0
    lr: float = 0.3
    seed: int = 0
    jitter_ms: float = 0.0

    def device_ms(self, rank: int) -> list[float]:
        """Each step's device time for worker ``rank``: ``compute_ms`` plus
        its seeded jitter (a function of the job, the rank and nothing else,
        so ATP and ESA see the same draws)."""
        rng = np.random.default_rng([self.seed, rank, 29])
        return list(self.compute_ms + rng.uniform(0.0, self.jitter_ms, self.steps))


@dataclass(frozen=True)
class EsaTrainConfig:
    jobs: int = 3
    pool_slots: int = 40  # aggregators in the daemon's pool
    window: int = 32  # each job's window: two jobs at once overfill 40
    mean_gap_s: float = 0.1  # Poisson arrivals
    steps: tuple[int, ...] = (8, 16, 32)  # a job's length, drawn per job
    compute_ms: float = 5.0  # a step's device time (forward and backward)
    jitter_ms: float = 0.0  # each step's device time longer by up to this, per worker
    link_gbps: float = 0.0  # every worker behind its own shaped link (0: loopback)
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.pool_slots < 1 or self.window < 1 or self.mean_gap_s < 0:
            raise ConfigError("jobs", "jobs, pool_slots and window >= 1, mean_gap_s >= 0")
        if self.window > self.pool_slots:
            raise ConfigError(
                "pool_slots", f"the daemon needs a pool of at least one window ({self.window})"
            )
        if self.jitter_ms < 0 or self.link_gbps < 0:
            raise ConfigError("jitter_ms", "jitter_ms and link_gbps must be >= 0")


def trace(cfg: EsaTrainConfig) -> list[EsaJob]:
    """The seeded jobs: sizes and Poisson arrivals (the first at 0)."""
    rng = np.random.default_rng([cfg.seed, 17])
    gaps = rng.exponential(cfg.mean_gap_s, cfg.jobs)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return [
        EsaJob(workers=int(rng.choice([2, 3])), steps=int(rng.choice(cfg.steps)),
               arrival_s=float(a), compute_ms=cfg.compute_ms, jitter_ms=cfg.jitter_ms,
               seed=cfg.seed * 100 + j)
        for j, a in enumerate(arrivals)
    ]  # fmt: skip


def _worker(
    job: EsaJob, ticket: Ticket, rank: int, host: NsHost | None, conn: Connection
) -> None:
    try:
        if host is not None:
            enter(host)  # before any socket is made
        torch.set_num_threads(1)
        data()
        replica = Replica(job)
        client = InaClient(ticket, rank, timeout_s=60.0, exponents="carried")
        losses, device_ms = [], job.device_ms(rank)
        conn.send("ready")
        conn.recv()
        t0, cpu0 = time.monotonic(), time.process_time()
        for step in range(job.steps):
            began = time.monotonic()
            g, loss = replica.gradient(step, rank)
            time.sleep(max(0.0, began + device_ms[step] / 1e3 - time.monotonic()))
            left = (job.steps - step) * replica.params * 4
            client.set_priority(srpt_aging(left, time.monotonic() - t0, AGING_S))
            replica.step_sum(client.allreduce(g, out=g))  # ina_hook's sum, on one tensor
            losses.append(loss)
        end = time.monotonic()
        client.close()
        conn.send({"t0": t0, "end": end, "cpu_s": time.process_time() - cpu0, "losses": losses,
                   "weights": fingerprint(replica.net), "clipped": client.clipped})  # fmt: skip
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"job {job.seed} rank {rank}: {e!r}")


def run_trace(cfg: EsaTrainConfig, policy: str) -> dict[str, Any]:
    """The trace through one daemon with ``policy``: per job its JCT, and
    whether its loss curve and weights equal its solo replay. On shaped
    links (root, network namespaces) every worker of the trace has a host of
    its own."""
    from contextlib import ExitStack

    from gradfabric.lab.daemon import cpu_s, switch_daemon

    if policy not in POLICIES:
        raise ConfigError("policy", f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    jobs = trace(cfg)
    first = np.cumsum([0] + [j.workers for j in jobs]).tolist()  # each job's first host
    results: list[Any] = [None] * len(jobs)
    flags = (*daemon_flags(cfg.window), "--policy", policy, "--slots", str(cfg.pool_slots),
             "--ps-link-mbps", str(cfg.link_gbps * 1000))  # fmt: skip
    with ExitStack() as stack:
        hosts: list[NsHost | None] = [None] * first[-1]
        tor = None
        if cfg.link_gbps:
            ns, tor = stack.enter_context(tor_star(first[-1], cfg.link_gbps))
            hosts = list(ns)
        sw = stack.enter_context(switch_daemon(*flags, host=tor))
        start, daemon_cpu = time.monotonic(), cpu_s(sw.proc.pid)

        def one(j: int, job: EsaJob) -> None:
            # every job's workers start now and go at its arrival on the trace's
            # clock: a job's start-up (a fork, its data, its socket) must not
            # move it along the trace (under load it took as long as the gaps
            # between arrivals, and jobs that should overlap did not)
            go_at = start + START_S + job.arrival_s
            try:
                if tor is None:
                    ticket = Ticket.register(sw.control, job.workers)
                else:  # the daemon's control port is reachable in its namespace only
                    ticket = call_in(tor, Ticket.register, sw.control, job.workers)
                total = cfg.timeout_s + job.steps * 2.0
                args = [(job, ticket, r, hosts[first[j] + r]) for r in range(job.workers)]
                results[j] = run_hosts(_worker, args, cfg.timeout_s, total, go_at=go_at)
            except Exception as e:
                results[j] = e

        threads = [threading.Thread(target=one, args=(j, job)) for j, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        daemon_cpu = cpu_s(sw.proc.pid) - daemon_cpu
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
    ranks = [r for recs in results for r in recs]
    span = max(r["end"] for r in ranks) - min(r["t0"] for r in ranks)  # some job training
    return {
        "policy": policy, "seed": cfg.seed, "jobs": rows,
        "mean_jct_s": statistics.fmean(jct), "p99_jct_s": float(np.percentile(jct, 99)),
        "counters": sw.final.get("counters", {}),
        # CPU seconds per second of the span some job trains (1: one core, busy throughout)
        "daemon_load": daemon_cpu / span,
        "workers_load": sum(r["cpu_s"] for r in ranks) / span,
    }  # fmt: skip
