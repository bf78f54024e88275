"""The soak (opt-in: ``pytest -m slow -s tests/integration/test_soak.py``).

Eight jobs of three workers sum random tensors through one switch daemon for
ten minutes (``GRADFABRIC_SOAK_S`` to change it) with 2% loss and 1%
duplication each way; half-way through, the daemon is SIGKILLed and started
again on the same ports, and every job resumes. Checked: every round of
every job equals the int64 sum; the daemon's memory does not grow over
either incarnation's second half; this process's file descriptors and
threads are back where they were once the clients close. The figures are
printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from gradfabric.lab.daemon import RunningSwitch, start_switch, stop_switch
from gradfabric.runtime.client import InaClient, Ticket
from tests.integration.test_emulator import _exact_rounds, _kill, _same_ports, _stats

JOBS, WORKERS = 8, 3
SOAK_S = float(os.environ.get("GRADFABRIC_SOAK_S", "600"))


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
def test_eight_jobs_for_ten_minutes_with_loss_duplication_and_a_restart() -> None:
    duration = SOAK_S
    fds0, threads0 = _open_fds(), threading.active_count()
    me = os.getpid()
    options: tuple[str, ...] = ("--policy", "atp", "--loss", "0.02", "--dup", "0.01",
                                "--rto-ms", "20")  # fmt: skip
    sw = start_switch(*options)
    options = _same_ports(sw, *options)
    tickets = [Ticket.register(sw.control, WORKERS) for _ in range(JOBS)]
    clients = [[InaClient(t, r, timeout_s=60) for r in range(WORKERS)] for t in tickets]
    rounds = [0] * JOBS
    errors: list[BaseException] = []
    stop = threading.Event()

    def train(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        try:
            while not stop.is_set():
                _exact_rounds(clients[k], 1, rng, (1, 1000, 20_000, 100_000))
                rounds[k] += 1
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            stop.set()

    def sample(sw: RunningSwitch, at: float) -> int:
        while time.monotonic() < at and not stop.is_set():
            time.sleep(0.5)
        return _rss_kb(sw.proc.pid)

    trainers = [threading.Thread(target=train, args=(k,)) for k in range(JOBS)]
    t0 = time.monotonic()
    half = duration / 2
    mine: list[int] = []
    try:
        for t in trainers:
            t.start()
        rss = [sample(sw, t0 + half / 2), sample(sw, t0 + half)]
        mine = [_rss_kb(me)]
        first = _stats(sw)["counters"]
        _kill(sw)
        sw = start_switch(*options)
        rss += [sample(sw, t0 + half + half / 2), sample(sw, t0 + duration)]
        mine.append(_rss_kb(me))
        stop.set()
        for t in trainers:
            t.join(120)
        second = _stats(sw)["counters"]
    finally:
        stop.set()
        for cs in clients:
            for c in cs:
                c.close()
        stop_switch(sw)
    if errors:
        raise errors[0]
    time.sleep(1)  # closed sockets and stopped threads settle
    counted = {k: first.get(k, 0) + second.get(k, 0) for k in {*first, *second}}
    figures = {
        "seconds": round(time.monotonic() - t0),
        "rounds_per_job": rounds,
        "rx_datagrams": counted["rx_datagrams"],
        "tx_datagrams": counted["tx_datagrams"],
        "drops": {k: v for k, v in sorted(counted.items()) if k.startswith(("drop", "impair"))},
        "jobs_restored": second.get("jobs_restored", 0),
        "switch_rss_kb": {"first_half": rss[:2], "second_half": rss[2:]},
        "this_process": {"fds": [fds0, _open_fds()],
                         "threads": [threads0, threading.active_count()],
                         "rss_kb_half_and_end": mine},
    }  # fmt: skip
    print("soak:", json.dumps(figures))
    assert min(rounds) >= 10 and second.get("jobs_restored", 0) == JOBS
    for a, b in (rss[:2], rss[2:], mine):  # a Python heap's noise, not growth per round
        assert b <= a * 1.1 + 2048, figures
    assert _open_fds() <= fds0 and threading.active_count() <= threads0, figures
