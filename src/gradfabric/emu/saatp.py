"""SA-ATP over real UDP: one worker slowed, ATP against ATP with straggler help.

A switch daemon (policy ``atp``) and ``workers`` processes, each a
``HostEngine`` (its own stream plus shadow streams for helping) on a UDP
socket. Every iteration a worker "computes" for ``compute_ms`` times its
slowdown (a sleep: worker ``straggler`` is ``slowdown`` times slower), then
pushes its gradient: ``iteration_packets`` packets of int32 values that are a
seeded function of (iteration, worker), standing for the backward pass over
the worker's data shard. It starts the next iteration once all of this one's
results are in. So every aggregate has an exact reference, and a worker
holding a replica of shard ``s`` can compute ``s``'s gradient.

With ``help`` the job registers SA-ATP at the switch: the switch watches
progress, and when the leaders are ``lag_packets`` ahead of a worker it
sends a ``NOTIFY`` to a replica holder. That helper, once its own compute is
done, computes the straggler's gradient from the replica (the same sleep at
its own speed) and sends it flagged ``HELP`` under the straggler's bit
through a shadow stream. Whichever copy arrives first is aggregated; a
straggler whose iteration completes while it is still computing abandons
that compute and starts the next iteration (its skipped sequences are never
sent). Every worker checks every result against the int64 sum.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.emu.client import Ticket, scheme_worker
from gradfabric.emu.switchd import SWITCH, control_call
from gradfabric.net.udp import open_engine
from gradfabric.proto.actions import Deliver, HelpRequest
from gradfabric.proto.host import HostEngine
from gradfabric.proto.worker import WorkerEngine


@dataclass(frozen=True)
class SaatpEmuConfig:
    workers: int = 4
    iterations: int = 8
    compute_ms: float = 100.0
    straggler: int = 1
    slowdown: float = 4.0
    iteration_packets: int = 64
    lag_packets: int = 16  # below the window (32): the leaders can get that far ahead
    replicas: int = 2
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.workers < 3 or not 0 <= self.straggler < self.workers:
            raise ConfigError("workers", "need >= 3 workers and a straggler among them")
        if self.slowdown < 1 or self.iterations < 2 or self.iteration_packets < 1:
            raise ConfigError("slowdown", "slowdown >= 1, >= 2 iterations, >= 1 packet")


def gradient(seed: int, iteration: int, worker: int, values: int) -> np.ndarray:
    """Worker ``worker``'s gradient in ``iteration`` (what its shard's backward gives)."""
    rng = np.random.default_rng([seed, iteration, worker])
    return rng.integers(-(2**20), 2**20, values, dtype=np.int32)


def run_emu_saatp(cfg: SaatpEmuConfig, help: bool) -> dict[str, Any]:
    """One run; returns per-iteration times (the slowest worker's), help counts
    and the switch's counters."""
    from gradfabric.emu.harness import switch_daemon

    with switch_daemon("--policy", "atp") as sw:
        sa = None
        if help:
            sa = {"lag_packets": cfg.lag_packets, "replicas": cfg.replicas,
                  "iteration_packets": cfg.iteration_packets}  # fmt: skip
        ticket = Ticket.register(sw.control, cfg.workers, help=sa)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for w in range(cfg.workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(cfg, ticket, w, child), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        try:
            for c in conns:  # every worker said hello
                if not c.poll(cfg.timeout_s) or c.recv() != "ready":
                    raise RuntimeError("a worker did not start")
            for c in conns:
                c.send("go")
            recs = []
            for w, c in enumerate(conns):
                if not c.poll(cfg.timeout_s * cfg.iterations):
                    raise TimeoutError(f"worker {w} did not finish")
                msg = c.recv()
                if isinstance(msg, str):
                    raise RuntimeError(msg)
                recs.append(msg)
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
    # iteration i ends when its last worker has all of its results
    ends = [max(r["ends"][i] for r in recs) for i in range(cfg.iterations)]
    starts = min(r["t0"] for r in recs)
    its = [ends[0] - starts] + [ends[i] - ends[i - 1] for i in range(1, cfg.iterations)]
    return {
        "help": help,
        "iteration_ms": [x * 1e3 for x in its],
        "median_iteration_ms": statistics.median(its[1:]) * 1e3,  # the first warms up
        "helps_sent": sum(r["helps"] for r in recs),
        "abandoned": sum(r["abandoned"] for r in recs),
        "exact": all(r["exact"] for r in recs),
        "switch": sw.final.get("counters", {}),
        "config": asdict(cfg),
    }


def _worker_main(cfg: SaatpEmuConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
    try:
        conn.send(asyncio.run(_Worker(cfg, ticket, rank, conn).run()))
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"worker {rank}: {e!r}")


class _Worker:
    def __init__(self, cfg: SaatpEmuConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
        self.cfg, self.ticket, self.rank, self.conn = cfg, ticket, rank, conn
        t = ticket
        own = scheme_worker(t, rank, cfg.timeout_s, takes_help=True)
        assert isinstance(own, WorkerEngine)
        self.host = HostEngine(own)
        self.P, self.vpp = cfg.iteration_packets, t.values_per_packet
        self.got = [0] * cfg.iterations  # results in, per iteration
        self.sums = [np.zeros(self.P * self.vpp, dtype=np.int64) for _ in range(cfg.iterations)]
        self.done: list[asyncio.Event] = []
        self.computed: list[asyncio.Event] = []
        self.current = 0
        self.helping = False
        self.helps = 0
        self.abandoned = 0

    def speed(self, worker: int) -> float:
        return self.cfg.slowdown if worker == self.cfg.straggler else 1.0

    async def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.ticket
        self.done = [asyncio.Event() for _ in range(cfg.iterations)]
        self.computed = [asyncio.Event() for _ in range(cfg.iterations)]
        transport, self.proto = await open_engine(
            self.host, {SWITCH: t.switch}, ("127.0.0.1", 0), self._deliver,
            bytes.fromhex(t.token), self._on_help,
        )  # fmt: skip
        hello = {"op": "hello", "job_id": t.job_id, "token": t.token, "rank": self.rank,
                 "port": transport.get_extra_info("sockname")[1], "host": "127.0.0.1"}  # fmt: skip
        await control_call(t.control, hello)
        loop = asyncio.get_running_loop()
        self.conn.send("ready")
        await loop.run_in_executor(None, self.conn.recv)  # "go"
        t0 = time.monotonic()
        ends = []
        for it in range(cfg.iterations):
            self.current = it
            compute = cfg.compute_ms / 1e3 * self.speed(self.rank)
            done = asyncio.create_task(self.done[it].wait())
            finished, _ = await asyncio.wait({done}, timeout=compute)
            if finished:  # helped through: drop this compute, skip its sequences
                self.abandoned += 1
            else:
                self.computed[it].set()
                g = gradient(cfg.seed, it, self.rank, self.P * self.vpp)
                now = time.monotonic_ns()
                self.proto.execute(self.host.own.push(len(g), now, g, at_seq=it * self.P))
                await asyncio.wait_for(done, cfg.timeout_s)
            self.computed[it].set()
            ends.append(time.monotonic())
        transport.close()
        return {"t0": t0, "ends": ends, "helps": self.helps, "abandoned": self.abandoned,
                "exact": self._check()}  # fmt: skip

    def _deliver(self, d: Deliver) -> None:
        it, k = divmod(d.seq, self.P)
        if d.pkt.payload is not None and it < self.cfg.iterations:
            self.sums[it][k * self.vpp : k * self.vpp + d.pkt.count] = d.pkt.payload
            self.got[it] += 1
            if self.got[it] == self.P:
                self.done[it].set()

    def _on_help(self, req: HelpRequest) -> None:
        it = req.from_seq // self.P
        if it != self.current or self.helping or req.straggler == self.rank:
            return
        self.helping = True
        asyncio.get_running_loop().create_task(self._help(req.straggler, it, req.from_seq))

    async def _help(self, s: int, it: int, from_seq: int) -> None:
        """Compute ``s``'s gradient from the replica once our own is done, and send
        what is still missing through the shadow stream."""
        try:
            await self.computed[it].wait()
            if self.done[it].is_set():
                return
            await asyncio.sleep(self.cfg.compute_ms / 1e3 * self.speed(self.rank))
            shadow = self.host.shadow(s)
            start = max(from_seq, self.host.own.base, it * self.P)
            end = (it + 1) * self.P
            busy = not shadow.idle or start < shadow.next_seq
            if self.done[it].is_set() or start >= end or busy:
                return
            shadow.skip_to(start)
            skip = (start - it * self.P) * self.vpp  # what has its result already
            g = gradient(self.cfg.seed, it, s, self.P * self.vpp)[skip:]
            self.helps += 1
            self.proto.execute(shadow.push(len(g), time.monotonic_ns(), g, at_seq=start))
        finally:
            self.helping = False

    def _check(self) -> bool:
        """Every iteration's result equals the int64 sum of every worker's gradient."""
        vals = self.P * self.vpp

        def ref(it: int) -> np.ndarray:
            grads = [gradient(self.cfg.seed, it, w, vals) for w in range(self.cfg.workers)]
            return np.asarray(np.sum([g.astype(np.int64) for g in grads], axis=0))

        return all(np.array_equal(self.sums[it], ref(it)) for it in range(self.cfg.iterations))
