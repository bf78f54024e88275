"""ESA with several real training jobs sharing one switch daemon.

A seeded trace of jobs (each: 2 or 3 workers, a number of steps, an arrival
time) trains the catalog's digits MLP (``lab.job``) through one switch
daemon whose aggregator pool is too small for every job's window at once.
Each job is launched as users launch one, by torchrun (one per job on
loopback; on shaped links one per worker's namespace, rendezvous at the
job's first worker), and its ranks join a gloo group; every job's torchrun
starts at once and its ranks wait, ready, for the trace's start and then
their job's arrival, so a job's start-up does not move it along the trace.
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
policy (collisions fall back to its parameter server), with ``esa``
(preemption by priority), and with ``atp`` whose clients repair only by
timeout (``TIMEOUTS``, an ablation); a job's completion time (JCT) runs
from its arrival to its last worker's last step. Every job's loss curve and weights
must equal its solo replay (``lab.job.reference``) bit for bit.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.core.hostcpu import waited_s
from gradfabric.lab.job import (
    Replica,
    check_shards,
    daemon_flags,
    data,
    fingerprint,
    reference,
)
from gradfabric.net.launch import run_on_hosts, run_rank, run_ranks
from gradfabric.net.netns import NsHost, call_in, tor_star
from gradfabric.proto.priority import srpt_aging
from gradfabric.runtime.client import InaClient, Ticket

POLICIES = ("atp", "esa")  # what every setting of a study runs
# ATP with its workers' fast retransmit off: a split sequence (some shares in
# an aggregator, the others at the PS) or a loss waits for the timeout. Not
# ATP's own client, which resends a gap at the first result past it; an
# ablation that shows what ESA's gain owes to how fast ATP repairs.
TIMEOUTS = "atp-timeouts"
# each policy a study runs: the daemon's policy and the clients' fast
# retransmit (None: the ticket's rule, ``runtime.ticket.fast_retransmit``)
ARMS: dict[str, tuple[str, int | None]] = {
    "atp": ("atp", None),
    "esa": ("esa", None),
    TIMEOUTS: ("atp", 0),
}
AGING_S = 1.0
MODULE = "gradfabric.lab.esa_train"
READY_S = 180.0  # every job's ranks started (torchrun, torch's import, a client) within this
GO_S = 0.5  # the trace's time zero: this long after the last rank said it is ready


def arm(policy: str) -> tuple[str, int | None]:
    """``policy``'s daemon policy and clients' fast retransmit (``ARMS``)."""
    if policy not in ARMS:
        raise ConfigError("policy", f"unknown policy {policy!r}; valid: {', '.join(ARMS)}")
    return ARMS[policy]


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
    shards: str = "interleaved"  # (``lab.job.SHARDS``)

    def __post_init__(self) -> None:
        check_shards(self.shards)

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


def _rank_main(spec_file: str) -> None:
    """One rank of a job, under torchrun (``run_rank`` joined its group):
    say it is ready, wait for the trace's start and the job's arrival, train,
    write its record beside the spec."""
    import torch.distributed as dist

    here = Path(spec_file).parent
    spec = json.loads(Path(spec_file).read_text())
    job, rank = EsaJob(**spec["job"]), dist.get_rank()
    torch.set_num_threads(1)
    data()
    replica = Replica(job)
    client = InaClient(Ticket.load(str(here / "ticket.json")), rank, timeout_s=60.0,
                       exponents="carried")  # fmt: skip
    losses, device_ms = [], job.device_ms(rank)
    (here / f"ready.{rank}").touch()
    go = Path(spec["go_file"])
    deadline = time.monotonic() + READY_S
    while not go.exists():  # (written whole: a rename)
        if time.monotonic() > deadline:
            raise PeerTimeoutError("the trace's start", READY_S)
        time.sleep(0.01)
    at = float(go.read_text()) + job.arrival_s  # the job's arrival on the trace's clock
    time.sleep(max(0.0, at - time.monotonic()))
    t0, cpu0, waited0 = time.monotonic(), time.process_time(), waited_s()
    for step in range(job.steps):
        began = time.monotonic()
        g, loss = replica.gradient(step, rank)
        time.sleep(max(0.0, began + device_ms[step] / 1e3 - time.monotonic()))
        left = (job.steps - step) * replica.params * 4
        client.set_priority(srpt_aging(left, time.monotonic() - t0, AGING_S))
        replica.step_sum(client.allreduce(g, out=g))  # ina_hook's sum, on one tensor
        losses.append(loss)
    end, waited1 = time.monotonic(), waited_s()
    client.close()
    lost = None if waited0 is None or waited1 is None else waited1 - waited0
    rec = {"t0": t0, "end": end, "cpu_s": time.process_time() - cpu0, "waited_s": lost,
           "losses": losses,
           "weights": fingerprint(replica.net), "clipped": client.clipped,
           "late_s": t0 - at}  # fmt: skip
    (here / f"rank{rank}.json").write_text(json.dumps(rec))


def _start(
    want: list[tuple[Path, int]], threads: list[threading.Thread], go_file: Path
) -> list[str]:
    """Wait until every rank of ``want`` (its job's directory, its rank) is
    ready (or a job's launch failed), then write the trace's time zero;
    returns the ranks that were not ready by then."""
    deadline = time.monotonic() + READY_S
    while any(not (d / f"ready.{r}").exists() for d, r in want):
        if not all(t.is_alive() for t in threads) or time.monotonic() > deadline:
            break  # (a launch that ended early failed: its thread has the error)
        time.sleep(0.05)
    tmp = go_file.with_suffix(".tmp")
    tmp.write_text(repr(time.monotonic() + GO_S))
    os.replace(tmp, go_file)
    return [f"{d.name} rank {r}" for d, r in want if not (d / f"ready.{r}").exists()]


def run_trace(cfg: EsaTrainConfig, policy: str) -> dict[str, Any]:
    """The trace through one daemon with ``policy``: per job its JCT, and
    whether its loss curve and weights equal its solo replay. On shaped
    links (root, network namespaces) every worker of the trace has a host of
    its own."""
    from contextlib import ExitStack

    from gradfabric.lab.daemon import cpu_s, switch_daemon

    jobs = trace(cfg)
    first = np.cumsum([0] + [j.workers for j in jobs]).tolist()  # each job's first host
    results: list[Any] = [None] * len(jobs)
    daemon, fast = arm(policy)
    flags = (*daemon_flags(cfg.window), "--policy", daemon, "--slots", str(cfg.pool_slots),
             "--ps-link-mbps", str(cfg.link_gbps * 1000))  # fmt: skip
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="esa-")))
        hosts: list[NsHost | None] = [None] * first[-1]
        tor = None
        if cfg.link_gbps:
            ns, tor = stack.enter_context(tor_star(first[-1], cfg.link_gbps))
            hosts = list(ns)
        sw = stack.enter_context(switch_daemon(*flags, host=tor))
        dirs = []
        for j, job in enumerate(jobs):
            d = tmp / f"job{j}"
            d.mkdir()
            if tor is None:
                ticket = Ticket.register(sw.control, job.workers)
            else:  # the daemon's control port is reachable in its namespace only
                ticket = call_in(tor, Ticket.register, sw.control, job.workers)
            ticket = replace(ticket, fast_retransmit=fast)
            ticket.save(str(d / "ticket.json"))
            spec = {"job": asdict(job), "go_file": str(tmp / "go")}
            (d / "spec.json").write_text(json.dumps(spec))
            dirs.append(d)
        daemon_cpu = cpu_s(sw.proc.pid)

        def one(j: int, job: EsaJob) -> None:
            total = READY_S + cfg.timeout_s + job.steps * 2.0
            args = [str(dirs[j] / "spec.json")]
            try:
                if tor is None:
                    run_ranks(job.workers, MODULE, args, timeout_s=total)
                else:
                    mine = hosts[first[j] : first[j] + job.workers]
                    run_on_hosts([h for h in mine if h is not None], MODULE, args, total)
                results[j] = [json.loads((dirs[j] / f"rank{r}.json").read_text())
                              for r in range(job.workers)]  # fmt: skip
            except Exception as e:
                results[j] = e

        threads = [threading.Thread(target=one, args=(j, job)) for j, job in enumerate(jobs)]
        for t in threads:
            t.start()
        want = [(d, r) for d, job in zip(dirs, jobs, strict=True) for r in range(job.workers)]
        unready = _start(want, threads, tmp / "go")
        for t in threads:
            t.join()
        daemon_cpu = cpu_s(sw.proc.pid) - daemon_cpu
    rows = []
    for job, recs in zip(jobs, results, strict=True):
        if isinstance(recs, Exception):
            raise RuntimeError(f"job {job.seed}: {recs}") from recs
    if unready:  # a job that starts late is not the trace's
        raise PeerTimeoutError(f"{', '.join(unready)} (not ready for the trace's start)", READY_S)
    for job, recs in zip(jobs, results, strict=True):
        ref = reference(job)
        loss = [sum(r["losses"][i] for r in recs) / job.workers for i in range(job.steps)]
        rows.append({
            "job": job.seed, "workers": job.workers, "steps": job.steps,
            "arrival_s": job.arrival_s,
            "jct_s": max(r["end"] for r in recs) - min(r["t0"] for r in recs),
            "exact": loss == ref["loss"] and all(r["weights"] == ref["weights"] for r in recs),
            "clipped": sum(r["clipped"] for r in recs),
            "start_late_s": max(r["late_s"] for r in recs),  # its arrival to its first step
            # a step's time its ranks spent runnable, waiting for a core (mean over ranks)
            "waited_ms_per_step": None if any(r.get("waited_s") is None for r in recs)
            else 1e3 * statistics.fmean(r["waited_s"] for r in recs) / job.steps,
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


if __name__ == "__main__":  # one rank of a job, started by torchrun
    run_rank(_rank_main, sys.argv[1])
