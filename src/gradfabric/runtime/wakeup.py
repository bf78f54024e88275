"""A wake-up for an event loop at a time given to the microsecond.

asyncio's own timers (``call_at``) wake up to a millisecond late on Linux:
its epoll selector rounds every timeout up to whole milliseconds. A switch
node's timer is the arrival of a packet on a modelled link (ATP's fallback
PS, ``proto.node.ModelledLinks``), tens of microseconds ahead at 1 Gbit/s;
rounded up, every packet that crosses such a link (twice, down and up)
would take a millisecond or two, and ATP, which sends more to its PS than
ESA, would pay more of it. A ``timerfd`` (Linux) armed at an absolute
``CLOCK_MONOTONIC`` time (``time.monotonic_ns``'s clock) and read by the
loop like any socket wakes it when the time comes. Where there is no
timerfd, the loop's own timers serve, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from collections.abc import Callable

CLOCK_MONOTONIC = 1
TFD_NONBLOCK, TFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(_Itimerspec), ctypes.c_void_p]  # fmt: skip
    except (OSError, AttributeError):
        return None
    return libc


class WakeUp:
    """Calls ``then()`` on ``loop`` once the time set by ``at`` has come (a
    later ``at`` replaces an earlier one; see the module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, then: Callable[[], None]) -> None:
        self.loop, self.then = loop, then
        self.libc = _libc()
        self.fd = -1 if self.libc is None else self.libc.timerfd_create(
            CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)  # fmt: skip
        self.handle: asyncio.TimerHandle | None = None  # the fallback's
        if self.fd >= 0:
            loop.add_reader(self.fd, self._ready)

    @property
    def precise(self) -> bool:
        """Whether a timerfd serves (else the loop's own timers)."""
        return self.fd >= 0

    def at(self, ns: int) -> None:
        """Wake at ``ns`` on ``time.monotonic_ns``'s clock (at once if past)."""
        if self.fd < 0 or self.libc is None:
            if self.handle is not None:
                self.handle.cancel()
            self.handle = self.loop.call_at(ns / 1e9, self.then)
            return
        ns = max(ns, 1)  # (a zero time would disarm it)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        if self.libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None):
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    def _ready(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return  # (re-armed since it fired)
        self.then()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
