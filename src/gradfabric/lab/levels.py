"""One all-reduce at both simulator levels, each alone in a process, for the
flow-level study (``experiments.flowlevel``): the levels' times, wall times
and peak memory. A child's imports are the simulator's only, so its peak
memory is the run's.

``Pair`` is the study's cell (``core.cells``): its record depends on this
module and the simulator's sources only, so a stored grid survives edits to
the experiment that lays it out, and a grown grid runs only its new cells."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradfabric.core.config import dump
from gradfabric.core.errors import ConfigError
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig
from gradfabric.sim.flow import Clos, plan, schedule
from gradfabric.wire.packet import VALUE_BYTES


def named(scheme: str, density: float = 1.0) -> str:
    """A scheme as the study's table names it (OmniReduce with its density)."""
    return scheme + (f" at density {density:g}" if density < 1 else "")


@dataclass(frozen=True)
class Pair:
    """One all-reduce of ``values`` by ``scheme`` over ``workers`` on
    ``fabric`` (``where`` names it in the study's table), its non-zero
    block share ``density`` (OmniReduce). Packet level runs it ``seeds``
    times (seeds 0, 1, ...) and takes the mean: where the seed draws the
    work (which blocks are non-zero) the flow level prices the expectation."""

    scheme: str
    workers: int
    fabric: FabricConfig
    ina: InaConfig
    values: int
    where: str
    density: float = 1.0
    seeds: int = 1

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ConfigError("seeds", f"must be >= 1, got {self.seeds}")
        if not 0 <= self.density <= 1:
            raise ConfigError("density", f"must be in [0, 1], got {self.density}")

    @property
    def label(self) -> str:
        return f"{named(self.scheme, self.density)}, {self.workers} on a {self.where}"


def both(cell: Pair) -> dict[str, Any]:
    """``cell`` at packet and at flow level, each in a fresh interpreter;
    the row of the study's table (packet level the reference)."""
    args = [cell.scheme, cell.workers, cell.values, dump(cell.fabric), dump(cell.ina),
            cell.density, cell.seeds]  # fmt: skip
    run = "from gradfabric.lab.levels import alone; alone({!r})"
    got = {level: child(run.format(json.dumps([level, *args]))) for level in ("packet", "flow")}
    packet, flow = got["packet"], got["flow"]
    return {
        "case": f"{cell.values * VALUE_BYTES / 2**20:g} MB all-reduce", "scheme": cell.scheme,
        "workers": cell.workers,
        "topology": cell.where, "density": cell.density, "packet_ms": packet["ns"] / 1e6,
        "flow_ms": flow["ns"] / 1e6, "error": flow["ns"] / packet["ns"] - 1,
        "train_packets": cell.ina.train_packets, "seeds": cell.seeds, "events": packet["events"],
        "packet_wall_s": packet["wall_s"], "flow_wall_s": flow["wall_s"],
        "packet_rss_mb": packet["rss_mb"], "flow_rss_mb": flow["rss_mb"],
    }  # fmt: skip


def child(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last line of output, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{code}:\n{out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def alone(args: str) -> None:
    """One all-reduce at one level (``packet`` or ``flow``), alone in this
    process (its imports the simulator's only); prints its time (packet
    level: the mean over ``seeds`` runs), events, wall time (both summed
    over the runs) and the process's peak resident memory as one JSON line.
    ``args``: JSON ``[level, scheme, workers, values, FabricConfig,
    InaConfig, density, seeds]`` (plain data)."""
    import time

    from gradfabric.core.config import load
    from gradfabric.sim.collective import run_collective

    level, scheme, workers, values, fabric_data, ina_data, density, seeds = json.loads(args)
    fabric, ina = load(FabricConfig, fabric_data), load(InaConfig, ina_data)
    buckets = [Bucket(0, values)]
    t0 = time.perf_counter()
    events = 0
    if level == "packet":
        runs = [run_collective(scheme, workers, buckets, fabric, ina, seed, density=density)
                for seed in range(seeds)]  # fmt: skip
        ns = sum(float(r.end_ns - r.start_ns) for r in runs) / seeds
        events = sum(r.events for r in runs)
    else:
        ns = schedule(plan(scheme, Clos.of(fabric, workers), workers, ina, density), buckets)
    wall = time.perf_counter() - t0
    print(json.dumps({"ns": ns, "events": events, "wall_s": wall, "rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory since it began its program
    (``VmHWM``: unlike ``ru_maxrss`` it does not carry the parent's peak
    across ``fork`` and ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")
