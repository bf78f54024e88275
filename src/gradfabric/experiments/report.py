"""The reproduction report: Markdown with the claims tables and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import yaml

from gradfabric.experiments.registry import SETTINGS, Claim, ExperimentResult


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(rows: list[dict[str, object]]) -> list[str]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return ["", *markdown(keys, [[row.get(k, "") for k in keys] for row in rows])]


def command(name: str, quick: bool) -> str:
    """The command that measures one experiment's part of the report again."""
    return f"`gradfabric reproduce{' --quick' if quick else ''} --only {name}`"


def met(c: Claim) -> str:
    return {True: "met", False: "**not met**", None: "-"}[c.met]


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


# the systems in the order the README and the reports list them
SYSTEMS = ("in-network aggregation", "SA-ATP", "ESA", "DLCP", "OmniReduce", "planner")


def system_order(system: str) -> tuple[int, str]:
    return (SYSTEMS.index(system) if system in SYSTEMS else len(SYSTEMS), system)


CLAIM_COLUMNS = ("system", "setting", "claim", "against", "ours", "paper / target", "met")


def claim_rows(
    claims: Sequence[Claim], extra: Sequence[Sequence[str]] | None = None
) -> list[list[str]]:
    """The cells of a claims table, one row per claim (``extra``: more cells
    per claim, e.g. the command that measures it again)."""
    more = extra or [[] for _ in claims]
    return [
        [c.system, SETTINGS[c.setting], c.claim, c.baseline, c.ours, c.paper, met(c), *m]
        for c, m in zip(claims, more, strict=True)
    ]


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(_fmt(v)) for v in row) + " |" for row in rows]


def real_headline(c: Claim) -> bool:
    """A system's headline from a real run (over UDP or in training)."""
    return c.headline and c.setting != "sim"


def write_report(
    results: list[ExperimentResult], out: Path, quick: bool, left: Sequence[str] = ()
) -> Path:
    claims = [(c, command(r.name, quick)) for r in results for c in r.claims]

    def table(chosen: list[tuple[Claim, str]], with_command: bool) -> list[str]:
        if not chosen:
            return ["None in this run."]
        cs = [c for c, _ in chosen]
        if not with_command:
            return markdown(CLAIM_COLUMNS, claim_rows(cs))
        return markdown([*CLAIM_COLUMNS, "measured by"], claim_rows(cs, [[x] for _, x in chosen]))

    lines = [
        "# gradfabric reproduction report",
        "",
        f"Mode: {'quick' if quick else 'full'}. Every figure below was measured by this run. "
        "Speed-ups read ours over the baseline: above 1 is better, whatever the paper's "
        "wording. \"met\" says whether ours reaches the paper's figure or the target.",
        *(["", "Left to their own runs (longer than a first contact wants): " + ", ".join(
            f"`gradfabric reproduce --quick --only {n}`" for n in left) + "."] if left else []),
        "",
        "## Headlines in real runs",
        "",
        "Each system measured for real (over UDP sockets or in DDP training) against the "
        "best thing a practitioner could run instead.",
        "",
        *table(sorted((x for x in claims if real_headline(x[0])),
                      key=lambda x: system_order(x[0].system)), with_command=False),
        "",
        "## The papers' claims",
        "",
        *table([x for x in claims if x[0].kind == "paper"], with_command=True),
        "",
        "## Our goals and checks against bounds",
        "",
        *table([x for x in claims if x[0].kind != "paper"], with_command=True),
    ]
    for r in results:
        took = f" in {r.seconds:.0f} s" if r.seconds else ""
        lines += ["", f"## {r.title}", "", f"Measured by {command(r.name, quick)}{took}.", ""]
        lines += [f"- {c.claim} ({SETTINGS[c.setting]}): {c.note}" for c in r.claims if c.note]
        lines += [f"- {n}" for n in r.notes]
        for p in r.plots:
            lines += ["", f"![{p}]({p})"]
        if r.rows:
            lines += _table(r.rows)
    (out / "config.yaml").write_text(
        yaml.safe_dump({r.name: r.config for r in results}, sort_keys=False)
    )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(
        json.dumps([asdict(r) for r in results], indent=1, default=str)
    )
    return path
