"""Launch a torch.distributed program on N ranks with torchrun.

On loopback: one ``torchrun`` with ``--nproc-per-node N``. On shaped links:
each rank is a host in its own network namespace on a ``shaped_star`` (one
``torchrun`` per namespace, ``--nnodes N --node-rank r``, rendezvous at rank
0's address), so every byte between ranks crosses a tbf-shaped veth. The
program reads ``RANK``/``WORLD_SIZE`` from the environment as under any
torchrun launch.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from collections.abc import Callable

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.netns import NsHost


def _torchrun(nproc: int, *where: str, max_restarts: int = 0) -> list[str]:
    """torchrun restarts the whole group up to ``max_restarts`` times after a
    rank fails (each rank reads ``TORCHELASTIC_RESTART_COUNT``)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", *where]  # fmt: skip


# One host: torchrun's standalone rendezvous binds port 0 itself and hands the
# same store to the ranks, so no port is chosen here and released (a race with
# any other process on the host).
STANDALONE = ("--standalone", "--nnodes=1")


def _on_node(nnodes: int, node_rank: int, master: str, port: int) -> tuple[str, ...]:
    """Rendezvous at ``master:port`` (another namespace's address, where no
    other process can hold the port)."""
    return (f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master}",
            f"--master-port={port}")  # fmt: skip


def run_rank(fn: Callable[..., None], *args: object) -> None:
    """One torchrun rank: join the group (gloo, from torchrun's environment),
    run ``fn(*args)`` to its end, then tear down while the interpreter is
    whole. ``fn`` returning frees its locals (a DDP module holds the C++
    group; left to interpreter exit, gloo's threads die with SIGABRT); the
    barrier keeps a rank from leaving while a peer still talks to it."""
    init_group()
    fn(*args)
    end_group()
    leave()


def init_group(backend: str = "gloo") -> None:
    """Join the default group from torchrun's environment. Under torchrun the
    ranks share the agent's store, which outlives a restart of the group: a
    restarted rank would read the old attempt's addresses there (and gloo
    would connect to dead ports), so each attempt keys its group under its own
    prefix (one agent restarts all its ranks together, so they agree on it)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    faulthandler.enable()  # (a fatal signal prints every thread's Python stack)
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    world = int(env["WORLD_SIZE"])
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend, store=PrefixStore(f"gradfabric/attempt_{attempt}", store),
        rank=int(env["RANK"]), world_size=world,
    )  # fmt: skip


# Called before a rank leaves its group (heartbeats that use the group's store
# stop here, while the store still stands).
BEFORE_END: list[Callable[[], None]] = []


def end_group(barrier: bool = True) -> None:
    """Leave the default process group once a rank's work has returned: wait
    for the peers (unless some may be dead), stop what uses the group
    (``BEFORE_END``), collect what still holds it, destroy it."""
    import gc

    import torch.distributed as dist

    for stop in BEFORE_END:
        stop()
    if barrier:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def leave() -> None:
    """End a rank's process once its work returned and ``end_group`` tore its
    group down: flush its output, then ``os._exit(0)``.

    Even after ``end_group`` a group outlives ``destroy_process_group`` once
    the rank built a DDP module: gloo's threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``) still run in the rank's ``atexit`` handlers, with the
    DDP module and its hook state long collected (so with a plain
    ``DDP(nn.Linear(4, 1))`` and no hook). What holds the group is torch's,
    torn down by the interpreter's finalisation and C++'s static destructors
    beside those threads, in an order nothing here controls. A rank ended
    with ``std::terminate``'s SIGABRT ("terminate called without an active
    exception", the mark of an unjoined thread or of a thread unwound at
    exit) once in the twenty-odd runs of the suite on a clean machine since
    the test that met it was written (rank 0 of
    ``test_ranks_whose_buckets_differ_get_an_error_naming_them``, whose hook
    raises by design), and in none of some 250 runs of that test alone on a
    2-core host. Where it ended is not known (no stack was printed; every
    rank now prints one, ``faulthandler``), but this phase is the one place
    left where a group is torn down beside its threads, and a rank whose work
    is done and whose group was destroyed in order has nothing left to do in
    it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    ranks: int,
    module: str,
    args: list[str],
    link_gbps: float | None = None,
    timeout_s: float = 3600,
    extra_env: dict[str, str] | None = None,
    max_restarts: int = 0,
    mtu: int | None = None,
) -> None:
    """Run ``python -m module *args`` on ``ranks`` ranks; raise if any fails
    (after ``max_restarts`` restarts of the group on loopback).

    ``link_gbps``: run each rank in its own network namespace behind a link
    shaped to that rate (root only; see ``gradfabric.net.netns``), of ``mtu``
    bytes (default ``netns.MTU``).
    """
    if link_gbps is None:
        cmd = _torchrun(ranks, *STANDALONE, max_restarts=max_restarts)
        proc = subprocess.Popen([*cmd, "-m", module, *args], env=_env(ranks, extra_env))
        _wait([proc], timeout_s)
        return
    from gradfabric.net.netns import MTU, shaped_star

    with shaped_star(ranks, link_gbps, mtu or MTU) as hosts:
        run_on_hosts(hosts, module, args, timeout_s, extra_env)


def run_on_hosts(
    hosts: list[NsHost],
    module: str,
    args: list[str],
    timeout_s: float = 3600,
    extra_env: dict[str, str] | None = None,
) -> None:
    """One torchrun per namespace host (rank ``r`` on ``hosts[r]``), rendezvous
    at the first host's address; raise if any rank fails."""
    ranks = len(hosts)
    env = _env(ranks, extra_env)
    prog = ["-m", module, *args]
    port = 29400 + os.getpid() % 500
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                h.netns,
                *_torchrun(1, *_on_node(ranks, r, hosts[0].ip, port)),
                *prog,
            ],
            env={**env, "GLOO_SOCKET_IFNAME": h.ifname},
        )
        for r, h in enumerate(hosts)
    ]
    _wait(procs, timeout_s)


def _env(ranks: int, extra: dict[str, str] | None) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    return {**os.environ, "OMP_NUM_THREADS": threads, **(extra or {})}


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise PeerTimeoutError("torchrun ranks", timeout_s) from None
    if any(codes):
        raise RuntimeError(f"ranks exited with {codes}")
