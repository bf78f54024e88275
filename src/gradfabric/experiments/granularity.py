"""Coarse granularity (packet trains): its error at 64 workers, its speed at 1024.

At 64 workers (two racks of 32 under a leaf-spine, hierarchical SwitchML) the
same all-reduce runs at packet granularity and with trains of 8 and 64
packets; the error is the relative difference in completion time. Then a
1024-worker SwitchML ResNet-50 iteration (32 racks of 32, 4 spines) runs with
64-packet trains and its wall time is reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradfabric.core.config import dump
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig, run_collective
from gradfabric.sim.network import LinkSpec
from gradfabric.workloads.catalog import model_spec
from gradfabric.workloads.compute import device, timeline

FABRIC = FabricConfig(
    topology="leaf_spine",
    hosts_per_rack=32,
    spines=4,
    link=LinkSpec(link_gbps=100.0, prop_delay_ns=500, queue_bytes=2_000_000),
)


def error_at_64(values: int, trains: tuple[int, ...], tick: Tick) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base = None
    for t in (1, *trains):
        tick(f"64 workers, train {t}")
        r = run_collective(
            "switchml",
            64,
            [Bucket(0, values)],
            FABRIC,
            InaConfig(train_packets=t, switchml_slots=128),
        )
        base = base or r.comm_ns
        rows.append(
            {
                "workers": 64,
                "values": values,
                "train_packets": t,
                "comm_ms": r.comm_ns / 1e6,
                "rel_error": r.comm_ns / base - 1,
                "events": r.events,
                "wall_s": r.wall_s,
            }
        )
    return rows


def iteration_1024(train: int, tick: Tick) -> dict[str, Any]:
    tick(f"1024 workers, train {train}")
    spec = model_spec("resnet50")
    tl = timeline(spec, 32, device("v100"))
    buckets = [Bucket(b.ready_ns, b.values) for b in tl.buckets]
    r = run_collective(
        "switchml", 1024, buckets, FABRIC, InaConfig(train_packets=train, switchml_slots=128)
    )
    return {
        "workers": 1024,
        "model": "resnet50",
        "train_packets": train,
        "iteration_ms": max(tl.compute_ns, r.end_ns) / 1e6,
        "events": r.events,
        "wall_s": r.wall_s,
    }


class Granularity:
    name = "granularity"
    title = "Simulation granularity: packet trains at 64 and 1024 workers"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        values = 2_000_000 if quick else model_spec("resnet50").params
        rows = error_at_64(values, (8, 64), tick)
        big = iteration_1024(64, tick)
        r = ExperimentResult(
            self.name,
            self.title,
            rows=[*rows, big],
            config={
                "fabric": dump(FABRIC),
                "values_at_64": values,
                "trains": [1, 8, 64],
                "workers_large": 1024,
                "train_large": 64,
            },
        )
        worst = max(abs(x["rel_error"]) for x in rows if x["train_packets"] == 64)
        r.claims.append(
            Claim(
                "simulator", "64-packet trains change 64-worker completion time by little",
                "sim", "packet level", f"{worst:.2%} error", "< 5%", worst < 0.05,
                kind="goal", note=f"{values} values",
            )
        )
        r.claims.append(
            Claim(
                "simulator",
                "1024-worker SwitchML ResNet-50 iteration on a leaf-spine in under 60 s wall",
                "sim", "", f"{big['wall_s']:.1f} s", "< 60 s", big["wall_s"] < 60, kind="goal",
            )
        )
        r.plots.append(
            plots.lines(
                [float(x["train_packets"]) for x in rows],
                {"relative error": [x["rel_error"] for x in rows]},
                "packets per simulated train",
                "completion-time error",
                "Train granularity error, 64 workers",
                out / "granularity.png",
                logx=True,
            ).name
        )
        return r


EXPERIMENTS.add("granularity", Granularity())
