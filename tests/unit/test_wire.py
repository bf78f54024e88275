"""Codec round trips, decoder rejections and quantiser error bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.core.errors import ProtocolError
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, decode, encode, wire_bytes
from gradfabric.wire.quant import INT32_MAX, BlockExponent, FixedScale


def _pkt(**kw: object) -> Packet:
    base: dict[str, object] = dict(
        job_id=7,
        worker_id=3,
        seq=123456,
        agg_index=42,
        bitmap=1 << 3,
        fan_in=8,
        flags=Flag.ECN,
        priority=2,
        layer=17,
        count=4,
        payload=np.array([1, -2, 3, 2**31 - 1], dtype=np.int32),
    )
    base.update(kw)
    return Packet(**base)  # type: ignore[arg-type]


def test_round_trip_int_and_float() -> None:
    p = _pkt()
    q = decode(encode(p))
    assert (
        q.job_id,
        q.worker_id,
        q.seq,
        q.agg_index,
        q.bitmap,
        q.fan_in,
        q.flags,
        q.priority,
        q.layer,
        q.count,
    ) == (7, 3, 123456, 42, 8, 8, Flag.ECN, 2, 17, 4)
    assert q.payload is not None and q.payload.dtype == np.int32
    assert np.array_equal(q.payload, p.payload)  # type: ignore[arg-type]
    f = _pkt(flags=Flag.FLOAT | Flag.OVERFLOW, payload=np.array([0.5, -1e30, 3, 4], np.float32))
    g = decode(encode(f))
    assert g.payload is not None and g.payload.dtype == np.float32
    assert np.array_equal(g.payload, f.payload)  # type: ignore[arg-type]
    assert len(encode(p)) == HEADER_BYTES + 16


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "short"),
        (lambda b: b"XX" + b[2:], "magic"),
        (lambda b: b[:2] + bytes([9]) + b[3:], "version"),
        (lambda b: b + b"\0", "length"),
        (lambda b: b[:-4], "length"),
    ],
)
def test_decoder_rejects_malformed(mutate: object, message: str) -> None:
    raw = encode(_pkt())
    with pytest.raises(ProtocolError, match=message):
        decode(mutate(raw))  # type: ignore[operator]


def test_decoder_rejects_semantic_garbage() -> None:
    with pytest.raises(ProtocolError, match="fan_in"):
        decode(encode(_pkt(fan_in=65)))
    with pytest.raises(ProtocolError, match="bitmap"):
        decode(encode(_pkt(fan_in=2, bitmap=1 << 5, worker_id=1)))
    with pytest.raises(ProtocolError, match="flag"):
        decode(encode(_pkt(flags=1 << 12)))
    nan = _pkt(flags=Flag.FLOAT, payload=np.array([np.nan, 0, 0, 0], np.float32))
    with pytest.raises(ProtocolError, match="non-finite"):
        decode(encode(nan))


def test_any_sender_decodes() -> None:
    """The wire bounds the bitmap's word, not the sender: OmniReduce past 64
    workers names its peers by a u16 and keeps no bitmap of them (the
    engines judge a sender: ``test_engines``)."""
    for sender in (63, 64, 1000, 2**16 - 1):
        assert decode(encode(_pkt(worker_id=sender))).worker_id == sender


def test_encode_refuses_inconsistent_packets() -> None:
    with pytest.raises(ValueError):
        encode(_pkt(payload=None))
    with pytest.raises(ValueError):
        encode(_pkt(count=5))
    with pytest.raises(ValueError):
        encode(_pkt(flags=Flag.FLOAT))  # int32 payload under the float flag


def test_wire_bytes_counts_one_header_per_real_packet() -> None:
    assert wire_bytes(256, 256) == HEADER_BYTES + 1024
    assert wire_bytes(257, 256) == 2 * HEADER_BYTES + 257 * 4
    assert wire_bytes(16 * 256, 256) == 16 * (HEADER_BYTES + 1024)


floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 64), data=st.data())
def test_fixed_scale_sum_within_stated_bound(n: int, data: st.DataObject) -> None:
    q = FixedScale(n)
    xs = [
        np.array(data.draw(st.lists(floats, min_size=8, max_size=8)), np.float32) for _ in range(n)
    ]
    enc = [q.encode(x) for x in xs]
    if any(e is None for e in enc):  # overflow: must really exceed the per-worker limit
        assert any(np.max(np.abs(x.astype(np.float64))) * q.scale > q.limit - 1 for x in xs)
        return
    total = np.sum([e.astype(np.int64) for e in enc if e is not None], axis=0)
    assert np.all(np.abs(total) <= INT32_MAX)  # the switch's int32 sum cannot overflow
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.abs(total / q.scale - ref)
    # the stated bound, plus the float64 rounding of evaluating it (a few ulps of the sum)
    assert np.all(err <= q.sum_error_bound() + 4 * np.finfo(np.float64).eps * np.abs(ref))


def test_fixed_scale_overflow_detected() -> None:
    q = FixedScale(8)
    assert q.encode(np.array([300.0], np.float32)) is None  # 3e8 > INT32_MAX // 8
    assert q.encode(np.array([200.0], np.float32)) is not None


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 64), scale_exp=st.integers(-20, 20), data=st.data())
def test_block_exponent_sum_within_stated_bound(
    n: int, scale_exp: int, data: st.DataObject
) -> None:
    q = BlockExponent(n)
    xs = [
        np.array(data.draw(st.lists(floats, min_size=8, max_size=8)), np.float32)
        * np.float32(2.0**scale_exp)
        for _ in range(n)
    ]
    e_max = max(q.exponent(x) for x in xs)
    enc = [q.encode(x, e_max) for x in xs]
    total = np.sum([e.astype(np.int64) for e in enc], axis=0)
    assert np.all(np.abs(total) <= INT32_MAX)
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.abs(total / q.scale(e_max) - ref)
    assert np.all(err <= q.sum_error_bound(e_max) + 4 * np.finfo(np.float64).eps * np.abs(ref))


def test_block_exponent_refuses_a_too_small_exponent() -> None:
    q = BlockExponent(4)
    with pytest.raises(ValueError):
        q.encode(np.array([8.0], np.float32), e_max=2)
