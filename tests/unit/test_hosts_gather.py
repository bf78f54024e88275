"""``Hosts.gather`` against a host that sends its record and exits between
the parent's two looks at it (the pipe, then the process)."""

from __future__ import annotations

from typing import Any

import pytest

from gradfabric.net import launch
from gradfabric.net.launch import Hosts


class _Pipe:
    """A pipe whose message arrives after the parent's first look."""

    def __init__(self, message: Any) -> None:
        self.message, self.looks = message, 0

    def poll(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def recv(self) -> Any:
        return self.message


class _Exited:
    sentinel = -1
    exitcode = 0

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        return None


def _hosts(pipe: _Pipe) -> Hosts:
    hosts = Hosts.__new__(Hosts)
    hosts.names, hosts.grace_s = ["worker 0"], 0.0
    hosts._procs, hosts._conns = [_Exited()], [pipe]  # type: ignore[list-item]
    return hosts


def test_a_host_that_sent_then_exited_between_the_looks_is_read_not_called_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its record was written before it exited: the gather reads it (a
    host found gone with nothing on its pipe is still named dead)."""
    monkeypatch.setattr(launch, "wait", lambda objects, timeout: [])
    assert _hosts(_Pipe({"t0": 1.0})).gather(1.0, "it finished") == [{"t0": 1.0}]

    class _Empty(_Pipe):
        def poll(self) -> bool:
            return False

    with pytest.raises(RuntimeError, match=r"worker 0 died \(exit code 0\) before it finished"):
        _hosts(_Empty(None)).gather(1.0, "it finished")
