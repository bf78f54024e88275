"""How fast the simulator runs: the compiled hot path beside the pure-Python
one, and events per second against workers.

Both paths run the same sources (pip builds the hot path with mypyc,
``setup.py``; ``GRADFABRIC_PURE=1`` makes a process import the ``.py`` files
instead). A process has one path for its lifetime, so each measurement runs
in a child process of its own (``child``)
and the two paths alternate, repeat after repeat, in one run.

The scaling table holds the simulated work per run roughly constant: at ``w``
workers packet trains of ``max(1, w // 8)`` packets (8 workers: packet
level). SwitchML runs on a star up to 32 workers and on a leaf-spine (racks
of 32, 4 spines, hierarchical aggregation) above; ATP's rows are on one
switch (a star of up to 64 workers, one bitmap word); its two levels past
that are timed in the flow-level study (``experiments.flowlevel``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradfabric import _build
from gradfabric.core.errors import ConfigError
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig, run_collective
from gradfabric.workloads.catalog import model_spec
from gradfabric.workloads.compute import device, timeline

PATHS = ("mypyc", "python")
GOAL_EVENTS_PER_S = 1_000_000


@dataclass(frozen=True)
class SpeedCase:
    scheme: str = "atp"
    model: str = "resnet50"
    workers: int = 8
    train_packets: int = 1

    @property
    def fabric(self) -> FabricConfig:
        """A star up to 32 workers, a leaf-spine above; ATP's rows a star (its
        rows stop at 64: one switch)."""
        star = self.scheme == "atp" or self.workers <= 32
        return FabricConfig(topology="star" if star else "leaf_spine")


SCALING = (
    *(SpeedCase("switchml", "resnet50", w, max(1, w // 8)) for w in (8, 64, 256, 1024)),
    *(SpeedCase("atp", "resnet50", w, max(1, w // 8)) for w in (8, 64)),
)


def granularity(train_packets: int) -> str:
    return "packet" if train_packets == 1 else f"{train_packets}-packet trains"


def measure(case: SpeedCase) -> dict[str, Any]:
    """One iteration's all-reduce of ``case.model``'s gradients, in this process."""
    tl = timeline(model_spec(case.model), 32, device("v100"))
    buckets = [Bucket(b.ready_ns, b.values) for b in tl.buckets]
    fabric = case.fabric
    r = run_collective(
        case.scheme, case.workers, buckets, fabric, InaConfig(train_packets=case.train_packets)
    )
    return {
        **asdict(case),
        "path": _build.compiled_path(),
        "topology": fabric.topology,
        "events": r.events,
        "wall_s": r.wall_s,
        "events_per_s": r.events / r.wall_s,
        "simulated_ms": r.comm_ns / 1e6,
    }


def measure_on(path: str, case: SpeedCase) -> dict[str, Any]:
    """``measure`` in a child process that runs ``path`` (``mypyc`` or ``python``)."""
    env = dict(os.environ)
    env.pop("GRADFABRIC_PURE", None)
    if path == "python":
        env["GRADFABRIC_PURE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gradfabric.experiments.simspeed import child; "
         "child(sys.argv[1])", json.dumps(asdict(case))],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"simulator speed run on {path} failed:\n{out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if row["path"] != path:
        raise ConfigError(
            "paths", f"asked for the {path} path but the child ran {row['path']} "
            "(nothing compiled? run: pip install -e .)",
        )  # fmt: skip
    return row


def available_paths() -> tuple[str, ...]:
    """The paths this checkout can run: ``python`` always, ``mypyc`` once built
    and current (whichever path this process itself runs)."""
    built = _build.fresh(Path(_build.__file__).parent)
    return PATHS if built else ("python",)


def side_by_side(
    case: SpeedCase, repeats: int, paths: tuple[str, ...], tick: Tick
) -> dict[str, Any]:
    """Each path ``repeats`` times, alternating; medians and their ratio."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for i in range(repeats):
        for p in paths:
            tick(f"{p} run {i + 1}/{repeats}")
            runs[p].append(measure_on(p, case))
    eps = {p: statistics.median(r["events_per_s"] for r in runs[p]) for p in paths}
    res: dict[str, Any] = {
        **asdict(case),
        "granularity": granularity(case.train_packets),
        "repeats": repeats,
        "events": runs[paths[0]][0]["events"],
        "events_per_s": eps,
        "wall_s": {p: [r["wall_s"] for r in runs[p]] for p in paths},
    }
    if "mypyc" in eps and "python" in eps:
        res["compiled_vs_python"] = eps["mypyc"] / eps["python"]
    return res


