"""SA-ATP carrying a real training job (``lab.saatp_train``): four ranks
train the digits MLP through the switch daemon with one rank 4x slower,
steady and moving every two steps, against ATP through the same switch,
gloo's all-reduce (DDP's default hook), speed-proportional batch shares
re-balanced from measured speeds and backup workers (a parameter server
stepping on the first n-1 gradients); the straggler model's prediction
beside each. Full: 16 steps, 5 runs per mode in both settings; quick: 10
steps, 3 runs, the moving straggler (the headline's setting) alone, against
ATP and the alternative the full study found best (backup workers). The
switch's ranks quantise with ``ina_hook``'s per-block quantiser, their
exponents carried from the last step's sum (``wire.carried``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.core.stats import mean_ci
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick, reaches
from gradfabric.lab.job import (
    DAEMON,
    MODEL,
    reference,
)
from gradfabric.lab.saatp_alternatives import MODES, run_mode
from gradfabric.lab.saatp_train import SaatpTrainConfig


def predicted_ms(cfg: SaatpTrainConfig, mode: str) -> float:
    """The step time the straggler model predicts, compute only (the
    communication is the same few milliseconds in every mode): ATP and the
    default hook wait for the slow rank; SA-ATP's helper computes its own
    micro-batch and the straggler's; backup workers wait for the fastest
    ``n - 1``; proportional shares take
    ``n / (n - 1 + 1/k)`` micro-batches' time once balanced, and after a move
    the new straggler computes a fast rank's share at its slow speed."""
    c, k, n = cfg.compute_ms, cfg.slowdown, cfg.workers
    if mode == "backup":  # the (n-1)th rank to finish is a fast one
        return c
    if mode in ("atp", "default"):
        return c * k
    if mode == "saatp":
        return c * min(k, 2.0)
    balanced = c * n / (n - 1 + 1 / k)
    if cfg.move_every == 0:
        return balanced
    return ((cfg.move_every - 1) * balanced + balanced * k) / cfg.move_every


SIMULATED = {"atp": "atp", "saatp": "saatp", "default": "ring"}


def simulated_ms(cfg: SaatpTrainConfig, mode: str) -> float | None:
    """The simulator's mean step time for the same job (model, micro-batch,
    device time, straggler pattern, window, packet size, SA-ATP's lag and
    replicas; a 100 Gbit/s star for loopback, replicas in memory), steps
    after the first; None for the modes it has no scheme for."""
    from gradfabric.proto.schemes import InaConfig
    from gradfabric.proto.switch.straggler import HelpConfig
    from gradfabric.sim.stragglers import StragglerConfig
    from gradfabric.sim.training import TrainingConfig, run_training

    if mode not in SIMULATED:
        return None
    stragglers = StragglerConfig(
        model="moving" if cfg.move_every else "fixed", workers=(cfg.straggler,),
        slowdown=cfg.slowdown, move_every=max(cfg.move_every, 1),
    )  # fmt: skip
    tc = TrainingConfig(
        scheme=SIMULATED[mode], model=MODEL, workers=cfg.workers, iterations=cfg.steps,
        batch=cfg.micro_batch, compute_ms=cfg.compute_ms, load_gbps=1000.0, seed=cfg.seed,
        stragglers=stragglers, help=HelpConfig(lag_packets=cfg.lag_packets, replicas=cfg.replicas),
        ina=InaConfig(values_per_packet=DAEMON.values_per_packet, atp_window=DAEMON.job_slots,
                      rto_ns=DAEMON.rto_ns),
    )  # fmt: skip
    return statistics.fmean(run_training(tc).iteration_ns[1:]) / 1e6


# ------------------------------------------------------------------ study

SETTINGS = {"steady": 0, "moving": 2}  # move_every: the straggler moves every 2 steps


