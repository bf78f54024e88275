"""Background traffic on a namespace star: constant-rate UDP that does not
back off (another tenant's bulk transfer, as the DLCP paper's load), from
every host up to the switch namespace and from there down to every host.

``background(hosts, tor, mbps)`` starts one sender process per namespace
(``python -m gradfabric.net.background``): each sends ``DATAGRAM`` bytes at
a time to the discard port of its peers at ``mbps`` per peer, with
exponential gaps (a Poisson flow), and holds that port open without reading
it (what arrives is dropped at the full socket, after the link, so no ICMP
comes back). Packets no rule places ride in ``netns.DEFAULT_CLASS``. On exit
the processes stop and report how many datagrams each sent.

``bursts(plan, mbps, on_ms, off_ms)`` is the bursty kind, for a fabric
(``net.fabric``): each sender alternates on and off periods (exponential,
means ``on_ms`` and ``off_ms``); an on period is one flow, from a socket of
its own (so a new source port, which ECMP hashes anew) to one peer drawn at
random, at ``mbps``: the on/off flows that make a fabric's tail.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gradfabric.core.errors import ConfigError
from gradfabric.net.netns import NsHost

DATAGRAM = 4_000  # one packet on the star's jumbo MTU; 1.6 ms of a 20 Mbit/s link
DISCARD_PORT = 9


@contextmanager
def background(
    hosts: list[NsHost], tor: NsHost, mbps: float, seed: int = 0
) -> Iterator[dict[str, float]]:
    """``mbps`` of UDP on every host's uplink and downlink while the block
    runs; yields a dict filled on exit: ``sent`` datagrams and the senders'
    ``cpu_s`` (they share the host's cores with the job)."""
    if mbps < 0:
        raise ConfigError("mbps", f"must be >= 0, got {mbps}")
    if mbps == 0:
        yield {"sent": 0, "cpu_s": 0.0}
        return
    plan = [(tor, [h.ip for h in hosts])] + [(h, [tor.ip]) for h in hosts]
    with _senders(plan, ["--mbps", str(mbps)], seed) as sent:
        yield sent


@contextmanager
def bursts(
    plan: list[tuple[NsHost, list[str]]], mbps: float, on_ms: float, off_ms: float, seed: int = 0
) -> Iterator[dict[str, float]]:
    """On/off flows from each ``plan`` host to its peers (module docstring)."""
    if mbps <= 0 or on_ms <= 0 or off_ms < 0:
        raise ConfigError("mbps", "bursts need a rate > 0, on_ms > 0 and off_ms >= 0")
    with _senders(plan, ["--mbps", str(mbps), "--on-ms", str(on_ms), "--off-ms", str(off_ms)],
                  seed) as sent:  # fmt: skip
        yield sent


@contextmanager
def _senders(
    plan: list[tuple[NsHost, list[str]]], flags: list[str], seed: int
) -> Iterator[dict[str, float]]:
    """One sender process per ``plan`` entry, stopped and counted on exit."""
    sent: dict[str, float] = {"sent": 0, "cpu_s": 0.0}
    procs = []
    for i, (where, peers) in enumerate(plan):
        cmd = ["ip", "netns", "exec", where.netns, sys.executable, "-m", __name__, *flags,
               "--seed", str(seed + i), "--bind", where.ip, *peers]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    try:
        yield sent
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            out, _ = p.communicate(timeout=10)
            if out.strip():
                for k, v in json.loads(out).items():
                    sent[k] += v


def _send(
    peers: list[str], bind: str, mbps: float, seed: int, on_ms: float = 0.0, off_ms: float = 0.0
) -> int:
    """Send until SIGTERM: to every peer at ``mbps`` each, or (``on_ms`` >
    0) in on/off flows, each to one random peer at ``mbps``."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sink.bind((bind, DISCARD_PORT))  # held, never read
    raw = bytes(DATAGRAM)
    gap = DATAGRAM * 8 / (mbps * 1e6)
    rng = random.Random(seed)
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    sent, t = 0, time.monotonic()
    out, to, flow_ends = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), peers, float("inf")
    if on_ms > 0:
        flow_ends = t  # the first flow starts now
    while not stop[0]:
        if t >= flow_ends:  # this flow is over: an off period, then a new one
            out.close()
            t += rng.expovariate(1e3 / off_ms) if off_ms > 0 else 0.0
            _sleep_until(t, stop)
            out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            out.bind((bind, 0))  # a new source port: a new flow to the fabric's hash
            to = [rng.choice(peers)]
            flow_ends = t + rng.expovariate(1e3 / on_ms)
        for p in to:
            try:
                out.sendto(raw, (p, DISCARD_PORT))
                sent += 1
            except OSError:  # a full queue refuses it: the load is offered, not carried
                pass
        t += gap * rng.expovariate(1.0)
        _sleep_until(t, stop)
    return sent


def _sleep_until(t: float, stop: list[bool]) -> None:
    while not stop[0] and (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def main() -> None:
    ap = argparse.ArgumentParser(description="constant-rate or on/off UDP to peers' discard port")
    ap.add_argument("peers", nargs="+")
    ap.add_argument("--mbps", type=float, required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--on-ms", type=float, default=0.0, help="mean on period (0: always on)")
    ap.add_argument("--off-ms", type=float, default=0.0, help="mean off period")
    a = ap.parse_args()
    sent = _send(a.peers, a.bind, a.mbps, a.seed, a.on_ms, a.off_ms)
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"sent": sent, "cpu_s": use.ru_utime + use.ru_stime}), flush=True)


if __name__ == "__main__":
    main()
