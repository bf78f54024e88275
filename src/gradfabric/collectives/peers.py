"""Naming the rank that is gone when a collective fails.

Every surviving rank of a failed call checks in at the rendezvous store,
which does not depend on the broken gloo connections; the ranks that have not
checked in are named. A rank learns of the failure in one of two ways: gloo
reports a closed connection at once, or (in ``emu``) the switch stops
answering and the rank's own timeout passes, a timeout that started about
when the other ranks' calls did. ``name_the_missing`` therefore waits a grace
period past the timeout before it names a rank, and a rank that timed out on
the switch discounts the ranks that did check in (``Roll.present``): both see
the one rank that died.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from gradfabric.core.errors import PeerTimeoutError

GRACE_S = 1.0  # how much later than ours another rank's timeout may pass


class Roll:
    """This rank's check-in for call ``call`` of ``tag`` (the tag and the call
    number keep different callers and calls apart). Ranks are the group's."""

    def __init__(self, tag: str, group: Any, world: int, rank: int, call: int) -> None:
        # (the default store is reached through a private accessor: there is no public one)
        self.store = dist.distributed_c10d._get_default_store()
        on = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.globals = [on(r) for r in range(world)]
        self.key = f"gradfabric/{tag}/{call}/"
        self.store.set(self.key + str(self.globals[rank]), "here")

    def present(self, rank: int) -> bool:
        return bool(self.store.check([self.key + str(self.globals[rank])]))

    def absent_after(self, wait_s: float) -> list[int]:
        """The ranks that have not checked in within ``wait_s`` (fewer as they arrive)."""
        deadline = time.monotonic() + wait_s
        missing = list(range(len(self.globals)))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self.present(r)]
            time.sleep(0.05)
        return missing


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
