"""The compiled block-exponent quantiser equals the numpy reference, bit for bit.

Same inputs to both (seeded and drawn by hypothesis: every float32 class,
zeros of both signs, subnormals, the largest finite values, NaN and
infinities, blocks that do not divide the tensor, every fan-in), and the
same results required: the exponents (or both saying "non-finite"), the
encoded int32 values, and the decoded float32 values compared as bit
patterns (so -0.0 against 0.0 or a different NaN would fail). The reference
is what runs where nothing was compiled (``GRADFABRIC_PURE=1``).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.wire import fastquant as fq
from gradfabric.wire.quant import INT32_MAX, block_scales

if os.environ.get("GRADFABRIC_PURE") or not (shutil.which("cc") or shutil.which("gcc")):
    pytest.skip("the compiled quantiser is not built here (pure run, or no C compiler)",
                allow_module_level=True)  # fmt: skip


def test_the_compiled_path_serves() -> None:
    """Bootstrap built it: a broken build is a failure here, not a quiet fallback."""
    assert fq.PATH == fq.COMPILED, fq.WHY_NOT


SPECIALS = np.array(
    [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
     1.0, -1.0, 0.5, 2.0**-126, 2.0**127, np.inf, -np.inf, np.nan],
    dtype=np.float32,
)  # fmt: skip


def _tensor(seed: int, n: int, special_share: float) -> np.ndarray:
    """Normal values at exponents from 2**-140 to 2**120, some specials."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 120, n))).astype(np.float32)
    pick = rng.random(n) < special_share
    x[pick] = rng.choice(SPECIALS, int(pick.sum()))
    return x


def _check(x: np.ndarray, block: int, fan_in: int, headroom: np.ndarray) -> None:
    e_ref = fq.exponents_reference(x, block)
    e_fast = fq.exponents(x, block)
    if e_ref is None:
        assert e_fast is None
        x = np.where(np.isfinite(x), x, np.float32(0))  # as the client does
        e_ref = e_fast = fq.exponents_reference(x, block)
        assert e_ref is not None
    assert e_fast is not None
    np.testing.assert_array_equal(e_fast, e_ref)
    agreed = e_ref + headroom[: len(e_ref)]  # another worker's block may be larger
    scale = block_scales(agreed, fan_in)
    scale[headroom[: len(e_ref)] == 3] = 0.0  # a lost block: encoded as zeros
    q_ref = fq.encode_reference(x, block, scale)
    q_fast = fq.encode(x, block, scale)
    np.testing.assert_array_equal(q_fast, q_ref)
    assert np.abs(q_ref.astype(np.int64)).max(initial=0) <= INT32_MAX // fan_in
    # the sum of fan_in workers' values (each worker's own encoding, shifted)
    rng = np.random.default_rng(len(x))
    r = q_ref.astype(np.int64) * fan_in - rng.integers(0, fan_in, len(x)) * np.sign(q_ref)
    real = block_scales(agreed, fan_in)
    with np.errstate(over="ignore"):  # sums past float32's range: inf on both paths
        d_ref = fq.decode_reference(r, block, real)
    d_fast = fq.decode(r, block, real)
    np.testing.assert_array_equal(d_fast.view(np.int32), d_ref.view(np.int32))
    into = np.full(len(x), np.float32(7))  # decoded into a given array: the same bits, there
    assert fq.decode(r, block, real, into) is into
    np.testing.assert_array_equal(into.view(np.int32), d_ref.view(np.int32))


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 3000),
    block=st.integers(1, 700),
    fan_in=st.integers(1, 64),
    special_share=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
)
def test_compiled_quantiser_equals_the_reference(
    seed: int, n: int, block: int, fan_in: int, special_share: float
) -> None:
    x = _tensor(seed, n, special_share)
    headroom = np.random.default_rng(seed + 1).integers(0, 4, n // block + 1)
    _check(x, block, fan_in, headroom.astype(np.int32))


@pytest.mark.parametrize("block", [256, 1024, 2048, 16_000])
def test_compiled_quantiser_on_a_large_tensor(block: int) -> None:
    """A gradient-sized tensor (1M values, no specials, and then a few): the
    loops' long runs, where a vectorising compiler takes other code paths."""
    for share in (0.0, 1e-5):
        x = _tensor(block, 1_000_003, share)
        headroom = np.random.default_rng(block).integers(0, 4, x.size // block + 1)
        _check(x, block, 4, headroom.astype(np.int32))


def test_decode_into_an_array_that_cannot_take_it_is_an_error() -> None:
    """A wrong dtype, length or a read-only array: a clear error, never a
    silent copy the caller would not see."""
    r, scale = np.arange(8, dtype=np.int64), np.ones(2)
    for bad in (np.empty(8, np.float64), np.empty(7, np.float32), np.empty(16, np.float32)[::2]):
        with pytest.raises(ValueError, match="out: a writeable contiguous float32 array of 8"):
            fq.decode(r, 4, scale, bad)
    frozen = np.empty(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out:"):
        fq.decode(r, 4, scale, frozen)
