"""OmniReduce: streaming sparse aggregation in the simulator, and real DDP
training of an embedding-heavy model with the sparse hook.

1. Simulator: one tensor all-reduced by OmniReduce's streaming engines, ring
   all-reduce and SwitchML on the same block-sparse tensors (8 workers, 100
   Gbit/s star), across densities; every result checked against the int64
   sum. The bound for OmniReduce is each worker's downlink carrying the union
   of non-zero blocks once.
2. Training: NeuMF on the synthetic click log, DDP on gloo processes launched
   with torchrun, each rank in a network namespace behind a 1 Gbit/s tbf link
   (loopback where namespaces are unavailable, said so in the notes), default
   hook and ``omnireduce_hook`` side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick, reaches
from gradfabric.lab.sparse_e2e import E2EConfig, run_e2e
from gradfabric.net.netns import usable
from gradfabric.proto.omni import block_mask
from gradfabric.sim.collective import Bucket, run_collective
from gradfabric.wire.packet import HEADER_BYTES

SIM_SCHEMES = ("ring", "switchml", "omnireduce")
E2E_KEYS = (
    "default_ms",
    "sparse-embedding_ms",
    "omnireduce_ms",
    "rows_ms",
    "rows_vs_sparse_embedding",
    "rows_loss_diff",
    "speedup",
    "speedup_vs_sparse_embedding",
    "sparse_embedding_loss_diff",
    "max_loss_diff",
    "weights_max_diff",
    "replica_spread",
    "bytes_ratio",
    "density_median",
    "grad_mb",
)


@dataclass(frozen=True)
class OmniGrid:
    densities: tuple[float, ...] = (1.0, 0.4, 0.2, 0.1, 0.04, 0.01)
    workers: int = 8
    values: int = 4_000_000
    seed: int = 0

    @classmethod
    def quick(cls) -> OmniGrid:
        return cls(densities=(1.0, 0.1, 0.01), values=1_000_000)


def run_sim(grid: OmniGrid, tick: Tick) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for d in grid.densities:
        for scheme in SIM_SCHEMES:
            tick(f"simulate {scheme}, density {d:g}")
            res = run_collective(
                scheme, grid.workers, [Bucket(0, grid.values)], seed=grid.seed, values=True,
                density=d,
            )  # fmt: skip
            assert res.inputs is not None and res.results is not None
            ref = np.sum([x.astype(np.int64) for x in res.inputs], axis=0)
            union = int(np.logical_or.reduce([block_mask(x, 256) for x in res.inputs]).sum())
            rows.append(
                {
                    "scheme": scheme,
                    "density": d,
                    "comm_us": res.comm_ns / 1e3,
                    "exact": all(np.array_equal(x, ref) for x in res.results),
                    # OmniReduce's floor: the union crosses each worker's downlink once
                    "union_bound_us": union * (1024 + HEADER_BYTES) * 8 / 100.0 / 1e3,
                }
            )
    ring = {r["density"]: r["comm_us"] for r in rows if r["scheme"] == "ring"}
    for r in rows:
        r["speedup_vs_ring"] = ring[r["density"]] / r["comm_us"]
    return rows


class OmniReduce:
    name = "omnireduce"
    title = "OmniReduce: sparse all-reduce, simulated and in DDP training"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        grid = OmniGrid.quick() if quick else OmniGrid()
        sim = run_sim(grid, tick)
        e2e_cfg = E2EConfig.quick() if quick else E2EConfig()
        notes = []
        if e2e_cfg.link_gbps is not None and not usable():
            e2e_cfg = replace(e2e_cfg, link_gbps=None)
            notes.append("Network namespaces unavailable: training ran on loopback.")
        tick(f"DDP training, {e2e_cfg.ranks} ranks, {e2e_cfg.steps} steps per hook")
        e2e = run_e2e(e2e_cfg)
        res = ExperimentResult(
            self.name,
            self.title,
            rows=[*sim, {k: e2e[k] for k in E2E_KEYS}],
            config={"grid": asdict(grid), "e2e": asdict(e2e_cfg)},
            notes=notes,
        )
        omni = [r for r in sim if r["scheme"] == "omnireduce"]
        best = max(omni, key=lambda r: r["speedup_vs_ring"])
        # (below 10% density the stream is latency-bound, not bandwidth-bound)
        worst = max(
            (r for r in omni if r["density"] >= 0.1),
            key=lambda r: r["comm_us"] / r["union_bound_us"],
        )
        link = f"{e2e_cfg.link_gbps:g} Gbit/s" if e2e_cfg.link_gbps else "loopback"
        vs_best = min(e2e["default_ms"], e2e["sparse-embedding_ms"]) / e2e["omnireduce_ms"]
        res.claims += [
            Claim(
                "OmniReduce", "omnireduce_hook on dense tables: NeuMF training step faster than "
                "the best baseline, up to", "training",
                "the faster of DDP's default hook and nn.Embedding(sparse=True)",
                f"{vs_best:.2f}x", "8.2x", reaches(vs_best, 8.2), speedup=vs_best,
                note="not the headline: what the README tells users to run is auto_hook on "
                f"sparse tables (experiment sparse-train); NeuMF {e2e['grad_mb']:.0f} MB of "
                f"gradients, {e2e_cfg.ranks} ranks, {link}, "
                f"block density {e2e['density_median']:.3f}; per iteration "
                f"{e2e['omnireduce_ms']:.0f} ms vs {e2e['default_ms']:.0f} ms (default hook, "
                f"{e2e['speedup']:.2f}x) and {e2e['sparse-embedding_ms']:.0f} ms "
                f"(nn.Embedding(sparse=True), {e2e['speedup_vs_sparse_embedding']:.2f}x)",
            ),
            Claim(
                "OmniReduce", "rows_hook (dense embedding gradients, any optimizer)", "training",
                "nn.Embedding(sparse=True) under plain DDP",
                f"{e2e['rows_vs_sparse_embedding']:.2f}x", ">= 0.95x",
                reaches(e2e["rows_vs_sparse_embedding"], 0.95), kind="goal",
                speedup=e2e["rows_vs_sparse_embedding"],
                note=f"NeuMF, {e2e_cfg.ranks} ranks, {link}, SGD with momentum (which both can "
                f"run): {e2e['rows_ms']:.0f} ms against {e2e['sparse-embedding_ms']:.0f} ms per "
                f"iteration; {e2e['omnireduce_ms'] / e2e['rows_ms']:.2f}x faster than "
                f"omnireduce_hook; loss within {e2e['rows_loss_diff']:.1e} of the default hook",
            ),
            Claim(
                "OmniReduce", "streaming aggregation moves only the union of non-zero blocks "
                "(worst at density >= 0.1)", "sim", "the union-over-downlink bound",
                f"{worst['comm_us'] / worst['union_bound_us']:.3f}x the bound's time",
                "1.0x (within 10% met)", worst["comm_us"] <= 1.1 * worst["union_bound_us"],
                kind="check", speedup=worst["union_bound_us"] / worst["comm_us"], headline=True,
                note=f"{grid.workers} workers, 100 Gbit/s, density {worst['density']:g}; "
                f"vs ring at density {best['density']:g}: {best['speedup_vs_ring']:.1f}x",
            ),
            Claim(
                "OmniReduce", "same loss curve as the default hook (max |difference|)",
                "training", "DDP's default hook", f"{e2e['max_loss_diff']:.1e}", "<= 1e-3",
                e2e["max_loss_diff"] <= 1e-3, kind="check",
                note=f"{e2e_cfg.steps} steps; replicas of the hooked model differ by "
                f"{e2e['replica_spread']:.1e}",
            ),
        ]
        series = {s: [r["comm_us"] for r in sim if r["scheme"] == s] for s in SIM_SCHEMES}
        series["union bound"] = [r["union_bound_us"] for r in sim if r["scheme"] == "omnireduce"]
        res.plots.append(
            plots.lines(
                list(grid.densities),
                series,
                "block density",
                "all-reduce time (us)",
                f"{grid.values * 4 / 1e6:g} MB, {grid.workers} workers, 100 Gbit/s (simulated)",
                out / "omnireduce_sim.png",
                logx=True,
            ).name
        )
        steps = list(range(len(e2e["loss"]["default"])))
        res.plots.append(
            plots.lines(
                [float(s) for s in steps],
                {_LABELS[k]: e2e["loss"][k] for k in _LABELS},
                "step",
                "training loss (BCE)",
                f"NeuMF on {e2e_cfg.ranks} ranks, {link}: loss per step",
                out / "omnireduce_loss.png",
            ).name
        )
        res.plots.append(
            plots.lines(
                [float(s) for s in steps],
                {_LABELS[k]: [t * 1e3 for t in e2e["times_s"][k]] for k in _LABELS},
                "step",
                "iteration time (ms)",
                f"NeuMF on {e2e_cfg.ranks} ranks, {link}: iteration time",
                out / "omnireduce_iter.png",
                from_zero=True,
            ).name
        )
        return res


_LABELS = {
    "default": "default hook", "sparse-embedding": "nn.Embedding(sparse=True)",
    "omnireduce": "omnireduce_hook", "rows": "rows_hook",
}  # fmt: skip

EXPERIMENTS.add("omnireduce", OmniReduce())
