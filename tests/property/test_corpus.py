"""The fuzzers' corpus, differential: every input of fuzz/corpus (the seeds
and each fault's regression input), read as fuzz/ops.h reads it, drives the
Python reference and the native core side by side; both must send the same
datagrams at every ``take`` and count the same at the end. (The sanitizer
runs themselves are ``scripts/fuzz.sh``; this keeps what they found, and the
seeds, in the default suite.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net import datapath, hostpath, switchpath
from gradfabric.proto.node import NodeConfig, SwitchNode
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.worker import ResumableWorker
from gradfabric.proto.worker_node import Fused, WorkerNode
from tests.native import require

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"
WORKERS = (3, 2, 64, 1)


def dlcp_config(window: int) -> dict[str, object]:
    """A DLCP node's bound, values a packet and timeout, from the window."""
    return {"push_bound": (0.0, 0.1, 0.5)[window % 3], "rto_ns": 1000 * (1 + window),
            "values_per_packet": 256 if window == 8 else 1 + window}  # fmt: skip
VPP = (1, 3, 300, 16000)


def _ops(data: bytes, at: int) -> Iterator[tuple[int, bytes]]:
    while at + 3 <= len(data):
        kind, n = data[at], int.from_bytes(data[at + 1 : at + 3], "little")
        yield kind, data[at + 3 : at + 3 + n]
        at += 3 + n


def _u32(p: bytes) -> int:
    return int.from_bytes(p[:4].ljust(4, b"\0"), "little")


def _nonzero(c: object) -> dict[str, int]:
    assert isinstance(c, Counters)
    return {k: v for k, v in c.items() if v}


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "switch_node").iterdir()))
def test_the_switch_node_corpus_runs_alike(name: str) -> None:
    require("the switch node", switchpath.PATH, switchpath.WHY_NOT)
    data = (CORPUS / "switch_node" / name).read_bytes().ljust(4, b"\0")
    scheme = ("switchml", "atp", "esa", "ps", "dlcp")[data[0] % 5]
    window, njobs = data[1] % 9, 1 + data[2] % 4
    if window == 0:  # the C takes a range of no slots (its guard, fuzzed); a node refuses one
        with pytest.raises(ConfigError, match="job_slots"):
            NodeConfig(scheme=scheme, slots=1 + data[3] % 16, job_slots=0)
        return
    cfg = NodeConfig(scheme=scheme, slots=njobs * window + data[3] % 16, job_slots=window,
                     **(dlcp_config(window) if scheme == "dlcp" else {}))  # fmt: skip
    ref, nat = SwitchNode(cfg), switchpath.NativeSwitchNode(cfg)
    resync = [False] * njobs

    def install(k: int) -> None:
        base = k * window if scheme == "switchml" else 0
        for node in (ref, nat):
            node.add_job(k + 1, bytes([k + 1]) * 8, WORKERS[k], base, resyncing=resync[k],
                         kind="background" if scheme == "dlcp" and k == 3 else None)

    try:
        for k in range(njobs):
            install(k)
        now = 0
        for kind, p in _ops(data, 4):
            k = p[0] % njobs if p else 0
            if kind % 5 == 0:
                ref.receive_datagram(p, now)
                nat.receive_datagram(p, now)
            elif kind % 5 == 1:
                assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
            elif kind % 5 == 2:
                resync[k] = not resync[k]
                ref.resync(k + 1, resync[k])
                nat.resync(k + 1, resync[k])
            elif kind % 5 == 3:
                now += _u32(p)
            else:
                for node in (ref, nat):
                    node.remove_job(k + 1)
                install(k)
            at = ref.get_timer()  # (DLCP's server's timers)
            assert nat.get_timer() == at
            if at is not None and at <= now:
                ref.handle_timer(now)
                nat.handle_timer(now)
        assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
        r, n = ref.counter_groups(), nat.counter_groups()
        assert _nonzero(n["node"]) == _nonzero(r["node"])
        assert _nonzero(n["switch"]) == _nonzero(r["switch"])
        rs, ns = r["servers"], n["servers"]
        assert isinstance(rs, dict) and isinstance(ns, dict)
        assert {j: _nonzero(c) for j, c in ns.items()} == {j: _nonzero(c) for j, c in rs.items()}
    finally:
        nat.close()


