"""DDP hooks in real training: iteration time per hook and model (``bench ddp``).

The dense MLP (32 MB of dense gradients), NeuMF (sparse embeddings) and the
mixed recommender (a large embedding bag plus a dense MLP), each trained by 2
gloo ranks under torchrun with DDP's built-in all-reduce, ``omnireduce_hook``
and ``auto_hook`` side by side, and the embeddings' stock option
(``sparse=True`` under plain DDP) beside ``auto_hook`` on the same
``sparse=True`` tables, iterations interleaved; each rank in a
network namespace behind a tbf-shaped link (loopback where namespaces are
unavailable, said so in the notes). Quick: one link rate (1 Gbit/s); full:
loopback, 1 and 10 Gbit/s. The mixed model's claims: ``auto_hook`` against
the best fixed choice on the same footing, with SGD (``sparse=True`` tables:
every option, the stock one included) and on dense gradients (what Adam and
AdamW need: DDP's all-reduce and ``omnireduce_hook``).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gradfabric.experiments import plots
from gradfabric.experiments.registry import EXPERIMENTS, Claim, ExperimentResult, Tick, reaches
from gradfabric.lab.ddp_bench import HOOKS, DdpBenchConfig, paired, run_ddp_bench
from gradfabric.net.netns import usable


class DdpHooks:
    name = "ddp"
    title = "DDP hooks: iteration time per hook and model (default, omnireduce, auto)"
    main_job = False  # checks, not a headline (sparse-train's is auto_hook's): its own command

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult:
        # the hooks; the stock option for embeddings (nn.Embedding(sparse=True)), and
        # auto_hook on such tables (``sparse+auto``), as a model trained with SGD would run it
        base = DdpBenchConfig(steps=12 if quick else 33, warmup=2 if quick else 3,
                              hooks=(*HOOKS, "sparse", "sparse+auto"))  # fmt: skip
        links: list[float | None] = [1.0] if quick else [None, 1.0, 10.0]
        notes = []
        if not usable():
            links = [None]
            notes.append("Network namespaces unavailable: the hooks ran on loopback only.")
        rows: list[dict[str, Any]] = []
        for link in links:
            tick(f"bench ddp, {'loopback' if link is None else f'{link:g} Gbit/s'}")
            rows += run_ddp_bench(replace(base, link_gbps=link))
        config = {"bench": asdict(base), "links": links}
        res = ExperimentResult(self.name, self.title, rows=rows, config=config, notes=notes)

        def at(model: str, hook: str, link: float | None) -> dict[str, Any]:
            key = (model, hook, link)
            return next(r for r in rows if (r["model"], r["hook"], r["link_gbps"]) == key)

        def against_fixed(
            ours: str, fixed: tuple[str, ...], link: float | None, what: str
        ) -> Claim:
            """auto_hook (as ``ours``) on the mixed model against the fastest of
            the ``fixed`` choices, paired; met where the interval reaches 1."""
            where = "loopback" if link is None else f"{link:g} Gbit/s"
            ms = {h: at("mixed", h, link)["iter_ms"] for h in (*fixed, ours)}
            best = min(fixed, key=ms.__getitem__)
            vs, half = paired(at("mixed", best, link)["iter_ms_all"],
                              at("mixed", ours, link)["iter_ms_all"])  # fmt: skip
            return Claim(
                "hooks", f"mixed model, {what}: auto_hook, ratio of mean step times, paired 95% "
                f"interval ({where})", "training", f"the best fixed choice ({best})",
                f"{vs:.3f} ± {half:.3f}x", ">= 1.0x", reaches(vs + half, 1.0), kind="goal",
                speedup=vs, note="met where the interval reaches 1; median steps: "
                + ", ".join(f"{h} {t:.0f} ms" for h, t in ms.items())
                + f" ({len(at('mixed', ours, link)['iter_ms_all'])} steps)",
            )  # fmt: skip

        for link in links:
            where = "loopback" if link is None else f"{link:g} Gbit/s"
            worst = min(at("mlp", h, link)["speedup_vs_default"] for h in ("omnireduce", "auto"))
            neumf = at("neumf", "auto", link)["speedup_vs_default"]
            res.claims += [
                Claim("hooks", f"dense model: the slower of omnireduce_hook and auto_hook "
                      f"({where})", "training", "DDP's own all-reduce", f"{worst:.3f}x",
                      ">= 0.95x", reaches(worst, 0.95), kind="goal", speedup=worst,
                      note="8x1024x1024 MLP, 32 MB of gradients, 4 MB buckets, 2 ranks; "
                      f"NeuMF auto_hook vs default {neumf:.2f}x"),
                # SGD: every option, the stock sparse=True one included, against
                # auto_hook on the same sparse=True table
                against_fixed("sparse+auto", ("default", "omnireduce", "sparse"), link,
                              "sparse=True table (SGD)"),
                # Adam, AdamW (no sparse=True): the options on dense gradients
                against_fixed("auto", ("default", "omnireduce"), link,
                              "dense gradients (any optimizer)"),
            ]  # fmt: skip
            shown = [r for r in rows if r["link_gbps"] == link]
            name = "loopback" if link is None else f"{link:g}g"
            for r in shown:
                r.pop("iter_ms_all", None)
            res.plots.append(
                plots.grouped_bars(
                    shown, "model", "hook", "iter_ms", "iteration time (ms, median)",
                    f"DDP per hook, 2 gloo ranks, {where}", out / f"ddp_hooks_{name}.png",
                ).name
            )  # fmt: skip
        return res


EXPERIMENTS.add("ddp", DdpHooks())
