"""The reproduction report: Markdown with a claims table and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import yaml

from gradfabric.experiments.registry import ExperimentResult


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(rows: list[dict[str, object]]) -> list[str]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]


def command(name: str, quick: bool) -> str:
    """The command that measures one experiment's part of the report again."""
    return f"`gradfabric reproduce{' --quick' if quick else ''} --only {name}`"


def write_report(results: list[ExperimentResult], out: Path, quick: bool) -> Path:
    lines = [
        "# gradfabric reproduction report",
        "",
        f"Mode: {'quick' if quick else 'full'}. Every figure below was measured by this run; "
        "ratios are ours / the paper's (or / the analytic bound). Each row names the "
        "command that measures it again on its own.",
        "",
        "## Claims",
        "",
        "| system | claim | paper | ours | ratio | where | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r.claims:
            ratio = "" if c.ratio is None else f"{c.ratio:.3f}"
            lines.append(
                f"| {c.system} | {c.claim} | {c.paper} | {c.ours} | {ratio} | {c.note} "
                f"| {command(r.name, quick)} |"
            )
    for r in results:
        lines += ["", f"## {r.title}", "", f"Measured by {command(r.name, quick)}.", ""]
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
