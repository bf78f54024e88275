"""Every rank and host process of a run starts here: three ways in, one life.

- ``run_ranks`` / ``run_on_hosts``: a program under torchrun, as users launch
  training. On loopback one ``torchrun --nproc-per-node N``; on shaped links
  each rank is a host in its own network namespace on a ``shaped_star`` (one
  ``torchrun`` per namespace, ``--nnodes N --node-rank r``, rendezvous at rank
  0's address), so every byte between ranks crosses a tbf-shaped veth. The
  program reads ``RANK``/``WORLD_SIZE`` from the environment; ``run_rank``
  is its body.
- ``spawn``: a function on N ranks of a process group (the tests, the
  benches, the planner's executed plans), met in a private ``FileStore``.
- ``Hosts`` / ``run_hosts``: processes that meet only through the network
  (the switch's clients, the UDP engines), talking to the parent over pipes.

All three give every process the same life (``faulthandler`` on; a group
joined, left in order by ``end_group`` and the process ended by ``leave``)
and name the rank or host that died or overran its deadline. Not here:
``core.cells`` runs an experiment's independent cells on a pool, dask or
ray, a grid executor rather than the processes of one run; the services a
run stands on (the switch daemon, ``lab.daemon``; background traffic,
``net.background``) are programs their own modules start and stop.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.netns import NsHost, enter


def _torchrun(nproc: int, *where: str, max_restarts: int = 0) -> list[str]:
    """torchrun restarts the whole group up to ``max_restarts`` times after a
    rank fails (each rank reads ``TORCHELASTIC_RESTART_COUNT``)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", *where]  # fmt: skip


# Set (to "1") by a CLI that keeps the libraries quiet (no ``--verbose``).
QUIET = "GRADFABRIC_QUIET"

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
        _wait([proc], timeout_s, [f"torchrun of ranks 0..{ranks - 1}"])
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
    if env.get(QUIET) == "1":
        # With one agent a node, the agent hosting the rendezvous store may
        # leave its exit barrier (every rank done, exit code 0) before the
        # store has told another agent, which then logs "Error waiting on
        # exit barrier ... Connection reset by peer" at ERROR: torch's race,
        # nothing for a user to act on. A rank that fails still prints its
        # traceback and torchrun its failure table (printed, not logged), and
        # ``_wait`` names it.
        env["LOGLEVEL"] = "CRITICAL"
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
    _wait(procs, timeout_s, [f"rank {r} (torchrun in {h.netns})" for r, h in enumerate(hosts)])