def _worker(route: int, window: int, vpp: int, flags: int) -> ResumableWorker:
    names = ("w0", "w1", "w2")
    p = Placement(
        7, names, {"sw": names}, servers=("sw",), window=window, pool_slots=64, slot_base=5,
        rto_ns=10_000, max_retries=5, values_per_packet=vpp, resumable=True,
        fast_retransmit=3 if flags & 1 else 0, nack=bool(flags & 2), takes_help=False,
        first_seq=2**32 - 64 if flags & 16 else 0,
    )  # fmt: skip
    e = SCHEMES.get(("switchml", "atp", "ps")[route]).worker(p, 1)
    assert isinstance(e, ResumableWorker)
    return e


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "worker").iterdir()))
def test_the_worker_node_corpus_runs_alike(name: str) -> None:
    require("the worker node", datapath.PATH, datapath.WHY_NOT)
    data = (CORPUS / "worker" / name).read_bytes().ljust(4, b"\0")
    route, window, vpp, flags = data[0] % 3, 1 + data[1] % 8, VPP[data[2] % 4], data[3]
    pace = 1.0 if flags & 4 else 0.0
    ref = WorkerNode(_worker(route, window, vpp, flags), bytes([7]) * 8, 0, pace)
    nat = datapath.NativeWorkerNode(_worker(route, window, vpp, flags), bytes([7]) * 8, 0, pace)
    now, calls = 0, []
    try:
        for kind, p in _ops(data, 4):
            if kind % 6 == 0:
                ref.receive_datagram(p, now)
                nat.receive_datagram(p, now)
            elif kind % 6 == 1:
                assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
            elif kind % 6 == 2:
                now += _u32(p)
                ref.handle_timer(now)
                nat.handle_timer(now)
            elif kind % 6 == 3 and ref.done:
                n = 1 + (_u32(p) & 0xFFFF)
                q = (np.arange(n, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
                x, scale = np.arange(n, dtype=np.float32), np.full(-(-n // vpp), 2.0**20)
                for node in (ref, nat):
                    arrays = (q.view(np.int32).copy(), np.zeros(n, np.int64))
                    fused = Fused(x, scale, scale, np.zeros(n, np.float32)) if flags & 8 else None
                    node.push(*arrays, now, fused)
                    calls.append((*arrays, fused))
            elif kind % 6 == 4:
                floor = ref.base - (p[0] if p else 0) % (3 * window + 1)
                ref.replay(floor, now)
                nat.replay(floor, now)
            elif kind % 6 == 5:
                assert nat.read_wait_ns(now) == ref.read_wait_ns(now)
            assert (nat.base, nat.done) == (ref.base, ref.done)
        assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
        for a, b in zip(calls[0::2], calls[1::2], strict=True):
            assert np.array_equal(a[1], b[1])
        assert _nonzero(nat.fold()) == _nonzero(ref.counters)
    finally:
        nat.close()


def _host_own(route: int, window: int, vpp: int, flags: int) -> ResumableWorker:
    """A helped host's own stream as fuzz/host.c configures it."""
    workers = (3, 4, 64)[(flags >> 3) % 3]
    names = tuple(f"w{r}" for r in range(workers))
    p = Placement(
        9, names, {"sw": names}, servers=("sw",), window=window, pool_slots=64, slot_base=5,
        rto_ns=10_000, max_retries=5, values_per_packet=vpp, resumable=True,
        fast_retransmit=3 if flags & 1 else 0, nack=bool(flags & 2), takes_help=True,
    )  # fmt: skip
    e = SCHEMES.get(("switchml", "atp")[route]).worker(p, 1)
    ahead = 4 if flags & 32 else e.cfg.max_ahead
    return ResumableWorker(e.name, replace(e.cfg, max_ahead=ahead), e.route)


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "host").iterdir()))
def test_the_helped_host_corpus_runs_alike(name: str) -> None:
    """fuzz/host.c's ops through ``ReferenceHost`` and ``NativeHost``: the same
    datagrams at every take, events, deadlines, streams and sinks."""
    require("the helped host", hostpath.PATH, hostpath.WHY_NOT)
    data = (CORPUS / "host" / name).read_bytes().ljust(4, b"\0")
    route, window, vpp, flags = data[0] % 2, 1 + data[1] % 8, VPP[data[2] % 4], data[3]
    workers = (3, 4, 64)[(flags >> 3) % 3]
    sinks = [np.zeros(256 * vpp, np.int64) for _ in range(2)]
    ref = hostpath.ReferenceHost(_host_own(route, window, vpp, flags), bytes([9]) * 8, sinks[0])
    nat = hostpath.NativeHost(_host_own(route, window, vpp, flags), bytes([9]) * 8, sinks[1])
    vals = (np.arange(1 << 16, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
    streams, now = {hostpath.OWN}, 0
    try:
        for kind, p in _ops(data, 4):
            k = kind % 8
            if k == 0:
                ref.receive_datagram(p, now)
                nat.receive_datagram(p, now)
            elif k in (1, 6):  # (6: the native driver's half-send; here a take)
                assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
            elif k == 2:
                now += _u32(p)
                ref.handle_timer(now)
                nat.handle_timer(now)
            elif k == 3:
                n = 1 + (_u32(p) & 0xFFF)
                at = ref.state().next_seq + (p[4] % 3 if len(p) > 4 else 0)
                for h in (ref, nat):
                    h.push(vals[:n].view(np.int32), now, at)
            elif k == 4 and (s := p[0] % workers if p else 0) != 1:
                n = 1 + (p[2] | (p[3] & 15) << 8 if len(p) > 3 else 0)
                streams.add(s)
                start = ref.state(s).next_seq + (p[1] % 4 if len(p) > 1 else 0)
                idle = [h.state(s).idle for h in (ref, nat)]
                assert idle[0] == idle[1]
                if idle[0]:
                    for h in (ref, nat):
                        h.skip_to(s, start)
                        h.push(vals[:n].view(np.int32), now, stream=s)
            elif k == 5:
                assert nat.events() == ref.events()
            elif k == 7 and (s := p[0] % (workers + 2) - 1 if p else -1) not in (1, workers):
                streams.add(s)  # made on first use, in both, in the same order
            assert nat.get_timer() == ref.get_timer()
            order = sorted(streams)
            assert [nat.state(s) for s in order] == [ref.state(s) for s in order]
            assert np.array_equal(sinks[0], sinks[1])
        assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
        assert nat.events() == ref.events()
        for s in streams:
            assert _nonzero(nat.counters(s)) == _nonzero(ref.counters(s))
    finally:
        nat.close()
