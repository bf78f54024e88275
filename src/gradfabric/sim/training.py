"""Several training iterations on the simulated fabric, with stragglers.

Each worker loops: start iteration ``i`` once it holds every result of
``i-1`` and its device is free; compute forward and backward at its speed for
this iteration (``StragglerConfig``), releasing DDP buckets as their
gradients are ready; the iteration ends for the worker when all its buckets
are aggregated. A worker whose buckets were all aggregated before it finished
computing them (it was helped) abandons the rest and starts the next
iteration with the others: that is how a straggler catches up.

Under ``saatp`` a host asked to help (``HelpRequest``) spends its spare
compute on the straggler's iteration from its replica of the straggler's
shard: once its own backward is done it runs the straggler's forward and
backward at its own speed and pushes each bucket, from the requested
sequence on, into a shadow stream that sends it under the straggler's bit.
The help stops when the iteration completes. Its compute time and the
replica's memory are reported; neither is free.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import HelpRequest
from gradfabric.proto.host import HostEngine
from gradfabric.proto.schemes import SCHEMES, InaConfig, collective
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.proto.worker import WorkerEngine
from gradfabric.sim.collective import Bucket, CollectiveRun, FabricConfig, missing
from gradfabric.sim.stragglers import StragglerConfig, factors
from gradfabric.workloads.catalog import STORED_SAMPLE_BYTES, check_model, model_spec
from gradfabric.workloads.compute import device, timeline

# How much of a straggler's iteration a helper takes over, decided when the
# helper's device becomes free: given the iteration's bucket ready offsets,
# the time since the iteration began, and the bucket the straggler has reached
# (the first with a result missing), the first bucket to help with, or None.
Takeover = Callable[[list[int], int, int], int | None]
TAKEOVER: Registry[Takeover] = Registry("takeover policy")


@TAKEOVER.register("beatable")
def _beatable(offsets: list[int], elapsed_ns: int, straggler_at: int) -> int | None:
    """Only what the helper can deliver first. The straggler took ``elapsed``
    to reach bucket ``straggler_at``, so its slowdown is at least
    ``elapsed / offsets[straggler_at]``; the helper, starting now at speed 1,
    beats it on bucket ``j`` when ``offsets[j] * (slowdown - 1) > elapsed``."""
    slowdown = elapsed_ns / max(1, offsets[straggler_at])
    if slowdown <= 1.0:
        return None
    beat = elapsed_ns / (slowdown - 1)
    return next((j for j in range(straggler_at, len(offsets)) if offsets[j] > beat), None)


@TAKEOVER.register("all")
def _all(offsets: list[int], elapsed_ns: int, straggler_at: int) -> int | None:
    """Everything the straggler has not delivered yet."""
    return straggler_at


@TAKEOVER.register("tail")
def _tail(offsets: list[int], elapsed_ns: int, straggler_at: int) -> int | None:
    """The buckets ready in the second half of backward."""
    half = offsets[0] + (offsets[-1] - offsets[0]) // 2
    return max(straggler_at, next(j for j, off in enumerate(offsets) if off >= half))


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class TrainingConfig:
    scheme: str = "atp"
    model: str = "resnet50"
    workers: int = 8
    iterations: int = 4
    batch: int = 32
    device: str = "v100"
    bucket_mb: float = 25.0
    seed: int = 0
    shard_gb: float = 17.5  # one worker's data shard (ImageNet's 140 GB over 8): a replica's cost
    # Before it computes, a helper loads the straggler's batch from its replica:
    # ``batch`` samples of the model's dataset (``STORED_SAMPLE_BYTES``: an
    # ImageNet JPEG averages ~110 KB) read and decoded at ``load_gbps``
    # (2 Gbit/s: about 2,300 ImageNet images/s on the helper's host)
    load_gbps: float = 2.0
    takeover: str = "all"
    # an iteration's forward and backward on a speed-1 device, in ms, where it
    # is known (an emulated device's deadline); 0: from the device and FLOPs
    compute_ms: float = 0.0
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    help: HelpConfig = field(default_factory=HelpConfig)
    fabric: FabricConfig = field(default_factory=FabricConfig)
    ina: InaConfig = field(default_factory=InaConfig)

    def __post_init__(self) -> None:
        collective(self.scheme)
        TAKEOVER.get(self.takeover)
        check_model(self.model)
        device(self.device)
        if self.iterations < 1 or self.workers < 1:
            raise ConfigError("iterations", "iterations and workers must be >= 1")
        if self.load_gbps <= 0 or self.compute_ms < 0:
            raise ConfigError("load_gbps", "load_gbps > 0 and compute_ms >= 0")


@dataclass
class TrainingResult:
    iteration_ns: list[int]
    end_ns: int
    events: int
    wall_s: float
    counters: dict[str, int]
    help_requests: int = 0
    helps_started: int = 0
    helps_declined: int = 0
    help_compute_ns: int = 0
    help_load_ns: int = 0
    replica_gb_per_worker: float = 0.0
    results: list[np.ndarray] | None = None
    inputs: list[np.ndarray] | None = None

    @property
    def mean_iteration_ms(self) -> float:
        return float(np.mean(self.iteration_ns)) / 1e6

    def summary(self) -> dict[str, Any]:
        return {
            "iter_time_ms": self.mean_iteration_ms,
            "total_ms": self.end_ns / 1e6,
            "help_requests": self.help_requests,
            "helps_started": self.helps_started,
            "helps_declined": self.helps_declined,
            "help_compute_ms": self.help_compute_ns / 1e6,
            "help_load_ms": self.help_load_ns / 1e6,
            "replica_gb_per_worker": self.replica_gb_per_worker,
            "wall_s": self.wall_s,
        }


class _Trainer:
    def __init__(self, cfg: TrainingConfig, values: bool) -> None:
        self.cfg = cfg
        spec = model_spec(cfg.model)
        self.dev = device(cfg.device)
        self.tl = timeline(spec, cfg.batch, self.dev, cfg.bucket_mb)
        if cfg.compute_ms:
            self.tl = self.tl.scaled(round(cfg.compute_ms * 1e6))
        self.J = len(self.tl.buckets)
        self.offsets = [b.ready_ns for b in self.tl.buckets]  # from the iteration's start
        buckets = [Bucket(0, b.values) for _ in range(cfg.iterations) for b in self.tl.buckets]
        self.run = run = CollectiveRun(
            cfg.scheme, cfg.workers, buckets, cfg.fabric, cfg.ina, cfg.seed, values
        )
        run.iteration_buckets = self.J
        run.help = cfg.help
        run.bucket_hook = self.bucket_done
        self.start = run.build()
        self.factors = factors(cfg.stragglers, cfg.iterations, cfg.workers, cfg.seed)
        n = cfg.workers
        self.current = [0] * n
        self.device_free = [0] * n
        self.done_in = [[0] * cfg.iterations for _ in range(n)]
        self.iter_end = [0] * cfg.iterations
        self.helping: dict[int, tuple[int, int]] = {}  # helper -> (iteration, help start)
        self.helps_started = 0
        self.helps_declined = 0
        self.iter_start = [0] * n
        self.help_compute_ns = 0
        self.help_load_ns = 0
        if cfg.stragglers.nic:
            self.nic_links = {w: self._nic_links(w) for w in range(n)}
        for w, name in enumerate(run.workers):
            run.net.nodes[name].on_help = self._help_handler(w)

    def _nic_links(self, w: int) -> list[Any]:
        name = self.run.workers[w]
        nodes = self.run.net.nodes
        up = nodes[name].routes["*"]
        down = [
            links[0]
            for node in nodes.values()
            for d, links in node.routes.items()
            if d == name and len(links) == 1
        ]
        return [*up, *down]

    def begin(self, w: int, it: int) -> None:
        loop = self.run.loop
        t0 = max(loop.now, self.device_free[w])
        sigma = float(self.factors[it, w])
        compute = sigma
        if self.cfg.stragglers.nic:
            for link in self.nic_links[w]:
                link.slow_down(sigma)
            compute = 1.0
        self.current[w] = it
        self.iter_start[w] = t0
        self.device_free[w] = t0 + int(compute * self.tl.compute_ns)
        for j, off in enumerate(self.offsets):
            loop.at(t0 + int(compute * off), self._push, (w, it, it * self.J + j))

    def _push(self, arg: tuple[int, int, int]) -> None:
        w, it, g = arg
        if self.current[w] == it:  # not abandoned
            self.start(w, g)

    def bucket_done(self, w: int, g: int) -> None:
        it = g // self.J
        self.done_in[w][it] += 1
        if self.done_in[w][it] < self.J:
            return
        now = self.run.loop.now
        self.iter_end[it] = max(self.iter_end[it], now)
        if self.device_free[w] > now:  # own compute or help still running: abandon it
            self._end_help(w, now)
            self.device_free[w] = now
        if it + 1 < self.cfg.iterations:
            self.begin(w, it + 1)
            self.current[w] = it + 1
        else:
            self.current[w] = -1

    def _end_help(self, w: int, now: int) -> None:
        h = self.helping.pop(w, None)
        if h is not None:
            self.help_compute_ns += max(0, min(now, self.device_free[w]) - h[1])

    def _help_handler(self, h: int) -> Any:
        def on_help(req: HelpRequest) -> None:
            self.help(h, req)

        return on_help

    def help(self, h: int, req: HelpRequest) -> None:
        """A help request: the helper decides once its device is free."""
        run = self.run
        s = run.rack_peers[h][req.straggler]  # the switch names it by its place in the rack
        it = (bisect.bisect_right(run.first_seq, req.from_seq) - 1) // self.J
        if it != self.current[h] or h in self.helping or s == h:
            return
        t0 = max(run.loop.now, self.device_free[h])
        self.helping[h] = (it, t0)
        run.loop.at(t0, self._start_help, (h, s, it, req.from_seq))

    def _start_help(self, arg: tuple[int, int, int, int]) -> None:
        h, s, it, from_seq = arg
        run = self.run
        own = run.worker_engines[h]
        end = (it + 1) * self.J  # first bucket of the next iteration
        done = own.base >= run.first_seq[end - 1] + run.npk[end - 1]
        at = max(0, bisect.bisect_right(run.first_seq, own.base) - 1 - it * self.J)
        first = (
            None
            if done or self.current[h] != it
            else TAKEOVER.get(self.cfg.takeover)(
                self.offsets, run.loop.now - self.iter_start[h], min(at, self.J - 1)
            )
        )
        shadow = run.hosts[h].shadow(run.place_in_rack(s))
        start_seq = (
            -1 if first is None else max(from_seq, own.base, run.first_seq[it * self.J + first])
        )
        if first is None or not shadow.idle or start_seq < shadow.next_seq:
            self.helping.pop(h, None)
            self.helps_declined += 1
            return
        g_start = bisect.bisect_right(run.first_seq, start_seq) - 1
        shadow.skip_to(start_seq)
        # the straggler's batch is read from the replica first; then compute
        sample = STORED_SAMPLE_BYTES[self.cfg.model]
        load_ns = int(self.cfg.batch * sample * 8 / self.cfg.load_gbps)
        self.help_load_ns += load_ns
        t0 = run.loop.now + load_ns
        sigma = 1.0 if self.cfg.stragglers.nic else float(self.factors[it, h])
        self.device_free[h] = t0 + int(sigma * self.tl.compute_ns)
        self.helping[h] = (it, t0)
        self.helps_started += 1
        for j, off in enumerate(self.offsets):
            g = it * self.J + j
            if g >= g_start:
                run.loop.at(t0 + int(sigma * off), self._push_help, (h, s, it, g, start_seq))

    def _push_help(self, arg: tuple[int, int, int, int, int]) -> None:
        h, s, it, g, start_seq = arg
        run = self.run
        if self.helping.get(h, (None,))[0] != it:  # the iteration completed: help stopped
            return
        skip = max(0, start_seq - run.first_seq[g]) * run.vpp
        count = run.buckets[g].count - skip
        payload = run.payload(s, g)  # the replica: the straggler's own data
        if payload is not None:
            payload = payload[skip:]
        shadow = run.hosts[h].shadow(run.place_in_rack(s))
        at = max(start_seq, run.first_seq[g])
        run.net.kick(run.workers[h], shadow.push(count, run.loop.now, payload, at_seq=at))
        if g == (it + 1) * self.J - 1:  # the straggler's whole iteration is computed
            self._end_help(h, run.loop.now)


def run_training(
    cfg: TrainingConfig, values: bool = False, horizon_ns: int = 10**13
) -> TrainingResult:
    tr = _Trainer(cfg, values)
    run = tr.run
    for w in range(cfg.workers):
        tr.begin(w, 0)
    t0 = time.perf_counter()
    run.loop.run(until_ns=horizon_ns)
    wall = time.perf_counter() - t0
    goal = cfg.workers * len(run.buckets)
    if run.finished != goal:
        raise missing(run, goal)
    ends = tr.iter_end
    counters = Counters()
    for sw in run.switches:
        counters.update(sw.counters)
    for node in run.net.nodes.values():
        if isinstance(node.engine, WorkerEngine | HostEngine):
            counters.update({f"host.{k}": v for k, v in node.engine.counters.items()})
    helps = counters.get("help_requests", 0)
    return TrainingResult(
        iteration_ns=[ends[0]] + [ends[i] - ends[i - 1] for i in range(1, len(ends))],
        end_ns=ends[-1],
        events=run.loop.events,
        wall_s=wall,
        counters=counters.as_dict(),
        help_requests=helps,
        helps_started=tr.helps_started,
        helps_declined=tr.helps_declined,
        help_compute_ns=tr.help_compute_ns,
        help_load_ns=tr.help_load_ns,
        replica_gb_per_worker=cfg.shard_gb * cfg.help.replicas
        if SCHEMES.get(cfg.scheme).helps
        else 0.0,
        results=run.results,
        inputs=run.inputs,
    )
