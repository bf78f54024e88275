"""One all-reduce at flow level, alone in a process, beside its packet level
(``lab.levels``): the flow-level study's row. The flow level takes well
under a second a cell, so it runs afresh each time, while packet level's
records (hours, at 1,024 workers and past) are stored."""

from __future__ import annotations

import json
from typing import Any

from gradfabric.lab.levels import Pair, args, child, packet, peak_rss_mb
from gradfabric.wire.packet import VALUE_BYTES


def both(cell: Pair, stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """``cell``'s row of the study's table: packet level (``stored``, else
    run now) and flow level, each from a fresh interpreter; the error is
    the flow level's relative to packet level's."""
    ref = stored if stored is not None else packet(cell)
    got = child(f"from gradfabric.lab.flowcell import alone; alone({json.dumps(args(cell))!r})")
    flow_ms = got["ns"] / 1e6
    return {
        "case": f"{cell.values * VALUE_BYTES / 2**20:g} MB all-reduce", "scheme": cell.scheme,
        "workers": cell.workers, "topology": cell.where, "density": cell.density,
        "packet_ms": ref["packet_ms"], "flow_ms": flow_ms,
        "error": flow_ms / ref["packet_ms"] - 1, "train_packets": cell.ina.train_packets,
        "seeds": cell.seeds, "events": ref["events"], "packet_wall_s": ref["packet_wall_s"],
        "flow_wall_s": got["wall_s"], "packet_rss_mb": ref["packet_rss_mb"],
        "flow_rss_mb": got["rss_mb"],
    }  # fmt: skip


def alone(data: str) -> None:
    """One all-reduce at flow level, alone in this process (its imports the
    simulator's only); prints its time, wall time and the process's peak
    resident memory as one JSON line. ``data``: ``levels.args``'s list."""
    import time

    from gradfabric.core.config import load
    from gradfabric.proto.schemes import InaConfig
    from gradfabric.sim.collective import Bucket, FabricConfig
    from gradfabric.sim.flow import Clos, plan, schedule

    scheme, workers, values, fabric_data, ina_data, density, _seeds = json.loads(data)
    fabric, ina = load(FabricConfig, fabric_data), load(InaConfig, ina_data)
    t0 = time.perf_counter()
    p = plan(scheme, Clos.of(fabric, workers), workers, ina, density)
    ns = schedule(p, [Bucket(0, values)])
    wall = time.perf_counter() - t0
    print(json.dumps({"ns": ns, "wall_s": wall, "rss_mb": peak_rss_mb()}))
