"""The compiled hook's ``sum_rows`` equals ``coo.coalesced``, bit for bit.

``coo.summed`` (a sparse table's rows summed per id, before and after the
ranks' exchange) runs the compiled function where the C++ hook is built and
the reference where it is not (``GRADFABRIC_PURE=1``). The same inputs to
both (drawn by hypothesis: few or many distinct ids, so rows repeat from
not at all to hundreds of times; values over a wide range of magnitudes
with zeros of both signs, NaN and infinities mixed in; float32 and float64;
every divisor up to 8, powers of two and not), and the same results
required: the ids, and the sums compared as bit patterns (-0.0 against 0.0
would fail; a NaN must be where the reference has one). Ids outside the
table are the same ``ValueError`` on both.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.collectives import coo, fast

if os.environ.get("GRADFABRIC_PURE") or not (shutil.which("c++") or shutil.which("g++")):
    pytest.skip("the compiled hook is not built here (pure run, or no C++ compiler)",
                allow_module_level=True)  # fmt: skip

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, 3.0e38, -3.0e38]


def test_the_compiled_path_serves() -> None:
    """Bootstrap built it: a broken build is a failure here, not a quiet fallback."""
    assert fast.why_not() is None, fast.why_not()


def _rows(seed: int, n: int, width: int, dtype: torch.dtype, special: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-60, 60, (n, 1), generator=g).to(dtype))
    x = torch.randn(n, width, generator=g, dtype=dtype) * scale
    pick = torch.rand(n, width, generator=g) < special
    choice = torch.tensor(SPECIALS, dtype=dtype)[torch.randint(0, len(SPECIALS), (n, width),
                                                               generator=g)]  # fmt: skip
    return torch.where(pick, choice, x)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def _same(ids: torch.Tensor, rows: torch.Tensor, limit: int, divisor: int) -> None:
    want_ids, want = coo.coalesced(ids, rows, limit, divisor)
    got_ids, got = fast.extension().sum_rows(ids, rows, limit, divisor)
    assert torch.equal(got_ids, want_ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(0, 3000),
    limit=st.integers(1, 100_000),
    distinct=st.integers(1, 4000),
    width=st.integers(1, 40),
    divisor=st.integers(1, 8),
    double=st.booleans(),
    special=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_sums_match_the_reference_bit_for_bit(
    seed: int, n: int, limit: int, distinct: int, width: int, divisor: int, double: bool,
    special: float,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, limit, (min(distinct, limit),), generator=g)
    ids = pool[torch.randint(0, len(pool), (n,), generator=g)]
    rows = _rows(seed, n, width, torch.float64 if double else torch.float32, special)
    _same(ids, rows, limit, divisor)


@pytest.mark.parametrize("bad", [-1, 5, 2**62])
def test_ids_outside_the_table_are_the_same_error_on_both(bad: int) -> None:
    ids = torch.tensor([1, 3, bad, 1])
    rows = torch.ones(4, 2)
    with pytest.raises(ValueError, match="outside a table of 5 rows") as ref:
        coo.coalesced(ids, rows, 5)
    with pytest.raises(ValueError, match="outside a table of 5 rows") as got:
        coo.summed(ids, rows, 5)
    assert str(got.value) == str(ref.value)
    assert fast.extension().sum_rows(ids, rows, 5, 1) is None


def test_strided_and_other_dtypes_take_a_path_that_sums_them() -> None:
    """Non-contiguous inputs are made contiguous; rows the compiled function
    does not serve (half precision) fall back to the reference."""
    ids = torch.tensor([[4, 0], [2, 4]]).t()[0]  # a strided view: 4, 2
    rows = torch.arange(12.0).reshape(2, 6)[:, ::2]
    got_ids, got = coo.summed(ids, rows, 5)
    assert got_ids.tolist() == [2, 4] and got.tolist() == [[6.0, 8.0, 10.0], [0.0, 2.0, 4.0]]
    half_ids, half = coo.summed(torch.tensor([1, 1]), torch.ones(2, 3, dtype=torch.float16), 2)
    assert half_ids.tolist() == [1] and half.dtype == torch.float16 and half.tolist() == [[2.0] * 3]
