"""The emulator in the reproduction suite: real DDP training (4 gloo ranks,
digits MLP) through the software switch with each policy, against DDP's
default hook on the same batches; ATP against SA-ATP over UDP with one worker
slowed; DLCP against reliable transport through the switch's congested
priority port; and the switch against gloo all-reduce, on loopback and (where
network namespaces can be made) on the shaped star of 1 Gbit/s links, beside
the simulator's prediction for that star. The switch sends each result once,
to the job's multicast group (``--multicast``), as SwitchML's and ATP's
switches do with their packet replication engine: unicast copies would cost
the daemon, which shares the host's cores, a send per worker."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.core.stats import ratio_ci_apart
from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick, reaches
from gradfabric.lab.dlcp_udp import DlcpEmuConfig, run_emu_dlcp, summary_row
from gradfabric.lab.saatp_udp import SaatpEmuConfig, run_emu_saatp
from gradfabric.lab.switch_bench import SwitchBenchConfig, run_switch_bench
from gradfabric.lab.switch_train import EmuTrainConfig, run_emu_training
from gradfabric.net import netns
from gradfabric.net.udp import datagram_bytes, default_values
from gradfabric.proto.schemes import InaConfig
from gradfabric.runtime.client import fast_retransmit
from gradfabric.runtime.switchd import default_window
from gradfabric.sim.collective import Bucket, FabricConfig, run_collective
from gradfabric.sim.flow import Clos, plan, schedule
from gradfabric.sim.network import LinkSpec
from gradfabric.wire.packet import VALUE_BYTES

EMULATED = ("switchml", "atp", "esa")
LOSS = 0.05  # the share of UDP the kernel drops at the switch in the loss row


class Emulator:
    name = "emulator"
    title = "Emulator: DDP training through the software switch (UDP)"

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        steps = 8 if quick else 60
        policies = EMULATED[:2] if quick else EMULATED  # (quick: ESA's pool in esa-train)
        cfgs = [EmuTrainConfig(policy=p, steps=steps, loss=0.05) for p in policies]
        config = {"training": [asdict(c) for c in cfgs]}
        res = ExperimentResult(self.name, self.title, config=config)
        curves: dict[str, list[float]] = {}
        for cfg in cfgs:
            tick(f"training through {cfg.policy}, 5% loss")
            rec = run_emu_training(cfg)
            c = rec["switch"]["counters"]
            res.rows.append(
                {
                    "policy": cfg.policy,
                    "ranks": cfg.ranks,
                    "switch_loss": cfg.loss,
                    "max_loss_diff": rec["max_loss_diff"],
                    "weights_max_diff": rec["weights_max_diff"],
                    "replica_spread": rec["replica_spread"],
                    "accuracy_default": rec["accuracy"]["default"],
                    "accuracy_switch": rec["accuracy"]["switch"],
                    "default_ms": rec["default_ms"],
                    "switch_ms": rec["switch_ms"],
                    "impair_loss": c.get("impair_loss", 0),
                    "rx_gradient": c.get("rx_gradient", 0),
                }
            )
            curves.setdefault("default hook", rec["loss"]["default"])
            curves[f"switch ({cfg.policy})"] = rec["loss"]["switch"]
        worst = max(r["max_loss_diff"] for r in res.rows)
        res.claims.append(
            Claim(
                "in-network aggregation", f"DDP through the switch ({'/'.join(policies)}, 5% "
                "loss) follows the default hook's loss curve", "training", "DDP's default hook",
                f"max |loss diff| {worst:.1e}", "exact aggregation (<= 1e-4)", worst <= 1e-4,
                kind="check", note=f"4 ranks, {steps} steps; replicas identical across ranks: "
                + ", ".join(f"{r['policy']} {r['replica_spread'] == 0}" for r in res.rows),
            )
        )
        res.plots.append(
            plots.lines(
                list(range(steps)), curves, "step", "training loss (global mean)",
                "digits MLP, 4 ranks: default hook vs through the software switch",
                out / "emulator_loss.png",
            ).name
        )  # fmt: skip
        for w in (2,) if quick else (2, 4):  # (quick: 4 workers on the shaped star below)
            tick(f"bench switch, {w} workers")
            row = run_switch_bench(SwitchBenchConfig(workers=w, iters=3 if quick else 10,
                                                     multicast=True))  # fmt: skip
            row.pop("switch_counters")
            res.rows.append(row)
        sa_cfg = SaatpEmuConfig(iterations=5 if quick else 10)
        sa = {}
        for helped in (False, True):
            tick("ATP vs SA-ATP over UDP" + (", helped" if helped else ""))
            r = run_emu_saatp(sa_cfg, helped)
            sa[helped] = r
            res.rows.append(
                {"scheme": "saatp-udp" if helped else "atp-udp", "slowdown": sa_cfg.slowdown,
                 "iter_time_ms": r["median_iteration_ms"], "helps": r["helps_sent"],
                 "exact": r["exact"]}
            )  # fmt: skip
        cut = 1 - sa[True]["median_iteration_ms"] / sa[False]["median_iteration_ms"]
        res.claims.append(
            Claim(
                "SA-ATP", "iteration time down, one worker 4x slower (a sleep)", "udp", "ATP",
                f"{cut * 100:.0f}% lower ({1 / (1 - cut):.2f}x)", "57% lower (2.33x)", cut >= 0.57,
                speedup=1 / (1 - cut), headline=True,
                note=f"{sa_cfg.workers} worker processes, compute {sa_cfg.compute_ms:g} ms (a "
                f"sleep): ATP {sa[False]['median_iteration_ms']:.0f} ms, SA-ATP "
                f"{sa[True]['median_iteration_ms']:.0f} ms per iteration; all sums exact: "
                f"{sa[False]['exact'] and sa[True]['exact']}",
            )
        )
        dl_cfg = DlcpEmuConfig(rounds=2 if quick else 5)
        dl = {}
        for reliable in (True, False):
            tick("DLCP over UDP" + (", reliable" if reliable else ""))
            r = run_emu_dlcp(dl_cfg, reliable)
            dl[reliable] = r
            res.rows.append(summary_row(r) | {"scheme": f"{r['scheme']}-udp"})
        got = res.rows[-1]
        res.claims.append(
            Claim(
                "DLCP", "bounded-loss completion under congestion; small gradients dropped first",
                "udp", "the loss bounds", f"lost {got['lost_push']:.3f} push, "
                f"{got['lost_pull']:.3f} pull", "<= 0.1 push, <= 0.02 pull",
                got["lost_push"] <= 0.1 and got["lost_pull"] <= 0.02, kind="check",
                headline=True, note="port drop rate by precedence (0: largest gradients): "
                + ", ".join(f"{got[f'drop_rate_p{d}']:.1%}" for d in range(4))
                + f"; round {dl[False]['round_ms']:.0f} ms vs reliable "
                f"{dl[True]['round_ms']:.0f} ms",
            )
        )
        if netns.usable():
            self._on_shaped_links(quick, out, tick, res)
        two = next(r for r in res.rows if r.get("workers") == 2 and r.get("link_gbps") is None)
        res.claims.append(
            Claim(
                "in-network aggregation", "gradient goodput per switch core", "udp", "",
                f"{two['switch_cpu_gbps']:.2f} Gbit/s", ">= 2 Gbit/s", two["switch_cpu_gbps"] >= 2,
                kind="goal",
                note=f"2 workers, 4 MB on loopback: {two['switch_ms']:.0f} ms through the "
                f"switch vs {two['gloo_ms']:.1f} ms gloo; datapath: {two['datapath']}",
            )
        )
        return res

    def _on_shaped_links(self, quick: bool, out: Path, tick: Tick, res: ExperimentResult) -> None:
        """The switch against gloo's ring where in-network aggregation is
        meant to win: 4 workers each behind one 1 Gbit/s link, the daemon
        where the ToR switch sits (a real run, ``bench switch --link-gbps``),
        beside the simulator's prediction for the same star, both against
        their bytes floors."""
        tick("bench switch, 4 workers behind 1 Gbit/s links")
        # the daemon's defaults (its datagrams and window from the links' MTU, results
        # multicast, the offloads on); RTO 5 ms for this run and the lossy one below:
        # their repairs wait on it, no lossless sum does
        cfg = SwitchBenchConfig(workers=4, tensor_mb=32, iters=5 if quick else 9, link_gbps=1.0,
                                rto_ms=5.0)  # fmt: skip
        row = run_switch_bench(cfg)
        row.pop("switch_counters")
        res.rows.append(row | {"setting": "shaped star"})
        self._at_mtu_1500(tick, res, cfg)
        atp = None
        if not quick:  # (quick: the 1500-byte run in its time)
            tick("bench switch, the same star, ATP")
            atp = run_switch_bench(replace(cfg, policy="atp"))
            atp.pop("switch_counters")
            res.rows.append(atp | {"setting": "shaped star, ATP"})
        sim = _simulated(cfg, int(cfg.tensor_mb * 1e6 / 4))
        bars = [
            {"way": way, "what": what, "ms": ms}
            for way, measured, simulated, floor in (
                ("switch (SwitchML)", row["switch_ms"], sim["switchml"], row["floor_ms"]),
                *([("switch (ATP)", atp["switch_ms"], None, atp["floor_ms"])] if atp else []),
                ("gloo ring", row["gloo_ms"], sim["ring"], row["ring_floor_ms"]),
            )
            for what, ms in (("measured", measured), ("simulated", simulated),
                             ("bytes floor", floor))
            if ms is not None  # (ATP's PS at the switch is not a star the simulator builds)
        ]  # fmt: skip
        res.plots.append(
            plots.grouped_bars(
                bars, "way", "what", "ms", "time per 32 MB sum (ms)",
                "4 workers behind 1 Gbit/s links: time against the bytes floor",
                out / "switch_vs_ring_shaped.png",
            ).name
        )  # fmt: skip
        bound = 2 * (cfg.workers - 1) / cfg.workers
        res.claims.append(
            Claim(
                "in-network aggregation", "all-reduce over real links (4 workers, 1 Gbit/s each, "
                "32 MB)", "udp", "gloo's ring all-reduce on the same links",
                f"{row['speedup']:.2f}x", f"{bound:.2f}x (the bytes bound; 90% of it met)",
                row["speedup"] >= 0.9 * bound, kind="check", speedup=row["speedup"],
                headline=True,
                note=f"switch {row['switch_ms']:.0f} ms ({row['floor_ratio']:.2f}x its floor), "
                f"gloo {row['gloo_ms']:.0f} ms ({row['ring_floor_ratio']:.2f}x its floor); the "
                f"simulator predicts {sim['switchml']:.0f} vs {sim['ring']:.0f} ms "
                f"({sim['ring'] / sim['switchml']:.2f}x; flow level "
                f"{sim.get('switchml@flow', math.nan):.0f} vs {sim.get('ring@flow', math.nan):.0f}"
                f" ms); datapath: {row['datapath']}; "
                f"results {'multicast' if row['multicast'] else 'unicast'}",
            )
        )
        if atp is not None:
            res.claims.append(
                Claim(
                    "in-network aggregation", "all-reduce over real links through ATP's pool (4 "
                    "workers, 1 Gbit/s each, 32 MB)", "udp",
                    "gloo's ring all-reduce on the same links", f"{atp['speedup']:.2f}x",
                    f"{bound:.2f}x (the bytes bound; 90% of it met)",
                    atp["speedup"] >= 0.9 * bound, kind="check", speedup=atp["speedup"],
                    note=f"ATP, its fallback PS hosted at the switch: {atp['switch_ms']:.0f} ms "
                    f"({atp['floor_ratio']:.2f}x its floor), gloo {atp['gloo_ms']:.0f} ms in the "
                    f"same run; datapath: {atp['datapath']}",
                )
            )
        self._under_loss(tick, res, cfg, row, sim["switchml"])
        self._ddp_on_shaped_links(quick, out, tick, res, cfg)

    def _at_mtu_1500(self, tick: Tick, res: ExperimentResult, star: SwitchBenchConfig) -> None:
        """The same star at the MTU most networks run, everything the daemon's
        default (no flag: its datagrams of 358 values, a window of 183, the
        offloads), gloo's ring on the same links at the same MTU."""
        tick("bench switch, the same star at MTU 1500, the daemon's defaults")
        cfg = SwitchBenchConfig(workers=4, tensor_mb=32, iters=star.iters, link_gbps=1.0,
                                mtu=1500)  # fmt: skip
        row = run_switch_bench(cfg)
        c = row.pop("switch_counters")
        res.rows.append(row | {"setting": "shaped star, MTU 1500"})
        # the bytes bound: the ring's 2(n-1)/n of the data against the switch's once,
        # each frame with its headers: a datagram's IP, UDP, token and header, a TCP
        # segment's IP and TCP with timestamps (52), and Ethernet's 14 each
        payload = VALUE_BYTES * cfg.values_per_packet
        ours = payload / (datagram_bytes(cfg.values_per_packet) + 14)
        ring = (cfg.mtu - 52) / (cfg.mtu + 14)
        bound = 2 * (cfg.workers - 1) / cfg.workers * ours / ring
        res.claims.append(
            Claim(
                "in-network aggregation", "all-reduce over real links at MTU 1500, the "
                "daemon's defaults (4 workers, 1 Gbit/s each, 32 MB)", "udp",
                "gloo's ring all-reduce on the same links, same MTU",
                f"{row['speedup']:.2f}x", f">= 1.2x (bytes bound {bound:.2f}x)",
                row["speedup"] >= 1.2, kind="goal", speedup=row["speedup"], headline=True,
                note=f"switch {row['switch_ms']:.0f} ms ({row['floor_ratio']:.2f}x its floor), "
                f"gloo {row['gloo_ms']:.0f} ms; {cfg.values_per_packet} values a datagram, a "
                f"window of {cfg.job_slots}; CPU per sum: switch {row['switch_cpu_s']:.3f} s, "
                f"slowest worker {row['worker_cpu_s']:.3f} s; the switch's {c['tx_datagrams']} "
                f"datagrams out left in {c.get('gso_sends', 0)} segmented sends, "
                f"{c.get('gro_reads', 0)} coalesced reads in; results "
                f"{'multicast' if row['multicast'] else 'unicast'}",
            )
        )

    def _under_loss(
        self, tick: Tick, res: ExperimentResult, cfg: SwitchBenchConfig, lossless: dict[str, Any],
        sim_lossless: float,
    ) -> None:
        """The same sums with ``LOSS`` of the UDP reaching the switch dropped
        by the kernel (nftables), against the lossless run just before, beside
        the simulator's prediction for the same star with the same loss on its
        uplinks (the workers' loss notices, fast retransmit and pacing as the
        emulator's clients set them)."""
        tick(f"bench switch under {LOSS:.0%} loss at the switch")
        lossy_cfg = replace(cfg, kernel_loss=LOSS)
        row = run_switch_bench(lossy_cfg)
        counters = row.pop("switch_counters")
        res.rows.append(row | {"setting": f"shaped star, {LOSS:.0%} loss at the switch"})
        est = ratio_ci_apart(lossless["switch_ms_all"], row["switch_ms_all"])
        values = int(cfg.tensor_mb * 1e6 / 4)
        predicted = sim_lossless / _simulated(lossy_cfg, values, ("switchml",))["switchml"]
        exact = row["max_error"] <= 1e-4 * cfg.workers
        res.claims.append(
            Claim(
                "in-network aggregation", f"all-reduce under {LOSS:.0%} loss at the switch "
                "(4 workers, 1 Gbit/s each, 32 MB), speed against the same sums without loss",
                "udp",
                "the lossless run just before (ratio of mean times, 95% interval)",
                f"{est.mean:.2f}x ± {est.half:.2f}",
                ">= 0.8x, the 95% interval's lower end, and exact",
                exact and est.lo >= 0.8, kind="goal", speedup=est.mean,
                note=f"{row['switch_ms']:.0f} ms against {lossless['switch_ms']:.0f} ms lossless "
                f"(medians of {cfg.iters} sums each); the simulator predicts {predicted:.2f}x "
                f"for the same star ({sim_lossless:.0f} ms lossless); over the run's "
                f"{cfg.warmup + cfg.iters} sums (the warm-ups' included) the kernel dropped "
                f"{row.get('kernel_dropped', 0)} datagrams and the switch sent "
                f"{counters.get('nack_sent', 0)} loss notices; largest error "
                f"{row['max_error']:.1e} against gloo's sum",
            )
        )

    def _ddp_on_shaped_links(
        self, quick: bool, out: Path, tick: Tick, res: ExperimentResult, star: SwitchBenchConfig
    ) -> None:
        """DDP training through the switch on the same star (``bench ddp
        --models mlp,transformer --hooks default,ina,ina@16``): the 8x1024
        MLP's 32 MB of gradients and the small transformer's 21 MB, the
        default hook at its best bucket size (4 MB; 16 and 32 measured
        slower) against ``ina_hook`` at 4 and at 16 MB, one interleaved run
        through a SwitchML switch, then the MLP with the default hook against
        ``ina_hook`` at 16 MB through an ATP switch; each step against its
        scheme's bytes floor and the simulator's time for the same sum
        (communication only, as the floor; SwitchML's and the ring's), and
        where each bucket's sum fell in the step (``bench ddp``'s timeline).
        The claims take the bucket size fixed before the run: 16 MB for the
        MLP (its best in every run since the switch's native datapath), 4 MB
        for the transformer (its best in five runs of five,
        docs/notebook/2026-11-28.md#ddp-through-switch-bucket)."""
        from gradfabric.lab.ddp_bench import DdpBenchConfig, run_ddp_bench

        tick("DDP through the switch, 4 ranks behind 1 Gbit/s links")
        cfg = DdpBenchConfig(models=("mlp", "transformer"), ranks=4, link_gbps=1.0,
                             steps=12 if quick else 23, warmup=2 if quick else 3,
                             hooks=("default", "ina", "ina@16"), switch_policy="switchml",
                             switch_multicast=True)  # fmt: skip
        rows = run_ddp_bench(cfg)
        tick("DDP through the switch at MTU 1500, the daemon's defaults")
        at1500 = run_ddp_bench(replace(cfg, models=("mlp",), hooks=("default", "ina@16"),
                                       mtu=1500))  # fmt: skip
        atp: list[dict[str, Any]] = []
        if not quick:  # (quick: the 1500-byte run in its time)
            tick("DDP through an ATP switch, the same star")
            atp = run_ddp_bench(replace(cfg, models=("mlp",), hooks=("default", "ina@16"),
                                        switch_policy="atp"))  # fmt: skip
        grad_mb = {m: next(r for r in rows if r["model"] == m)["grad_mb"] for m in cfg.models}
        floors: dict[str, dict[str, float]] = {}  # model -> scheme -> ms at 1 Gbit/s
        sims: dict[str, dict[str, float]] = {}  # the simulator's sum, the same
        for model, mb in grad_mb.items():
            values = int(mb * 2**20 / 4)
            sim = _simulated(replace(star, job_slots=cfg.switch_window), values)
            bits = values * 32
            floors[model] = {"default": 2 * 3 / 4 * bits / 1e6, "ina": bits / 1e6}
            sims[model] = {"default": sim["ring"], "ina": sim["switchml"],
                           "default@flow": sim.get("ring@flow", math.nan),
                           "ina@flow": sim.get("switchml@flow", math.nan)}
        bars: dict[str, list[dict[str, Any]]] = {model: [] for model in cfg.models}
        for r in rows + atp[1:]:
            r.pop("iter_ms_all")
            scheme = "default" if r["hook"] == "default" else "ina"
            floor = floors[r["model"]]
            r |= {"setting": "DDP, shaped star", "bytes_floor_ms": floor[scheme]}
            res.rows.append(r)
            through = "" if scheme == "default" else f", {r['switch_policy']}"
            label = f"{r['hook']}{through}\n{r['bucket_cap_mb']:g} MB buckets"
            bars[r["model"]] += [
                {"hook": label, "what": "measured step", "ms": r["iter_ms"]},
                {"hook": label, "what": "bytes floor", "ms": floor[scheme]},
            ]
            if r.get("switch_policy") != "atp" or scheme == "default":
                bars[r["model"]] += [
                    {"hook": label, "what": "simulated sum", "ms": sims[r["model"]][scheme]},
                    {"hook": label, "what": "simulated sum (flow level)",
                     "ms": sims[r["model"]][f"{scheme}@flow"]},
                ]  # fmt: skip
        for model, mb in grad_mb.items():
            res.plots.append(
                plots.grouped_bars(
                    bars[model], "hook", "what", "ms", "time per step (ms)",
                    f"DDP, {model} ({mb:.0f} MB of gradients), 4 ranks behind 1 Gbit/s links",
                    out / f"ddp_switch_shaped{'' if model == 'mlp' else '_' + model}.png",
                ).name
            )  # fmt: skip
        res.plots.append(
            plots.step_timeline(
                rows, "DDP through the switch, 4 ranks behind 1 Gbit/s links\neach bucket on "
                "the hook's thread (rank 0, medians)", out / "ddp_switch_timeline.png",
            ).name
        )  # fmt: skip

        def row(model: str, hook: str, among: list[dict[str, Any]] = rows) -> dict[str, Any]:
            return next(r for r in among if (r["model"], r["hook"]) == (model, hook))

        mlp, default = row("mlp", "ina@16"), row("mlp", "default")
        ratio, half = mlp["paired_vs_default"]
        res.claims.append(
            Claim(
                "in-network aggregation", "DDP step through the switch (4 ranks, 1 Gbit/s each, "
                "MLP)", "training", "DDP's default hook (gloo ring, its best bucket size)",
                f"{ratio:.2f}x ± {half:.2f}", ">= 1.3x (bytes bound 1.5x)", reaches(ratio, 1.3),
                kind="goal", speedup=ratio, headline=True,
                note=f"ina_hook, 16 MB buckets, {mlp['iter_ms']:.0f} ms per step against the "
                f"default hook's {default['iter_ms']:.0f} ms (4 MB buckets, its best); bytes "
                f"floors {floors['mlp']['ina']:.0f} and {floors['mlp']['default']:.0f} ms; the "
                f"simulator's sum of the step's gradients {sims['mlp']['ina']:.0f} and "
                f"{sims['mlp']['default']:.0f} ms (flow level {sims['mlp']['ina@flow']:.0f} and "
                f"{sims['mlp']['default@flow']:.0f}); ratio of mean step times, paired 95% "
                f"interval, {cfg.steps - cfg.warmup} steps" + _busy(mlp, default),
            )
        )
        lm, default = row("transformer", "ina"), row("transformer", "default")
        ratio, half = lm["paired_vs_default"]
        res.claims.append(
            Claim(
                "in-network aggregation", "DDP step through the switch (4 ranks, 1 Gbit/s each, "
                "the transformer)", "training", "DDP's default hook (gloo ring, its best bucket "
                "size)", f"{ratio:.2f}x ± {half:.2f}", "faster: the 95% interval above 1x",
                ratio - half > 1, kind="check", speedup=ratio,
                note=f"ina_hook, 4 MB buckets, {lm['iter_ms']:.0f} ms per step against the "
                f"default hook's {default['iter_ms']:.0f} ms (4 MB buckets); bytes floors "
                f"{floors['transformer']['ina']:.0f} and {floors['transformer']['default']:.0f} "
                f"ms; compute is most of this model's step; weights within "
                f"{lm['max_param_diff_vs_default']:.1e} of the default hook's (SwitchML's block "
                "quantisation)",
            )
        )
        for r in at1500:
            r.pop("iter_ms_all")
            res.rows.append(r | {"setting": "DDP, shaped star, MTU 1500"})
        mlp, default = row("mlp", "ina@16", at1500), row("mlp", "default", at1500)
        v = default_values(1500)
        ratio, half = mlp["paired_vs_default"]
        res.claims.append(
            Claim(
                "in-network aggregation", "DDP step through the switch at MTU 1500, the "
                "daemon's defaults (4 ranks, 1 Gbit/s each, MLP)", "training",
                "DDP's default hook (gloo ring, its best bucket size), same links and MTU",
                f"{ratio:.2f}x ± {half:.2f}", "no slower: the 95% interval reaches 1x",
                ratio + half >= 1, kind="goal", speedup=ratio, headline=True,
                note=f"ina_hook, 16 MB buckets, {mlp['iter_ms']:.0f} ms per step against the "
                f"default hook's {default['iter_ms']:.0f} ms (4 MB buckets) in the same run "
                f"(interleaved); the switch with no flag ({v} values a datagram, a window of "
                f"{default_window(v)}); ratio of mean step "
                f"times, paired 95% "
                f"interval, {cfg.steps - cfg.warmup} steps" + _busy(mlp, default),
            )
        )
        if not atp:
            return
        mlp, default = row("mlp", "ina@16", atp), row("mlp", "default", atp)
        ratio, half = mlp["paired_vs_default"]
        res.claims.append(
            Claim(
                "in-network aggregation", "DDP step through an ATP switch (4 ranks, 1 Gbit/s "
                "each, MLP)", "training", "DDP's default hook (gloo ring, its best bucket size)",
                f"{ratio:.2f}x ± {half:.2f}", ">= 1.3x (bytes bound 1.5x)", reaches(ratio, 1.3),
                kind="goal", speedup=ratio,
                note=f"ina_hook, 16 MB buckets, {mlp['iter_ms']:.0f} ms per step against the "
                f"default hook's {default['iter_ms']:.0f} ms in the same run (interleaved); ratio "
                f"of mean step times, paired 95% interval, {cfg.steps - cfg.warmup} steps",
            )
        )


