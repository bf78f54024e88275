"""Processes for a run's hosts: one per worker, started together, each
record collected, a worker that dies named at once."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any


def run_hosts(
    target: Callable[..., None], args: list[tuple[Any, ...]], start_s: float, total_s: float,
    go_at: float | None = None,
) -> list[Any]:
    """Start one process per ``args`` running ``target(*args, conn)``; once
    each said "ready" (and not before ``go_at``, a ``time.monotonic()``
    instant, where given), say "go" to all and collect each one's record (a
    string is an error, raised here naming the worker). The processes fork
    from a server that imported ``target``'s module (and so torch) once and
    has run nothing: a run starts in a fraction of a second, not the seconds
    of every process importing torch anew, and no parent thread is forked."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([target.__module__])
    procs, conns = [], []
    for a in args:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(*a, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        for msg in _collect(conns, procs, start_s, "start"):  # every worker said hello
            if msg != "ready":
                raise RuntimeError(msg)
        if go_at is not None:
            time.sleep(max(0.0, go_at - time.monotonic()))
        for c in conns:
            c.send("go")
        recs = _collect(conns, procs, total_s, "finish")
        return recs
    finally:  # after a failure the others are stuck on the lost peer: stop them now
        for p in procs:
            if "recs" in locals():
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _collect(conns: list[Connection], procs: list[Any], seconds: float, what: str) -> list[Any]:
    """One message from each worker within ``seconds``. A worker that exits
    without one is named at once (a killed helper must not cost the others'
    timeouts); an error string it sent is raised as it is."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + seconds
    while len(got) < len(conns):
        waiting = [w for w in range(len(conns)) if w not in got]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"worker(s) {waiting} did not {what} within {seconds:g} s")
        ready = set(wait([conns[w] for w in waiting] + [procs[w].sentinel for w in waiting], left))
        for w in waiting:
            if conns[w] in ready or conns[w].poll():
                try:
                    msg = conns[w].recv()
                except EOFError:
                    msg = None
                if isinstance(msg, str) and msg != "ready":
                    raise RuntimeError(msg)
                if msg is not None:
                    got[w] = msg
                    continue
            if procs[w].sentinel in ready or not procs[w].is_alive():
                procs[w].join(1)
                raise RuntimeError(
                    f"worker {w} died (exit code {procs[w].exitcode}) before it could {what}"
                )
    return [got[w] for w in range(len(conns))]
