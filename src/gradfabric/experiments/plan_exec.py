"""Heterogeneous plans executed: the cost model against real runs (``bench plan``).

Four gloo processes emulate devices at speeds 1, 1, 0.5 and 0.25 of a host
core; the planner's plan (on the cost model as is and calibrated), even and
speed-proportional data parallelism and an even pipeline (each on every
device and on the subset where the calibrated model finds it fastest) and
seeded random plans train an MLP stack, each plan in a run of its own. Quick: 3 random plans and
8 steps; full: 9 random plans and 14 steps. Then ``train_plan``: the online
controller re-plans a job through the built-in speed trace on the same
processes, each move made for real, the loss beside the unsplit run's.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick
from gradfabric.planner.execute import ExecConfig, run_plans
from gradfabric.planner.train_plan import TrainPlanConfig, train_plan


class PlanExec:
    name = "plan-exec"
    title = "Heterogeneous plans executed: predicted vs measured step time"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        cfg = ExecConfig(steps=8 if quick else 14)
        random_count = 3 if quick else 9
        tick(f"calibrate, then {5 + random_count} plans on {len(cfg.speeds)} processes")
        res = run_plans(cfg, random_count)
        rows, sm = res["rows"], res["summary"]
        by = {r["plan"]: r for r in rows}
        best = by["planner-calibrated"]
        result = ExperimentResult(self.name, self.title, rows=rows,
                                  config={"exec": asdict(cfg), "random": random_count})  # fmt: skip
        result.claims += [
            Claim("planner", "cost model vs executed plans, median |error| after calibration",
                  "<= 15%", f"{sm['median_abs_error_calibrated']:.0%}",
                  0.15 / max(sm["median_abs_error_calibrated"], 1e-9),
                  f"{sm['plans']} plans; before calibration {sm['median_abs_error']:.0%}; "
                  f"worst {sm['worst_abs_error_calibrated']:.0%}"),
            Claim("planner", "the planner's plan (calibrated model) executed, vs the fastest "
                  "executed baseline (even DP, proportional DP, even pipeline, each on every "
                  "device and on its best subset)", "faster",
                  f"{sm['planner_vs_best_baseline']:.2f}x", None,
                  f"that baseline: {sm['best_baseline']}; predicted "
                  f"{sm['predicted_planner_vs_best_baseline']:.2f}x; vs even DP on every device "
                  f"{best['speedup_vs_even_dp']:.2f}x, vs the even pipeline "
                  f"{by['even-pipeline']['measured_ms'] / best['measured_ms']:.2f}x"),
        ]  # fmt: skip
        result.plots.append(
            plots.predicted_vs_measured(
                rows, {"cost model": "predicted_ms", "calibrated": "calibrated_ms"},
                f"{sm['plans']} plans on {len(cfg.speeds)} throttled processes",
                out / "plan_exec_predicted_vs_measured.png",
            ).name
        )  # fmt: skip
        tick("train-plan: the controller re-planning a job through a speed trace")
        tp = train_plan(TrainPlanConfig(steps_per_slot=4 if quick else 6))
        ts = tp["summary"]
        result.rows += [{"part": "train-plan", **r} for r in tp["rows"]]
        moves = [r for r in tp["rows"] if r["moved_mb"] > 0]
        result.claims += [
            Claim("planner", "re-planned mid-training (layers and optimizer state moved), the "
                  "loss curve equals the uninterrupted full-batch run's", "equal",
                  f"max relative difference {ts['max_loss_rel_diff']:.1e}", None,
                  f"{ts['steps']} steps over {ts['slots']} slots, {ts['migrations']} moves, "
                  f"{ts['dtype']}; gradfabric train-plan"),
        ]  # fmt: skip
        if moves:
            worst = max(moves, key=lambda r: r["measured_migration_ms"])
            result.claims.append(
                Claim("planner", "the controller's migration term against the measured "
                      "transfers (largest move)", "-",
                      f"{worst['predicted_migration_ms']:.2f} ms predicted, "
                      f"{worst['measured_migration_ms']:.1f} ms measured", None,
                      f"{worst['moved_mb']:.1f} MB moved (parameters and momentum) in slot "
                      f"{worst['slot']}; gradfabric train-plan"),
            )  # fmt: skip
        return result


EXPERIMENTS.add("plan-exec", PlanExec())
