"""DLCP carrying real DDP training over congested links (``lab.dlcp_train``):
time to a fixed test accuracy and final accuracy, DLCP against DDP's
default hook (gloo over TCP, unmarked and marked into the top class) and
DLCP's own reliable mode, at two background loads, over seeds.

Each seed runs every scheme (the order rotating with the seed) on the same
data order, initial weights and background seed; speed-ups are paired by
seed. Full: loads 0.5 and 0.8, 5 seeds, every scheme; quick: load 0.8, 3
seeds, DLCP against the best baseline of the full study (gloo-prio) alone.

On the leaf-spine (``fabric="leaf-spine"``) the simulator's prediction for
the same fabric stands beside (``predict``): ``sim.dlcp`` with the same
racks, spines, link rates, queues, mean load and bounds, the gradient as DDP
sends it (one bucket), the server in the second rack's leaf, a FIFO per
class at every port (as the namespaces' htb classes) and the compute time
measured here. It differs in what it does not model: its background is
Poisson at the same mean (here on/off flows), its links have no token
bucket's burst (here an idle link passes 160 KB at once), its queues drop
by WRED on precedence (here at the tail), its TCP is DCTCP (gloo's is
CUBIC), its job is one tensor a step (``bucket_kb`` and ``pace_kb`` are not
passed on), and its hosts spend no CPU on a packet (here every datagram
crosses Python and the kernel). On the
star it is not run: the simulator has no star with the server at its hub.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.core.stats import mean_ci
from gradfabric.experiments import plots
from gradfabric.experiments.registry import (
    EXPERIMENTS,
    Claim,
    ExperimentResult,
    Tick,
    at_target,
    reaches,
)
from gradfabric.lab.dlcp_train import SCHEMES, DlcpTrainConfig, run_dlcp_training
from gradfabric.lab.job import data, gradient, model, shard_batch

TARGET = 0.93  # test accuracy; every scheme reaches it within the default 40 steps
BASELINES = ("gloo", "gloo-prio", "reliable")


def time_to(rec: dict[str, Any], target: float = TARGET) -> float | None:
    """Seconds of training (the slowest rank's steps, summed) until the
    first evaluation at or above ``target``; None if it never got there."""
    for step, acc in rec["evals"]:
        if at_target(acc, target):
            return float(sum(rec["times_s"][:step]))
    return None


def _split(d: dict[str, Any], b: dict[str, Any], best: str) -> str:
    """Where DLCP's CPU went beside the baseline's (rows stored before the
    split was recorded have none)."""
    if not d.get("sys_ms_per_step"):
        return ""
    user = [x["cpu_ms_per_step"] - x["sys_ms_per_step"] - x["server_ms_per_step"] for x in (d, b)]
    return (f" (ranks' user {user[0]:.0f} vs {user[1]:.0f}, ranks' kernel "
            f"{d['sys_ms_per_step']:.0f} vs {b['sys_ms_per_step']:.0f}, DLCP's server "
            f"{d['server_ms_per_step']:.0f}; {best} has no server)")  # fmt: skip


def summary(rec: dict[str, Any]) -> dict[str, Any]:
    """One run as the numbers the study keeps."""
    steps = len(rec["times_s"])
    cpu = rec["ranks_cpu_s"] + rec.get("daemon_cpu_s", 0.0)
    return {
        "step_ms": statistics.median(rec["times_s"]) * 1e3,
        "tta_s": time_to(rec),
        "accuracy": rec["evals"][-1][1],
        "loss": rec["loss"],
        "lost_push": rec.get("lost_push", 0.0),
        "lost_pull": rec.get("lost_pull", 0.0),
        "incomplete": rec.get("incomplete", 0.0),
        "late_push": rec.get("late_push", [0.0] * 4),
        "classes": rec["classes"],
        "cpu_ms_per_step": cpu / steps * 1e3,
        # of the ranks' CPU, the kernel's (sockets, and the namespaces' forwarding)
        "sys_ms_per_step": rec.get("ranks_sys_s", 0.0) / steps * 1e3,
        "server_ms_per_step": rec.get("daemon_cpu_s", 0.0) / steps * 1e3,
        "background_cpu_s": rec["background"].get("cpu_s", 0.0),
    }


def study(
    cfg: DlcpTrainConfig, seeds: int, loads: tuple[float, ...], tick: Tick | None = None,
    schemes: tuple[str, ...] = SCHEMES,
) -> dict[str, Any]:
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for load in loads:
        for seed in range(seeds):
            order = schemes[seed % len(schemes) :] + schemes[: seed % len(schemes)]
            for scheme in order:
                if tick:
                    tick(f"load {load:g}: {scheme}, seed {seed + 1}/{seeds}")
                c = replace(cfg, scheme=scheme, load=load, seed=cfg.seed + seed)
                runs.setdefault((load, scheme), []).append(summary(run_dlcp_training(c)))
    rows = []
    for (load, scheme), rs in runs.items():
        tta = [r["tta_s"] for r in rs if r["tta_s"] is not None]
        t, a, s = (
            mean_ci(tta) if tta else None,
            mean_ci([r["accuracy"] for r in rs]),
            mean_ci([r["step_ms"] for r in rs]),
        )
        late = [r["late_push"] for r in rs]
        drops = {c: sum(r["classes"][c]["dropped"] for r in rs) for c in rs[0]["classes"]}
        sent = {c: sum(r["classes"][c]["sent"] for r in rs) for c in rs[0]["classes"]}
        rows.append({
            "load": load, "scheme": scheme, "runs": len(rs), "reached": len(tta),
            "tta_s": t.mean if t else None, "tta_s_half": t.half if t else None,
            "step_ms": s.mean, "step_ms_half": s.half,
            "accuracy": a.mean, "accuracy_half": a.half,
            "lost_push": statistics.fmean(r["lost_push"] for r in rs),
            "lost_pull": statistics.fmean(r["lost_pull"] for r in rs),
            "incomplete": statistics.fmean(r["incomplete"] for r in rs),
            # pushed values left out of a sum, by drop precedence (0: the largest)
            "late_push": [statistics.fmean(x) for x in zip(*late, strict=True)],
            "drop_rate": {c: drops[c] / max(1, drops[c] + sent[c]) for c in drops},
            "cpu_ms_per_step": statistics.fmean(r["cpu_ms_per_step"] for r in rs),
            "sys_ms_per_step": statistics.fmean(r.get("sys_ms_per_step", 0.0) for r in rs),
            "server_ms_per_step": statistics.fmean(r.get("server_ms_per_step", 0.0) for r in rs),
            "loss": [statistics.fmean(x) for x in zip(*(r["loss"] for r in rs), strict=True)],
        })  # fmt: skip
    for load in loads:
        dl = runs[(load, "dlcp")]
        for base in _present(schemes):
            pairs = [(b["tta_s"], d["tta_s"]) for b, d in zip(runs[(load, base)], dl, strict=True)
                     if b["tta_s"] is not None and d["tta_s"] is not None]  # fmt: skip
            if not pairs:
                continue
            g = mean_ci([b / d for b, d in pairs])
            rows.append({"load": load, "scheme": f"dlcp/{base}", "speedup": g.mean,
                         "speedup_half": g.half, "pairs": len(pairs)})  # fmt: skip
    config = asdict(cfg) | {"seeds": seeds, "loads": loads, "target": TARGET,
                            "schemes": list(schemes)}  # fmt: skip
    if cfg.fabric == "leaf-spine":
        rows += [r for load in loads for r in predict(replace(cfg, load=load), seeds)]
    return {"rows": rows, "config": config}


# the simulator's schemes beside the real ones: DLCP and its reliable mode as
# they run here (a sprayed PS with priorities); gloo as a reliable ring hashed
# per flow (DCTCP, the simulator's TCP). gloo-prio has no counterpart: the
# simulator places a transport's packets by their gradients' magnitude, not
# a whole flow in the top class.
SIM_SCHEMES: dict[str, dict[str, Any]] = {
    "dlcp": {},
    "reliable": {"push_bound": 0.0, "pull_bound": 0.0},
    "gloo": {"collective": "allreduce", "transport": "dctcp", "priority": False,
             "spray": False},
}  # fmt: skip


def compute_ms(cfg: DlcpTrainConfig, steps: int = 30) -> float:
    """One rank's forward and backward pass here (median over ``steps``
    micro-batches on one thread, as the ranks run): the simulator's compute."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net, took = model(cfg), []
        data()  # loaded once, before the clock
        for step in range(steps):
            rows = shard_batch(cfg, step, 0)
            t0 = time.perf_counter()
            gradient(net, rows)
            took.append(time.perf_counter() - t0)
        return statistics.median(took) * 1e3
    finally:
        torch.set_num_threads(threads)


