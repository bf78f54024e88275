"""The daemon's impairments: fates drawn at the configured rates, delays in range."""

from __future__ import annotations

import math

import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.runtime.impair import Impairer, Impairment


def _within_binomial(count: int, n: int, p: float, sigmas: float = 6.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_fates_follow_the_configured_rates() -> None:
    n, loss, dup = 50_000, 0.1, 0.2
    counters = Counters()
    imp = Impairer(Impairment(loss=loss, dup=dup, seed=3), counters)
    copies = [imp.copies() for _ in range(n)]
    assert copies.count(0) == counters["impair_loss"]
    assert copies.count(2) == counters["impair_dup"]
    assert _within_binomial(copies.count(0), n, loss)
    # a duplicate is drawn only for datagrams that were not lost
    assert _within_binomial(copies.count(2), n, (1 - loss) * dup)


def test_delays_lie_in_the_jitter_window_and_repeat_with_the_seed() -> None:
    cfg = Impairment(dup=0.5, delay_ns=1_000_000, jitter_ns=300_000, seed=7)
    runs = []
    for _ in range(2):
        imp = Impairer(cfg, Counters())
        runs.append([imp.delays_s() for _ in range(2_000)])
    assert runs[0] == runs[1]
    delays = [d for copies in runs[0] for d in copies]
    assert {len(c) for c in runs[0]} == {1, 2}
    assert all(1e-3 <= d <= 1.3e-3 for d in delays)
    assert max(delays) - min(delays) > 0.25e-3  # the jitter is used, not just the floor


@pytest.mark.parametrize("bad", [{"loss": 1.0}, {"dup": -0.1}, {"jitter_ns": -1}])
def test_rejects_impossible_rates(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Impairment(**bad)  # type: ignore[arg-type]
