"""The block-exponent quantiser's compiled path, and its numpy reference.

The clients of the switch daemon put every float32 tensor into the int32
domain block by block (``runtime.client``): the block exponents, the encode with
each block's agreed scale, the decode of the summed integers. In numpy that
is several passes and a float64 copy of the tensor, the largest share of a
worker's CPU per sum. ``_fastquant.c`` does each step in one pass with the
same IEEE operations per value, so its results equal the reference's bit for
bit (``tests/property/test_fastquant.py`` holds them equal on seeded and
adversarial inputs).

pip builds it with the C compiler (``setup.py``) beside this file; it is
used only while it is current and ``GRADFABRIC_PURE`` is unset
(``core.native``). Elsewhere the numpy functions here run: same results,
more CPU.
``PATH`` says which one serves (``gradfabric --version`` prints it).

Only numpy and the standard library: the switch daemon may use this too.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gradfabric.core import native
from gradfabric.core.native import COMPILED, PYTHON
from gradfabric.wire.quant import block_exponents

SOURCE = Path(__file__).with_name("_fastquant.c")

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


_p, _n = ctypes.c_void_p, ctypes.c_int64
_LIB, WHY_NOT = native.load(SOURCE.with_suffix(""), [SOURCE], (
    ("gf_exponents", [_p, _n, _n, _p], ctypes.c_int),
    ("gf_encode", [_p, _n, _n, _p, _p], None),
    ("gf_decode", [_p, _n, _n, _p, _p], None),
))  # fmt: skip
PATH = COMPILED if _LIB is not None else PYTHON


def functions() -> tuple[int, int] | None:
    """The addresses of the C encode and decode (for the workers' datapath,
    which quantises each packet as it leaves and decodes each result as it
    arrives with these very functions), or None where numpy serves."""
    if _LIB is None:
        return None
    enc, dec = (ctypes.cast(f, ctypes.c_void_p).value for f in (_LIB.gf_encode, _LIB.gf_decode))
    return (enc, dec) if enc and dec else None


def exponents(x: F32, block: int) -> I32 | None:
    """Each ``block``-value slice's exponent (``wire.quant.block_exponents``),
    or None if ``x`` holds a NaN or an infinity."""
    _check_block(block)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if _LIB is None:
        return exponents_reference(x, block)
    out = np.empty(-(-len(x) // block), dtype=np.int32)
    bad = _LIB.gf_exponents(x.ctypes.data, len(x), block, out.ctypes.data)
    return None if bad else out


def encode(x: F32, block: int, scale: F64) -> I32:
    """``rint(x * scale[b])`` as int32 for the values of each block ``b``
    (finite ``x``; scales that keep every value within int32)."""
    out: I32 = _per_block("gf_encode", encode_reference, x, np.float32, np.int32, block, scale)
    return out


def decode(r: I64, block: int, scale: F64, out: F32 | None = None) -> F32:
    """``r / scale[b]`` as float32 for the values of each block ``b``, into
    ``out`` where given (float32, ``len(r)`` values)."""
    into: F32 = _per_block("gf_decode", decode_reference, r, np.int64, np.float32, block, scale,
                           out)  # fmt: skip
    return into


def output(out: Any, n: int, dtype: Any) -> Any:
    """``out`` if it can take ``n`` values of ``dtype`` in place, else a new array
    (None); an array that cannot is an error, not a silent copy."""
    if out is None:
        return np.empty(n, dtype=dtype)
    if out.dtype != dtype or out.shape != (n,) or not out.flags.c_contiguous or \
            not out.flags.writeable:  # fmt: skip
        raise ValueError(f"out: a writeable contiguous {np.dtype(dtype)} array of {n} values, "
                         f"got {out.dtype} {out.shape}")  # fmt: skip
    return out


def _per_block(
    name: str, reference: Any, src: Any, src_type: Any, out_type: Any, block: int, scale: F64,
    into: Any = None,
) -> Any:  # fmt: skip
    """One loop of the library over ``src`` with a scale per block, or the
    reference; into ``into`` where given."""
    _check_block(block)
    src = np.ascontiguousarray(src, dtype=src_type)
    scale = np.ascontiguousarray(scale, dtype=np.float64)
    if len(scale) < -(-len(src) // block):
        raise ValueError(f"{len(scale)} scales for {-(-len(src) // block)} blocks")
    out = output(into, len(src), out_type)
    if _LIB is None:
        out[:] = reference(src, block, scale)
        return out
    getattr(_LIB, name)(src.ctypes.data, len(src), block, scale.ctypes.data, out.ctypes.data)
    return out


def _check_block(block: int) -> None:
    if block < 1:
        raise ValueError(f"a block holds at least one value, got {block}")


# -- the reference (numpy), what runs where nothing was compiled --------------
def exponents_reference(x: F32, block: int) -> I32 | None:
    return block_exponents(x, block) if np.isfinite(x).all() else None


def encode_reference(x: F32, block: int, scale: F64) -> I32:
    return np.rint(x.astype(np.float64) * _per_value(scale, block, len(x))).astype(np.int32)


def decode_reference(r: I64, block: int, scale: F64) -> F32:
    return (r / _per_value(scale, block, len(r))).astype(np.float32)


def _per_value(scale: F64, block: int, n: int) -> F64:
    return np.repeat(scale, block)[:n]
