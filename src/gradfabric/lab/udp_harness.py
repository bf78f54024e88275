"""Run one all-reduce over real UDP on loopback: one process per node.

Every process builds the job's engines through the scheme registry
(``proto.schemes``, as the simulator does) and keeps its own; it binds a UDP
socket on an ephemeral port, reports the port, receives the address book,
and runs. The workers start their seeded input (``proto.schemes.worker_input``,
the same data the simulator's values mode uses) as one bucket and send back
what they received. Every scheme the simulator runs runs here
(``COLLECTIVES``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.launch import Hosts
from gradfabric.net.udp import open_engine
from gradfabric.proto.actions import Deliver
from gradfabric.proto.interface import Engine
from gradfabric.proto.schemes import InaConfig, Placement, collective, worker_input
from gradfabric.proto.switch.straggler import HelpConfig

# A Python switch process on a shared host: windows that keep the switch's
# socket buffer from overflowing (loopback drops what does not fit, and the
# retransmissions cost more than the window gains) and a longer RTO than a
# hardware switch needs.
UDP_DEFAULTS = InaConfig(switchml_slots=8, atp_window=8, ps_window=8, rto_ns=100_000_000)


def placement(scheme: str, workers: int, values: int, ina: InaConfig) -> Placement:
    """The job's layout: workers ``w0..`` under one switch ``sw0``, the
    scheme's servers beside them; SA-ATP counts the one bucket as its
    iteration. The hierarchical ring (no switch: racks only group its rings)
    sees two racks where the workers split evenly, so its ring across the
    racks runs too."""
    s = collective(scheme)
    names = tuple(f"w{i}" for i in range(workers))
    racks = {"sw0": names}
    if scheme == "hring" and workers >= 4 and workers % 2 == 0:
        racks = {"sw0": names[: workers // 2], "sw1": names[workers // 2 :]}
    per_iteration = max(1, -(-values // ina.values_per_sim_packet))
    return s.place(
        names, racks, ina, servers=s.servers(workers, ina),
        help=HelpConfig(iteration_packets=per_iteration),
    )  # fmt: skip


def job_engines(scheme: str, workers: int, ina: InaConfig, values: int = 1) -> dict[str, Engine]:
    return collective(scheme).engines(placement(scheme, workers, values, ina), ina)


@dataclass
class UdpResult:
    results: list[np.ndarray]
    wall_s: float
    counters: dict[str, dict[str, int]]


@dataclass(frozen=True)
class _NodeSpec:
    """What one node process needs to build its engine and its data (picklable)."""

    scheme: str
    name: str
    workers: int
    ina: InaConfig
    seed: int
    values: int
    timeout_s: float


def _node_main(spec: _NodeSpec, conn: Connection) -> None:
    try:
        asyncio.run(_node(spec, conn))
    except Exception as e:  # report, never hang the parent
        conn.send(f"{spec.name}: {e!r}")


async def _recv(conn: Connection) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, conn.recv)


async def _node(spec: _NodeSpec, conn: Connection) -> None:
    scheme, name, workers, ina = spec.scheme, spec.name, spec.workers, spec.ina
    seed, values, timeout_s = spec.seed, spec.values, spec.timeout_s
    p = placement(scheme, workers, values, ina)
    kind = collective(scheme)
    engine = kind.engines(p, ina)[name]
    result = np.zeros(values, dtype=np.int64)
    vpp = ina.values_per_sim_packet
    left = [1 if kind.per_bucket else max(1, -(-values // vpp))]  # deliveries to come
    done = asyncio.get_running_loop().create_future()

    def on_deliver(d: Deliver) -> None:
        if d.pkt.payload is not None:
            lo = 0 if kind.per_bucket else d.seq * vpp
            result[lo : lo + d.pkt.count] = d.pkt.payload
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(None)

    transport, proto = await open_engine(engine, {}, ("127.0.0.1", 0), on_deliver)
    try:
        conn.send(transport.get_extra_info("sockname")[1])  # the port
        proto.book.update(await _recv(conn))
        if name in p.workers:
            await _recv(conn)  # "go": every node has its address book
            rank = p.workers.index(name)
            data = worker_input(seed, rank, workers, values)
            proto.execute(kind.start(engine, 0, values, time.monotonic_ns(), data, 0))
            await asyncio.wait(
                {done, proto.gave_up}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done.done():
                if proto.gave_up.done():
                    raise proto.gave_up.result()
                raise PeerTimeoutError(kind.entry(p), timeout_s)
            conn.send((result, dict(engine.counters)))
        else:
            await _recv(conn)  # "stop"
            conn.send(dict(engine.counters))
    finally:
        transport.close()


def udp_allreduce(
    scheme: str,
    workers: int,
    values: int,
    seed: int = 0,
    ina: InaConfig | None = None,
    timeout_s: float = 60.0,
) -> UdpResult:
    """All-reduce ``values`` int32 per worker through a switch process on loopback."""
    ina = ina or UDP_DEFAULTS
    names = list(job_engines(scheme, workers, ina, values))
    specs = [(_NodeSpec(scheme, n, workers, ina, seed, values, timeout_s),) for n in names]
    workers_at = sorted((i for i, n in enumerate(names) if n.startswith("w")),
                        key=lambda i: int(names[i][1:]))  # w0, w1, ...  # fmt: skip
    others = [i for i in range(len(names)) if i not in workers_at]
    with Hosts(_node_main, specs, method="spawn", names=names) as nodes:
        ports = nodes.gather(timeout_s, "it bound its port")
        nodes.send({n: ("127.0.0.1", port) for n, port in zip(names, ports, strict=True)})
        t0 = time.perf_counter()
        nodes.send("go", workers_at)
        done = nodes.gather(timeout_s, "its result", workers_at)
        wall = time.perf_counter() - t0
        nodes.send("stop", others)
        stopped = nodes.gather(timeout_s, "it stopped", others)
        counters = {names[i]: cnt for i, cnt in zip(others, stopped, strict=True)}
        counters |= {names[i]: cnt for i, (_, cnt) in zip(workers_at, done, strict=True)}
        return UdpResult([arr for arr, _ in done], wall, counters)