def predict(cfg: DlcpTrainConfig, seeds: int) -> list[dict[str, Any]]:
    """The simulator's iteration time for ``cfg``'s leaf-spine, per scheme
    of ``SIM_SCHEMES`` (mean and 95% interval over ``seeds``)."""
    from gradfabric.sim.dlcp import DlcpConfig, run_dlcp

    if cfg.duty >= 1:  # background always on: the simulator's sources take < 1 of a link
        return []
    params = sum(p.numel() for p in model(cfg).parameters())
    base = DlcpConfig(
        workers=cfg.workers, tensors=(params,), push_bound=cfg.push_bound,
        pull_bound=cfg.pull_bound, load=cfg.duty,
        background_hosts=cfg.bg_hosts, link_gbps=cfg.link_mbps / 1000,
        queue_bytes=cfg.queue_kb * 1024, spines=cfg.spines, iterations=10,
        compute_ms=compute_ms(cfg), rto_ns=int(cfg.rto_ms * 1e6), horizon_s=30.0,
        per_packet=cfg.values_per_packet, server="leaf", class_buffers=True,
    )  # fmt: skip
    rows = []
    for scheme, over in SIM_SCHEMES.items():
        its = []
        for s in range(seeds):
            # unfinished within the horizon: counted, not averaged
            with contextlib.suppress(RuntimeError):
                its.append(run_dlcp(replace(base, seed=cfg.seed + s, **over)).iteration_ms)
        m = mean_ci(its) if its else None
        rows.append({"load": cfg.load, "scheme": f"sim:{scheme}",
                     "step_ms": m.mean if m else None, "step_ms_half": m.half if m else None,
                     "unfinished": seeds - len(its), "runs": seeds,
                     "compute_ms": base.compute_ms})  # fmt: skip
    return rows


