"""``experiment sparse-train``'s claims: a goal is met only where the paired
95% interval resolves it."""

from __future__ import annotations

from typing import Any

import pytest

from gradfabric.experiments.sparse_train import WITHIN, _against_torchrec


def _point(vs: float, half: float, ours_kb: float, torchrec_kb: float) -> dict[str, Any]:
    return {"vs_torchrec": [vs, half], "ours_bytes": ours_kb * 1e3,
            "torchrec_bytes": torchrec_kb * 1e3, "stock_bytes": ours_kb * 1e3}  # fmt: skip


@pytest.mark.parametrize(
    ("vs", "half", "met"),
    [(1.18, 0.15, True), (1.11, 0.29, False), (1.04, 0.07, False), (0.96, 0.07, False)],
)
def test_faster_than_torchrec_where_ours_moves_fewer_bytes_means_resolved(
    vs: float, half: float, met: bool
) -> None:
    c = _against_torchrec(_point(vs, half, 220, 295), "neumf, sgd, 2 ranks, 1 Gbit/s")
    assert c.met is met and c.ours == f"{vs:.2f}x ± {half:.2f}"


def test_where_torchrec_moves_fewer_bytes_no_goal_only_the_figure() -> None:
    c = _against_torchrec(_point(0.58, 0.05, 1457, 770), "neumf, sgd, 8 ranks, 1 Gbit/s")
    assert c.met is None and "TorchRec's all-to-all moves fewer bytes" in c.paper


def test_within_5_percent_of_the_best_ddp_option_means_the_intervals_lower_end() -> None:
    """The stored loopback study: 0.93x ± 0.06 (DLRM, the hybrid, 2 ranks) is
    not within 5%; 1.24x ± 0.07 (4 ranks) is, resolved."""
    import json
    from pathlib import Path

    from gradfabric.experiments.sparse_train import claims

    path = Path(__file__).resolve().parents[2] / "docs" / "data" / "sparse-train-loopback.json"
    result = json.loads(path.read_text())["result"]
    got = {c.claim.split(", loopback")[0]: c for c in claims(result)}
    two, four = (got[f"auto_hook on sparse=True tables, dlrm, adam, {n} ranks"] for n in (2, 4))
    assert (two.ours, two.met) == ("0.93x ± 0.06", False)
    assert (four.ours, four.met) == ("1.24x ± 0.07", True) and str(WITHIN) in four.paper
