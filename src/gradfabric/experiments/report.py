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


def write_report(results: list[ExperimentResult], out: Path, quick: bool) -> Path:
    lines = [
        "# gradfabric reproduction report",
        "",
        f"Mode: {'quick' if quick else 'full'}. Every figure below was measured by this run; "
        "ratios are ours / the paper's (or / the analytic bound).",
        "",
        "## Claims",
        "",
        "| system | claim | paper | ours | ratio | where |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r.claims:
            ratio = "" if c.ratio is None else f"{c.ratio:.3f}"
            lines.append(f"| {c.system} | {c.claim} | {c.paper} | {c.ours} | {ratio} | {c.note} |")
    for r in results:
        lines += ["", f"## {r.title}", ""]
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
