"""One all-reduce at packet level, alone in a process, for the flow-level
study (``experiments.flowlevel``; the flow level's side is ``lab.flowcell``):
its time, wall time and peak memory. A child's imports are the simulator's
only, so its peak memory is the run's.

``Pair`` is the study's cell and ``packet`` its stored record
(``core.cells``): it depends on this module and the packet level's sources
only, so a stored grid survives edits to the experiment that lays it out
and to the flow level, and a grown grid runs only its new cells."""

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


def packet(cell: Pair) -> dict[str, Any]:
    """``cell`` at packet level in a fresh interpreter: its time in ms (the
    mean over its seeds), events, wall time and peak memory. The study's
    stored cell: this module imports no flow level, so its records outlive
    edits of ``sim.flow`` (``core.cells.code_digest``)."""
    got = child(f"from gradfabric.lab.levels import alone; alone({json.dumps(args(cell))!r})")
    return {"packet_ms": got["ns"] / 1e6, "events": got["events"],
            "packet_wall_s": got["wall_s"], "packet_rss_mb": got["rss_mb"]}  # fmt: skip


def args(cell: Pair) -> list[Any]:
    """What a child needs of ``cell``, as plain data (``alone``'s ``args``)."""
    return [cell.scheme, cell.workers, cell.values, dump(cell.fabric), dump(cell.ina),
            cell.density, cell.seeds]  # fmt: skip


def child(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last line of output, as JSON."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{code}:\n{out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def alone(data: str) -> None:
    """One all-reduce at packet level, alone in this process (its imports
    the simulator's only); prints its time (the mean over ``seeds`` runs),
    events and wall time (both summed over the runs) and the process's peak
    resident memory as one JSON line. ``data``: ``args``'s list as JSON."""
    import time

    from gradfabric.core.config import load
    from gradfabric.sim.collective import run_collective

    scheme, workers, values, fabric_data, ina_data, density, seeds = json.loads(data)
    fabric, ina = load(FabricConfig, fabric_data), load(InaConfig, ina_data)
    t0 = time.perf_counter()
    runs = [run_collective(scheme, workers, [Bucket(0, values)], fabric, ina, seed,
                           density=density) for seed in range(seeds)]  # fmt: skip
    wall = time.perf_counter() - t0
    ns = sum(float(r.end_ns - r.start_ns) for r in runs) / seeds
    events = sum(r.events for r in runs)
    print(json.dumps({"ns": ns, "events": events, "wall_s": wall, "rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory since it began its program
    (``VmHWM``: unlike ``ru_maxrss`` it does not carry the parent's peak
    across ``fork`` and ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")