def _present(schemes: tuple[str, ...] | list[str]) -> list[str]:
    """The baselines among ``schemes``, in ``BASELINES``' order."""
    return [b for b in BASELINES if b in schemes]


def _at(res: dict[str, Any], load: float, scheme: str) -> dict[str, Any]:
    return next(r for r in res["rows"] if r["load"] == load and r["scheme"] == scheme)


def best_baseline(res: dict[str, Any], load: float) -> str:
    """The baseline with the shortest mean time to the target (a baseline
    that never reached it is not the best)."""
    ran = _present(res["config"].get("schemes", SCHEMES))
    reached = [b for b in ran if _at(res, load, b)["tta_s"] is not None]
    return min(reached or ran, key=lambda b: _at(res, load, b)["tta_s"] or float("inf"))


def _reached(row: dict[str, Any]) -> str:
    """`` (reached in k of n runs)`` where a scheme missed the target in some."""
    k, n = row.get("reached"), row.get("runs")
    return "" if k is None or k == n else f" (reached in {k} of {n} runs)"


def claims(res: dict[str, Any]) -> list[Claim]:
    out = []
    for load in res["config"]["loads"]:
        best = best_baseline(res, load)
        d, b = _at(res, load, "dlcp"), _at(res, load, best)
        g = next((r for r in res["rows"] if r["scheme"] == f"dlcp/{best}" and r["load"] == load),
                 None)  # fmt: skip
        ours = "not reached" if g is None else f"{g['speedup']:.2f}x ± {g['speedup_half']:.2f}"
        others = ", ".join(
            (f"{s} {_at(res, load, s)['tta_s']:.2f} s" if _at(res, load, s)["tta_s"] else f"{s} -")
            + _reached(_at(res, load, s))
            for s in res["config"].get("schemes", SCHEMES)
        )
        where = (
            f"DDP over a {res['config']['spines']}-spine leaf-spine, bursty load {load:g}"
            if res["config"].get("fabric") == "leaf-spine"
            else f"DDP over congested links (load {load:g})"
        )
        sim = {r["scheme"][4:]: r for r in res["rows"]
               if r["scheme"].startswith("sim:") and r["load"] == load}  # fmt: skip
        beside = "" if not sim else "; the simulator's step for the same fabric: " + ", ".join(
            f"{k} {v['step_ms']:.1f} ms" if v["step_ms"] is not None else f"{k} -"
            for k, v in sim.items()
        ) + "".join(
            f", {k} unfinished in {v['unfinished']}/{v['runs']} runs"
            for k, v in sim.items() if v["unfinished"]
        ) + " (measured: " + ", ".join(
            f"{k} {_at(res, load, k)['step_ms']:.1f} ms" for k in sim
            if k in res["config"].get("schemes", SCHEMES)
        ) + ")"
        out.append(Claim(
            "DLCP", f"{where}: time to "
            f"{res['config']['target'] * 100:.0f}% test accuracy", "training",
            f"the best baseline: {best}", ours, "84.3% faster (1.84x)",
            False if g is None else reaches(g["speedup"], 1.843),
            speedup=None if g is None else g["speedup"],
            headline=load == max(res["config"]["loads"]),
            note=f"{res['config']['seeds']} seeds, paired 95% intervals; time to target: {others}; "
            f"final accuracy DLCP {d['accuracy'] * 100:.1f}% vs {best} "
            f"{b['accuracy'] * 100:.1f}%; DLCP lost {d['lost_push'] * 100:.1f}% of pushed and "
            f"{d['lost_pull'] * 100:.1f}% of pulled values, {d['incomplete'] * 100:.1f}% of "
            f"summed values miss a contribution; CPU per step (ranks and server) DLCP "
            f"{d['cpu_ms_per_step']:.0f} ms vs {best} {b['cpu_ms_per_step']:.0f} ms"
            f"{_split(d, b, best)}{beside}",
        ))  # fmt: skip
    return out


