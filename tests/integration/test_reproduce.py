"""``gradfabric reproduce`` writes a report with claims, tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gradfabric.cli import main
from gradfabric.wire.packet import HEADER_BYTES


def _section(report: str, title: str) -> list[str]:
    """The rows of the table under a report's ``## title``."""
    table = report.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return [x for x in table.splitlines() if x.startswith("| ")][1:]  # past the header


def _check_report(out: Path, experiments: set[str]) -> dict:
    report = (out / "report.md").read_text()
    pngs = list(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 5_000 for p in pngs)
    for p in pngs:
        assert f"]({p.name})" in report
    results = json.loads((out / "results.json").read_text())
    assert {r["name"] for r in results} == experiments
    assert set(yaml.safe_load((out / "config.yaml").read_text())) == experiments
    papers, ours = _section(report, "The papers' claims"), _section(report, "Our goals and checks")
    claims = [c for r in results for c in r["claims"]]
    assert len(papers) == sum(c["kind"] == "paper" for c in claims)
    assert len(ours) == len(claims) - len(papers)
    for r in results:  # each claim names the command that measures it again
        again = f"`gradfabric reproduce --quick --only {r['name']}` |"
        assert sum(line.endswith(again) for line in papers + ours) == len(r["claims"])
    real = [c for c in claims if c["headline"] and c["setting"] != "sim"]
    assert len(_section(report, "Headlines in real runs")) == len(real)
    for c in claims:  # met or not, as the figures say: a speed-up's target is its paper's
        assert c["setting"] in ("sim", "udp", "training") and c["met"] in (True, False, None)
        row = next(x for x in papers + ours if f"| {c['claim']} |" in x.replace("\\|", "|"))
        assert row.split(" | ")[6] == {True: "met", False: "**not met**", None: "-"}[c["met"]]
    return {r["name"]: r for r in results}


@pytest.mark.long
def test_reproduce_granularity(tmp_path: Path) -> None:
    assert main(["reproduce", "--quick", "--only", "granularity", "--out", str(tmp_path)]) == 0
    res = _check_report(tmp_path, {"granularity"})["granularity"]
    rows = [r for r in res["rows"] if r.get("workers") == 64]
    # the packet-level run against the physical floor: every worker's packets
    # (256 int32 values and a header each) through its 100 Gbit/s link, once
    packets = -(-rows[0]["values"] // 256)
    floor_ms = packets * (256 * 4 + HEADER_BYTES) * 8 / 100e9 * 1e3
    assert rows[0]["train_packets"] == 1
    assert floor_ms <= rows[0]["comm_ms"] <= 1.05 * floor_ms
    # trains against the packet-level run: within 5%
    assert all(abs(r["comm_ms"] / rows[0]["comm_ms"] - 1) < 0.05 for r in rows[1:])
    big = next(r for r in res["rows"] if r.get("workers") == 1024)
    assert big["iteration_ms"] > 0 and big["events"] > 1_000_000


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the README's main job: under 15 minutes on 2 cores
def test_reproduce_quick_everything(tmp_path: Path) -> None:
    from gradfabric.experiments.registry import EXPERIMENTS

    assert main(["reproduce", "--quick", "--out", str(tmp_path)]) == 0
    left = {n for n in EXPERIMENTS.names() if not getattr(EXPERIMENTS.get(n), "main_job", True)}
    res = _check_report(tmp_path, set(EXPERIMENTS.names()) - left)  # the rest, every one
    report = (tmp_path / "report.md").read_text()
    assert left == {"esa", "esa-scale", "esa-scale-1024", "flow-level", "ddp", "simspeed"}
    assert all(f"`gradfabric reproduce --quick --only {n}`" in report for n in left)
    assert {"baselines", "saatp", "dlcp", "omnireduce", "planner", "emulator"} <= set(res)
    assert all(c["met"] for c in res["baselines"]["claims"])  # the analytic bounds hold
    real = {c["system"] for r in res.values() for c in r["claims"]
            if c["headline"] and c["setting"] != "sim"}  # fmt: skip
    assert {"in-network aggregation", "SA-ATP", "ESA", "DLCP", "OmniReduce", "planner"} <= real
