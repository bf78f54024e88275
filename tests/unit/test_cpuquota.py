"""A CPU quota bounds the process's share of a core, and leaves nothing
behind. The bound is an upper one: a busy host only gives the process less,
so no noise can make it fail."""

from __future__ import annotations

import os
import time

import pytest

from gradfabric.core import cpuquota
from gradfabric.core.errors import ConfigError
from gradfabric.lab.plan_bench import ExecConfig


def _spin(seconds: float) -> tuple[float, float]:
    """Busy-loop for ``seconds`` of wall time; (CPU seconds, wall seconds)."""
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(1000))
    return time.process_time() - c0, time.perf_counter() - t0


@pytest.mark.skipif(not cpuquota.available(), reason="needs root and the cgroup v1 cpu controller")
def test_a_quota_bounds_the_share_of_a_core_and_is_removed_after() -> None:
    home = cpuquota._own_cgroup()
    with cpuquota.quota(0.25) as path:
        cpu, wall = _spin(0.6)
        stat = cpuquota.throttled(path)
        assert str(os.getpid()) in (path / "cgroup.procs").read_text().split()
    # 0.25 of a core, plus at most one period's quota of slack at the edges
    assert cpu <= 0.25 * wall + cpuquota.PERIOD_US * 1e-6
    assert stat["throttled"] > 0
    assert not path.exists()
    assert str(os.getpid()) in (home / "cgroup.procs").read_text().split()


@pytest.mark.skipif(not cpuquota.available(), reason="needs root and the cgroup v1 cpu controller")
def test_a_thread_quota_holds_the_calling_thread_alone() -> None:
    """Only the calling thread is in the quota's cgroup (a thread running
    beside it is not) and it is held to the quota."""
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with cpuquota.quota(0.2, thread=True) as path:
            held = _thread_spin(0.6)
            members = (path / "tasks").read_text().split()
    finally:
        stop.set()
        other.join()
    assert members == [str(threading.get_native_id())]
    assert str(other.native_id) not in members
    assert held <= 0.2 * 0.6 + cpuquota.PERIOD_US * 1e-6
    assert not path.exists()


def _thread_spin(seconds: float) -> float:
    """This thread's CPU seconds over ``seconds`` of busy wall time."""
    c0, t0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(1000))
    return time.thread_time() - c0


def test_a_quota_must_be_positive_and_a_config_names_its_device_kind() -> None:
    with pytest.raises(ConfigError, match="cores"), cpuquota.quota(0.0):
        pass
    with pytest.raises(ValueError, match="devices"):
        ExecConfig(devices="gpu")
    with pytest.raises(ValueError, match="quota_cores"):
        ExecConfig(devices="quota", quota_cores=0.0)
