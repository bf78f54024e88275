"""Naming the rank that is gone when a gloo collective fails."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from gradfabric.core.errors import PeerTimeoutError


def name_the_missing(
    tag: str, group: Any, world: int, rank: int, call: int, wait_s: float, err: RuntimeError
) -> PeerTimeoutError:
    """After a failed call, every surviving rank checks in at the rendezvous
    store (which does not depend on the broken gloo connections); the ranks
    that have not checked in after ``wait_s`` are named. ``tag`` and ``call``
    keep different callers and calls apart."""
    # (the default store is reached through a private accessor: there is no public one)
    store = dist.distributed_c10d._get_default_store()
    ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(world)]
    key = f"gradfabric/{tag}/{call}/"
    store.set(key + str(ranks[rank]), "here")
    deadline = time.monotonic() + wait_s
    missing = list(ranks)
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([key + str(r)])]
        time.sleep(0.05)
    names = ", ".join(f"rank {r}" for r in missing) or "no rank (all checked in)"
    e = PeerTimeoutError(names, wait_s)
    e.args = (f"{tag} collective failed ({str(err).splitlines()[0][:200]}); {names} did not "
              f"report within {wait_s:g} s",)  # fmt: skip
    return e