def draw(res: dict[str, Any], out: Path) -> list[str]:
    link = "a leaf-spine's" if res["config"].get("fabric") == "leaf-spine" else "congested"
    rows = [r | {"load_label": f"load {r['load']:g}"} for r in res["rows"]
            if r["scheme"] in SCHEMES and r.get("tta_s") is not None]  # fmt: skip
    bars = plots.grouped_bars(
        rows, "load_label", "scheme", "tta_s",
        f"seconds to {res['config']['target'] * 100:.0f}% test accuracy",
        f"DLCP vs gloo and reliable mode, real DDP over {link} 50 Mbit/s links",
        out / "dlcp_train_tta.png", err="tta_s_half",
    ).name  # fmt: skip
    hi = max(res["config"]["loads"])
    curves = {r["scheme"]: r["loss"] for r in res["rows"] if r["load"] == hi and "loss" in r}
    steps = len(next(iter(curves.values())))
    loss = plots.lines(
        list(range(1, steps + 1)), curves, "step", "training loss (mean over seeds)",
        f"DLCP training loss at load {hi:g}", out / "dlcp_train_loss.png",
    ).name  # fmt: skip
    return [bars, loss]


class DlcpTrain:
    name = "dlcp-train"
    title = "DLCP carrying real DDP training over congested links"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        from gradfabric.net.netns import nft_available, usable

        if not (usable() and nft_available()):
            why = "needs root, network namespaces and nftables; not run here"
            return ExperimentResult(self.name, self.title, notes=[f"DLCP in training {why}."])
        # quick: DLCP against the baseline the full study found best (gloo-prio) alone
        schemes = ("dlcp", "gloo-prio") if quick else SCHEMES
        res = study(DlcpTrainConfig(), 3 if quick else 5, (0.8,) if quick else (0.5, 0.8), tick,
                    schemes)  # fmt: skip
        result = ExperimentResult(self.name, self.title, rows=res["rows"], config=res["config"])
        result.claims += claims(res)
        result.plots += draw(res, out)
        return result


EXPERIMENTS.add("dlcp-train", DlcpTrain())
