"""SA-ATP carrying a real training job (``lab.saatp_train``), judged by time
to a target test accuracy: four ranks train the digits MLP through the
switch daemon with one rank 4x slower, steady and moving every two steps,
against ATP through the same switch, gloo's all-reduce (DDP's default
hook), speed-proportional batch shares re-balanced from measured speeds and
backup workers (a parameter server stepping on the first n - b gradients, b
tuned); step time, the straggler model's and the simulator's predictions
beside. Full: 30 steps, 5 seeds per mode in both settings; quick: 20 steps,
3 seeds, the moving straggler (the headline's setting) alone, against ATP
and the alternative the full study found best there (backup workers, b = 1). The switch's ranks
quantise with ``ina_hook``'s per-block quantiser, their exponents carried
from the last step's sum (``wire.carried``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.core.errors import ConfigError
from gradfabric.core.stats import mean_ci, ratio_ci
from gradfabric.experiments import plots
from gradfabric.experiments.registry import (
    EXPERIMENTS,
    Claim,
    ExperimentResult,
    Tick,
    at_target,
    reaches,
)
from gradfabric.lab.job import (
    DAEMON,
    MODEL,
    reference,
)
from gradfabric.lab.saatp_alternatives import run_mode
from gradfabric.lab.saatp_train import SaatpTrainConfig


def predicted_ms(cfg: SaatpTrainConfig, mode: str) -> float:
    """The step time the straggler model predicts, compute only (the
    communication is the same few milliseconds in every mode): ATP and the
    default hook wait for the slow rank; SA-ATP's helper computes its own
    micro-batch and the straggler's; backup workers wait for the fastest
    ``n - b`` (fast ranks, with one straggler); proportional shares take
    ``n / (n - 1 + 1/k)`` micro-batches' time once balanced, and after a move
    the new straggler computes a fast rank's share at its slow speed."""
    c, k, n = cfg.compute_ms, cfg.slowdown, cfg.workers
    if mode == "backup":  # the (n - b)th rank to finish is a fast one
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
# Time to accuracy: the end of the first step after which the test accuracy
# reaches TARGET (as MLPerf's and DAWNBench's time to a target); the replay of
# seeds 0-4 first reaches 0.90 between steps 10 and 20 of 30.
TARGET = 0.90
STEPS = 30
# Backup workers at their best: the server waits for the first n - b of n
# gradients, b tuned per setting (``best``); with 4 ranks, b = 3 would step
# on one micro-batch in 4.
BACKUPS = (1, 2)
# The study's modes: a name, the run's mode and its number of backups.
NAMED: dict[str, tuple[str, int]] = {
    "atp": ("atp", 1), "saatp": ("saatp", 1), "default": ("default", 1),
    "proportional": ("proportional", 1), **{f"backup-{b}": ("backup", b) for b in BACKUPS},
}  # fmt: skip
MODES_TUNED = tuple(NAMED)


