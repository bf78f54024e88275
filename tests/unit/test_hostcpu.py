"""The host's busy share from /proc/stat: ticks parsed by hand, summed over
intervals, and a busy loop seen by the real file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradfabric.core import hostcpu


def test_busy_is_every_state_but_idle_and_iowait_guest_left_out() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  100 5 50 800 20 3 7 2 11 4\n"
    assert hostcpu.parse(line) == (100 + 5 + 50 + 3 + 7 + 2, 987)
    with pytest.raises(ValueError, match="cpu line"):
        hostcpu.parse("cpu0 1 2 3 4 5 6 7 8")
    with pytest.raises(ValueError, match="cpu line"):
        hostcpu.parse("intr 12 0 3")


def test_a_share_adds_ticks_not_shares() -> None:
    b = hostcpu.Busy()
    assert b.share is None
    b.add((0, 0), (1, 2))  # half of 2 ticks
    b.add((5, 10), (15, 20))  # all of 10
    b.add(None, (99, 99))  # a reading that failed adds nothing
    assert b.share == pytest.approx(11 / 12)  # (the mean of the shares would say 0.75)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_busy_loop_shows_in_the_host_ticks() -> None:
    before = hostcpu.snapshot()
    c0 = time.process_time()
    while time.process_time() - c0 < 0.3:  # 0.3 s of this thread's CPU
        pass
    after = hostcpu.snapshot()
    assert before is not None and after is not None
    busy, total = after[0] - before[0], after[1] - before[1]
    # clock ticks are 10 ms here (USER_HZ 100): 0.3 s of CPU is ~30 of them at least
    assert busy >= 20 and total >= busy
    assert hostcpu.snapshot("/nonexistent/stat") is None


def test_a_thread_sharing_its_core_with_a_busy_process_waits_for_it(tmp_path: Path) -> None:
    """The run-queue delay: read by field from schedstat, and real: a busy
    loop pinned to one core beside another busy process on that core waits
    for it about half of the time (at least a sixth, against the noise of a
    shared host)."""
    fake = tmp_path / "schedstat"
    fake.write_text("123 4500000000 7\n")
    assert hostcpu.waited_s(str(fake)) == 4.5
    assert hostcpu.waited_s(str(tmp_path / "missing")) is None
    if hostcpu.waited_s() is None or not hasattr(os, "sched_setaffinity"):
        pytest.skip("no schedstat or affinity here")
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(rival.pid, {core})
        os.sched_setaffinity(0, {core})
        time.sleep(0.1)  # the rival is spinning
        w0, t0 = hostcpu.waited_s(), time.monotonic()
        while time.monotonic() - t0 < 0.6:
            pass
        w1 = hostcpu.waited_s()
    finally:
        os.sched_setaffinity(0, before)
        rival.kill()
        rival.wait()
    assert w0 is not None and w1 is not None and w1 - w0 > 0.1