def _env(ranks: int, extra: dict[str, str] | None) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    return {**os.environ, "OMP_NUM_THREADS": threads, **(extra or {})}


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float, names: list[str]) -> None:
    """Wait for every torchrun; the first to fail ends the others at once
    (its peers would wait for it in their group's rendezvous until torch's
    own timeout) and is named first, then whoever failed by then. A torchrun
    is stopped with SIGTERM, which its agent passes on to the ranks it
    started (in sessions of their own, which a SIGKILL of the agent would
    leave running), then killed if it lingers."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]  # (every one: a generator would stop at a live one)
        first = next((i for i, c in enumerate(codes) if c), None)
        if first is not None or all(c is not None for c in codes):
            break
        if time.monotonic() > deadline:
            late = [n for n, c in zip(names, codes, strict=True) if c is None]
            _stop(procs)
            raise PeerTimeoutError(", ".join(late), timeout_s)
        time.sleep(0.05)
    if first is None:
        return
    _stop(procs)
    failed = [names[first]] + [n for i, (n, p) in enumerate(zip(names, procs, strict=True))
                               if i != first and p.returncode and p.returncode > 0]  # fmt: skip
    raise RuntimeError(f"torchrun failed: {', '.join(failed)} (first: {names[first]}, exit code "
                       f"{procs[first].returncode})")  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- spawn: a function on N ranks of a process group ---
#
# Run a function on N local torch.distributed ranks, with a rendezvous that
# cannot race and a teardown that cannot abort.
#
# Every multi-process test and benchmark used to carry three bugs of one class,
# which ``spawn`` and ``_entry`` close:
#
# - **A port chosen by binding a socket and closing it** is free only until
#   another process takes it (a test running beside this one, or gloo's own pair
#   listeners, which bind ephemeral ports too). The ranks here meet in a
#   ``FileStore`` inside a private temporary directory instead: no other run can
#   name it, and gloo's listeners still bind whatever port the kernel hands
#   them, so nothing is chosen and released.
# - **A process group that outlives its function.** DDP's reducer (and any hook
#   state) holds the C++ process group, so ``destroy_process_group`` inside the
#   function only unregisters it; the group itself is then destroyed during
#   interpreter finalisation with gloo's threads still running, and
#   ``std::terminate`` ends the rank with SIGABRT ("terminate called without an
#   active exception"), one run in a few. The entry here runs the function to
#   its end (its locals, the DDP module among them, are gone when it returns),
#   waits at a barrier so that no rank has work in flight, collects garbage and
#   only then destroys the group, while the interpreter is whole.
# - **A teardown after the teardown.** Even then a group outlives
#   ``destroy_process_group`` once a rank built a DDP module, and torch tears
#   it down in the interpreter's finalisation beside gloo's threads (a rank
#   aborted once in the suite's runs, most likely there). A rank whose work
#   returned and whose group was destroyed in order leaves with
#   ``os._exit(0)`` (``leave``, which says more); ``faulthandler``
#   is on in every rank, so a fatal signal before that reports every
#   thread's Python stack (a spawned rank's into the error ``spawn`` raises).
#
# A function that ends with an exception skips the barrier (its peers may be
# dead or stuck) and the exception reaches ``torch.multiprocessing``'s report.
# Functions that kill a rank on purpose pass ``barrier_at_exit=False``.

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
    # A fatal signal writes every thread's Python stack to the rank's crash
    # file, which ``spawn`` puts into the error it raises (a rank's stderr
    # is captured with its parent's; the error is what a report shows first).
    crash = open(_crash_path(store_path, rank), "w")  # noqa: SIM115 (open to the end)
    faulthandler.enable(crash)
    if hosts is not None:  # (first: gloo's sockets must be made in the namespace)
        enter(hosts[rank])
    import torch
    import torch.distributed as dist

    if threads is not None:
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
    ``ProcessExitedException``; where the signal was one ``faulthandler``
    catches (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL; not SIGKILL or
    SIGTERM), the latter's text ends with the rank's Python stacks at the
    signal, the thread that took it first, and any other rank's crash is
    printed to stderr. ``threads``: intra-op threads per rank (ranks
    that share a few cores spin against each other otherwise). ``hosts``:
    rank ``r`` runs in ``hosts[r]``'s network namespace and its gloo sockets
    on that host's link (``net.netns``; the rendezvous is a file, which every
    namespace sees)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"{world} ranks need {world} hosts, got {len(hosts)}")
    with tempfile.TemporaryDirectory(prefix="gf-rdzv-") as rdzv:
        store = os.path.join(rdzv, "store")
        entry_args = (fn, world, store, args, timeout_s, barrier_at_exit, backend, threads, hosts)
        import torch.multiprocessing as tmp
        from torch.multiprocessing.spawn import ProcessExitedException

        ctx = tmp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _entry, args=entry_args, nprocs=world, join=False, start_method="spawn"
        )
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.0, end - time.monotonic())):
                if time.monotonic() >= end:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    raise PeerTimeoutError(", ".join(f"rank {r}" for r in alive), deadline_s)
        except ProcessExitedException as e:  # its stacks in its text, the others' on stderr
            stacks = _crash_stacks(_crash_path(store, e.error_index))
            if stacks:
                e.msg = f"{e.msg}\n{stacks}"
                e.args = (e.msg,)
            _print_crashes(store, world, but=e.error_index)
            raise
        except BaseException:  # a rank's error or the deadline: a crash beside it on stderr
            _print_crashes(store, world)
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()


def _crash_path(store_path: str, rank: int) -> str:
    return f"{store_path}.crash-{rank}"


def _crash_stacks(path: str) -> str:
    """A crashed rank's ``faulthandler`` report (empty if none), its header
    first ("Fatal Python error: ..."), then the thread that took the signal
    ("Current thread": its stack says where), then the others."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    blocks = text.split("\n\n")
    first = [b for b in blocks if b.startswith(("Fatal Python error", "Current thread"))]
    return "\n\n".join(first + [b for b in blocks if b not in first])


def _print_crashes(store_path: str, world: int, but: int = -1) -> None:
    """Every other rank's crash report on stderr, before the files go."""
    for rank in range(world):
        if rank != but and (stacks := _crash_stacks(_crash_path(store_path, rank))):
            print(f"rank {rank} crashed:\n{stacks}", file=sys.stderr)


