"""Block exponents agreed without a message: each carried from the last sum.

``ina_hook`` agrees on every block's exponent in a round over the training
process group before each sum (``runtime.session``): exact scaling, at the cost
of one exchange that waits for the slowest rank. Where no rank may wait (a
straggler whose share others send for it: SA-ATP), or no round is wanted,
every rank derives the exponents from what all of them already hold, the
last sum of the same tensor: a block's exponent is its last sum's
(``block_exponents``) plus ``HEADROOM_BITS``, never below the tensor's
largest less ``FLOOR_BITS`` (a block that summed to zero may hold values
next time). Values beyond a block's ``2**e`` clip to it and are counted,
as gradient clipping would; the rest is ``BlockExponent``'s quantiser
(``fastquant.encode`` and ``decode``, bit for bit the agreed path's).

Every rank computes the same exponents from the same sum, so the integer
sum stays exact and cannot overflow. Before a tensor's first sum the
exponents are ``first`` (the default: values up to 2**6 pass unclipped).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError
from gradfabric.wire import fastquant
from gradfabric.wire.quant import block_exponents, block_scales

HEADROOM_BITS = 6  # a block's values may grow 64x over its last sum before they clip
FLOOR_BITS = 24  # a block's range spans at least float32's mantissa below the tensor's largest
FIRST = 6

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


class CarriedExponents:
    """One tensor's quantiser across its sums (see the module doc):
    ``encode`` a rank's values, ``decode`` the integer sum, ``carry`` the
    decoded sum into the next call's exponents."""

    def __init__(self, fan_in: int, block: int, first: int = FIRST) -> None:
        if fan_in < 1 or block < 1:
            raise ConfigError("fan_in", f"fan_in and block must be >= 1, got {fan_in}, {block}")
        self.fan_in, self.block, self.first = fan_in, block, first
        self.exps: I32 | None = None  # each block's, once a sum was carried
        self.clipped = 0  # values this rank clipped to their block's range, so far

    def exponents(self, n: int) -> I32:
        """The exponents of the next sum of ``n`` values."""
        blocks = -(-n // self.block)
        if self.exps is None:
            return np.full(blocks, self.first, dtype=np.int32)
        if len(self.exps) != blocks:
            raise ValueError(f"a carried tensor of {len(self.exps)} blocks summed as {blocks}")
        return self.exps

    def scales(self, n: int) -> npt.NDArray[np.float64]:
        return block_scales(self.exponents(n), self.fan_in)

    def clip(self, x: F32) -> F32:
        """``x`` (finite) with values beyond their block's range clipped to
        it (counted in ``clipped``): ``x`` itself where none is."""
        exps = self.exponents(len(x))
        seen = fastquant.exponents(x, self.block)
        if seen is None:
            raise ValueError(
                "non-finite values cannot be carried: no round tells the other ranks "
                "(sum them with agreed exponents, ina_hook's default)"
            )
        if not (seen > exps).any():
            return x
        bound = np.repeat(np.exp2(exps.astype(np.float64)), self.block)[: len(x)]
        self.clipped += int(np.count_nonzero(np.abs(x) > bound))
        return np.clip(x, -bound, bound).astype(np.float32)

    def encode(self, x: F32) -> I32:
        """``x`` as int32 at the carried scales, clipped first (``clip``)."""
        return fastquant.encode(self.clip(x), self.block, self.scales(len(x)))

    def decode(self, total: I64, out: F32 | None = None) -> F32:
        """The integer sum back to float32 (into ``out`` where given)."""
        return fastquant.decode(total, self.block, self.scales(len(total)), out)

    def carry(self, total: F32) -> None:
        """The decoded sum every rank holds sets the next call's exponents."""
        total = np.asarray(total, dtype=np.float32)
        if not total.any():  # nothing to carry: the next sum starts afresh
            self.exps = None
            return
        e = block_exponents(total, self.block)
        self.exps = (np.maximum(e, e.max() - FLOOR_BITS) + HEADROOM_BITS).astype(np.int32)
