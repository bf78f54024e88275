"""The switch daemon's native datapath against the reference, datagram for datagram.

The reference is what the daemon runs in Python: ``emu.switchd.accept`` (the
job, its token, the decoding, a job that resynchronises) and a
``SwitchEngine`` with ``SwitchMLPolicy``, whose actions become datagrams
sealed with the job's token for the workers that said hello. Seeded
traffic from several jobs' workers (their windows of sequences, every copy
reuse, retransmissions, duplicates, reordering; most shares ask for loss
notices, so both must send the same notices) is mixed with stale
packets, packets for another job's slots or another worker's bit, forged
tokens, unknown jobs, float payloads, wrong counts, results from below,
random and truncated bytes, and a job that resynchronises for a while;
every datagram goes to both, which must send the same datagrams to the same
ranks, count the same drops under the same names, and report the same
missing workers.

ATP and ESA the same way, with each job's parameter server hosted as the
daemon hosts it (``AtpReference``: the engines hand packets to each other
through the daemon's first-in-first-out queue): workers' shares hashed over a
pool small enough that jobs collide, retransmissions (partials flushed to
the PS, results answered from it), float and overflowing payloads, sums that
overflow int32 at the PS, priorities that preempt under ESA, results forged
from below, stale and late shares; the PS's counters and what it waits on
are compared too. The PS baseline's daemon the same way, its datagrams
straight to each job's PS, which answers the workers itself.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.core.trace import Counters
from gradfabric.emu.control import DaemonJob
from gradfabric.emu.switchd import accept
from gradfabric.net import switchpath
from gradfabric.proto.actions import Action, Send
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.routes import atp_index
from gradfabric.proto.schemes import Placement
from gradfabric.proto.switch import SwitchEngine
from gradfabric.proto.switch.atp import FREE
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.envelope import TOKEN_BYTES, seal
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, encode
from tests.native import require

require("the switch datapath", switchpath.PATH, switchpath.WHY_NOT, module=True)

SLOTS = 16


class Reference:
    """The daemon's Python datapath for a SwitchML switch: ``accept``, then the
    hosted engines, which hand packets to each other through one queue, in
    order (``SwitchDaemon.deliver``; a SwitchML root hands nothing on)."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.switch = SwitchEngine.build("sw", "switchml", SLOTS)
        self.servers: dict[str, ParameterServer] = {}
        self.jobs: dict[int, DaemonJob] = {}
        self.addressed: dict[int, set[int]] = {}

    def add(self, job_id: int, token: bytes, workers: int, base: int, window: int) -> None:
        names = tuple(f"j{job_id}w{r}" for r in range(workers))
        p = Placement(job_id, names, {"sw": names})
        self.jobs[job_id] = DaemonJob(job_id, token, workers, base, "ina", p, entry="sw")
        self.switch.add_job(SwitchJob(job_id, names, slot_base=base, slot_count=window))
        self.addressed[job_id] = set()

    def datagram(self, data: bytes, now: int) -> list[tuple[int, bytes]]:
        self.counters["rx_datagrams"] += 1
        got = accept(data, self.jobs, self.counters)
        if got is None:
            return []
        out: list[tuple[int, bytes]] = []
        work = [(got[0].entry, got[1])]
        for name, pkt in work:  # grows as the engines hand packets on
            engine = self.switch if name == "sw" else self.servers[name]
            actions: list[Action] = engine.on_packet(pkt, now)
            for a in actions:
                dsts = (a.dst,) if isinstance(a, Send) else a.dsts  # type: ignore[union-attr]
                for d in dsts:
                    if d == "sw" or d in self.servers:
                        work.append((d, a.pkt))
                        continue
                    # a worker of any job (an ESA preemption answers another job's)
                    jid, rank = (int(x) for x in d[1:].split("w"))
                    if rank in self.addressed[jid]:
                        out.append((rank, seal(self.jobs[jid].token, a.pkt)))
                    else:
                        self.counters["drop_no_address"] += 1
        return out