def run_named(cfg: SaatpTrainConfig, name: str) -> dict[str, Any]:
    """``run_mode`` for a name of ``NAMED``."""
    mode, backups = NAMED[name]
    return run_mode(replace(cfg, backups=backups), mode)


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row that reached the target on the most seeds, then in the fewest
    mean time (a mean over only the seeds that reached it flatters a mode
    that sometimes does not)."""
    return min(rows, key=lambda r: (-r["reached"], math.inf if r["tta_s"] is None else r["tta_s"]))


def time_to_target(
    run: dict[str, Any], target: float = TARGET, warm: bool = False
) -> tuple[float, int] | None:  # fmt: skip
    """Seconds from the job's start to the end of the first step after which
    its test accuracy reaches ``target`` (``at_target``), and that step's
    count; None if no step did. ``warm``: the clock starts at the end of the
    first step, whose one-off costs (connections, a server's start, the first
    allocations) differ by mode and weigh on a run of a few steps as they
    would not on a job of thousands."""
    at = 0.0
    for k, (ms, acc) in enumerate(zip(run["step_ms"], run["accs"], strict=True)):
        at += 0.0 if warm and k == 0 else ms / 1e3
        if at_target(acc, target):
            return at, k + 1
    return None


def study(
    cfg: SaatpTrainConfig, seeds: int, settings: dict[str, int] = SETTINGS,
    tick: Callable[[str], None] = lambda _: None, modes: tuple[str, ...] = MODES_TUNED,
    target: float = TARGET,
) -> dict[str, Any]:  # fmt: skip
    """Every mode (of ``NAMED``, ``atp`` and ``saatp`` among them) in each
    setting on ``seeds`` seeds (seed ``i``: the model's initial weights and
    every micro-batch), the modes interleaved within a seed so that its runs
    are paired. Per mode: time to ``target`` (mean over
    the seeds that reached it, 95% interval), SA-ATP's paired speed-up in it
    (the ratio of mean times over the seeds where both reached it,
    ``ratio_ci``; ``tta_pairs`` of them), the steps it took; the mean step time (steps after the
    first) and SA-ATP's paired speed-up in it; the straggler model's and the
    simulator's predictions; ``atp`` and ``saatp`` checked bit for bit
    against each seed's ``reference``. (``tuned`` names the backup workers'
    best ``b`` in each setting.)"""
    unknown = [m for m in modes if m not in NAMED]
    if unknown or not {"atp", "saatp"} <= set(modes) or seeds < 1 or not 0 < target <= 1:
        raise ConfigError("modes", f"modes of {', '.join(NAMED)} with atp and saatp, seeds "
                          ">= 1 and a target accuracy in (0, 1]")  # fmt: skip
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}  # setting -> mode -> seed 0's test accuracy
    traces: dict[str, dict[str, list[dict[str, list[float]]]]] = {}  # every seed's (``trace``)
    for name, move in settings.items():
        c0 = replace(cfg, move_every=move)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        exact: dict[str, bool] = {m: True for m in modes}
        for seed in range(seeds):
            c = replace(c0, seed=seed)
            ref = reference(c)
            for mode in modes if seed % 2 == 0 else modes[::-1]:
                tick(f"{name}: {mode}, seed {seed + 1}/{seeds}")
                run = run_named(c, mode)
                runs[mode].append(run)
                exact[mode] &= run["loss"] == ref["loss"] and run["weights"] == ref["weights"]
            if seed == 0:
                curves[name] = {"reference": ref["accs"]} | {m: runs[m][0]["accs"] for m in modes}
        traces[name] = {m: [trace(r) for r in rs] for m, rs in runs.items()}
        rows += _rows(c0, name, runs, traces[name], exact, target)
    ran = {"seeds": seeds, "settings": settings, "target": target, "modes": list(modes),
           "backups": [NAMED[m][1] for m in modes if NAMED[m][0] == "backup"]}  # fmt: skip
    return {"rows": rows, "curves": curves, "target": target, "traces": traces,
            "config": asdict(cfg) | ran}  # fmt: skip


def trace(run: dict[str, Any]) -> dict[str, list[float]]:
    """What time to any target needs of a run: its step times and the test
    accuracy after each step (stored for every seed, so that the ladder of
    targets is derived from the runs as they were measured)."""
    return {"step_ms": [round(ms, 3) for ms in run["step_ms"]], "accs": list(run["accs"])}


def _to_target(
    runs: dict[str, list[dict[str, Any]]], mode: str, target: float
) -> dict[str, Any]:  # fmt: skip
    """``mode``'s time to ``target`` over its seeds (mean and 95% interval
    over those that reached it, how many did, the steps it took) and
    SA-ATP's paired speed-up in it over the seeds where both reached it,
    also with the clock started after step 1 (``_warm``); and (``_censored``)
    the ratio of mean times over every seed with ``mode``'s misses counted at
    its run's end, a lower bound on its time: an estimate that can only
    understate SA-ATP's lead (its interval is the floors', not the true
    times'); None unless SA-ATP reached it on every seed."""
    mine = [time_to_target(r, target) for r in runs[mode]]
    ours = [time_to_target(r, target) for r in runs["saatp"]]
    reached = [t for t in mine if t is not None]
    both = [(t[0], s[0]) for t, s in zip(mine, ours, strict=True)
            if t is not None and s is not None]  # fmt: skip
    warm = [(a[0], b[0]) for r, q in zip(runs[mode], runs["saatp"], strict=True)
            if (a := time_to_target(r, target, warm=True)) is not None
            and (b := time_to_target(q, target, warm=True)) is not None]  # fmt: skip
    tta_s = mean_ci([t for t, _ in reached]) if reached else None
    pair = ratio_ci([t for t, _ in both], [s for _, s in both]) if both else None
    # (none where SA-ATP got there in its first step: no time after it to compare)
    warm_ok = warm and math.fsum(s for _, s in warm) > 0
    pair_warm = ratio_ci([t for t, _ in warm], [s for _, s in warm]) if warm_ok else None
    cens = None
    if ours and all(s is not None for s in ours):
        floor = [t[0] if t is not None else math.fsum(r["step_ms"]) / 1e3
                 for t, r in zip(mine, runs[mode], strict=True)]  # fmt: skip
        cens = ratio_ci(floor, [s[0] for s in ours if s is not None])
    return {
        "tta_s": None if tta_s is None else tta_s.mean,
        "tta_s_half": None if tta_s is None else tta_s.half,
        "reached": len(reached),
        "steps_to_target": statistics.fmean(k for _, k in reached) if reached else None,
        "saatp_tta_speedup": None if pair is None else pair.mean,
        "saatp_tta_speedup_half": None if pair is None else pair.half,
        "tta_pairs": len(both),
        "saatp_tta_speedup_warm": None if pair_warm is None else pair_warm.mean,
        "saatp_tta_speedup_warm_half": None if pair_warm is None else pair_warm.half,
        "saatp_tta_speedup_censored": None if cens is None else cens.mean,
        "saatp_tta_speedup_censored_half": None if cens is None else cens.half,
    }


