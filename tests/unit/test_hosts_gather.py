"""``Hosts.gather`` against a host that sends its record and exits while the
parent looks at it, and against one that exits without a record."""

from __future__ import annotations

from typing import Any

import pytest

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net import launch
from gradfabric.net.launch import Hosts


class _Host:
    """One host's process and pipe. ``record``: what it sends, at the parent's
    first look at the pipe, and then it exits (None: it exits without)."""

    sentinel = -1
    exitcode = 0

    def __init__(self, record: Any) -> None:
        self.record, self.alive, self.looks = record, True, 0

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        return None

    def poll(self) -> bool:
        self.looks += 1
        if self.looks == 1:  # it sends (or not) and exits just after this look
            self.alive = False
            return False
        return True  # its record, or the end of the pipe

    def recv(self) -> Any:
        if self.record is None:
            raise EOFError
        return self.record


def _gather(host: _Host) -> list[Any]:
    hosts = Hosts.__new__(Hosts)
    hosts.names, hosts.grace_s = ["worker 0"], 0.0
    hosts._procs, hosts._conns = [host], [host]  # type: ignore[list-item]
    return hosts.gather(1.0, "it finished")


def test_a_host_that_sends_then_exits_while_looked_at_is_read_not_named_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch, "wait", lambda objects, timeout: [])
    assert _gather(_Host({"t0": 1.0})) == [{"t0": 1.0}]


def test_a_host_gone_without_its_record_is_named_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Named dead on the pass after its pipe ends, not left to the deadline
    (its ended pipe polls readable: reading it again must not loop)."""
    monkeypatch.setattr(launch, "wait", lambda objects, timeout: [])
    try:
        _gather(_Host(None))
    except RuntimeError as e:
        assert str(e) == "worker 0 died (exit code 0) before it finished"
    except PeerTimeoutError:
        pytest.fail("a host gone without its record waited for the deadline")
    else:
        pytest.fail("a host gone without its record was not named")
