"""Fixed-point quantisers that put float gradients into the switch's int32 domain.

Both guarantee that the sum of ``fan_in`` quantised values cannot overflow
int32, so aggregation in the integer domain is exact; the only error is the
rounding at encode time, bounded below.

* ``FixedScale`` (ATP): ``q = round(x * scale)``, scale 1e6 by default. A packet
  any of whose values exceeds ``INT32_MAX // fan_in`` after scaling overflows:
  it is sent as float32 with ``Flag.OVERFLOW`` and summed at the PS.
  Bound: ``|decode(sum q) - sum x| <= fan_in * 0.5 / scale``.
* ``BlockExponent`` (SwitchML): all workers agree on ``e_max``, the largest
  block exponent (``max|x| <= 2**e_max``) of the block over workers;
  ``scale = INT32_MAX / (fan_in * 2**e_max)`` so ``|q| <= INT32_MAX / fan_in``
  (we floor ``INT32_MAX / fan_in`` before dividing by ``2**e_max`` so rounding
  can never step past the limit and no clipping error enters).
  Bound: ``|decode(sum q) - sum x| <= fan_in * 0.5 / scale``, i.e.
  ``fan_in**2 * 2**e_max / (2 * INT32_MAX)``: relative to the block maximum,
  about ``fan_in**2 * 2.3e-10``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError

INT32_MAX = 2**31 - 1
F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True)
class FixedScale:
    fan_in: int
    scale: float = 1e6

    def __post_init__(self) -> None:
        if self.fan_in < 1:
            raise ConfigError("fan_in", f"must be >= 1, got {self.fan_in}")
        if self.scale <= 0:
            raise ConfigError("scale", f"must be > 0, got {self.scale}")

    @property
    def limit(self) -> int:
        """Largest |q| a worker may send so that ``fan_in`` of them fit int32."""
        return INT32_MAX // self.fan_in

    def encode(self, x: F32) -> I32 | None:
        """Quantise ``x``; None means overflow: send ``x`` as float32 instead."""
        scaled = np.rint(x.astype(np.float64) * self.scale)
        if not np.all(np.isfinite(scaled)) or np.any(np.abs(scaled) > self.limit):
            return None
        return scaled.astype(np.int32)

    def decode(self, q: npt.NDArray[np.integer]) -> F32:
        return (q.astype(np.float64) / self.scale).astype(np.float32)

    def sum_error_bound(self) -> float:
        return self.fan_in * 0.5 / self.scale


@dataclass(frozen=True)
class BlockExponent:
    fan_in: int

    def __post_init__(self) -> None:
        if self.fan_in < 1:
            raise ConfigError("fan_in", f"must be >= 1, got {self.fan_in}")

    @staticmethod
    def exponent(x: F32) -> int:
        """Smallest e with max|x| <= 2**e (block exponent of this worker's block)."""
        peak = float(np.max(np.abs(x))) if len(x) else 0.0
        if peak == 0.0:
            return -126
        _mant, e = np.frexp(peak)  # peak = mant * 2**e, 0.5 <= mant < 1
        return int(e)

    def scale(self, e_max: int) -> float:
        return self.limit / 2.0**e_max

    def encode(self, x: F32, e_max: int) -> I32:
        """Quantise a block whose every |x| <= 2**e_max; raises ValueError otherwise."""
        q = np.rint(x.astype(np.float64) * self.scale(e_max))
        if np.any(np.abs(q) > self.limit):
            raise ValueError(f"block exceeds 2**{e_max}: e_max must be the max over workers")
        return q.astype(np.int32)

    @property
    def limit(self) -> int:
        return INT32_MAX // self.fan_in

    def decode(self, q: npt.NDArray[np.integer], e_max: int) -> F32:
        return (q.astype(np.float64) / self.scale(e_max)).astype(np.float32)

    def sum_error_bound(self, e_max: int) -> float:
        return self.fan_in * 0.5 / self.scale(e_max)


def block_exponents(x: F32, block: int) -> I32:
    """``BlockExponent.exponent`` of every ``block``-value slice of ``x`` at once."""
    if not np.all(np.isfinite(x)):
        raise ValueError("non-finite values cannot be quantised")
    pad = (-len(x)) % block
    peaks = np.abs(np.concatenate([x, np.zeros(pad, x.dtype)])).reshape(-1, block).max(axis=1)
    _mant, e = np.frexp(peaks.astype(np.float64))
    return np.where(peaks > 0, e, -126).astype(np.int32)


def block_scales(e_max: npt.NDArray[np.integer], fan_in: int) -> npt.NDArray[np.float64]:
    """``BlockExponent(fan_in).scale`` for each agreed block exponent."""
    return np.asarray((INT32_MAX // fan_in) / np.exp2(e_max.astype(np.float64)))


def encode_block(x: F32, scale: float) -> I32:
    """One block quantised with its agreed ``scale``: ``rint(x * scale)``
    in float64, as int32 (the block-exponent scale keeps it in range; what
    ``wire.fastquant.encode`` does for every block at once, bit for bit)."""
    out: I32 = np.rint(x.astype(np.float64) * float(scale)).astype(np.int32)
    return out


def decode_block(r: npt.NDArray[np.int64], scale: float) -> F32:
    """One block's integer sum back to float32 (``wire.fastquant.decode``'s,
    bit for bit): one float64 division, one rounding to float32."""
    out: F32 = (r / float(scale)).astype(np.float32)
    return out
