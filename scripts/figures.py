"""Every measured figure in the README and the docs, generated from stored results.

    python scripts/figures.py            # rewrite the generated parts from docs/data
    python scripts/figures.py --check    # exit 1 if a generated part is stale or a
                                         # figure is typed by hand outside one
    python scripts/figures.py --import NAME RESULTS_DIR --command CMD --commit REV

A stored result (``docs/data/NAME.json``) is the ``results.json`` of the
command that measured it, with that command, the date and the commit it ran
on. The figures live in marked parts of the pages, ``<!-- fig:KEY -->`` ...
``<!-- /fig -->`` (inline or over several lines), which this script alone
writes: the README's systems table, the results page (``docs/results.md``,
every claim by system with its source), the main job's time and each
experiment's default time. Outside those parts a page may not state a measured
speed-up, interval or percentage (``HAND_TYPED``); the lab notebook
(``docs/notebook/``) is a dated history and is not checked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from gradfabric.experiments.registry import SETTINGS, Claim
from gradfabric.experiments.report import (
    CLAIM_COLUMNS,
    SYSTEMS,
    claim_rows,
    markdown,
    system_order,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
PAGES = ("README.md", "docs")  # every Markdown file under these is checked,
NOTEBOOK = ROOT / "docs" / "notebook"  # but the notebook's dated history
BLOCK = re.compile(r"<!-- fig:([\w-]+) -->(.*?)<!-- /fig -->", re.S)
# a measured figure typed by hand: a decimal speed-up or percentage, an interval
HAND_TYPED = re.compile(r"\d\.\d+ ?x\b|\d\.\d+%|±|\+-")
PAPERS = {  # what each paper claims (their words, not our measurements)
    "in-network aggregation": "line rate (SwitchML); the ring moves 2(n-1)/n of it",
    "SA-ATP": "up to 1.8x training, 57% lower iteration time",
    "ESA": "up to 1.35x average JCT",
    "DLCP": "up to 84.3% faster training",
    "OmniReduce": "up to 8.2x",
    "planner": "up to 68.59% lower batch time",
}


@dataclass
class Source:
    """One stored result: the command that measured it, when, on what code."""

    name: str
    command: str
    date: str
    commit: str
    claims: list[Claim]

    @property
    def label(self) -> str:
        return f"`{self.command}` ({self.date}, {self.commit})"

    @property
    def study(self) -> bool:  # a study of one system, not the quick suite
        return not self.command.startswith("gradfabric reproduce")


def sources() -> list[Source]:
    """The stored results, studies before the quick suite (a study's headline,
    with more runs, stands where both have one)."""
    out = []
    for path in sorted(DATA.glob("*.json")):
        d = json.loads(path.read_text())
        if "claims" not in d:
            continue  # data of another kind (timings)
        claims = [Claim(**c) for c in d["claims"]]
        out.append(Source(path.stem, d["command"], d["date"], d["commit"], claims))
    return sorted(out, key=lambda s: not s.study)


def headlines(srcs: list[Source], system: str, setting: str) -> list[tuple[Claim, Source]]:
    """The headline claims of one system in one setting, from the first source
    (in ``sources``' order) that has any."""
    for s in srcs:
        found = [(c, s) for c in s.claims
                 if c.system == system and c.setting == setting and c.headline]  # fmt: skip
        if found:
            return found
    return []


def against(c: Claim) -> str:
    """The baseline's name as a README cell gives it (its details, in
    brackets, are on the results page), and the link MTU where the claim
    names one (the same system measured at two)."""
    m = re.search(r"\bat (MTU \d+)", c.claim)
    return c.baseline.split(" (")[0].split(", same")[0] + (f" at {m.group(1)}" if m else "")


def _cell(claims: list[tuple[Claim, Source]]) -> str:
    """A README cell: ours against the baseline (``against``)."""
    return "; ".join(
        f"**{c.ours}** vs {against(c)}" + (" (not met)" if c.met is False else "")
        for c, _ in claims
    ) or "-"


def readme_table(srcs: list[Source]) -> str:
    rows = [[system, PAPERS[system], *(_cell(headlines(srcs, system, s)) for s in SETTINGS)]
            for system in SYSTEMS]  # fmt: skip
    return "\n".join(["", *markdown(["system", "paper's claim", *SETTINGS.values()], rows), ""])


def results_page(srcs: list[Source]) -> str:
    lines = [
        "",
        "# Results",
        "",
        "Every figure on this page was measured by the command beside it, on a 2-core CPU "
        "host (gloo, no GPU), and is generated from its stored result (`docs/data`) by "
        "`python scripts/figures.py`; a test fails when a page disagrees with the store. "
        "Speed-ups read ours over the baseline, above 1 better; \"met\" says whether ours "
        "reaches the paper's figure or the target.",
        "",
        "## Headlines in real runs",
        "",
        "Each system measured for real (over UDP or in DDP training) against the best thing "
        "a practitioner could run instead.",
        "",
    ]
    real = [x for system in SYSTEMS for setting in ("udp", "training")
            for x in headlines(srcs, system, setting)]  # fmt: skip
    lines += markdown([*CLAIM_COLUMNS, "measured by"],
                      claim_rows([c for c, _ in real], [[s.label] for _, s in real]))  # fmt: skip
    for system in sorted({c.system for s in srcs for c in s.claims}, key=system_order):
        mine = [(c, s) for s in srcs for c in s.claims if c.system == system]
        lines += ["", f"## {system}", ""]
        lines += markdown([*CLAIM_COLUMNS[1:], "measured by"],
                          [r[1:] for r in claim_rows([c for c, _ in mine],
                                                     [[s.label] for _, s in mine])])  # fmt: skip
        notes = [f"- {c.claim} ({SETTINGS[c.setting]}): {c.note}" for c, _ in mine if c.note]
        lines += ["", *notes] if notes else []
    return "\n".join(lines) + "\n"


def _timings() -> dict[str, Any]:
    return json.loads((DATA / "timings.json").read_text())


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {round(s % 60)} s"


def main_job_time() -> str:
    t = _timings()["main_job"]
    return f"{_minutes(t['seconds'])} on 2 cores, measured on a fresh clone at {t['commit']}"


def experiment_times() -> str:
    rows = [[f"`{r['command']}`", _minutes(r["seconds"]), f"{r['date']}, {r['commit']}"]
            for r in _timings()["experiments"]]  # fmt: skip
    return "\n".join(["", "Each default run timed alone on a fresh clone of a 2-core host "
                      "(`python scripts/time_defaults.py` measures them again):", "",
                      *markdown(["command", "wall time", "measured"], rows), ""])  # fmt: skip


def sparse_table(_: list[Source], only: tuple[str, str] | None = None) -> str:
    """Every point of the stored sparse-train studies (``only``: one link's
    and model's): each option's median step (ms) with its bytes floor (the
    bytes on the busiest link over the link's rate) in brackets, the step's
    compute alone, and ours against the best DDP option and against
    TorchRec (the faster of its two shardings), paired per step (95%)."""
    from gradfabric.experiments.sparse_train import OURS
    from gradfabric.lab.trec import SHARDINGS

    def at(p: dict[str, Any], hook: str) -> str:
        ms, floor = p["ms"].get(hook), p.get("floor_ms", {}).get(hook)
        if ms is None:
            return "-"
        return f"{ms:.0f}" + (f" ({floor:.1f})" if floor is not None else "")

    def vs(pair: list[float] | None) -> str:
        return "-" if not pair else f"{pair[0]:.2f}x ± {pair[1]:.2f}"

    rows = []
    for path in sorted(DATA.glob("sparse-train*.json")):
        stored = json.loads(path.read_text())
        for p in stored["result"]["points"]:
            if only and (p["link"], p["model"]) != only:
                continue
            rows.append([p["link"], f"{p['model']}, {p['optimizer']}", p["ranks"],
                         at(p, "default"), at(p, "sparse"),
                         " / ".join(at(p, h) for h in SHARDINGS if h in p["ms"]) or "-",
                         at(p, OURS),
                         at(p, "local"), f"{vs(p['vs_ddp'])} ({p['best_ddp']})",
                         vs(p["vs_torchrec"])])  # fmt: skip
    header = ["link", "model, optimizer", "ranks", "default hook", "sparse=True (Adam: hybrid)",
              "TorchRec (planner / column-wise; the floor: the faster's)", "ours", "compute alone",
              "ours vs best DDP option", "ours vs TorchRec"]
    return "\n".join(["", *markdown(header, rows), ""])


RENDER: dict[str, Callable[[list[Source]], str]] = {
    "sparse-train": sparse_table,
    "sparse-train-neumf": lambda srcs: sparse_table(srcs, ("1 Gbit/s", "neumf")),
    "systems-table": readme_table,
    "results": results_page,
    "main-job-time": lambda _: main_job_time(),
    "experiment-times": lambda _: experiment_times(),
}


def pages() -> Iterable[Path]:
    for p in PAGES:
        path = ROOT / p
        pages = sorted(path.rglob("*.md")) if path.is_dir() else [path]
        yield from (q for q in pages if NOTEBOOK not in q.parents)


def regenerate(text: str, srcs: list[Source]) -> str:
    def render(m: re.Match[str]) -> str:
        if m[1] not in RENDER:
            raise SystemExit(f"unknown figure fig:{m[1]}; known: {', '.join(RENDER)}")
        return f"<!-- fig:{m[1]} -->{RENDER[m[1]](srcs)}<!-- /fig -->"

    return BLOCK.sub(render, text)


def hand_typed(text: str) -> list[str]:
    """Lines outside the generated parts that state a measured figure."""
    bare = BLOCK.sub("", text)
    return [line.strip() for line in bare.splitlines() if HAND_TYPED.search(line)]


def check_or_write(write: bool) -> list[str]:
    """Problems found (stale generated parts, figures typed by hand); with
    ``write``, the stale parts are rewritten instead of reported."""
    srcs, problems = sources(), []
    for page in pages():
        text = page.read_text()
        new = regenerate(text, srcs)
        name = page.relative_to(ROOT)
        if new != text:
            if write:
                page.write_text(new)
            else:
                problems.append(f"{name}: generated figures out of date (run scripts/figures.py)")
        problems += [f"{name}: figure typed by hand: {line}" for line in hand_typed(new)]
    return problems


def import_result(
    name: str, results: Path, command: str, commit: str, date: str, experiment: str | None = None
) -> Path:
    """Store a command's ``results.json`` as ``docs/data/NAME.json``. A study's
    claims are computed again from its rows by the experiment's own
    ``claims`` (the same function its command ran), so that stores written
    before a change of the claims' shape read alike."""
    d = json.loads((results / "results.json").read_text())
    if isinstance(d, list):  # gradfabric reproduce: a list of experiments' results
        claims = [c for r in d for c in r["claims"]]
        result: Any = [{k: r[k] for k in ("name", "title", "claims", "notes")} for r in d]
    else:
        result = {k: v for k, v in d.items() if k != "claims" and not k.startswith("table")}
        result.setdefault("config", yaml.safe_load((results / "config.yaml").read_text()))
        claims = study_claims(experiment or name, result)
    out = DATA / f"{name}.json"
    named = {"experiment": experiment} if experiment else {}  # where NAME is not its module
    out.write_text(json.dumps({"command": command, "date": date, "commit": commit, **named,
                               "claims": claims, "result": result}, indent=1) + "\n")  # fmt: skip
    return out


def study_claims(experiment: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims ``experiment``'s own ``claims`` computes from a study's rows."""
    module = __import__(f"gradfabric.experiments.{experiment.replace('-', '_')}",
                        fromlist=["claims"])  # fmt: skip
    return [asdict(c) for c in module.claims(result)]


def rederive(name: str, date: str) -> Path:
    """A study's stored claims computed again from its stored rows by its
    experiment's ``claims`` as it is now (the measurements unchanged; the
    store then records the date its claims were derived on)."""
    out = DATA / f"{name}.json"
    d = json.loads(out.read_text())
    d["claims"] = study_claims(d.get("experiment", name), d["result"])
    d["claims_derived"] = date
    out.write_text(json.dumps(d, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="report, do not write; exit 1 if stale")
    p.add_argument("--import", dest="imported", nargs=2, metavar=("NAME", "RESULTS_DIR"),
                   help="store a command's results directory as docs/data/NAME.json")  # fmt: skip
    p.add_argument("--command", help="with --import: the command that measured it")
    p.add_argument("--commit", help="with --import: the commit it ran on")
    p.add_argument("--experiment", help="with --import: the experiment whose claims() reads "
                   "it, where NAME is another (default: NAME)")  # fmt: skip
    p.add_argument("--rederive", metavar="NAME", help="compute docs/data/NAME.json's claims "
                   "again from its stored rows (after its experiment changed)")  # fmt: skip
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    if args.imported:
        if not (args.command and args.commit):
            p.error("--import needs --command and --commit")
        print(import_result(args.imported[0], Path(args.imported[1]), args.command,
                            args.commit, args.date, args.experiment))  # fmt: skip
        return 0
    if args.rederive:
        print(rederive(args.rederive, args.date))
        return 0
    problems = check_or_write(write=not args.check)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
