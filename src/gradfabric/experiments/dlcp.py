"""DLCP in the reproduction suite: the transport on a congested leaf-spine
with a parameter server and with ring all-reduce (iteration and p99
communication time against background load, against reliable transport, with
and without priorities and spraying), and the convergence study (bounded
gradient loss by drop policy on real training)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gradfabric.experiments import plots
from gradfabric.experiments.dlcp_convergence import ConvergenceConfig, run_convergence
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.sim.dlcp import experiment_configs, run_grid

LOADS = (0.0, 0.5, 0.8)


class Dlcp:
    name = "dlcp"
    title = "DLCP: accuracy under bounded, prioritised gradient loss"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        nets = experiment_configs(quick)
        loads = (0.5, 0.8) if quick else LOADS
        transport = run_grid(nets, loads, tick)
        cfg = ConvergenceConfig.quick() if quick else ConvergenceConfig()
        rows = run_convergence(cfg, tick)
        res = ExperimentResult(
            self.name,
            self.title,
            rows=[*transport, *rows],
            config={
                "transport": [asdict(n) for n in nets],
                "loads": loads,
                "convergence": asdict(cfg),
            },
        )
        t = {(r["baseline"], r["scheme"], r["load"]): r for r in transport}
        hi = loads[-1]
        schemes = list(dict.fromkeys(r["scheme"] for r in transport))
        for coll, label in (("ps", "a PS"), ("allreduce", "ring all-reduce")):
            rel, dl = t[(coll, "reliable", hi)], t[(coll, "dlcp", hi)]
            gain = 1 - dl["iter_time_ms"] / rel["iter_time_ms"]
            tail = 1 - dl["p99_comm_ms"] / rel["p99_comm_ms"]
            ms = {s: t[(coll, s, hi)]["iter_time_ms"] for s in schemes}
            res.claims.append(
                Claim(
                    "DLCP",
                    f"training acceleration over reliable transport with {label}, up to",
                    "84.3%",
                    f"{gain * 100:.1f}% (p99 comm. -{tail * 100:.1f}%)",
                    gain / 0.843,
                    f"load {hi:g}, ms per iteration: "
                    + ", ".join(f"{s} {v:.2f}" for s, v in ms.items()),
                )
            )
            res.plots.append(
                plots.lines(
                    list(loads),
                    {s: [t[(coll, s, ld)]["p99_comm_ms"] for ld in loads] for s in schemes},
                    "background load (share of a host link)",
                    "p99 tensor communication time (ms)",
                    f"DLCP vs reliable transport, {label} on a leaf-spine (simulated)",
                    out / f"dlcp_p99_{coll}.png",
                ).name
            )
        base = rows[0]["accuracy"]
        at = {(r["policy"], r["loss_bound"]): r for r in rows}
        mag = at[("magnitude", 0.1)]
        res.claims.append(
            Claim(
                "DLCP",
                "magnitude-aware loss at p = 0.1 keeps accuracy (within 0.5 pp of lossless)",
                "<= 0.5 pp",
                f"{mag['delta_pp']:+.2f} pp",
                None,
                f"digits MLP, 4 workers, {len(cfg.seeds)} seeds; random "
                f"{at[('random', 0.1)]['delta_pp']:+.2f} pp, largest "
                f"{at[('largest', 0.1)]['delta_pp']:+.2f} pp at p = 0.1; "
                f"at p = {cfg.bounds[-1]:g}: "
                + ", ".join(
                    f"{p} {at[(p, cfg.bounds[-1])]['delta_pp']:+.2f} pp" for p in cfg.policies
                ),
            )
        )
        res.plots.append(
            plots.lines(
                list(cfg.bounds),
                {p: [at[(p, b)]["accuracy"] * 100 for b in cfg.bounds] for p in cfg.policies}
                | {"lossless": [base * 100] * len(cfg.bounds)},
                "loss bound p (push; pull gets p x 0.2)",
                "test accuracy (%)",
                "digits MLP: accuracy against gradient loss, by drop policy",
                out / "dlcp_convergence.png",
            ).name
        )
        return res


EXPERIMENTS.add("dlcp", Dlcp())
