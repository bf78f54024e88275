"""Naming the rank that is gone when a collective fails.

Every surviving rank of a failed call checks in at the rendezvous store,
which does not depend on the broken gloo connections; the ranks that have not
checked in are named. A rank learns of the failure in one of two ways: gloo
reports a closed connection at once, or (in ``runtime``) the switch stops
answering and the rank's own timeout passes, a timeout that started about
when the other ranks' calls did. ``name_the_missing`` therefore waits a grace
period past the timeout before it names a rank, and a rank that timed out on
the switch discounts the ranks that did check in (``Roll.present``): both see
the one rank that died.

A rank that is alive can still be late to check in: one that gloo blocks
behind another survivor learns of the failure only when that survivor gives
up. So every rank in a collective keeps a heartbeat (``keep_alive``: a
counter in the store, bumped by a thread every ``HEARTBEAT_S``, which runs
while the rank's main thread waits inside gloo), and a rank is named only if
it neither checked in nor beat while we waited. Counters, not clocks: hosts'
clocks need not agree. The heartbeat stops before the group is torn down
(``net.launch.end_group``) or at exit.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any, Final

import torch.distributed as dist

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net import launch

GRACE_S = 1.0  # how much later than ours another rank's timeout may pass
HEARTBEAT_S: Final = 0.25


def _store() -> Any:
    # (the default store is reached through a private accessor: there is no public one)
    return dist.distributed_c10d._get_default_store()


def _alive_key(global_rank: int) -> str:
    return f"gradfabric/alive/{global_rank}"


class _Heartbeat:
    def __init__(self, store: Any, key: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(store, key), daemon=True, name="gradfabric-heartbeat"
        )
        self.thread.start()

    def _run(self, store: Any, key: str) -> None:
        while not self.stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the group's store is gone: so is the group
                return
            self.stop.wait(HEARTBEAT_S)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(4 * HEARTBEAT_S)


_HEARTBEATS: dict[int, _Heartbeat] = {}  # by the default group's identity


def keep_alive() -> None:
    """Start this rank's heartbeat for the default group (once)."""
    group = id(dist.distributed_c10d._get_default_group())
    if group not in _HEARTBEATS:
        _HEARTBEATS[group] = _Heartbeat(_store(), _alive_key(dist.get_rank()))


def stop_heartbeats() -> None:
    while _HEARTBEATS:
        _HEARTBEATS.popitem()[1].end()


launch.BEFORE_END.append(stop_heartbeats)
atexit.register(stop_heartbeats)


class Roll:
    """This rank's check-in for call ``call`` of ``tag`` (the tag and the call
    number keep different callers and calls apart). Ranks are the group's."""

    def __init__(self, tag: str, group: Any, world: int, rank: int, call: int) -> None:
        self.store = _store()
        on = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.globals = [on(r) for r in range(world)]
        self.key = f"gradfabric/{tag}/{call}/"
        self.store.set(self.key + str(self.globals[rank]), "here")

    def present(self, rank: int) -> bool:
        return bool(self.store.check([self.key + str(self.globals[rank])]))

    def beats(self, rank: int) -> int:
        return int(self.store.add(_alive_key(self.globals[rank]), 0))

    def absent_after(self, wait_s: float) -> list[int]:
        """The ranks that have neither checked in nor beaten within ``wait_s``."""
        before = [self.beats(r) for r in range(len(self.globals))]
        deadline = time.monotonic() + wait_s
        missing = list(range(len(self.globals)))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self.present(r)]
            time.sleep(0.05)
        return [r for r in missing if self.beats(r) == before[r]]


def name_the_missing(
    tag: str, group: Any, world: int, rank: int, call: int, wait_s: float, err: RuntimeError
) -> PeerTimeoutError:
    """After a gloo call failed with ``err``: the error naming the ranks (global
    numbers) that did not check in within ``wait_s`` plus the grace period."""
    roll = Roll(tag, group, world, rank, call)
    missing = [roll.globals[r] for r in roll.absent_after(wait_s + GRACE_S)]
    names = ", ".join(f"rank {r}" for r in missing) or "no rank (all checked in)"
    e = PeerTimeoutError(names, wait_s)
    e.args = (f"{tag} collective failed ({str(err).splitlines()[0][:200]}); {names} did not "
              f"report within {wait_s:g} s",)  # fmt: skip
    return e