# --- Hosts: processes that meet only through the network ---


class Hosts:
    """One process per ``args`` entry, each running ``target(*args, conn)``
    with a pipe to the parent, started together and stopped together.

    The parent talks to them by index: ``send`` a message to some or all,
    ``gather`` one message from each of some or all. A string that is not
    an expected word is a host's error, raised here with its text; a host
    that exits without its message is named at once (a killed peer must not
    cost the others' timeouts); a host past the deadline is named in a
    ``PeerTimeoutError``. On leaving the ``with`` block every host still
    alive is given ``grace_s`` to exit, then killed.

    ``method``: ``"forkserver"`` forks each host from a server that imported
    ``target``'s module (and so torch) once and has run nothing: hosts start
    in a fraction of a second, not the seconds of every process importing
    torch anew, and no parent thread is forked. ``"spawn"`` starts bare."""

    def __init__(
        self, target: Callable[..., None], args: list[tuple[Any, ...]],
        method: str = "forkserver", names: list[str] | None = None, grace_s: float = 5.0,
    ) -> None:  # fmt: skip
        ctx: Any = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([target.__module__])
        self.names = names or [f"host {i}" for i in range(len(args))]
        self.grace_s = grace_s
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        try:
            for a in args:
                parent, child = ctx.Pipe()
                p = ctx.Process(target=target, args=(*a, child), daemon=True)
                p.start()
                self._procs.append(p)
                self._conns.append(parent)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Hosts:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(wait=kind is None)

    def send(self, msg: Any, which: Iterable[int] | None = None) -> None:
        for i in range(len(self._conns)) if which is None else which:
            self._conns[i].send(msg)

    def gather(
        self, seconds: float, what: str, which: Iterable[int] | None = None,
        words: tuple[str, ...] = ("ready",),
    ) -> list[Any]:  # fmt: skip
        """One message from each host of ``which`` (default all) within
        ``seconds``, in that order; ``what`` names the step in errors."""
        order = list(range(len(self._conns)) if which is None else which)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + seconds
        while len(got) < len(order):
            waiting = [i for i in order if i not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                late = ", ".join(self.names[i] for i in waiting)
                raise PeerTimeoutError(f"{late} (to {what})", seconds)
            conns = [self._conns[i] for i in waiting]
            ready = set(wait(conns + [self._procs[i].sentinel for i in waiting], left))
            for i in waiting:
                # gone before the pipe is read: whatever it sent is there by then
                # (read the other way round, a host that sends and exits between
                # the two looks would be named dead with its record on its pipe)
                gone = self._procs[i].sentinel in ready or not self._procs[i].is_alive()
                if self._conns[i] in ready or self._conns[i].poll():
                    try:
                        msg = self._conns[i].recv()
                    except EOFError:
                        msg = None
                    if isinstance(msg, str) and msg not in words:
                        raise RuntimeError(msg)
                    if msg is not None:
                        got[i] = msg
                        continue
                if gone:
                    self._procs[i].join(1)
                    code = self._procs[i].exitcode
                    raise RuntimeError(f"{self.names[i]} died (exit code {code}) before {what}")
        return [got[i] for i in order]

    def close(self, wait: bool = False) -> None:
        """Stop every host: after a clean run each gets ``grace_s`` to exit;
        after a failure the others are stuck on the lost peer, killed now."""
        for p in self._procs:
            if wait:
                p.join(self.grace_s)
            if p.is_alive():
                p.kill()
                p.join(self.grace_s)
        for c in self._conns:
            c.close()


def run_hosts(
    target: Callable[..., None],
    args: list[tuple[Any, ...]],
    start_s: float,
    total_s: float,
    go_at: float | None = None,
) -> list[Any]:
    """The common run of ``Hosts``: each host says "ready" (within
    ``start_s``), all are told "go" together (not before ``go_at``, a
    ``time.monotonic()`` instant, where given), and each one's record is
    collected (within ``total_s``)."""
    with Hosts(target, args, names=[f"worker {i}" for i in range(len(args))]) as hosts:
        hosts.gather(start_s, "it started")
        if go_at is not None:
            time.sleep(max(0.0, go_at - time.monotonic()))
        hosts.send("go")
        return hosts.gather(total_s, "it finished")
