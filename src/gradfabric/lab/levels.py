"""One all-reduce at one simulator level, alone in a process, for the
flow-level study's wall-time and memory figures (``experiments.flowlevel``):
its imports are the simulator's only, so its peak memory is the run's."""

from __future__ import annotations

from pathlib import Path

from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig
from gradfabric.sim.flow import Clos, plan, schedule


def alone(args: str) -> None:
    """One all-reduce at one level (``packet`` or ``flow``), alone in this
    process (its imports the simulator's only); prints its time, wall time
    and the process's peak resident memory as one JSON line. ``args``: JSON
    ``[level, scheme, workers, values, FabricConfig, InaConfig]`` (plain data)."""
    import json
    import time

    from gradfabric.core.config import load
    from gradfabric.sim.collective import run_collective

    level, scheme, workers, values, fabric_data, ina_data = json.loads(args)
    fabric, ina = load(FabricConfig, fabric_data), load(InaConfig, ina_data)
    buckets = [Bucket(0, values)]
    t0 = time.perf_counter()
    if level == "packet":
        r = run_collective(scheme, workers, buckets, fabric, ina)
        ns = float(r.end_ns - r.start_ns)
    else:
        ns = schedule(plan(scheme, Clos.of(fabric, workers), workers, ina), buckets)
    wall = time.perf_counter() - t0
    print(json.dumps({"ns": ns, "wall_s": wall, "rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory since it began its program
    (``VmHWM``: unlike ``ru_maxrss`` it does not carry the parent's peak
    across ``fork`` and ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")