def _rows(
    c: SaatpTrainConfig, setting: str, runs: dict[str, list[dict[str, Any]]],
    traced: dict[str, list[dict[str, list[float]]]], exact: dict[str, bool], target: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """``runs``' rows; time to ``target`` from ``traced`` (as ``by_target`` reads it)."""
    step = {m: [statistics.fmean(r["step_ms"][1:]) for r in rs] for m, rs in runs.items()}
    rows = []
    for mode, rs in runs.items():
        to = _to_target(traced, mode, target)
        ours_step = ratio_ci(step[mode], step["saatp"])
        base = NAMED[mode][0]
        sim_ms = simulated_ms(c, base)
        rows.append({
            "setting": setting, "move_every": c.move_every, "mode": mode, **to,
            "step_ms": mean_ci(step[mode]).mean, "step_ms_half": mean_ci(step[mode]).half,
            "saatp_speedup": ours_step.mean, "saatp_speedup_half": ours_step.half,
            "predicted_ms": predicted_ms(c, base),
            "simulated_ms": sim_ms, "simulated_tta_s": _sim_tta(sim_ms, to),
            "accuracy": statistics.fmean(r["accuracy"] for r in rs),
            "final_loss": statistics.fmean(r["loss"][-1] for r in rs),
            "replicas_agree": all(r["replicas_agree"] for r in rs),
            "bitwise_reference": exact[mode] if base in ("atp", "saatp") else None,
            "helps": (helps := sum(r.get("helps", 0) for r in rs)),
            # each help is one more micro-batch's forward and backward
            "extra_compute": helps / (len(rs) * c.steps * c.workers),
            "abandoned": sum(r.get("abandoned", 0) for r in rs),
            "clipped": sum(r.get("clipped", 0) for r in rs),
            "dropped": sum(r.get("dropped", 0) for r in rs),
            "replica_shards": rs[0].get("replica_shards"),
            "runs": len(rs),
        })  # fmt: skip
    return rows


def _sim_tta(sim_ms: float | None, to: dict[str, Any]) -> float | None:
    """The simulator's step time times this mode's measured steps to the target."""
    steps = to["steps_to_target"]
    return None if sim_ms is None or steps is None else sim_ms / 1e3 * steps


def current_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The study's rows with their time to the target read again from its
    stored ``traces`` by the rule as it is now (``_to_target``), where it
    kept them: a stored row says what the rule said when it was made."""
    traces, out = res.get("traces", {}), []
    for r in res["rows"]:
        runs = traces.get(r["setting"], {})
        if runs.get("saatp") and r["mode"] in runs:
            to = _to_target(runs, r["mode"], res["target"])
            r = r | to | {"simulated_tta_s": _sim_tta(r["simulated_ms"], to)}
        out.append(r)
    return out


def tuned(rows: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """The (setting, mode) of the backup workers' ``best`` ``b`` in each
    setting: derived from the rows, never stored, so it follows ``best``."""
    out = set()
    for setting in dict.fromkeys(r["setting"] for r in rows):
        backups = [r for r in rows if r["setting"] == setting and NAMED[r["mode"]][0] == "backup"]
        if backups:
            out.add((setting, best(backups)["mode"]))
    return out


LABELS = {
    "atp": "ATP (switch)",
    "saatp": "SA-ATP (switch)",
    "default": "gloo all-reduce (default hook)",
    "proportional": "speed-proportional shares",
    **{f"backup-{b}": f"backup workers (first n-{b})" for b in BACKUPS},
}


def alternatives(rows: list[dict[str, Any]], setting: str) -> list[dict[str, Any]]:
    """What a user would run instead, each at its best: gloo's all-reduce,
    proportional shares, backup workers with the ``best`` ``b``."""
    here = [r for r in rows if r["setting"] == setting]
    backups = [r for r in here if NAMED[r["mode"]][0] == "backup"]
    return [r for r in here if r["mode"] in ("default", "proportional")] + (
        [best(backups)] if backups else []
    )


def _row(rows: list[dict[str, Any]], setting: str, mode: str) -> dict[str, Any]:
    return next(r for r in rows if r["setting"] == setting and r["mode"] == mode)


def _x(r: dict[str, Any], key: str) -> str:
    """A speed-up and its interval; for time to the target, over how many
    paired seeds where not all (the others: one of the two never reached it)."""
    if r[key] is None:
        return "not reached"
    pairs = r.get("tta_pairs", r["runs"]) if key == "saatp_tta_speedup" else r["runs"]
    return _ratio(r, key) + (f" ({pairs} of {r['runs']} seeds)" if pairs < r["runs"] else "")


def _ratio(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.2f}x ± {r[key + '_half']:.2f}"


def _f(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def level(ratio: float | None, half: float | None) -> bool | None:
    """Is SA-ATP at least level with an alternative, by the paired ratio of
    times and its 95% interval? Met where the interval's floor is within 5%
    of level, not met where its top is below 1, unresolved (None) in
    between or where no seed paired."""
    if ratio is None or half is None:
        return None
    if ratio - half >= LEVEL:
        return True
    return False if ratio + half < 1.0 else None


LEVEL = 0.95  # within 5% of level counts as level


def _level(r: dict[str, Any]) -> bool | None:
    """``level`` of SA-ATP's paired speed-up over the mode of row ``r``."""
    return level(r["saatp_tta_speedup"], r["saatp_tta_speedup_half"])


def missed(alts: list[dict[str, Any]], top: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives ``best`` ranked below ``top`` only for reaching the
    target on fewer seeds, where SA-ATP paired with them on some: a mode that
    sometimes misses can still be the faster where it does not."""
    return [r for r in alts
            if r["reached"] < top["reached"] and r["saatp_tta_speedup"] is not None]  # fmt: skip


def level_with(top: dict[str, Any], others: list[dict[str, Any]]) -> bool | None:
    """SA-ATP against the best alternative ``top`` (``level``) and against
    each of ``others`` (those it ``missed``) on the seeds both reached:
    behind any of them is not level, unresolved against any is unresolved.
    Reaching the target more often does not by itself make SA-ATP level with
    a mode that is faster when it gets there."""
    verdicts = [_level(r) for r in [top, *others]]
    if False in verdicts:
        return False
    return None if None in verdicts else True


def _missed_note(others: list[dict[str, Any]]) -> str:
    return "".join(
        f"; {LABELS[r['mode']]} reached it on {r['reached']} of {r['runs']} seeds, SA-ATP "
        f"{_ratio(r, 'saatp_tta_speedup')} of it where both did"
        + ("" if r.get("saatp_tta_speedup_censored") is None else
           f", at least {r['saatp_tta_speedup_censored']:.2f}x over every seed (its misses "
           "counted at its run's end, a lower bound on its time)")
        for r in others
    )  # fmt: skip


# The ladder of targets a study reads from the same runs (``by_target``):
# every rung below its own target, and its target. Where each alternative
# wins as the target rises. The rungs share their runs: they show how a
# verdict moves with the target, not independent confirmations of it.
LADDER = (0.80, 0.85, 0.90, 0.92)
VERDICT = {True: "level or ahead", False: "behind", None: "unresolved"}


def ladder(target: float) -> tuple[float, ...]:
    """The rungs of ``LADDER`` below ``target``, then ``target``."""
    return (*(t for t in LADDER if t < target - 1e-9), target)


def by_target(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting, rung of ``ladder`` and mode, its ``_to_target`` from the
    stored ``traces`` (none for a study stored before it kept them)."""
    return [
        {"setting": setting, "target": t, "mode": m, "runs": len(rs), **_to_target(runs, m, t)}
        for setting, runs in res.get("traces", {}).items() if runs.get("saatp")
        for t in ladder(res["target"])
        for m, rs in runs.items()
    ]  # fmt: skip


def verdicts(res: dict[str, Any]) -> dict[str, list[tuple[float, dict[str, Any], bool | None]]]:
    """Per setting, at each rung: whether SA-ATP is at least level with the
    best alternative there (``best`` of ``alternatives``, backup workers'
    ``b`` tuned per rung; ``level_with``), and the alternative that decides
    it: the best, or one ranked below it only for missing seeds."""
    rows = by_target(res)
    out: dict[str, list[tuple[float, dict[str, Any], bool | None]]] = {}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for t in ladder(res["target"]):
            alts = alternatives([r for r in rows if r["target"] == t], setting)
            if alts:
                top = best(alts)
                v = level_with(top, others := missed(alts, top))
                decides = next(r for r in [top, *others] if _level(r) is v)
                out.setdefault(setting, []).append((t, decides, v))
    return out


def _ladder_note(rungs: list[tuple[float, dict[str, Any], bool | None]]) -> str:
    def warm(r: dict[str, Any]) -> str:
        if r.get("saatp_tta_speedup_warm") is None:
            return ""
        return f"; with the clock from step 2, {_ratio(r, 'saatp_tta_speedup_warm')}"

    return "; by target (the alternative that decides, SA-ATP over it): " + ", ".join(
        f"{t:.0%} {VERDICT[v]} ({LABELS[top['mode']]}, {_x(top, 'saatp_tta_speedup')}{warm(top)})"
        for t, top, v in rungs
    )  # fmt: skip


def claims(res: dict[str, Any]) -> list[Claim]:
    """Per setting, time to the target accuracy against ATP (the paper's
    baseline) and against the best thing a user could run instead (``best``
    of ``alternatives``); step time beside, not the headline."""
    rows, cfg, target = current_rows(res), res["config"], res["target"]
    rungs = verdicts(res)
    out = []
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    by_label = cfg.get("shards", "interleaved") == "by-label"
    for setting in settings:
        # the headline: the slow rank moving (what SA-ATP is for) on shards
        # of the same mix of classes, as a data loader's sampler deals them
        sa, atp = _row(rows, setting, "saatp"), _row(rows, setting, "atp")
        head = sa["move_every"] > 0 and not by_label
        where = (f"4 ranks, digits MLP, one rank {cfg['slowdown']:g}x slower, {setting}"
                 + (f" (moves every {sa['move_every']} steps)" if sa["move_every"] else "")
                 + (", each rank's shard a few classes (by label)" if by_label else "")
                 + f", {cfg['seeds']} seeds of {cfg['steps']} steps")  # fmt: skip
        named = setting + (" straggler, shards by label" if by_label else " straggler")

        def tta(r: dict[str, Any]) -> str:
            return _f(r["tta_s"], ".2f", " s") + (
                f" ({r['reached']}/{r['runs']} reached)" if r["reached"] < r["runs"] else ""
            )

        out.append(
            Claim("SA-ATP", f"time to {target:.0%} accuracy, {named}", "training",
                  "ATP through the switch", _x(atp, "saatp_tta_speedup"), "1.8x",
                  reaches(atp["saatp_tta_speedup"], 1.8), speedup=atp["saatp_tta_speedup"],
                  headline=head,
                  note=f"{where}: {tta(sa)} vs {tta(atp)} (simulated step x steps "
                  f"{_f(sa['simulated_tta_s'], '.2f')} vs {_f(atp['simulated_tta_s'], '.2f')} "
                  f"s), {_f(sa['steps_to_target'], '.1f')} vs "
                  f"{_f(atp['steps_to_target'], '.1f')} steps to the target; the loss curve and "
                  f"weights equal ATP's bit for bit: {sa['bitwise_reference']}; cost: "
                  f"{sa['replica_shards']} replica shards per rank, {sa['extra_compute']:.0%} "
                  "more compute")
        )  # fmt: skip
        alts = alternatives(rows, setting)
        if alts:
            top = best(alts)
            lvl, others = top["saatp_tta_speedup"], missed(alts, top)
            out.append(
                Claim("SA-ATP", f"time to {target:.0%} accuracy, {named}",
                      "training", f"the best alternative: {LABELS[top['mode']]}",
                      _x(top, "saatp_tta_speedup"), "level (interval >= 0.95)",
                      level_with(top, others),
                      kind="goal", speedup=lvl, headline=head,
                      note=f"{where}: {tta(sa)} vs {tta(top)}, "
                      f"{_f(sa['steps_to_target'], '.1f')} vs "
                      f"{_f(top['steps_to_target'], '.1f')} steps to the target, "
                      f"{sa['step_ms']:.0f} vs {top['step_ms']:.0f} ms a step; below 1: the "
                      f"alternative is faster{_missed_note(others)}"
                      + (_ladder_note(rungs[setting]) if setting in rungs else ""))
            )  # fmt: skip
        out.append(
            Claim("SA-ATP", f"DDP step time, {named}", "training",
                  "ATP through the switch", _x(atp, "saatp_speedup"), "1.8x",
                  reaches(atp["saatp_speedup"], 1.8), speedup=atp["saatp_speedup"],
                  note=f"{where}: {sa['step_ms']:.0f} vs {atp['step_ms']:.0f} ms per step "
                  f"(simulated {_f(sa['simulated_ms'], '.0f')} vs "
                  f"{_f(atp['simulated_ms'], '.0f')}, "
                  f"compute-only model {sa['predicted_ms']:.0f} vs {atp['predicted_ms']:.0f})")
        )  # fmt: skip
    return out


class SaatpTrain:
    name = "saatp-train"
    title = "SA-ATP in real training: a slow rank helped through the switch"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        # quick (under a minute): 20 steps (seeds 0-2 reach 90% by step 16),
        # the headline's setting alone (the slow rank moving, what SA-ATP is
        # for), against ATP and the alternative the full study found best
        # there (backup workers, b = 1)
        cfg = SaatpTrainConfig(steps=20 if quick else STEPS)
        settings = dict(list(SETTINGS.items())[-1:]) if quick else SETTINGS
        modes = ("atp", "saatp", "backup-1") if quick else MODES_TUNED
        res = study(cfg, seeds=3 if quick else 5, settings=settings, tick=tick, modes=modes)
        result = ExperimentResult(self.name, self.title, rows=res["rows"], config=res["config"])
        result.claims += claims(res)
        result.plots += [draw_tta(res, out), draw_steps(res, out), draw_accuracy(res, out),
                         draw_targets(res, out)]  # fmt: skip
        return result


def _bars(
    res: dict[str, Any], value: str, mark: tuple[str, str], ylabel: str, title: str, path: Path
) -> str:
    """Bars of ``value`` per setting and mode, ``mark`` (key, legend) as ticks."""
    key, legend = mark
    rows = [
        {k: math.nan if v is None else v for k, v in r.items()}
        | {"label": LABELS[r["mode"]], legend: math.nan if r[key] is None else r[key]}
        for r in res["rows"]
    ]
    return plots.grouped_bars(
        rows, "setting", "label", value, ylabel, title, path, err=value + "_half", mark=legend
    ).name


def draw_tta(res: dict[str, Any], out: Path) -> str:
    target, k = f"{res['target']:.0%}", res["config"]["slowdown"]
    return _bars(
        res, "tta_s", ("simulated_tta_s", "simulator (its step x the steps)"),
        f"time to {target} accuracy (s, 95% interval)",
        f"one rank {k:g}x slower: time to {target} test accuracy", out / "saatp_train_tta.png",
    )  # fmt: skip


def draw_steps(res: dict[str, Any], out: Path) -> str:
    return _bars(
        res, "step_ms", ("predicted_ms", "compute-only model"),
        "step time (ms, mean, 95% interval)",
        f"one rank {res['config']['slowdown']:g}x slower: step time", out / "saatp_train_steps.png",
    )  # fmt: skip


def draw_targets(res: dict[str, Any], out: Path) -> str:
    """Each mode's time to every rung of the ladder in the last setting (the
    headline's), mean over the seeds that reached it with its interval."""
    setting = list(res["traces"])[-1]
    rows = [r for r in by_target(res) if r["setting"] == setting]
    xs = [100 * t for t in ladder(res["target"])]

    def col(mode: str, key: str) -> list[float]:
        return [math.nan if r[key] is None else r[key] for r in rows if r["mode"] == mode]

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    return plots.lines(
        xs, {LABELS[m]: col(m, "tta_s") for m in modes}, "target test accuracy (%)",
        "time to the target (s, 95% interval)",
        f"digits MLP, {setting} straggler: time to each target (mean over the seeds that "
        "reached it)", out / "saatp_train_targets.png",
        err={LABELS[m]: col(m, "tta_s_half") for m in modes}, from_zero=True,
        legend_outside=True,
    ).name  # fmt: skip


def draw_accuracy(res: dict[str, Any], out: Path) -> str:
    setting = list(res["curves"])[-1]
    curves = res["curves"][setting]
    series = {LABELS.get(m, m): ys for m, ys in curves.items()}
    return plots.lines(
        list(range(1, len(curves["reference"]) + 1)), series, "step", "test accuracy",
        f"digits MLP, {setting} straggler, seed 0: SA-ATP's and ATP's curve is the replay's",
        out / "saatp_train_accuracy.png",
    ).name  # fmt: skip


EXPERIMENTS.add("saatp-train", SaatpTrain())
