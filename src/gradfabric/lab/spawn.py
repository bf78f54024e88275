"""Run a function on N local torch.distributed ranks, with a rendezvous that
cannot race and a teardown that cannot abort.

Every multi-process test and benchmark used to carry three bugs of one class:

- **A port chosen by binding a socket and closing it** is free only until
  another process takes it (a test running beside this one, or gloo's own pair
  listeners, which bind ephemeral ports too). The ranks here meet in a
  ``FileStore`` inside a private temporary directory instead: no other run can
  name it, and gloo's listeners still bind whatever port the kernel hands
  them, so nothing is chosen and released.
- **A process group that outlives its function.** DDP's reducer (and any hook
  state) holds the C++ process group, so ``destroy_process_group`` inside the
  function only unregisters it; the group itself is then destroyed during
  interpreter finalisation with gloo's threads still running, and
  ``std::terminate`` ends the rank with SIGABRT ("terminate called without an
  active exception"), one run in a few. The entry here runs the function to
  its end (its locals, the DDP module among them, are gone when it returns),
  waits at a barrier so that no rank has work in flight, collects garbage and
  only then destroys the group, while the interpreter is whole.
- **A teardown after the teardown.** Even then a group outlives
  ``destroy_process_group`` once a rank built a DDP module, and torch tears
  it down in the interpreter's finalisation beside gloo's threads (a rank
  aborted once in the suite's runs, most likely there). A rank whose work
  returned and whose group was destroyed in order leaves with
  ``os._exit(0)`` (``net.launch.leave``, which says more); ``faulthandler``
  is on in every rank, so a fatal signal before that prints every thread's
  Python stack.

A function that ends with an exception skips the barrier (its peers may be
dead or stuck) and the exception reaches ``torch.multiprocessing``'s report.
Functions that kill a rank on purpose pass ``barrier_at_exit=False``.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.launch import end_group, leave
from gradfabric.net.netns import NsHost, enter

RankFn = Callable[..., None]  # fn(rank, world, *args)


def _entry(
    rank: int,
    fn: RankFn,
    world: int,
    store_path: str,
    args: tuple[Any, ...],
    timeout_s: float,
    barrier_at_exit: bool,
    backend: str,
    threads: int | None,
    hosts: list[NsHost] | None,
) -> None:
    faulthandler.enable()  # (a fatal signal prints every thread's Python stack)
    if hosts is not None:  # (first: gloo's sockets must be made in the namespace)
        enter(hosts[rank])
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    fn(rank, world, *args)
    end_group(barrier_at_exit)
    leave()


def spawn(
    fn: RankFn,
    world: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 120.0,
    deadline_s: float = 600.0,
    barrier_at_exit: bool = True,
    backend: str = "gloo",
    threads: int | None = None,
    hosts: list[NsHost] | None = None,
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks inside a
    process group of ``backend`` and wait for all of them.

    ``timeout_s`` is the group's collective timeout; ``deadline_s`` bounds the
    whole run: past it the ranks still running are killed and
    ``PeerTimeoutError`` names them. A rank's exception or fatal signal is
    raised here as ``torch.multiprocessing``'s ``ProcessRaisedException`` /
    ``ProcessExitedException``. ``threads``: intra-op threads per rank (ranks
    that share a few cores spin against each other otherwise). ``hosts``:
    rank ``r`` runs in ``hosts[r]``'s network namespace and its gloo sockets
    on that host's link (``net.netns``; the rendezvous is a file, which every
    namespace sees)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"{world} ranks need {world} hosts, got {len(hosts)}")
    with tempfile.TemporaryDirectory(prefix="gf-rdzv-") as tmp:
        store = os.path.join(tmp, "store")
        entry_args = (fn, world, store, args, timeout_s, barrier_at_exit, backend, threads, hosts)
        ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _entry, args=entry_args, nprocs=world, join=False, start_method="spawn"
        )
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.0, end - time.monotonic())):
                if time.monotonic() >= end:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    raise PeerTimeoutError(", ".join(f"rank {r}" for r in alive), deadline_s)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
