"""The same engines over real UDP sockets give the simulator's exact results."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from gradfabric.lab.udp_harness import UDP_DEFAULTS, udp_allreduce
from gradfabric.net.udp import open_engine
from gradfabric.proto.schemes import COLLECTIVES, SCHEMES
from gradfabric.proto.switch import SwitchEngine, SwitchJob
from gradfabric.sim.collective import Bucket, run_collective
from gradfabric.wire.packet import Packet, encode


@pytest.mark.parametrize("scheme", COLLECTIVES)
def test_udp_allreduce_matches_simulator_values_mode(scheme: str) -> None:
    """The registry builds the same engines for both drivers: every scheme's
    UDP result equals the simulator's and the int64 sum of the inputs."""
    values, workers, seed = 50_001, 4, 21
    udp = udp_allreduce(scheme, workers, values, seed=seed, timeout_s=60)
    sim = run_collective(
        scheme, workers, [Bucket(0, values)], seed=seed, values=True, ina=UDP_DEFAULTS
    )
    assert sim.results is not None and sim.inputs is not None
    ref = np.sum([x.astype(np.int64) for x in sim.inputs], axis=0)
    for w in range(workers):
        assert np.array_equal(udp.results[w], sim.results[w])
        assert np.array_equal(udp.results[w], ref)
    if not SCHEMES.get(scheme).per_bucket:  # one result per packet, each delivered once
        assert all(udp.counters[f"w{w}"]["results"] == -(-values // 256) for w in range(workers))


def test_udp_driver_counts_malformed_datagrams() -> None:
    async def scenario() -> dict[str, int]:
        eng = SwitchEngine.build("sw0", "switchml", 4, (SwitchJob(1, ("w0", "w1"), slot_count=2),))
        transport, _ = await open_engine(eng, {}, ("127.0.0.1", 0))
        port = transport.get_extra_info("sockname")[1]
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        good = encode(Packet(1, 0, 0, 0, 1, 2, count=1, payload=np.array([5], np.int32)))
        for raw in (b"", b"\x00" * 7, b"garbage" * 40, good[:-1], good):
            client.sendto(raw, ("127.0.0.1", port))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if eng.counters["rx_gradient"] == 1 and eng.counters["drop_malformed"] == 4:
                break
        client.close()
        transport.close()
        return dict(eng.counters)

    counters = asyncio.run(scenario())
    assert counters["drop_malformed"] == 4
    assert counters["rx_gradient"] == 1