def _busy(row: dict[str, Any], ref: dict[str, Any]) -> str:
    """What the host's cores did in the two rows' steps (``host_busy``), where read."""
    if row.get("host_busy") is None or ref.get("host_busy") is None:
        return ""
    return (f"; the host's {row['cores']} cores busy {row['host_busy']:.0%} of the step "
            f"against {ref['host_busy']:.0%} under the default hook (every process and the "
            "kernel's forwarding: the ranks, the switch and the links share them)")  # fmt: skip


def _simulated(
    cfg: SwitchBenchConfig, values: int, schemes: tuple[str, ...] = ("switchml", "ring")
) -> dict[str, float]:
    """The star ``cfg`` describes, simulated: ms for one sum of ``values``
    through SwitchML and with the ring (those of ``schemes``); 1 Gbit/s links whose queue holds what
    tbf's 20 ms does, the datagrams' values per packet, the workers' window,
    RTO, fast retransmit, loss notices and pacing (resends first), and
    ``cfg.kernel_loss`` on the links into the switch (where nftables drops
    it: UDP only, so never the ring's TCP)."""
    link = LinkSpec(link_gbps=cfg.link_gbps or 1.0, prop_delay_ns=20_000, queue_bytes=2_500_000)
    uplink = replace(link, loss=cfg.kernel_loss) if cfg.kernel_loss else None
    ina = InaConfig(values_per_packet=cfg.values_per_packet, switchml_slots=cfg.job_slots,
                    rto_ns=int(cfg.rto_ms * 1e6), nack=True, paced=True,
                    fast_retransmit=fast_retransmit(True, cfg.job_slots))  # fmt: skip
    runs = {"switchml": (FabricConfig(link=link, uplink=uplink), ina),
            "ring": (FabricConfig(link=link), InaConfig(values_per_packet=cfg.values_per_packet))}
    got = {
        scheme: run_collective(scheme, cfg.workers, [Bucket(0, values)], *run).comm_ns / 1e6
        for scheme, run in runs.items()
        if scheme in schemes
    }  # fmt: skip
    if not cfg.kernel_loss:  # and the flow level's (it has no loss), as "<scheme>@flow"
        for scheme in list(got):
            fabric, config = runs[scheme]
            p = plan(scheme, Clos.of(fabric, cfg.workers), cfg.workers, config)
            got[f"{scheme}@flow"] = schedule(p, [Bucket(0, values)]) / 1e6
    return got


EXPERIMENTS.add("emulator", Emulator())
