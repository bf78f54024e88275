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
    sent: dict[str, float] = {"sent": 0, "cpu_s": 0.0}
    if mbps == 0:
        yield sent
        return
    plan = [(tor, [h.ip for h in hosts])] + [(h, [tor.ip]) for h in hosts]
    procs = []
    for i, (where, peers) in enumerate(plan):
        cmd = ["ip", "netns", "exec", where.netns, sys.executable, "-m", __name__, "--mbps",
               str(mbps), "--seed", str(seed + i), "--bind", where.ip, *peers]  # fmt: skip
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


def _send(peers: list[str], bind: str, mbps: float, seed: int) -> int:
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sink.bind((bind, DISCARD_PORT))  # held, never read
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    raw = bytes(DATAGRAM)
    gap = DATAGRAM * 8 / (mbps * 1e6)
    rng = random.Random(seed)
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    sent, t = 0, time.monotonic()
    while not stop[0]:
        for p in peers:
            try:
                out.sendto(raw, (p, DISCARD_PORT))
                sent += 1
            except OSError:  # a full queue refuses it: the load is offered, not carried
                pass
        t += gap * rng.expovariate(1.0)
        time.sleep(max(0.0, t - time.monotonic()))
    return sent


def main() -> None:
    ap = argparse.ArgumentParser(description="constant-rate UDP to peers' discard port")
    ap.add_argument("peers", nargs="+")
    ap.add_argument("--mbps", type=float, required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sent = _send(a.peers, a.bind, a.mbps, a.seed)
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"sent": sent, "cpu_s": use.ru_utime + use.ru_stime}), flush=True)


if __name__ == "__main__":
    main()
