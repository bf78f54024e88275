"""Block exponents carried from the last sum (``wire.carried``): every rank
derives the same scales without a message, the integer sum is exact, the
decoded sum is the float64 sum within the block quantiser's bound, and what
a block's range cannot hold is clipped and counted."""

from __future__ import annotations

import numpy as np
import pytest

from gradfabric.wire.carried import FIRST, FLOOR_BITS, HEADROOM_BITS, CarriedExponents
from gradfabric.wire.quant import INT32_MAX, BlockExponent

N, BLOCK = 4, 256


def _ranks(seed: int, size: int, spread: float) -> list[np.ndarray]:
    """Four ranks' gradients: blocks whose magnitudes differ by up to
    ``spread`` decades (the same blocks every step, as a model's layers),
    their noise drawn anew each step (``seed``)."""
    mags = 10.0 ** np.random.default_rng(0).uniform(-spread, 0, -(-size // BLOCK))
    rng = np.random.default_rng(seed)
    per_value = np.repeat(mags, BLOCK)[:size]
    return [(rng.normal(0, 1, size) * per_value).astype(np.float32) for _ in range(N)]


def _step(quants: list[CarriedExponents], xs: list[np.ndarray]) -> np.ndarray:
    total = np.zeros(len(xs[0]), dtype=np.int64)
    for q, x in zip(quants, xs, strict=True):
        total += q.encode(x)
    sums = [q.decode(total) for q in quants]
    for q, s in zip(quants, sums, strict=True):
        q.carry(s)
    assert all(np.array_equal(sums[0], s) for s in sums)  # every rank holds the same sum
    return sums[0]


def test_every_rank_carries_the_same_exponents_and_the_sum_stays_in_its_bound() -> None:
    quants = [CarriedExponents(N, BLOCK) for _ in range(N)]
    size = 5000
    for step in range(6):  # gradients shrinking as training goes, blocks 4 decades apart
        xs = [x * 0.5**step for x in _ranks(step, size, 4.0)]
        exps = quants[0].exponents(size)
        got = _step(quants, xs)
        assert all(q.clipped == 0 for q in quants)
        want = np.sum([x.astype(np.float64) for x in xs], axis=0)
        bound = np.repeat([BlockExponent(N).sum_error_bound(int(e)) for e in exps], BLOCK)[:size]
        # the integer rounding (fan_in halves of a step) and float32's of the result
        assert np.all(np.abs(got - want) <= bound + np.abs(want) * 2**-24)
        nxt = quants[0].exponents(size)
        assert all(np.array_equal(q.exponents(size), nxt) for q in quants)
    # carried from the last sum: its block exponent plus the headroom, floored
    e_sum = np.frexp(np.abs(got).reshape(-1, BLOCK).max(1) if size % BLOCK == 0 else
                     np.array([np.abs(got[i:i + BLOCK]).max() for i in range(0, size, BLOCK)]))[1]
    assert np.array_equal(nxt, np.maximum(e_sum, e_sum.max() - FLOOR_BITS) + HEADROOM_BITS)


def test_what_a_block_cannot_hold_is_clipped_counted_and_never_overflows() -> None:
    quants = [CarriedExponents(N, BLOCK) for _ in range(N)]
    xs = [np.full(600, 0.01, dtype=np.float32) for _ in range(N)]
    _step(quants, xs)  # the next range: 2**(6 + the exponent of 0.04, -4)
    assert np.array_equal(quants[0].exponents(600), np.full(3, 2))
    big = np.full(600, 0.01, dtype=np.float32)
    big[[3, 300, 599]] = [1e9, -1e9, 4.0]  # the last sits at its block's bound
    q = quants[0].encode(big)
    assert quants[0].clipped == 2
    limit = INT32_MAX // N
    assert q[3] == limit and q[300] == -limit and q[599] == limit
    assert np.abs(q.astype(np.int64)).max() * N <= INT32_MAX


def test_a_first_sum_uses_the_first_range_and_a_zero_sum_starts_afresh() -> None:
    quant = CarriedExponents(N, BLOCK)
    assert np.array_equal(quant.exponents(1000), np.full(4, FIRST))
    quant.carry(np.zeros(1000, dtype=np.float32))
    assert np.array_equal(quant.exponents(1000), np.full(4, FIRST))
    quant.carry(np.ones(1000, dtype=np.float32))
    with pytest.raises(ValueError, match="4 blocks summed as 2"):
        quant.exponents(300)
    with pytest.raises(ValueError, match="non-finite"):
        quant.encode(np.array([1.0, np.nan] * 500, dtype=np.float32))