def study(
    cfg: SaatpTrainConfig, repeats: int, settings: dict[str, int] = SETTINGS,
    tick: Callable[[str], None] = lambda _: None, modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:  # fmt: skip
    """Every mode in each setting, ``repeats`` runs, the modes interleaved
    within a run so that a repeat's ratios are paired. Per mode: the mean
    step time (over steps after the first, then over runs, 95% interval), the
    prediction, accuracy; SA-ATP's speed-up over each mode as the mean of the
    paired per-run ratios; ``atp`` and ``saatp`` checked bit for bit against
    ``reference``."""
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}  # setting -> mode -> the first run's loss
    for name, move in settings.items():
        c = replace(cfg, move_every=move)
        ref = reference(c)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        curves[name] = {"reference": ref["loss"]}
        for rep in range(repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                tick(f"{name}: {mode}, run {rep + 1}/{repeats}")
                runs[mode].append(run_mode(c, mode))
                curves[name].setdefault(mode, runs[mode][-1]["loss"])
        step = {m: [statistics.fmean(r["step_ms"][1:]) for r in rs] for m, rs in runs.items()}
        for mode, rs in runs.items():
            ours = mean_ci([x / y for x, y in zip(step[mode], step["saatp"], strict=True)])
            rows.append({
                "setting": name, "move_every": move, "mode": mode,
                "step_ms": mean_ci(step[mode]).mean, "step_ms_half": mean_ci(step[mode]).half,
                "predicted_ms": predicted_ms(c, mode),
                "simulated_ms": simulated_ms(c, mode),
                "saatp_speedup": ours.mean, "saatp_speedup_half": ours.half,
                "accuracy": statistics.fmean(r["accuracy"] for r in rs),
                "final_loss": statistics.fmean(r["loss"][-1] for r in rs),
                "replicas_agree": all(r["replicas_agree"] for r in rs),
                "bitwise_reference": all(
                    r["loss"] == ref["loss"] and r["weights"] == ref["weights"] for r in rs
                ) if mode in ("atp", "saatp") else None,
                "helps": (helps := sum(r.get("helps", 0) for r in rs)),
                # each help is one more micro-batch's forward and backward
                "extra_compute": helps / (len(rs) * c.steps * c.workers),
                "abandoned": sum(r.get("abandoned", 0) for r in rs),
                "clipped": sum(r.get("clipped", 0) for r in rs),
                "dropped": sum(r.get("dropped", 0) for r in rs),
                "replica_shards": rs[0].get("replica_shards"),
                "runs": len(rs),
            })  # fmt: skip
    return {"rows": rows, "curves": curves,
            "config": asdict(cfg) | {"repeats": repeats, "settings": settings}}  # fmt: skip


LABELS = {
    "atp": "ATP (switch)",
    "saatp": "SA-ATP (switch)",
    "default": "gloo all-reduce (default hook)",
    "proportional": "speed-proportional shares",
    "backup": "backup workers (first n-1)",
}
ALTERNATIVES = ("default", "proportional", "backup")


def _row(rows: list[dict[str, Any]], setting: str, mode: str) -> dict[str, Any]:
    return next(r for r in rows if r["setting"] == setting and r["mode"] == mode)


def claims(res: dict[str, Any]) -> list[Claim]:
    """The headline against ATP (the paper's baseline) and against the best
    thing a user could run instead, per setting."""
    rows, cfg = res["rows"], res["config"]
    out = []
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    for setting in settings:
        head = setting == settings[-1]  # the slow rank moving, what SA-ATP is for
        sa, atp = _row(rows, setting, "saatp"), _row(rows, setting, "atp")
        ran = [m for m in ALTERNATIVES if any(r["mode"] == m for r in rows)]
        best = min(ran, key=lambda m: _row(rows, setting, m)["step_ms"])
        alt = _row(rows, setting, best)
        where = f"4 ranks, digits MLP, one rank {cfg['slowdown']:g}x slower, {setting}" + (
            f" (moves every {sa['move_every']} steps)" if sa["move_every"] else ""
        )
        out += [
            Claim("SA-ATP", f"DDP step time, {setting} straggler", "training",
                  "ATP through the switch",
                  f"{atp['saatp_speedup']:.2f}x ± {atp['saatp_speedup_half']:.2f}", "1.8x",
                  reaches(atp["saatp_speedup"], 1.8), speedup=atp["saatp_speedup"], headline=head,
                  note=f"{where}: {sa['step_ms']:.0f} vs {atp['step_ms']:.0f} ms per step "
                  f"(simulated {sa['simulated_ms']:.0f} vs {atp['simulated_ms']:.0f}, "
                  f"compute-only model {sa['predicted_ms']:.0f} vs {atp['predicted_ms']:.0f}); "
                  f"loss curve and weights equal ATP's bit for bit: {sa['bitwise_reference']}; "
                  f"cost: {sa['replica_shards']} replica shards per rank, "
                  f"{sa['extra_compute']:.0%} more compute"),
            Claim("SA-ATP", f"DDP step time, {setting} straggler", "training",
                  f"the best alternative: {LABELS[best]}",
                  f"{alt['saatp_speedup']:.2f}x ± {alt['saatp_speedup_half']:.2f}",
                  "1.8x (over ATP)", reaches(alt["saatp_speedup"], 1.8),
                  speedup=alt["saatp_speedup"], headline=head,
                  note=f"that alternative: {LABELS[best]}, {alt['step_ms']:.0f} ms per step "
                  f"(predicted {alt['predicted_ms']:.0f}), accuracy {alt['accuracy']:.3f} "
                  f"against SA-ATP's {sa['accuracy']:.3f} after {cfg['steps']} steps; below "
                  "1: the alternative is faster"),
        ]  # fmt: skip
    return out


class SaatpTrain:
    name = "saatp-train"
    title = "SA-ATP in real training: a slow rank helped through the switch"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        cfg = SaatpTrainConfig(steps=10 if quick else 16)
        # quick: the headline's setting alone (the slow rank moving, what SA-ATP is for)
        settings = dict(list(SETTINGS.items())[-1:]) if quick else SETTINGS
        # quick: against ATP and the alternative the full study found best (backup workers)
        modes = ("atp", "saatp", "backup") if quick else MODES
        res = study(cfg, repeats=3 if quick else 5, settings=settings, tick=tick, modes=modes)
        result = ExperimentResult(self.name, self.title, rows=res["rows"], config=res["config"])
        result.claims += claims(res)
        result.plots += [draw_steps(res, out), draw_loss(res, out)]
        return result


def draw_steps(res: dict[str, Any], out: Path) -> str:
    rows = [
        r | {"label": LABELS[r["mode"]], "predicted (compute only)": r["predicted_ms"]}
        for r in res["rows"]
    ]
    return plots.grouped_bars(
        rows, "setting", "label", "step_ms", "step time (ms, mean, 95% interval)",
        f"one rank {res['config']['slowdown']:g}x slower: step time by straggler pattern",
        out / "saatp_train_steps.png", err="step_ms_half", mark="predicted (compute only)",
    ).name  # fmt: skip


def draw_loss(res: dict[str, Any], out: Path) -> str:
    setting = next(iter(res["curves"]))
    curves = res["curves"][setting]
    series = {LABELS.get(m, m): ys for m, ys in curves.items()}
    return plots.lines(
        list(range(len(curves["reference"]))), series, "step", "training loss (global batch)",
        f"digits MLP, {setting} straggler: SA-ATP's curve is ATP's and the replay's",
        out / "saatp_train_loss.png",
    ).name  # fmt: skip


EXPERIMENTS.add("saatp-train", SaatpTrain())
