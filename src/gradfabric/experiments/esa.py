"""ESA: average and p99 job completion time against pool size and load.

ESA, ATP and SwitchML static partitioning run the same job trace (seeded
Poisson arrivals of ResNet-50 and BERT-base jobs of 4 or 8 workers) on one
rack whose ToR pool all jobs share. ``mem_util`` is the share of pool-time
spent aggregating; ``mem_held`` the share held by some job (aggregating, or
waiting for the PS result, or reserved).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradfabric.experiments import plots
from gradfabric.experiments.config import dump
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.sim.multijob import TENANCY_SCHEMES, TenancyConfig, run_tenancy


@dataclass(frozen=True)
class EsaGrid:
    pool_slots: tuple[int, ...] = (256, 512, 1024, 4096)
    loads: tuple[float, ...] = (0.5, 0.7, 0.9)
    schemes: tuple[str, ...] = TENANCY_SCHEMES
    jobs: int = 12
    seed: int = 0

    @classmethod
    def quick(cls) -> EsaGrid:
        return cls(pool_slots=(512, 4096), loads=(0.7,), jobs=8)


def run_grid(grid: EsaGrid, tick: Tick) -> list[dict[str, Any]]:
    rows = []
    for pool in grid.pool_slots:
        for load in grid.loads:
            for scheme in grid.schemes:
                tick(f"pool {pool}, load {load:g}, {scheme}")
                cfg = TenancyConfig(
                    scheme=scheme, pool_slots=pool, load=load, jobs=grid.jobs, seed=grid.seed
                )
                r = run_tenancy(cfg)
                rows.append(
                    {
                        "scheme": scheme,
                        "pool_slots": pool,
                        "load": load,
                        "jobs": len(r.jobs),
                        "avg_jct_s": r.avg_jct_s,
                        "p99_jct_s": r.p99_jct_s,
                        "mem_util": r.mem_util,
                        "mem_held": r.mem_held,
                        "wall_s": r.wall_s,
                        "preemptions": r.counters.get("preemptions", 0),
                        "ps_collisions": r.counters.get("ps_collision", 0),
                    }
                )
    return rows


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    atp = {(r["pool_slots"], r["load"]): r for r in rows if r["scheme"] == "atp"}
    out = []
    for r in rows:
        base = atp.get((r["pool_slots"], r["load"]))
        if r["scheme"] == "esa" and base is not None:
            out.append(
                {
                    "pool_slots": r["pool_slots"],
                    "load": r["load"],
                    "atp_avg_jct_s": base["avg_jct_s"],
                    "esa_avg_jct_s": r["avg_jct_s"],
                    "improvement": base["avg_jct_s"] / r["avg_jct_s"],
                    "atp_p99_jct_s": base["p99_jct_s"],
                    "esa_p99_jct_s": r["p99_jct_s"],
                }
            )
    return out


class Esa:
    name = "esa"
    title = "ESA: preemptive, priority-scheduled switch memory"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        grid = EsaGrid.quick() if quick else EsaGrid()
        rows = run_grid(grid, tick)
        cmp = compare(rows)
        r = ExperimentResult(
            self.name,
            self.title,
            rows=cmp + rows,
            config={"grid": dump(grid), "tenancy": dump(TenancyConfig())},
        )
        best = max(cmp, key=lambda c: c["improvement"])
        worst = min(cmp, key=lambda c: c["improvement"])
        where = "pool {pool_slots}, load {load:g}"
        r.claims.append(
            Claim(
                "ESA",
                "average JCT better than ATP by up to",
                "1.35x",
                f"{best['improvement']:.2f}x",
                best["improvement"] / 1.35,
                where.format(**best),
            )
        )
        r.claims.append(
            Claim(
                "ESA",
                "never worse than ATP by more than 3% (avg JCT)",
                ">= 0.97x",
                f"{worst['improvement']:.3f}x",
                worst["improvement"] / 0.97,
                where.format(**worst),
            )
        )
        load = grid.loads[-1]
        pools = [float(p) for p in grid.pool_slots]
        series = {
            s: [
                next(
                    x["avg_jct_s"]
                    for x in rows
                    if x["scheme"] == s and x["pool_slots"] == p and x["load"] == load
                )
                * 1e3
                for p in grid.pool_slots
            ]
            for s in grid.schemes
        }
        r.plots.append(
            plots.lines(
                pools,
                series,
                "pool size (aggregators)",
                "average JCT (ms)",
                f"Average JCT, load {load:g}",
                out / "esa_jct.png",
                logx=True,
            ).name
        )
        r.notes.append(
            "A simulated aggregator stands for a train of "
            f"{TenancyConfig().ina.train_packets} real ones; pool sizes are in real "
            "aggregators (256-value packets)."
        )
        return r


EXPERIMENTS.add("esa", Esa())
