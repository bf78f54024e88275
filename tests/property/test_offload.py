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

from gradfabric.net import datapath, netns
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


def _socket(bind: str | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if bind is not None:
        s.bind((bind, 0))
    return s


@pytest.mark.skipif(not netns.usable(), reason="needs root and network namespaces")
def test_a_run_over_the_route_s_mtu_goes_datagram_by_datagram() -> None:
    """Datagrams longer than the route's MTU cannot be segmented (the kernel
    refuses): that run goes datagram by datagram, each as IP fragments, all
    delivered; the next run of that size is not tried segmented again."""
    with netns.tor_star(1, 1.0, mtu=1500) as (hosts, tor):
        rx = netns.call_in(tor, _socket, tor.ip)
        tx = netns.call_in(hosts[0], _socket)
        try:
            if not offload(tx)["gso"]:
                pytest.skip("this kernel lacks UDP GSO")
            sent = [bytes([i]) * 4000 for i in range(10)]
            first = send_datagrams(tx, rx.getsockname(), sent)
            assert _read_plain(rx, 10) == sent
            again = send_datagrams(tx, rx.getsockname(), sent)
            assert _read_plain(rx, 10) == sent
        finally:
            tx.close()
            rx.close()
    assert first["sent"] == again["sent"] == 10 and first["segmented"] == again["segmented"] == 0
    assert first["syscalls"] == 1 + 10  # the refused message, then each datagram
    assert again["syscalls"] == 1  # one batch, no message tried segmented