def _scenario(seed: int) -> None:
    rng = random.Random(seed)
    ref, nat = Reference(), switchpath.NativeSwitch(SLOTS)
    jobs = []  # (id, token, workers, base, window, vpp)
    base = 0
    for job_id in (3, 9):
        workers, window, vpp = rng.randrange(1, 5), rng.choice([1, 2, 4]), rng.choice([1, 5, 300])
        token = rng.randbytes(TOKEN_BYTES)
        ref.add(job_id, token, workers, base, window)
        nat.job(job_id, token, workers, base, window, False, {})
        jobs.append((job_id, token, workers, base, window, vpp))
        base += window
    try:
        for job_id, _, workers, *_ in jobs:  # hellos: all but maybe one worker
            for r in range(workers):
                if rng.random() < 0.9:
                    ref.addressed[job_id].add(r)
                    nat.job(*_native_args(jobs, job_id, ref))
        now = 0
        sent: list[bytes] = []
        for _step in range(600):
            now += rng.randrange(0, 10_000)
            job_id, token, workers, base, window, vpp = rng.choice(jobs)
            if rng.random() < 0.03:  # the job resynchronises for a while (a restart)
                dj = ref.jobs[job_id]
                dj.resync = None if dj.resync is not None else {}
                nat.job(*_native_args(jobs, job_id, ref))
            seq = rng.randrange(0, 6 * window)
            wid = rng.randrange(workers)
            values = np.random.default_rng((seed, seq, wid)).integers(-(2**30), 2**30, vpp,
                                                                       dtype=np.int32)  # fmt: skip
            flags = Flag.NACK if rng.random() < 0.7 else 0  # (a worker that takes notices)
            pkt = Packet(job_id, wid, seq, base + seq % window, 1 << wid, workers, flags, 0, 0, vpp,
                         values)  # fmt: skip
            data = token + encode(pkt)
            r = rng.random()
            if r < 0.25 and sent:
                data = rng.choice(sent)  # a duplicate, or a retransmission
            elif r < 0.4:
                data = _bad(rng, pkt, token, jobs)
            sent.append(data)
            a = ref.datagram(data, now)
            nat.datagram(data, now)
            assert nat.take() == a
            for jid, *_ in jobs:
                sj = ref.switch.jobs[jid]
                assert nat.missing(jid) == ref.switch.policy.missing(sj)
        daemon, engine = Counters(), Counters()
        job_counters = {jid: Counters() for jid in ref.jobs}
        nat.fold(daemon, engine, job_counters)
        assert _nonzero(daemon) == _nonzero(ref.counters)
        assert _nonzero(engine) == _nonzero(ref.switch.counters)
        for jid, dj in ref.jobs.items():
            assert _nonzero(job_counters[jid]) == _nonzero(dj.counters)
        stats = ref.switch.policy.stats
        assert nat.pool() == (stats.busy_ns, stats.held_ns, stats.claims)
    finally:
        nat.close()


def _native_args(jobs: list[tuple], job_id: int, ref: Reference) -> tuple:
    _, token, workers, base, window, _ = next(j for j in jobs if j[0] == job_id)
    addrs = {r: bytes([r]) * 16 for r in ref.addressed[job_id]}
    return job_id, token, workers, base, window, ref.jobs[job_id].resync is not None, addrs


def _nonzero(c: Counters) -> dict[str, int]:
    return {k: v for k, v in c.items() if v}


def _bad(rng: random.Random, pkt: Packet, token: bytes, jobs: list[tuple]) -> bytes:
    kind = rng.randrange(11)
    good = token + encode(pkt)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 60))
    if kind == 1:  # a forged token
        return rng.randbytes(TOKEN_BYTES) + good[TOKEN_BYTES:]
    if kind == 2:  # truncated
        return good[: rng.randrange(TOKEN_BYTES + HEADER_BYTES, len(good))]
    if kind == 3:  # a header byte mutated (the job id's bytes left alone)
        b = bytearray(good)
        at = rng.choice([i for i in range(HEADER_BYTES) if i not in (6, 7)])
        b[TOKEN_BYTES + at] = rng.randrange(256)
        return bytes(b)
    assert pkt.payload is not None
    if kind == 4:  # an unknown job
        pkt.job_id = 77
    elif kind == 5:  # another worker's bit, or a bitmap of two
        pkt.bitmap = rng.choice([pkt.bitmap << 1, pkt.bitmap | 1 << pkt.fan_in - 1, 3])
    elif kind == 6:  # another job's slot
        pkt.agg_index = (pkt.agg_index + 1 + rng.randrange(SLOTS)) % (SLOTS + 2)
    elif kind == 7:  # in float
        pkt.flags |= Flag.FLOAT
        pkt.payload = pkt.payload.astype(np.float32)
    elif kind == 8:  # another count
        pkt.count = max(0, pkt.count - 1)
        pkt.payload = pkt.payload[: pkt.count]
    elif kind == 9:  # a result from below (a root has no parent)
        pkt.flags |= Flag.ACK
        pkt.bitmap, pkt.fan_in = rng.choice([(1, 1), (1, 2)])
    else:  # help under another's bit (SA-ATP)
        pkt.flags |= Flag.HELP
        pkt.bitmap = 1 << rng.randrange(pkt.fan_in)
    return token + encode(pkt)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_native_switch_equals_the_reference_datagram_for_datagram(seed: int) -> None:
    _scenario(seed)