def scaling(tick: Tick, cases: tuple[SpeedCase, ...] = SCALING) -> list[dict[str, Any]]:
    """The scaling table, on this process's path."""
    rows = []
    for c in cases:
        tick(f"{c.scheme} {c.workers} workers")
        rows.append(measure(c))
    return rows


class SimSpeed:
    name = "simspeed"
    title = "Simulator speed: compiled vs pure Python, and against workers"
    main_job = False  # a check of the simulator's own speed: its own command

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        case = SpeedCase()
        speed = side_by_side(case, 1 if quick else 3, available_paths(), tick)
        rows = scaling(tick)
        flat = {k: v for k, v in speed.items() if k not in ("events_per_s", "wall_s")}
        flat |= {f"{p}_events_per_s": v for p, v in speed["events_per_s"].items()}
        r = ExperimentResult(
            self.name, self.title, rows=[flat, *rows],
            config={"case": asdict(case), "scaling": [asdict(c) for c in SCALING]},
        )  # fmt: skip
        eps = speed["events_per_s"]
        best = max(eps, key=lambda p: eps[p])
        r.claims.append(
            Claim(
                "simulator", "8-worker ATP ResNet-50 iteration, packet level: events per wall "
                "second", "sim", "", f"{eps[best]:,.0f} ({best})", f">= {GOAL_EVENTS_PER_S:,}",
                eps[best] >= GOAL_EVENTS_PER_S, kind="goal",
                note=", ".join(f"{p} {v:,.0f}" for p, v in eps.items())
                + (f"; compiled/python {speed['compiled_vs_python']:.2f}x"
                   if "compiled_vs_python" in speed else "; nothing compiled"),
            )
        )  # fmt: skip
        workers = sorted({x["workers"] for x in rows})
        kilo = {(x["scheme"], x["workers"]): x["events_per_s"] / 1e3 for x in rows}
        r.plots.append(
            plots.lines(
                [float(w) for w in workers],
                {
                    f"{scheme} (thousands)": [kilo.get((scheme, w), math.nan) for w in workers]
                    for scheme in ("switchml", "atp")
                },
                "workers (trains of workers/8 packets)",
                "events per wall second",
                f"Simulator speed, ResNet-50 iteration ({rows[0]['path']} path)",
                out / "simspeed.png",
                logx=True,
            ).name
        )
        r.notes.append(
            f"scaling rows ran on the {rows[0]['path']} path; trains of max(1, workers // 8) "
            "packets keep the simulated work per run roughly constant"
        )
        return r


EXPERIMENTS.add("simspeed", SimSpeed())


def child(case_json: str) -> None:
    """What ``measure_on`` runs: one measurement, printed as one JSON line."""
    print(json.dumps(measure(SpeedCase(**json.loads(case_json)))))


def bare_loop(events: int = 1_000_000, live: int = 64) -> float:
    """Events per second of the event heap alone (this process's path),
    ``live`` events pending as a window of packets in flight, each event's
    callback one interpreted function that schedules the next: the most any
    run can reach with a callback per event."""
    from gradfabric.sim.loop import EventLoop

    loop = EventLoop()

    def tick(i: int) -> None:
        if i < events:
            loop.push(loop.now + 100 + (i * 7919) % 1000, tick, i + live)

    for i in range(live):
        loop.at(i, tick, i)
    t0 = time.perf_counter()
    loop.run()
    return loop.events / (time.perf_counter() - t0)


def profile(case: SpeedCase, top: int = 12) -> list[dict[str, Any]]:
    """Where a run's time goes, by function: ``case`` on the pure-Python
    path (its functions are visible to ``cProfile``; the compiled path runs
    the same sources, each faster), in a child process; the ``top`` by own
    time, with their share of the run."""
    env = dict(os.environ, GRADFABRIC_PURE="1")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gradfabric.experiments.simspeed import "
         "profile_child; profile_child(sys.argv[1], int(sys.argv[2]))",
         json.dumps(asdict(case)), str(top)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"profiled simulator run failed:\n{out.stderr[-2000:]}")
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def profile_child(case_json: str, top: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(measure, SpeedCase(**json.loads(case_json)))
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    rows = [
        {"function": f"{Path(f).name}:{line} {name}", "calls": int(v[1]),
         "own_s": v[2], "share": v[2] / total}
        for (f, line, name), v in stats.items()
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["own_s"])
    print(json.dumps(rows[:top]))
