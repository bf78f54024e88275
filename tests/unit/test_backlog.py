"""The switch daemon's send backlog: what a full send buffer refuses waits
and leaves in order; past the bound it is a counted drop, never a crash."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile

import pytest

from gradfabric.runtime import switchd
from gradfabric.runtime.switchd import SwitchConfig, SwitchDaemon


async def _push(n: int, read_after: int) -> tuple[list[bytes], SwitchDaemon]:
    """Send ``n`` datagrams through the daemon's ``_sendto`` to a unix
    datagram socket nobody reads until ``read_after`` were offered (its queue
    fills, so the kernel refuses), then read all that come."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sink")
        sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sink.bind(path)
        sink.setblocking(False)
        daemon = SwitchDaemon(SwitchConfig())
        daemon.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        daemon.sock.setblocking(False)
        got: list[bytes] = []
        for i in range(n):
            daemon._sendto(i.to_bytes(4, "big"), path)  # type: ignore[arg-type]
            if i + 1 == read_after:
                assert daemon.backlog, "the kernel refused nothing: the test proves nothing"
        for _ in range(1000):
            await asyncio.sleep(0.001)  # the loop's writer callback flushes
            while True:
                try:
                    got.append(sink.recv(16))
                except BlockingIOError:
                    break
            if not daemon.backlog and len(got) >= n - daemon.counters["drop_tx_full"]:
                break
        daemon.stop()
        sink.close()
        return got, daemon


def test_refused_datagrams_wait_and_leave_in_order() -> None:
    got, daemon = asyncio.run(_push(2000, 2000))
    assert got == [i.to_bytes(4, "big") for i in range(2000)]
    assert daemon.counters["tx_datagrams"] == 2000 and daemon.counters["drop_tx_full"] == 0


def test_a_backlog_past_its_bound_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(switchd, "MAX_BACKLOG", 10)
    got, daemon = asyncio.run(_push(2000, 2000))
    dropped = daemon.counters["drop_tx_full"]
    assert dropped > 0 and len(got) + dropped == 2000
    # what was sent is a prefix in order, then the last ten that waited
    nums = [int.from_bytes(g, "big") for g in got]
    assert nums == sorted(nums)
