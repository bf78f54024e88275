"""The switch daemon's wake-up (``runtime.wakeup``): never early, replaced by
a later setting, and closed cleanly."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from gradfabric.runtime.wakeup import WakeUp


def test_a_wake_up_comes_once_its_time_has_come_and_a_new_time_replaces_the_old() -> None:
    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        done = asyncio.Event()

        def then() -> None:
            fired.append(time.monotonic_ns())
            done.set()

        w = WakeUp(loop, then)
        try:
            if sys.platform == "linux":
                assert w.precise  # a timerfd serves
            now = time.monotonic_ns()
            w.at(now + 10_000_000_000)  # in 10 s: replaced by the next
            want = now + 300_000
            w.at(want)
            await asyncio.wait_for(done.wait(), 5.0)
            await asyncio.sleep(0.05)  # (no second wake-up for the replaced time)
            assert len(fired) == 1 and fired[0] >= want  # never before its time
            done.clear()
            w.at(time.monotonic_ns() - 1_000)  # a time already past: at once
            await asyncio.wait_for(done.wait(), 5.0)
            return fired
        finally:
            w.close()

    assert len(asyncio.run(run())) == 2


def test_a_closed_wake_up_leaves_nothing_behind() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        w = WakeUp(loop, lambda: pytest.fail("a closed wake-up fired"))
        w.at(time.monotonic_ns() + 1_000_000)
        fd = w.fd
        w.close()
        assert w.fd == -1
        if fd >= 0:
            with pytest.raises(OSError):
                os.fstat(fd)
        await asyncio.sleep(0.01)

    asyncio.run(run())
