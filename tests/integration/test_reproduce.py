"""``gradfabric reproduce`` writes a report with claims, tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gradfabric.cli import main


def _check_report(out: Path, experiments: set[str]) -> dict:
    report = (out / "report.md").read_text()
    assert "| system | claim | paper | ours | ratio |" in report
    pngs = list(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 5_000 for p in pngs)
    for p in pngs:
        assert f"]({p.name})" in report
    results = json.loads((out / "results.json").read_text())
    assert {r["name"] for r in results} == experiments
    assert set(yaml.safe_load((out / "config.yaml").read_text())) == experiments
    return {r["name"]: r for r in results}


def test_reproduce_granularity(tmp_path: Path) -> None:
    assert main(["reproduce", "--quick", "--only", "granularity", "--out", str(tmp_path)]) == 0
    res = _check_report(tmp_path, {"granularity"})["granularity"]
    errors = [r["rel_error"] for r in res["rows"] if r.get("workers") == 64]
    assert errors[0] == 0.0 and all(abs(e) < 0.05 for e in errors)
    big = next(r for r in res["rows"] if r.get("workers") == 1024)
    assert big["iteration_ms"] > 0 and big["events"] > 1_000_000


@pytest.mark.slow
@pytest.mark.timeout(1200)  # every experiment, quick: about 6 minutes on 2 cores
def test_reproduce_quick_everything(tmp_path: Path) -> None:
    from gradfabric.experiments.registry import EXPERIMENTS

    assert main(["reproduce", "--quick", "--out", str(tmp_path)]) == 0
    res = _check_report(tmp_path, set(EXPERIMENTS.names()))  # every registered experiment
    assert {"baselines", "saatp", "esa", "dlcp", "omnireduce", "planner", "emulator"} <= set(res)
    ratios = [c["ratio"] for c in res["baselines"]["claims"]]
    assert all(abs(r - 1) < 0.05 for r in ratios)
