"""DLCP over UDP, measured: workers push tensors through the switch daemon's
congested port to their DLCP server and pull the sum, both within their
loss bounds, while a ``background`` job's datagrams (``blast``) load the
same port.

``run_emu_dlcp`` measures one congested run: workers push float32 tensors
(each with a different layer, so priority classes differ) while a blaster
sends background traffic; every pulled tensor is compared with the exact
float64 sum, and the share of values lost (zero-filled) is checked against
the bounds. Reliable mode (bounds 0) is run side by side.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.runtime.client import Ticket, together
from gradfabric.runtime.dlcp import DlcpClient
from gradfabric.wire.envelope import seal
from gradfabric.wire.packet import ina_packet, traffic_class

BACKGROUND_CLASS = traffic_class(1, 1)  # as in the simulator: the back layers' queue


def blast(ticket: Ticket, mbps: float, stop: threading.Event, seed: int = 0) -> int:
    """Send a background job's packets (1 KB each, class ``BACKGROUND_CLASS``)
    to the switch at ``mbps`` until ``stop``; returns how many."""
    token = bytes.fromhex(ticket.token)
    vals = np.zeros(248, dtype=np.int32)
    pkt = ina_packet(job_id=ticket.job_id, worker_id=0, seq=0, agg_index=0, bitmap=1, fan_in=1,
                     priority=BACKGROUND_CLASS, count=len(vals), values=vals)  # fmt: skip
    raw = seal(token, pkt)
    gap = len(raw) * 8 / (mbps * 1e6)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    addr = ticket.switch
    rng = random.Random(seed)
    sent, t = 0, time.monotonic()
    while not stop.is_set():
        for _ in range(8):  # bursts of 8: sleeping per packet costs more than the gap
            sock.sendto(raw, addr)
            sent += 1
        t += 8 * gap * rng.expovariate(1.0)
        time.sleep(max(0.0, t - time.monotonic()))
    sock.close()
    return sent


@dataclass(frozen=True)
class DlcpEmuConfig:
    workers: int = 3
    tensors: int = 8  # per round, one per layer
    values: int = 32_768  # per tensor
    rounds: int = 3
    port_mbps: float = 200.0
    background_mbps: float = 50.0
    push_bound: float = 0.1
    pull_bound: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 2 or self.tensors < 1 or self.rounds < 1 or self.port_mbps <= 0:
            raise ConfigError("workers", "need >= 2 workers, >= 1 tensor and round, a port rate")


def _worker_round(
    client: DlcpClient, xs: list[np.ndarray], tensors: int
) -> Callable[[], list[np.ndarray]]:
    """One worker's round: its tensors, back layers first (as backward makes them)."""

    def run() -> list[np.ndarray]:
        outs: list[np.ndarray] = [np.zeros(0)] * tensors
        for t in reversed(range(tensors)):
            outs[t] = client.allreduce(xs[t], t, tensors)
        return outs

    return run


def summary_row(r: dict[str, Any]) -> dict[str, Any]:
    """One run as a table row: time, lost shares, the port's drop rate per precedence."""
    port = r["port"]
    rates = {
        f"drop_rate_p{d}": port.get(f"queue_drop_precedence{d}", 0)
        / max(1, port.get(f"offered_precedence{d}", 0))
        for d in range(4)
    }
    keep = ("scheme", "round_ms", "lost_push", "lost_pull", "wrong_share")
    return {k: r[k] for k in keep} | rates


def run_emu_dlcp(cfg: DlcpEmuConfig, reliable: bool = False) -> dict[str, Any]:
    """One run; returns the round times, the lost shares and the port's counters."""
    from gradfabric.lab.daemon import switch_daemon

    push, pull = (0.0, 0.0) if reliable else (cfg.push_bound, cfg.pull_bound)
    options = ("--policy", "dlcp", "--port-mbps", str(cfg.port_mbps),
               "--push-bound", str(push), "--pull-bound", str(pull),
               "--values-per-packet", "256", "--job-slots", "32", "--rto-ms", "5")  # fmt: skip
    with switch_daemon(*options) as sw:
        job = Ticket.register(sw.control, cfg.workers, "dlcp")
        bg = Ticket.register(sw.control, 1, "background")
        clients = [DlcpClient(job, r) for r in range(cfg.workers)]
        rng = np.random.default_rng(cfg.seed)
        stop = threading.Event()
        blaster = threading.Thread(target=blast, args=(bg, cfg.background_mbps, stop, cfg.seed))
        blaster.start()
        rounds, wrong = [], 0.0
        try:
            for _ in range(cfg.rounds):
                xs = [
                    [rng.standard_normal(cfg.values).astype(np.float32) for _ in range(cfg.tensors)]
                    for _ in range(cfg.workers)
                ]
                t0 = time.perf_counter()
                outs = together(
                    [_worker_round(c, x, cfg.tensors) for c, x in zip(clients, xs, strict=True)]
                )
                rounds.append(time.perf_counter() - t0)
                for t in range(cfg.tensors):
                    ref = np.sum([xs[w][t].astype(np.float64) for w in range(cfg.workers)], axis=0)
                    for o in outs:
                        # a value differs from the exact sum only where some worker's
                        # push or this worker's pull of it was lost (read as zero)
                        wrong = max(wrong, float((np.abs(o[t] - ref) > 1e-4).mean()))
            pulled = [c.lost() for c in clients]
        finally:
            stop.set()
            blaster.join()
            for c in clients:
                c.close()
    counters = sw.final.get("counters", {})
    values = cfg.rounds * cfg.tensors * cfg.values
    return {
        "scheme": "reliable" if reliable else "dlcp",
        "round_ms": float(np.median(rounds)) * 1e3,
        # shares of values zero-filled: at the server (all pushes), at the workers (pulls)
        "lost_push": counters.get("values_lost", 0) / (values * cfg.workers),
        "lost_pull": max(pulled) / values,
        "wrong_share": wrong,  # the largest share of a result differing from the exact sum
        "port": {
            k: v for k, v in counters.items() if k.startswith(("queue", "port", "bg_", "offered"))
        },
        "counters": counters,
        "config": asdict(cfg),
    }
