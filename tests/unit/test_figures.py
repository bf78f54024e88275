"""The figures in the README and the docs are the stored results' (docs/data),
written by scripts/figures.py: none stale, none typed by hand, and every
stored claim the one its experiment computes from the stored rows."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


figures = _figures()


def test_every_page_is_up_to_date_and_has_no_hand_typed_figure() -> None:
    problems = figures.check_or_write(write=False)
    assert not problems, "\n".join(problems)


def test_the_check_can_fail() -> None:
    assert figures.hand_typed("DDP through the switch: 1.18x ± 0.03 over the default hook")
    assert figures.hand_typed("loses 2.3% of its values")
    assert not figures.hand_typed("the ring moves 2(n-1)/n of the bytes, rank 0 at 10 Gbit/s")
    page = "a <!-- fig:main-job-time -->21 minutes<!-- /fig --> run"
    assert figures.regenerate(page, figures.sources()) != page
    block = "<!-- fig:systems-table -->| 9.99x |<!-- /fig -->"
    assert not figures.hand_typed(block)  # inside a generated part: the generator's


STORED = sorted((ROOT / "docs" / "data").glob("*.json"))


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.name)
def test_a_studys_stored_claims_are_its_rows_claims(path: Path) -> None:
    """A stored study's claims, computed again from its stored rows by the
    experiment's own code, are the stored ones: a figure cannot be edited in
    the store without its rows."""
    d = json.loads(path.read_text())
    if "claims" not in d or not isinstance(d["result"], dict):
        pytest.skip("no rows to compute claims from (timings; the quick suite)")
    name = d.get("experiment", path.stem)  # (a second study of one experiment names it)
    module = importlib.import_module(f"gradfabric.experiments.{name.replace('-', '_')}")
    assert [asdict(c) for c in module.claims(d["result"])] == d["claims"]


def test_the_readme_table_shows_stored_headlines() -> None:
    """Each figure in the README's systems table is a stored headline's, with
    the baseline it was measured against."""
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- fig:systems-table -->(.*?)<!-- /fig -->", readme, re.S)
    assert table
    shown = re.findall(r"\*\*(.+?)\*\* vs ([^;|]+?)(?: \(not met\))?(?:;|\s\|)", table[1])
    stored = {(c.ours, figures.against(c))
              for s in figures.sources() for c in s.claims if c.headline}  # fmt: skip
    assert shown and all((ours, base.strip()) in stored for ours, base in shown), shown
    systems = [row.split("|")[1].strip() for row in table[1].splitlines()[3:] if row]
    assert systems == list(figures.SYSTEMS)


def test_rederive_computes_a_stores_claims_again_from_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a change to how an experiment states its claims, ``--rederive``
    writes the claims its rows give now, and keeps the rows as they were."""
    stored = json.loads((ROOT / "docs" / "data" / "sparse-train.json").read_text())
    tampered = {**stored, "claims": stored["claims"][:1]}
    (tmp_path / "sparse-train.json").write_text(json.dumps(tampered))
    monkeypatch.setattr(figures, "DATA", tmp_path)
    figures.rederive("sparse-train", "2026-01-01")
    d = json.loads((tmp_path / "sparse-train.json").read_text())
    assert d["claims"] == stored["claims"] and d["result"] == stored["result"]
    assert d["claims_derived"] == "2026-01-01" and d["commit"] == stored["commit"]


def test_a_cell_names_the_mtu_a_claim_was_measured_at() -> None:
    """The same system at two MTUs reads apart in the README: the claim's
    "at MTU N" follows the baseline's bare name."""
    from gradfabric.experiments.registry import Claim

    def claim(text: str, baseline: str) -> Claim:
        return Claim("in-network aggregation", text, "udp", baseline, "1.4x", "-", True)

    at = claim("all-reduce at MTU 1500, the defaults (4 workers)", "the ring (best), same MTU")
    assert figures.against(at) == "the ring at MTU 1500"
    assert figures.against(claim("all-reduce (4 workers)", "the ring (its best)")) == "the ring"
