"""The shared retransmission timeout (``proto.rto``) against RFC 6298's
arithmetic, written out here."""

from __future__ import annotations

import pytest

from gradfabric.proto.rto import MAX_BACKOFF, Rto


def test_the_estimators_follow_rfc_6298() -> None:
    rto = Rto(1_000)
    assert rto.ns() == 1_000  # no sample: the floor
    samples = [10_000, 14_000, 6_000, 30_000]
    srtt, var = float(samples[0]), samples[0] / 2  # (2.2: the first sample)
    rto.sample(samples[0])
    for r in samples[1:]:  # (2.3: beta 1/4, then alpha 1/8, the old srtt in rttvar's)
        var = (1 - 1 / 4) * var + 1 / 4 * abs(srtt - r)
        srtt = (1 - 1 / 8) * srtt + 1 / 8 * r
        rto.sample(r)
    assert rto.srtt == pytest.approx(srtt) and rto.rttvar == pytest.approx(var)
    assert rto.ns() == int(srtt + 4 * var)


def test_the_floor_and_the_backoff() -> None:
    rto = Rto(50_000)
    rto.sample(1_000)
    assert rto.ns() == 50_000  # a sample under the floor
    for _ in range(10):
        rto.expired()
    assert rto.backoff == MAX_BACKOFF and rto.ns() == 50_000 * MAX_BACKOFF
    rto.progress()
    assert rto.ns() == 50_000
    with pytest.raises(ValueError, match="floor"):
        Rto(0)
