"""Records of two model replicas trained side by side (the same data, two
ways of reducing gradients): their step times and loss curves."""

from __future__ import annotations

import statistics
from typing import Any


def compare_sides(rec: dict[str, Any], a: str, b: str) -> None:
    """Two replicas trained side by side: each one's median step time (step 0
    warms up) and the largest gap between their loss curves, into ``rec``."""
    for k in (a, b):
        rec[f"{k}_ms"] = median_ms(rec, k)
    rec["max_loss_diff"] = loss_gap(rec, a, b)


def median_ms(rec: dict[str, Any], side: str) -> float:
    return float(statistics.median(rec["times_s"][side][1:])) * 1e3


def loss_gap(rec: dict[str, Any], a: str, b: str) -> float:
    pairs = zip(rec["loss"][a], rec["loss"][b], strict=True)
    return max(abs(float(x) - float(y)) for x, y in pairs)