class AtpReference(Reference):
    """The daemon's Python datapath for an ATP or ESA switch and the PS it
    hosts for each job (``SwitchDaemon.deliver``: one queue, in order); for
    ``ps``, the PS baseline's: the switch idle, each job's datagrams to its PS."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.ps = policy == "ps"
        self.switch = SwitchEngine.build("sw", "atp" if self.ps else policy, SLOTS)

    def add(  # type: ignore[override]  # no slot range: a hashed pool
        self, job_id: int, token: bytes, workers: int, window: int
    ) -> None:
        names = tuple(f"j{job_id}w{r}" for r in range(workers))
        server = f"s{job_id}"
        p = Placement(job_id, names, {"sw": names}, servers=(server,))
        entry = server if self.ps else "sw"
        self.jobs[job_id] = DaemonJob(job_id, token, workers, 0, "ina", p, entry=entry)
        if not self.ps:
            self.switch.add_job(SwitchJob(job_id, names, window=window, ps_shards=(server,)))
        self.servers[server] = ParameterServer(server, (PsJob(
            job_id, names, via=None if self.ps else "sw", window=4 * window),))  # fmt: skip
        self.addressed[job_id] = set()

    def missing(self, job_id: int) -> int:
        names = self.servers[f"s{job_id}"].missing_workers(job_id)
        bits = sum(1 << int(n.split("w")[1]) for n in names)
        sj = self.switch.jobs.get(job_id)
        return bits | (0 if sj is None else self.switch.policy.missing(sj))


def _atp_scenario(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    ref = AtpReference(policy)
    nat = switchpath.NativeSwitch(SLOTS, policy)
    jobs = []  # (id, token, workers, window, vpp)
    for job_id in (3, 9, 12):
        workers, window, vpp = rng.randrange(1, 5), rng.choice([1, 2, 4]), rng.choice([1, 5, 300])
        token = rng.randbytes(TOKEN_BYTES)
        ref.add(job_id, token, workers, window)
        jobs.append((job_id, token, workers, window, vpp))

    def install(job_id: int) -> None:
        _, token, workers, window, _ = next(j for j in jobs if j[0] == job_id)
        addrs = {r: bytes([r]) * 16 for r in ref.addressed[job_id]}
        nat.job(job_id, token, workers, 0, 0, ref.jobs[job_id].resync is not None, addrs,
                window, (4 * window, 1e6))  # fmt: skip

    try:
        for job_id, _, workers, *_ in jobs:
            for r in range(workers):
                if rng.random() < 0.9:
                    ref.addressed[job_id].add(r)
            install(job_id)
        now, sent = 0, list[bytes]()
        for _step in range(700):
            now += rng.randrange(0, 10_000)
            job_id, token, workers, window, vpp = rng.choice(jobs)
            if rng.random() < 0.02:  # the job resynchronises for a while (a restart)
                dj = ref.jobs[job_id]
                dj.resync = None if dj.resync is not None else {}
                install(job_id)
            seq, wid = rng.randrange(0, 8 * window), rng.randrange(workers)
            values = np.random.default_rng((seed, seq, wid)).integers(-(2**30), 2**30, vpp,
                                                                       dtype=np.int32)  # fmt: skip
            flags = rng.choice([0, 0, 0, Flag.ECN, Flag.RESEND])
            payload: np.ndarray = values
            if rng.random() < 0.05:  # a share that overflowed the worker's integers
                flags |= Flag.FLOAT | Flag.OVERFLOW
                payload = (values / 7.0).astype(np.float32)
            agg = atp_index(job_id, seq, SLOTS)
            pkt = Packet(job_id, wid, seq, agg, 1 << wid, workers, flags, rng.randrange(4), 0,
                         vpp, payload)  # fmt: skip
            data = token + encode(pkt)
            r = rng.random()
            if r < 0.2 and sent:
                data = rng.choice(sent)  # a duplicate, or a late copy
            elif r < 0.32:
                data = _bad(rng, pkt, token, [(j[0], j[1], j[2], 0, j[3], j[4]) for j in jobs])
            elif r < 0.35:  # a result forged from below, as a token holder could
                pkt.flags = Flag.ACK | pkt.flags & (Flag.FLOAT | Flag.RESEND)
                pkt.bitmap, pkt.fan_in = (1 << workers) - 1, workers
                data = token + encode(pkt)
            sent.append(data)
            assert nat.datagram(data, now) is None
            assert nat.take() == ref.datagram(data, now)
            for jid, *_ in jobs:
                assert nat.missing(jid) == ref.missing(jid)
            assert nat.occupied() == sum(1 for a in ref.switch.policy.pool if a.state != FREE)
        daemon, engine = Counters(), Counters()
        job_counters = {jid: Counters() for jid in ref.jobs}
        servers = {jid: Counters() for jid in ref.jobs}
        nat.fold(daemon, engine, job_counters, servers)
        assert _nonzero(daemon) == _nonzero(ref.counters)
        assert _nonzero(engine) == _nonzero(ref.switch.counters)
        for jid, dj in ref.jobs.items():
            assert _nonzero(job_counters[jid]) == _nonzero(dj.counters)
            assert _nonzero(servers[jid]) == _nonzero(ref.servers[f"s{jid}"].counters)
        stats = ref.switch.policy.stats
        assert nat.pool() == (stats.busy_ns, stats.held_ns, stats.claims)
        for jid, *_ in jobs:  # a job that leaves frees what it held, its PS with it
            if jid in ref.switch.jobs:
                ref.switch.remove_job(jid)
            nat.forget(jid)
            assert nat.missing(jid) == 0
            assert nat.occupied() == sum(1 for a in ref.switch.policy.pool if a.state != FREE)
        assert nat.pool() == (stats.busy_ns, stats.held_ns, stats.claims)
    finally:
        nat.close()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["atp", "esa", "ps"]))
def test_native_atp_esa_and_ps_equal_the_reference_datagram_for_datagram(
    seed: int, policy: str
) -> None:
    _atp_scenario(policy, seed)
