"""The foundation's experiment: the four baselines against analytic bounds."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from gradfabric.core.config import dump, load_yaml
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.experiments.simulate import SimulateConfig, run_simulate


def builtin_config(name: str = "baselines") -> SimulateConfig:
    path = resources.files("gradfabric") / "configs" / f"{name}.yaml"
    return load_yaml(SimulateConfig, Path(str(path)))


class Baselines:
    name = "baselines"
    title = "Baselines: SwitchML, ATP, BytePS-style PS and ring all-reduce"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        cfg = builtin_config()
        res = run_simulate(cfg, tick)
        rows, checks = res["rows"], res["checks"]
        r = ExperimentResult(self.name, self.title, rows=rows, config=dump(cfg))
        for c in checks:
            r.claims.append(
                Claim(
                    "baseline model", c["check"], "sim", "analytic bound",
                    f"{c['measured']:.4g} vs {c['bound']:.4g} {c['unit']}", "within 5%",
                    bool(c["within_5pct"]), kind="check", note=c["subject"],
                )
            )
        n = cfg.workers
        for model in cfg.models:
            comm = {x["scheme"]: x["comm_only_ms"] for x in rows if x["model"] == model}
            if "ring" in comm and "switchml" in comm:
                expect = 2 * (n - 1) / n
                got = comm["ring"] / comm["switchml"]
                r.claims.append(
                    Claim(
                        "in-network aggregation",
                        f"each byte sent once each way: all-reduce faster than the ring, "
                        f"n={n}, {model}", "sim", "ring all-reduce", f"{got:.2f}x",
                        f"{expect:.2f}x (bytes bound)", got >= 0.95 * expect, kind="check",
                        speedup=got, headline=model == cfg.models[0],
                        note="within 5% of the bound counts as met",
                    )
                )
            if "ps" in comm and "switchml" in comm:
                got = comm["ps"] / comm["switchml"]
                r.claims.append(
                    Claim(
                        "BytePS-style PS",
                        f"with one server per worker the PS moves S each way, like INA, {model}",
                        "sim", "SwitchML", f"{got:.3f}x SwitchML's time", "1.00x",
                        abs(got - 1) <= 0.05, kind="check",
                    )
                )
        r.plots.append(
            plots.grouped_bars(
                rows,
                "model",
                "scheme",
                "iteration_ms",
                "iteration time (ms)",
                f"Iteration time, {n} workers, {cfg.fabric.link.link_gbps:g} Gbit/s",
                out / "baselines_iteration.png",
            ).name
        )
        r.plots.append(
            plots.measured_vs_bound(
                checks, "Simulator vs analytic bounds", out / "baselines_bounds.png"
            ).name
        )
        r.notes.append(
            f"granularity: one simulated packet = {cfg.ina.train_packets} real packets "
            "(the window-limited check runs at packet granularity)"
        )
        return r


EXPERIMENTS.add("baselines", Baselines())
