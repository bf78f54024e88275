"""SA-ATP over real UDP: one worker slowed, ATP against ATP with straggler help.

A switch daemon (policy ``atp``) and ``workers`` processes, each a helped
host (its own stream plus shadow streams for helping: ``net.hostpath``, in
C where it is built, else ``proto.host.HostEngine``) on a UDP socket.
Every iteration a worker "computes" for ``compute_ms`` times its slowdown
(a sleep: worker ``straggler`` is ``slowdown`` times slower), then
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
import contextlib
import socket
import statistics
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from gradfabric.core.errors import ConfigError, PeerTimeoutError, ProtocolError
from gradfabric.net import hostpath
from gradfabric.net.hostpath import OWN, HostDriver
from gradfabric.net.launch import run_hosts
from gradfabric.net.udp import size_buffers
from gradfabric.proto.worker import WorkerEngine
from gradfabric.runtime.client import Ticket, scheme_worker
from gradfabric.runtime.switchd import control_call


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
    host: str = "auto"  # the helped hosts' implementation (``net.hostpath.HOSTS``)

    def __post_init__(self) -> None:
        if self.workers < 3 or not 0 <= self.straggler < self.workers:
            raise ConfigError("workers", "need >= 3 workers and a straggler among them")
        if self.slowdown < 1 or self.iterations < 2 or self.iteration_packets < 1:
            raise ConfigError("slowdown", "slowdown >= 1, >= 2 iterations, >= 1 packet")
        hostpath.check_path(self.host)


def gradient(seed: int, iteration: int, worker: int, values: int) -> np.ndarray:
    """Worker ``worker``'s gradient in ``iteration`` (what its shard's backward gives)."""
    rng = np.random.default_rng([seed, iteration, worker])
    return rng.integers(-(2**20), 2**20, values, dtype=np.int32)


def run_emu_saatp(cfg: SaatpEmuConfig, help: bool) -> dict[str, Any]:
    """One run; returns per-iteration times (the slowest worker's), help counts
    and the switch's counters."""
    from gradfabric.lab.daemon import switch_daemon
    from gradfabric.lab.job import daemon_flags

    # packets laid out as the training study's; SA-ATP's monitor in the native node
    with switch_daemon("--policy", "atp", *daemon_flags()) as sw:
        sa = None
        if help:
            sa = {"lag_packets": cfg.lag_packets, "replicas": cfg.replicas,
                  "iteration_packets": cfg.iteration_packets}  # fmt: skip
        ticket = Ticket.register(sw.control, cfg.workers, help=sa)
        recs = run_hosts(
            _worker_main, [(cfg, ticket, w) for w in range(cfg.workers)], cfg.timeout_s,
            cfg.timeout_s * cfg.iterations,
        )  # fmt: skip
    its, cpu_s = iteration_times(recs), statistics.median(r["cpu_s"] for r in recs)
    return {
        "help": help,
        "iteration_ms": [x * 1e3 for x in its],
        "median_iteration_ms": statistics.median(its[1:]) * 1e3,  # the first warms up
        "helps_sent": sum(r["helps"] for r in recs),
        "abandoned": sum(r["abandoned"] for r in recs),
        "exact": all(r["exact"] for r in recs),
        "host": sorted({r["host"] for r in recs}),  # which helped host served
        # each host's CPU an iteration, the median host's: with compute a sleep,
        # what the host's transport costs (and the event loop around it)
        "cpu_ms_per_iteration": cpu_s * 1e3 / cfg.iterations,
        "switch": sw.final.get("counters", {}),
        "config": asdict(cfg),
    }


def iteration_times(recs: list[dict[str, Any]]) -> list[float]:
    """Seconds per iteration: iteration i ends when its last worker has all of its results."""
    ends = [max(r["ends"][i] for r in recs) for i in range(len(recs[0]["ends"]))]
    starts = min(r["t0"] for r in recs)
    return [ends[0] - starts] + [ends[i] - ends[i - 1] for i in range(1, len(ends))]


def _worker_main(cfg: SaatpEmuConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
    try:
        conn.send(asyncio.run(_Sleeper(cfg, ticket, rank, conn).run()))
    except Exception as e:  # reported to the parent, never a hang
        conn.send(f"worker {rank}: {e!r}")


class HelpedWorker:
    """One SA-ATP host's iterations: its own share pushed when computed, a
    straggler's share computed from the replica and pushed through a shadow
    stream when the switch asks. What a share *is* (a sleep and seeded ints,
    or a real backward pass) is the subclass's: ``own_share``,
    ``other_share``, ``finish`` and ``report``."""

    def __init__(
        self, ticket: Ticket, rank: int, conn: Connection, iterations: int, packets: int,
        timeout_s: float, host: str = "auto",
    ) -> None:  # fmt: skip
        self.ticket, self.rank, self.conn, self.timeout_s = ticket, rank, conn, timeout_s
        own = scheme_worker(ticket, rank, timeout_s, takes_help=True)
        assert isinstance(own, WorkerEngine)
        self.iterations, self.P, self.vpp = iterations, packets, ticket.values_per_packet
        # every iteration's sum, where the host writes each result (seq * vpp)
        self.sink = np.zeros(iterations * self.P * self.vpp, dtype=np.int64)
        self.sums = [self.sink[i * self.P * self.vpp : (i + 1) * self.P * self.vpp]
                     for i in range(iterations)]  # fmt: skip
        self.host = hostpath.host(own, bytes.fromhex(ticket.token), self.sink, host)
        self.got = [0] * iterations  # results in, per iteration
        self.done: list[asyncio.Event] = []
        self.computed: list[asyncio.Event] = []
        self.current = 0
        self.helping = False
        self.helps = 0
        self.abandoned = 0

    async def own_share(self, it: int) -> np.ndarray | None:
        """This host's int32 share of iteration ``it`` (``P * vpp`` values), or
        None when the iteration completed (helped through) before it was ready."""
        raise NotImplementedError

    async def other_share(self, it: int, straggler: int) -> np.ndarray | None:
        """``straggler``'s share of ``it``, computed from the replica at this
        host's speed; None when the iteration completed meanwhile."""
        raise NotImplementedError

    async def finish(self, it: int) -> None:
        """Iteration ``it``'s sum is in ``self.sums[it]``: apply it."""

    def report(self) -> dict[str, Any]:
        return {}

    def until_done(self, it: int, seconds: float) -> Awaitable[bool]:
        """Wait up to ``seconds``; True if iteration ``it`` completed meanwhile."""
        return _within(self.done[it], seconds)

    async def run(self) -> dict[str, Any]:
        t = self.ticket
        self.done = [asyncio.Event() for _ in range(self.iterations)]
        self.computed = [asyncio.Event() for _ in range(self.iterations)]
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        size_buffers(sock)
        self.driver = HostDriver(self.host, sock, t.switch, self._result, self._on_help)
        hello = {"op": "hello", "job_id": t.job_id, "token": t.token, "rank": self.rank,
                 "port": sock.getsockname()[1], "host": "127.0.0.1"}  # fmt: skip
        await control_call(t.control, hello)
        loop = asyncio.get_running_loop()
        self.conn.send("ready")
        await loop.run_in_executor(None, self.conn.recv)  # "go"
        t0, cpu0 = time.monotonic(), time.process_time()
        ends = []
        for it in range(self.iterations):
            self.current = it
            g = await self.own_share(it)
            if g is None:  # helped through: this compute dropped, its sequences skipped
                self.abandoned += 1
            else:
                self.computed[it].set()
                self.driver.push(g, at_seq=it * self.P)
                await self._results(it)
            self.computed[it].set()
            await self.finish(it)
            ends.append(time.monotonic())
        cpu_s = time.process_time() - cpu0
        counters = dict(self.host.counters())
        self.driver.close()
        return {"t0": t0, "ends": ends, "helps": self.helps, "abandoned": self.abandoned,
                "cpu_s": cpu_s,
                "host": self.host.path,
                "counters": counters} | self.report()  # fmt: skip

    async def _results(self, it: int) -> None:
        """Wait for iteration ``it``'s results. A stream that gave up on the
        switch, or the timeout, is the switch's ``PeerTimeoutError`` naming
        the stream; an error in the host or a callback, raised."""
        done: asyncio.Future[Any] = asyncio.ensure_future(self.done[it].wait())
        gave_up: asyncio.Future[Any] = self.driver.gave_up
        await asyncio.wait({done, gave_up}, timeout=self.timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if done.done():
            return
        done.cancel()
        if gave_up.done() and gave_up.exception() is not None:
            raise gave_up.exception()  # type: ignore[misc]  # (checked: not None)
        s = gave_up.result() if gave_up.done() else None
        stream = "" if s is None else " (its own stream)" if s == OWN else f" (helping {s})"
        raise PeerTimeoutError(f"switch {self.ticket.switch}{stream}", self.timeout_s)

    def _result(self, seq: int, count: int) -> None:
        """Result ``seq`` is in the sink (``count`` < 0: it came in floats,
        the sum left the integer domain: the iteration cannot be taken)."""
        if count < 0:
            raise ProtocolError(f"result {seq} left the integer domain (an int32 sum overflowed)")
        it = seq // self.P
        self.got[it] += 1
        if self.got[it] == self.P:
            self.done[it].set()

    def _on_help(self, straggler: int, from_seq: int) -> None:
        it = from_seq // self.P
        if it != self.current or self.helping or straggler == self.rank:
            return
        self.helping = True
        asyncio.get_running_loop().create_task(self._help(straggler, it, from_seq))

    async def _help(self, s: int, it: int, from_seq: int) -> None:
        """Compute ``s``'s share from the replica once our own is done, and send
        what is still missing through the shadow stream."""
        try:
            await self.computed[it].wait()
            if self.done[it].is_set():
                return
            full = await self.other_share(it, s)
            if full is None:
                return
            shadow = self.host.state(s)
            start = max(from_seq, self.host.state().base, it * self.P)
            end = (it + 1) * self.P
            busy = not shadow.idle or start < shadow.next_seq
            if self.done[it].is_set() or start >= end or busy:
                return
            self.host.skip_to(s, start)
            g = full[(start - it * self.P) * self.vpp :]  # what has no result yet
            self.helps += 1
            self.driver.push(g, at_seq=start, stream=s)
        finally:
            self.helping = False


async def _within(event: asyncio.Event, seconds: float) -> bool:
    if seconds > 0 and not event.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


class _Sleeper(HelpedWorker):
    """Compute is a sleep, a share seeded ints: every sum has an exact reference."""

    def __init__(self, cfg: SaatpEmuConfig, ticket: Ticket, rank: int, conn: Connection) -> None:
        super().__init__(ticket, rank, conn, cfg.iterations, cfg.iteration_packets, cfg.timeout_s,
                         cfg.host)  # fmt: skip
        self.cfg = cfg

    def compute_s(self, worker: int) -> float:
        slow = self.cfg.slowdown if worker == self.cfg.straggler else 1.0
        return self.cfg.compute_ms / 1e3 * slow

    async def own_share(self, it: int) -> np.ndarray | None:
        if await self.until_done(it, self.compute_s(self.rank)):
            return None
        return gradient(self.cfg.seed, it, self.rank, self.P * self.vpp)

    async def other_share(self, it: int, straggler: int) -> np.ndarray | None:
        if await self.until_done(it, self.compute_s(self.rank)):
            return None
        return gradient(self.cfg.seed, it, straggler, self.P * self.vpp)

    def report(self) -> dict[str, Any]:
        return {"exact": self._check()}

    def _check(self) -> bool:
        """Every iteration's result equals the int64 sum of every worker's gradient."""
        vals = self.P * self.vpp

        def ref(it: int) -> np.ndarray:
            grads = [gradient(self.cfg.seed, it, w, vals) for w in range(self.cfg.workers)]
            return np.asarray(np.sum([g.astype(np.int64) for g in grads], axis=0))

        return all(np.array_equal(self.sums[it], ref(it)) for it in range(self.cfg.iterations))
