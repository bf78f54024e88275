"""A CPU quota for the calling process: a device as slow as the host makes it.

``quota(cores)`` moves this process (all its threads, and those it starts
later; or, with ``thread=True``, only the calling thread) into a cgroup of its
own under the one it is in, whose CFS bandwidth
is ``cores`` of one CPU per ``PERIOD_US``, and on exit moves it back and
deletes the cgroup. The process's compute then runs at that share of a core,
with whatever the host's caches, memory and scheduler make of it: no sleep
stands in for compute (the planner's deadline throttle does that, and so
matches its cost model by construction). It needs root and the cgroup v1
``cpu`` controller (``/sys/fs/cgroup/cpu``); ``available()`` says whether
both are here, and tests skip where not. cgroup v2 (``cpu.max``) is not
supported yet.

The period is short (10 ms) so that a quota spreads over a step of tens of
milliseconds rather than letting a process run free and then stall for most
of a 100 ms period.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gradfabric.core.errors import ConfigError

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel's least quota


def available() -> bool:
    return os.geteuid() == 0 and (ROOT / "cpu.cfs_quota_us").exists()


def _own_cgroup() -> Path:
    """The cpu cgroup this process is in (``/proc/self/cgroup``'s cpu line)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return ROOT / path.lstrip("/")
    return ROOT


def throttled(path: Path) -> dict[str, int]:
    """The cgroup's ``cpu.stat``: periods, periods throttled, ns throttled."""
    stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
    return {"periods": int(stat["nr_periods"]), "throttled": int(stat["nr_throttled"]),
            "throttled_ns": int(stat["throttled_time"])}  # fmt: skip


@contextmanager
def quota(cores: float, thread: bool = False) -> Iterator[Path]:
    """This process at ``cores`` of one CPU until the block ends; yields the
    cgroup's path (``throttled`` reads it). ``thread``: only the calling
    thread (and threads it starts inside the block), the process's other
    threads left free: a device whose compute is slow while its
    communication threads are not."""
    if not cores > 0:
        raise ConfigError("cores", f"a CPU quota must be > 0 cores, got {cores}")
    if not available():
        raise ConfigError("cpu quota", "needs root and the cgroup v1 cpu controller at "
                          f"{ROOT} (cgroup v2 hosts are not supported yet)")  # fmt: skip
    home = _own_cgroup()
    who, members = ((threading.get_native_id(), "tasks") if thread
                    else (os.getpid(), "cgroup.procs"))  # fmt: skip
    path = home / f"gradfabric-{os.getpid()}-{who}"
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US, round(cores * PERIOD_US))))
        (path / members).write_text(str(who))
        yield path
    finally:
        _remove(path, home)


def _remove(path: Path, home: Path) -> None:
    """Move every task of cgroup ``path`` back ``home`` (threads started
    inside the block too) and remove it. A thread can arrive between the
    read and the rmdir, and the kernel can hold an emptied group a moment
    (EBUSY): read and move again, for up to a second, then let the error out."""
    for attempt in range(100):
        for tid in (path / "tasks").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # (a thread that ended since)
                (home / "tasks").write_text(tid)
        try:
            path.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or attempt == 99:
                raise
            time.sleep(0.01)
