"""ESA carrying real training jobs (``emu.esa_train``): seeded traces of
jobs sharing one switch daemon, ATP against ESA, where the pool is scarce
(two jobs' windows overfill it) and where it is ample; the simulator's JCT
for the same trace beside each. Quick: 3 traces per setting; full: 10."""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.core.stats import mean_ci
from gradfabric.emu.esa_train import (
    AGING_S,
    POLICIES,
    EsaTrainConfig,
    run_trace,
    trace,
)
from gradfabric.emu.job import DAEMON, MODEL
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick, reaches
from gradfabric.proto.schemes import InaConfig
from gradfabric.sim.multijob import TenancyConfig, run_tenancy


def simulated(cfg: EsaTrainConfig, policy: str) -> dict[str, float]:
    """The simulator's mean and p99 JCT for the same trace (jobs, arrivals,
    model, device time, pool, window and packet size; a 100 Gbit/s star)."""
    jobs = trace(cfg)
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as f:
        f.write("".join(f"{j.arrival_s},{MODEL},{j.workers},{j.steps}\n" for j in jobs))
        f.flush()
        tc = TenancyConfig(
            scheme=policy, pool_slots=cfg.pool_slots, hosts=max(8, sum(j.workers for j in jobs)),
            trace_file=f.name, workers_choices=(2, 3), batch=jobs[0].micro_batch,
            compute_ms=cfg.compute_ms, seed=cfg.seed, aging_s=AGING_S,
            ina=InaConfig(values_per_packet=DAEMON.values_per_packet, train_packets=1,
                          atp_window=cfg.window, rto_ns=DAEMON.rto_ns),
        )  # fmt: skip
        r = run_tenancy(tc)
    return {"mean_jct_s": r.avg_jct_s, "p99_jct_s": r.p99_jct_s}


SETTINGS = {"scarce": 40, "ample": 4096}  # pool slots


def study(
    cfg: EsaTrainConfig, seeds: int, settings: dict[str, int] = SETTINGS, tick: Any = None
) -> dict[str, Any]:
    """Each setting's traces (``seeds`` of them) under ATP and ESA, the
    policies alternating first; ESA's speed-up of the mean and p99 JCT over
    ATP's, mean over traces with the 95% interval."""
    rows = []
    for name, slots in settings.items():
        ratios: dict[str, list[float]] = {"mean": [], "p99": []}
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for seed in range(seeds):
            c = replace(cfg, pool_slots=slots, seed=cfg.seed + seed)
            for policy in POLICIES if seed % 2 == 0 else POLICIES[::-1]:
                if tick:
                    tick(f"{name} pool: {policy}, trace {seed + 1}/{seeds}")
                runs[policy].append(run_trace(c, policy) | {"sim": simulated(c, policy)})
            atp, esa = runs["atp"][-1], runs["esa"][-1]
            ratios["mean"].append(atp["mean_jct_s"] / esa["mean_jct_s"])
            ratios["p99"].append(atp["p99_jct_s"] / esa["p99_jct_s"])
        for policy, rs in runs.items():
            rows.append({
                "setting": name, "pool_slots": slots, "policy": policy,
                "mean_jct_s": statistics.fmean(r["mean_jct_s"] for r in rs),
                "p99_jct_s": statistics.fmean(r["p99_jct_s"] for r in rs),
                "sim_mean_jct_s": statistics.fmean(r["sim"]["mean_jct_s"] for r in rs),
                "sim_p99_jct_s": statistics.fmean(r["sim"]["p99_jct_s"] for r in rs),
                "exact": all(j["exact"] for r in rs for j in r["jobs"]),
                "preemptions": sum(r["counters"].get("preemptions", 0) for r in rs),
                "ps_fallback": sum(r["counters"].get("ps_resend", 0)
                                   + r["counters"].get("flush_partial", 0) for r in rs),
            })  # fmt: skip
        sim = (
            [r["sim"]["mean_jct_s"] for r in runs["atp"]],
            [r["sim"]["mean_jct_s"] for r in runs["esa"]],
        )
        m, p = mean_ci(ratios["mean"]), mean_ci(ratios["p99"])
        rows.append({"setting": name, "pool_slots": slots, "policy": "esa/atp",
                     "mean_jct_speedup": m.mean, "mean_jct_speedup_half": m.half,
                     "p99_jct_speedup": p.mean, "p99_jct_speedup_half": p.half,
                     "sim_mean_jct_speedup": statistics.fmean(
                         a / e for a, e in zip(*sim, strict=True))})  # fmt: skip
    return {"rows": rows, "config": asdict(cfg) | {"seeds": seeds, "settings": settings}}


def claims(res: dict[str, Any]) -> list[Claim]:
    out = []
    for r in res["rows"]:
        if r["policy"] != "esa/atp":
            continue
        atp, esa = (next(x for x in res["rows"] if x["setting"] == r["setting"]
                         and x["policy"] == p) for p in ("atp", "esa"))  # fmt: skip
        out.append(Claim(
            "ESA", f"average JCT of real training jobs, {r['setting']} pool "
            f"({r['pool_slots']} aggregators)", "training",
            "ATP through the same daemon (PS fallback sharded per worker, merge charged)",
            f"{r['mean_jct_speedup']:.2f}x ± {r['mean_jct_speedup_half']:.2f}", "1.35x",
            reaches(r["mean_jct_speedup"], 1.35), speedup=r["mean_jct_speedup"],
            headline=r["setting"] == "scarce",
            note=f"{res['config']['seeds']} seeded traces of {res['config']['jobs']} jobs; mean "
            f"JCT {esa['mean_jct_s'] * 1e3:.0f} vs {atp['mean_jct_s'] * 1e3:.0f} ms, p99 "
            f"{r['p99_jct_speedup']:.2f}x ± {r['p99_jct_speedup_half']:.2f}; simulated "
            f"{r['sim_mean_jct_speedup']:.2f}x; every job's loss curve equal to its solo "
            f"replay: {atp['exact'] and esa['exact']}; preemptions {esa['preemptions']}",
        ))  # fmt: skip
    return out


def draw(res: dict[str, Any], out: Path) -> str:
    rows = [r | {"measured": r["mean_jct_s"] * 1e3, "simulated": r["sim_mean_jct_s"] * 1e3}
            for r in res["rows"] if r["policy"] in POLICIES]  # fmt: skip
    return plots.grouped_bars(
        rows, "setting", "policy", "measured", "mean JCT (ms)",
        "real jobs through one switch: ATP vs ESA (black: simulated)",
        out / "esa_train_jct.png", mark="simulated",
    ).name  # fmt: skip


class EsaTrain:
    name = "esa-train"
    title = "ESA with real training jobs sharing one switch daemon"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        res = study(EsaTrainConfig(), seeds=3 if quick else 10, tick=tick)
        result = ExperimentResult(self.name, self.title, rows=res["rows"], config=res["config"])
        result.claims += claims(res)
        result.plots.append(draw(res, out))
        return result


EXPERIMENTS.add("esa-train", EsaTrain())
