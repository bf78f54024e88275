"""Start a switch daemon as its own process (as an operator would), for the
training runs, the benchmark and the tests."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.netns import NsHost
from gradfabric.net.udp import Address
from gradfabric.runtime.client import parse_address


@dataclass
class RunningSwitch:
    proc: subprocess.Popen[str]
    data: Address
    control: Address
    metrics: Address | None = None  # where Prometheus text is served, if asked for
    final: dict[str, Any] = field(default_factory=dict)  # stats after SIGTERM

    @property
    def control_text(self) -> str:
        return f"{self.control[0]}:{self.control[1]}"


def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise PeerTimeoutError("switch daemon", timeout_s)
    return proc.stdout.readline()


def start_switch(
    *options: str, timeout_s: float = 30.0, host: NsHost | None = None
) -> RunningSwitch:
    """``gradfabric switch serve --json *options`` in a new process (inside
    ``host``'s network namespace, on its address, if given)."""
    cmd = [sys.executable, "-m", "gradfabric.cli", "switch", "serve", "--json", *options]
    if host is not None:
        cmd = ["ip", "netns", "exec", host.netns, *cmd, "--host", host.ip]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = _line(proc, timeout_s)
    if not line:
        proc.wait(5)
        raise RuntimeError(f"switch daemon exited with {proc.returncode} before serving")
    where = json.loads(line)
    metrics = parse_address(where["metrics"]) if "metrics" in where else None
    return RunningSwitch(
        proc, parse_address(where["data"]), parse_address(where["control"]), metrics
    )


def stop_switch(sw: RunningSwitch, timeout_s: float = 10.0) -> None:
    """SIGTERM; keep its final counters."""
    if sw.proc.poll() is None:
        sw.proc.send_signal(signal.SIGTERM)
        try:
            line = _line(sw.proc, timeout_s)
            sw.final = json.loads(line) if line else {}
        finally:
            try:
                sw.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                sw.proc.kill()
                sw.proc.wait()
    if sw.proc.stdout is not None:
        sw.proc.stdout.close()


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (user and system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def switch_daemon(*options: str, host: NsHost | None = None) -> Iterator[RunningSwitch]:
    sw = start_switch(*options, host=host)
    try:
        yield sw
    finally:
        stop_switch(sw)
