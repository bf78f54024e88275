"""The offloads change how datagrams travel, never which: the differential
harness for the native driver's segmented sends (UDP GSO) and coalesced
reads (UDP GRO).

Hypothesis draws sequences of datagrams (runs of one length, which the
driver sends as one segmented message, broken by other lengths, empty
datagrams, the largest a message carries) and the native driver sends them
over loopback (which carries a segmented message whole, as a veth does).
Three readers must each get exactly the sequence sent, in order: the native
driver's own read with coalescing on (it cuts each coalesced message as it
does before its engine sees it), a plain socket (the kernel cuts the
message before delivery: what a Python reference reads), and everything
again with the offloads off.
"""

from __future__ import annotations

import socket
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.net import datapath
from gradfabric.net.datapath import offload, send_datagrams, take_datagrams
from tests.native import require

require("the native UDP driver", datapath.PATH, datapath.WHY_NOT, module=True)

LENGTHS = (0, 1, 40, 1432, 1433, 8232, 16_000)  # wire datagrams of 0 .. 358 .. 2048 values


@st.composite
def trains(draw: st.DrawFn) -> list[bytes]:
    """Runs of equal lengths (one segmented message each, up to its limits)."""
    out: list[bytes] = []
    for _ in range(draw(st.integers(1, 6))):
        n, k = draw(st.sampled_from(LENGTHS)), draw(st.integers(1, 70))
        seed = draw(st.integers(0, 255))
        out += [bytes((seed + i + j) % 256 for j in range(n)) for i in range(k)]
    return out[:400]


def _pair() -> tuple[socket.socket, socket.socket]:
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s in (tx, rx):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
    rx.bind(("127.0.0.1", 0))
    return tx, rx


def _read_native(rx: socket.socket, n: int) -> tuple[list[bytes], int]:
    got: list[bytes] = []
    coalesced = 0
    rx.settimeout(2.0)
    while len(got) < n:
        rx.recv(1, socket.MSG_PEEK)  # wait for the next message (a timeout fails the test)
        more, c = take_datagrams(rx)
        got += more
        coalesced += c
    return got, coalesced


def _read_plain(rx: socket.socket, n: int) -> list[bytes]:
    rx.settimeout(2.0)
    return [rx.recv(65536) for _ in range(n)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trains())
def test_segmented_and_coalesced_datagrams_are_the_datagrams_sent(sent: list[bytes]) -> None:
    tx, rx = _pair()
    try:
        on = offload(tx)
        offload(rx)
        c = send_datagrams(tx, rx.getsockname(), sent)
        assert c["sent"] == len(sent) and c["refused"] == 0, c
        got, coalesced = _read_native(rx, len(sent))
        assert got == sent
        lens = [len(d) for d in sent]
        runs = any(a == b > 0 for a, b in pairwise(lens))
        if on["gso"] and runs:  # a run went as one message and arrived as one
            assert c["segmented"] > 0, c
            assert coalesced > 0
    finally:
        tx.close()
        rx.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trains(), st.booleans())
def test_a_reader_without_coalescing_gets_the_same_datagrams(sent: list[bytes], on: bool) -> None:
    """A plain socket (the reference's read) gets each datagram of a
    segmented message on its own; with the offloads off nothing is segmented."""
    tx, rx = _pair()
    try:
        got = offload(tx) if on else datapath_off(tx)
        c = send_datagrams(tx, rx.getsockname(), sent)
        assert _read_plain(rx, len(sent)) == sent
        if not got["gso"]:
            assert c["segmented"] == 0 and c["syscalls"] >= 1, c
    finally:
        offload(tx)  # (the process's sends segmented again, as the other tests expect)
        tx.close()
        rx.close()


def datapath_off(sock: socket.socket) -> dict[str, bool]:
    import os

    os.environ[datapath.OFFLOAD_ENV] = "0"
    try:
        return offload(sock)
    finally:
        del os.environ[datapath.OFFLOAD_ENV]


def test_the_kernel_here_has_both_offloads() -> None:
    """Where Linux has UDP GSO and GRO (4.18 and 5.0 on), both are on by
    default; elsewhere the driver says so and runs without them."""
    tx, _ = _pair()
    try:
        got = offload(tx)
    finally:
        tx.close()
    if not got["gro"]:
        pytest.skip(f"this kernel lacks UDP_GRO: {got}")
    assert got == {"gro": True, "gso": True}
