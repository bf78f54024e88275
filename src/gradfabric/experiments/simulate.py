"""``gradfabric simulate``: baselines on real models, checked against analytic bounds.

``mode: packet`` (the default) runs every packet (``sim.collective``);
``mode: flow`` runs the flow level (``sim.flow``) on ``clos`` (a fat-tree or
leaf-spine of any size; default: the packet level's ``fabric``), where
``stragglers`` of the workers compute ``slowdown`` times slower (ATP and ESA
wait for them; SA-ATP's helpers take their buckets over).

For every (model, scheme) two runs: an *iteration* (forward, then backward
with DDP-style buckets released as their gradients are ready, overlapping
communication) and a *communication-only* all-reduce of the whole model
(every gradient ready at t=0), which is what the analytic bounds describe:

* ring all-reduce: ``T = 2(n-1)/n * S/B + 2(n-1) * (2 * prop + t_pkt)``, with
  ``S`` the bytes on the wire (payload plus one header per packet) and
  ``t_pkt`` one packet's serialisation time;
* SwitchML: goodput ``min(B * payload/(payload + header), W * payload / RTT)``
  with ``RTT = 2 * (t_pkt + prop)`` (worker to switch and back).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gradfabric.core.errors import ConfigError
from gradfabric.proto.schemes import collective
from gradfabric.sim.collective import (
    Bucket,
    CollectiveResult,
    FabricConfig,
    InaConfig,
    run_collective,
)
from gradfabric.sim.flow import FLOW_SCHEMES, Clos, iteration_ns, plan, schedule, servers_of
from gradfabric.wire.packet import HEADER_BYTES, VALUE_BYTES, wire_bytes
from gradfabric.workloads.catalog import batch_load_ns, check_model, model_spec
from gradfabric.workloads.compute import Timeline, device, timeline
from gradfabric.workloads.trace import is_trace, trace_timeline


@dataclass(frozen=True)
class SimulateConfig:
    name: str = "baselines"
    models: tuple[str, ...] = ("resnet50", "vgg16")
    schemes: tuple[str, ...] = ("switchml", "atp", "ps", "ring")
    workers: int = 8
    batch: int = 32
    device: str = "v100"
    bucket_mb: float = 25.0
    seed: int = 0
    check_bounds: bool = True
    fabric: FabricConfig = field(default_factory=FabricConfig)
    ina: InaConfig = field(default_factory=InaConfig)
    mode: str = "packet"  # packet | flow
    clos: Clos | None = None  # flow mode's fabric (None: ``fabric`` as a Clos)
    stragglers: float = 0.0  # flow mode: the share of workers that straggle
    slowdown: float = 1.0  # ... this many times slower in compute
    load_gbps: float = 2.0  # a helper reads the straggler's batch at this rate (SA-ATP)
    # one stored training sample's bytes, which a helper reads (0: the catalog's
    # for its models; give it for a module or trace of your own, else help is free)
    sample_bytes: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("packet", "flow"):
            raise ConfigError("mode", f"unknown {self.mode!r}; valid: packet, flow")
        if self.mode == "packet" and (self.clos is not None or self.stragglers):
            raise ConfigError("clos", "clos and stragglers are the flow mode's (mode: flow)")
        if not 0 <= self.stragglers <= 1 or self.slowdown < 1 or self.load_gbps <= 0:
            raise ConfigError("stragglers", "stragglers in [0, 1], slowdown >= 1, load_gbps > 0")
        for m in self.models:
            if not is_trace(m):  # a recorded step: read when it runs (``workload``)
                check_model(m, "models")
        for s in self.schemes:
            if self.mode == "packet" or s not in FLOW_SCHEMES:
                collective(s, "schemes")
        device(self.device)
        if self.workers < 1 or self.batch < 1:
            raise ConfigError("workers", "workers and batch must be >= 1")


def packet_time_ns(ina: InaConfig, fabric: FabricConfig) -> float:
    size = HEADER_BYTES + VALUE_BYTES * ina.values_per_packet
    return size * 8 / fabric.link.link_gbps


def ring_bound_ns(n: int, values: int, ina: InaConfig, fabric: FabricConfig) -> float:
    link = fabric.link
    chunk_wire = wire_bytes(values, ina.values_per_packet) / n
    bw = 2 * (n - 1) * chunk_wire * 8 / link.link_gbps
    return bw + 2 * (n - 1) * (2 * link.prop_delay_ns + packet_time_ns(ina, fabric))


def switchml_bound_gbps(ina: InaConfig, fabric: FabricConfig, window: int) -> float:
    payload = VALUE_BYTES * ina.values_per_packet
    line = fabric.link.link_gbps * payload / (payload + HEADER_BYTES)
    rtt = 2 * (packet_time_ns(ina, fabric) + fabric.link.prop_delay_ns)
    return min(line, window * payload * 8 / rtt)


Tick = Callable[[str], None]


def _row(
    model: str, scheme: str, it: CollectiveResult, comm: CollectiveResult, compute_ns: int
) -> dict[str, Any]:
    iter_ns = max(compute_ns, it.end_ns)
    return {
        "model": model,
        "scheme": scheme,
        "workers": it.workers,
        "iteration_ms": iter_ns / 1e6,
        "compute_ms": compute_ns / 1e6,
        "comm_only_ms": comm.comm_ns / 1e6,
        "goodput_gbps": comm.goodput_gbps,
        "mem_util": comm.mem_util,
        "mem_held": comm.mem_held,
        "ps_fallback": comm.ps_fallback,
        "events": it.events + comm.events,
        "wall_s": it.wall_s + comm.wall_s,
    }


def run_simulate(cfg: SimulateConfig, tick: Tick | None = None) -> dict[str, Any]:
    tick = tick or (lambda _label: None)
    if cfg.mode == "flow":
        return {"rows": flow_rows(cfg, tick), "checks": []}
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for model in cfg.models:
        tl = workload(model, cfg)
        params = sum(b.values for b in tl.buckets)
        buckets = [Bucket(b.ready_ns, b.values) for b in tl.buckets]
        whole = [Bucket(0, params)]
        for scheme in cfg.schemes:
            tick(f"{model}/{scheme}")
            it = run_collective(scheme, cfg.workers, buckets, cfg.fabric, cfg.ina, cfg.seed)
            comm = run_collective(scheme, cfg.workers, whole, cfg.fabric, cfg.ina, cfg.seed)
            rows.append(_row(model, scheme, it, comm, tl.compute_ns))
            if not cfg.check_bounds:
                continue
            bound = BOUNDS.get(scheme)
            check = None if bound is None else bound(model, params, comm, cfg)
            if check is not None:
                checks.append(check)
    if cfg.check_bounds and "switchml" in cfg.schemes and cfg.fabric.topology == "star":
        # The window-limited regime: a window too small to fill the pipe, at
        # packet granularity whatever the config says (a train would blur RTT).
        small = replace(cfg.ina, switchml_slots=8, train_packets=1)
        values = min(sum(b.values for b in workload(cfg.models[0], cfg).buckets), 4_000_000)
        tick("window-limited switchml")
        r = run_collective(
            "switchml", cfg.workers, [Bucket(0, values)], cfg.fabric, small, cfg.seed
        )
        checks.append(
            _check(
                f"{values} values",
                "switchml goodput vs min(line, W*payload/RTT), W=8",
                r.goodput_gbps,
                switchml_bound_gbps(small, cfg.fabric, 8),
                "Gbit/s",
            )
        )
    return {"rows": rows, "checks": checks}


def workload(model: str, cfg: SimulateConfig) -> Timeline:
    """A model's step: from the catalog or a user's module (FLOPs at the
    device's rate, ``batch`` samples), or recorded (an execution trace)."""
    dev = device(cfg.device)
    if is_trace(model):
        return trace_timeline(model, dev, cfg.bucket_mb)
    return timeline(model_spec(model), cfg.batch, dev, cfg.bucket_mb)


def flow_fabric(cfg: SimulateConfig) -> Clos:
    """``clos`` if given, else ``fabric`` as a Clos; a star past the 64 ports
    a switch's bitmap has is the smallest fat-tree that holds the workers and
    the schemes' servers."""
    if cfg.clos is not None:
        return cfg.clos
    if cfg.fabric.topology == "star" and cfg.workers > 64:  # room for every scheme's servers
        servers = max(servers_of(s, cfg.workers, cfg.ina) for s in cfg.schemes)
        return Clos.holding(cfg.workers + servers, cfg.fabric.link)
    return Clos.of(cfg.fabric, cfg.workers)


def flow_rows(cfg: SimulateConfig, tick: Tick) -> list[dict[str, Any]]:
    """Every (model, scheme) at flow level: one iteration and the whole
    model's all-reduce alone, as packet level's rows (``sim.flow``)."""
    clos = flow_fabric(cfg)
    slow = round(cfg.stragglers * cfg.workers)
    rows: list[dict[str, Any]] = []
    for model in cfg.models:
        tl = workload(model, cfg)
        params = sum(b.values for b in tl.buckets)
        buckets = [Bucket(b.ready_ns, b.values) for b in tl.buckets]
        load_ns = batch_load_ns(model, cfg.batch, cfg.load_gbps, cfg.sample_bytes)
        for scheme in cfg.schemes:
            tick(f"{model}/{scheme} (flow)")
            t0 = time.perf_counter()
            p = plan(scheme, clos, cfg.workers, cfg.ina)
            it = iteration_ns(
                p, buckets, tl.compute_ns, [cfg.slowdown] * slow,
                helped=scheme == "saatp", help_delay_ns=load_ns,
            )  # fmt: skip
            comm = schedule(p, [Bucket(0, params)])
            rows.append({
                "model": model, "scheme": scheme, "workers": cfg.workers, "mode": "flow",
                "iteration_ms": it / 1e6, "compute_ms": tl.compute_ns / 1e6,
                "comm_only_ms": comm / 1e6, "goodput_gbps": params * 32 / comm,
                "stragglers": slow, "groups": p.groups,
                "wall_s": time.perf_counter() - t0,
            })  # fmt: skip
    return rows


def _ring_check(
    model: str, params: int, comm: CollectiveResult, cfg: SimulateConfig
) -> Check | None:
    bound = ring_bound_ns(cfg.workers, params, cfg.ina, cfg.fabric)
    return _check(model, "ring time vs 2(n-1)/n*S/B + latency", comm.comm_ns, bound, "ns")


def _switchml_check(
    model: str, params: int, comm: CollectiveResult, cfg: SimulateConfig
) -> Check | None:
    if cfg.fabric.topology != "star":  # the bound is a single switch's
        return None
    w = cfg.ina.switchml_slots
    return _check(
        model,
        f"switchml goodput vs min(line, W*payload/RTT), W={w}",
        comm.goodput_gbps,
        switchml_bound_gbps(cfg.ina, cfg.fabric, w),
        "Gbit/s",
    )


Check = dict[str, Any]
# The analytic bound each scheme's time is checked against (SwitchML's on a star).
BOUNDS: dict[str, Callable[[str, int, CollectiveResult, SimulateConfig], Check | None]] = {
    "ring": _ring_check,
    "switchml": _switchml_check,
}


def _check(subject: str, what: str, measured: float, bound: float, unit: str) -> dict[str, Any]:
    ratio = measured / bound
    return {
        "subject": subject,
        "check": what,
        "measured": measured,
        "bound": bound,
        "unit": unit,
        "ratio": ratio,
        "within_5pct": abs(ratio - 1) <= 0.05,
    }
