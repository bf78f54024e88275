"""How busy the host's cores were: every process's and the kernel's time.

A rank's ``process_time`` misses what a step costs elsewhere on the host:
the switch daemon, the kernel forwarding datagrams between namespaces (its
softirq work lands on whichever task it interrupts, or on ``ksoftirqd``),
other ranks' threads. ``/proc/stat``'s first line counts all of it, in clock
ticks summed over the cores: ``snapshot()`` reads it as (busy, total) ticks,
busy being every state but idle and iowait, and ``Busy`` adds the ticks of
intervals, so that a share over many short steps is not the mean of shares
each rounded to a tick. Linux only; elsewhere ``snapshot()`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

STAT = "/proc/stat"
IDLE, IOWAIT = 3, 4  # the idle columns of the "cpu" line (after its name)


def parse(line: str) -> tuple[int, int]:
    """(busy, total) clock ticks of /proc/stat's summed "cpu" line. Guest
    time (columns 9 and 10) is already counted in user and nice, so it is
    left out of the total."""
    name, *fields = line.split()
    if name != "cpu" or len(fields) < 4:
        raise ValueError(f"not /proc/stat's summed cpu line: {line!r}")
    ticks = [int(f) for f in fields[:8]]
    total = sum(ticks)
    idle = ticks[IDLE] + (ticks[IOWAIT] if len(ticks) > IOWAIT else 0)
    return total - idle, total


def snapshot(path: str = STAT) -> tuple[int, int] | None:
    """The host's (busy, total) ticks so far, or None where there is no /proc/stat."""
    try:
        with open(path) as f:
            return parse(f.readline())
    except OSError:
        return None


@dataclass
class Busy:
    """The busy share of the host's cores over the intervals added."""

    busy: int = 0
    total: int = 0

    def add(self, before: tuple[int, int] | None, after: tuple[int, int] | None) -> None:
        if before is not None and after is not None:
            self.busy += after[0] - before[0]
            self.total += after[1] - before[1]

    @property
    def share(self) -> float | None:
        return self.busy / self.total if self.total > 0 else None


SCHEDSTAT = "/proc/thread-self/schedstat"


def waited_s(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core
    (the scheduler's run-queue delay, ``schedstat``'s second field), or None
    where the kernel does not keep it. Over a step, the part of its time a
    rank lost to others' work on the same cores."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
