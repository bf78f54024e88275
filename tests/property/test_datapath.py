"""The workers' native datapath against the reference engine, datagram for datagram.

A seeded scenario plays a switch against the reference (``ResumableWorker``
behind the emulator's sealing and decoding, and ``emu.client.Call``'s
delivery): results come back late, reordered, duplicated or not at all,
some carry ECN, a lost packet is often followed by the switch's loss notice
(where the worker takes them), and among them arrive notices for sequences
answered, never sent, another worker's or another job's, stale results, another job's, forged
tokens, random bytes, truncated and mutated datagrams, results in float and
results of the wrong length; half the calls quantise inside the datapath
(``net.datapath.Fused``), whose datagrams and decoded sums must equal the
reference's whole-tensor encode and decode bit for bit. Every event (a
start, a datagram, a due timer, with its time) goes to both; the C core must emit
the same datagrams byte for byte at every step, report the same deadlines,
give up on the same sequence, count the same drops, produce the same sums and
hand back the same engine state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.core.errors import ProtocolError
from gradfabric.emu.client import Call
from gradfabric.net import datapath
from gradfabric.proto.actions import Deliver, Fail, Send
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.worker import ResumableWorker
from gradfabric.wire import fastquant
from gradfabric.wire.envelope import TOKEN_BYTES, drop_reason, seal, unseal
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, decode, encode
from tests.native import require

require("the worker datapath", datapath.PATH, datapath.WHY_NOT, module=True)
require("the quantiser", fastquant.PATH, fastquant.WHY_NOT, module=True)

TOKEN = bytes.fromhex("0123456789abcdef")
JOB, WORKERS = 7, 3


def _engine(
    policy: str, window: int, vpp: int, fast: int, retries: int, nack: bool
) -> ResumableWorker:
    names = tuple(f"w{r}" for r in range(WORKERS))
    p = Placement(
        JOB, names, {"sw": names}, servers=("sw",), window=window, pool_slots=64, slot_base=5,
        rto_ns=1_000_000, values_per_packet=vpp, max_retries=retries, resumable=True,
        fast_retransmit=fast, nack=nack, takes_help=False,
    )  # fmt: skip
    e = SCHEMES.get(policy).worker(p, 1)
    assert isinstance(e, ResumableWorker)
    return e


@dataclass
class Reference:
    """The reference worker as the emulator's client drives it."""

    engine: ResumableWorker
    priority: int
    call: Call | None = None
    failed: int | None = None

    def _run(self, actions: list[Any]) -> list[bytes]:
        out = []
        for a in actions:
            if isinstance(a, Send):
                out.append(seal(TOKEN, a.pkt))
            elif isinstance(a, Deliver):
                assert self.call is not None
                self.call.take(a.seq, a.pkt)
            elif isinstance(a, Fail):
                self.failed = int(a.reason.split()[1])
        return out

    def start(self, q: np.ndarray, now: int) -> list[bytes]:
        self.call = Call(len(q), self.engine.cfg.values_per_packet)
        self.call.first = self.engine.next_seq
        return self._run(self.engine.push(len(q), now, q, priority=self.priority))

    def datagram(self, data: bytes, now: int) -> list[bytes]:
        try:
            pkt = unseal(data, TOKEN)
        except ProtocolError as e:
            self.engine.counters[drop_reason(e)] += 1
            return []
        return self._run(self.engine.on_packet(pkt, now))

    def timer(self, now: int) -> list[bytes]:
        return self._run(self.engine.on_timer(now))


@dataclass
class Switch:
    """A seeded, misbehaving switch: it answers each packet it takes with the
    sum of the worker's values and the others' (kept per sequence)."""

    rng: random.Random
    loss: float
    ecn: float
    pending: list[bytes] = field(default_factory=list)
    sums: dict[int, np.ndarray] = field(default_factory=dict)
    answered: list[bytes] = field(default_factory=list)

    def take(self, data: bytes) -> None:
        pkt = decode(data[TOKEN_BYTES:])
        if self.rng.random() < self.loss:
            if pkt.flags & Flag.NACK and self.rng.random() < 0.7:  # the loss noticed
                self.pending.append(self.notice(pkt.seq, pkt.worker_id))
            return
        assert pkt.payload is not None
        others = self.sums.setdefault(
            pkt.seq, np.random.default_rng(pkt.seq).integers(-1000, 1000, pkt.count, np.int32)
        )
        flags = Flag.ACK | (Flag.ECN if self.rng.random() < self.ecn else 0)
        res = Packet(JOB, 0, pkt.seq, pkt.agg_index, (1 << WORKERS) - 1, WORKERS, flags, 0, 0,
                     pkt.count, pkt.payload + others)  # fmt: skip
        for _ in range(2 if self.rng.random() < 0.05 else 1):
            self.pending.append(seal(TOKEN, res))

    def notice(self, seq: int, worker: int, job: int = JOB) -> bytes:
        """The switch's loss notice: the header of ``seq`` flagged NACK."""
        return TOKEN + encode(Packet(job, worker, seq, 5, 1 << worker, WORKERS, Flag.NACK))

    def bad(self, first: int) -> bytes:
        """A datagram that must be dropped or flagged, of one of many kinds."""
        r, kind = self.rng, self.rng.randrange(12)
        if kind == 9:  # a notice for a sequence long answered, or never sent
            return self.notice(r.choice([max(0, first - 1), first + 1000]), 1)
        if kind == 10:  # a notice for another worker
            return self.notice(first, r.choice([0, 2]))
        if kind == 11:  # another job's notice
            return self.notice(first, 1, JOB + 1)
        good = self.rng.choice(self.answered) if self.answered else None
        if kind == 0 or good is None:
            return r.randbytes(r.randrange(0, 80))
        if kind == 1:  # a forged token
            return r.randbytes(TOKEN_BYTES) + good[TOKEN_BYTES:]
        if kind == 2:  # truncated
            return good[: r.randrange(0, len(good))]
        if kind == 3:  # a header byte mutated
            b = bytearray(good)
            b[TOKEN_BYTES + r.randrange(HEADER_BYTES)] = r.randrange(256)
            return bytes(b)
        pkt = decode(good[TOKEN_BYTES:])
        assert pkt.payload is not None
        if kind == 4:  # another job's result
            pkt.job_id = JOB + 1
        elif kind == 5:  # not a result
            pkt.flags &= ~Flag.ACK
        elif kind == 6:  # a result far behind or ahead
            pkt.seq = r.choice([max(0, first - 1), pkt.seq + 1000])
        elif kind == 7:  # in float
            pkt.flags |= Flag.FLOAT
            pkt.payload = pkt.payload.astype(np.float32)
        else:  # of another length
            pkt.count = max(1, pkt.count - 1)
            pkt.payload = pkt.payload[: pkt.count]
        return TOKEN + encode(pkt)

    def release(self) -> list[bytes]:
        """Some of what is pending, in a random order."""
        self.rng.shuffle(self.pending)
        k = self.rng.randrange(0, len(self.pending) + 1)
        out, self.pending = self.pending[:k], self.pending[k:]
        self.answered += [d for d in out if decode(d[TOKEN_BYTES:]).flags & Flag.ACK]
        return out


def _scenario(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    window, vpp = rng.choice([1, 3, 8]), rng.choice([1, 7, 64])
    fast, retries, nack = rng.choice([0, 3]), rng.choice([2, 50]), rng.random() < 0.5
    priority = rng.randrange(4)
    ref_engine = _engine(policy, window, vpp, fast, retries, nack)
    nat_engine = _engine(policy, window, vpp, fast, retries, nack)
    ref = Reference(ref_engine, priority)
    nat = datapath.NativeWorker(nat_engine, TOKEN, priority)
    sw = Switch(rng, loss=rng.choice([0.0, 0.1, 0.3]), ecn=rng.choice([0.0, 0.2]))
    now = 1_000_000_000
    try:
        for call in range(rng.randrange(1, 4)):
            n = rng.randrange(1, 40 * vpp)
            out = np.zeros(n, np.int64)
            assert datapath.unsuitable(nat_engine) is None
            fused = None
            if rng.random() < 0.5:  # the quantiser in the datapath: floats in, floats out
                x = np.random.default_rng((seed, call)).standard_normal(n).astype(np.float32)
                blocks = -(-n // vpp)
                scale = np.exp2(np.random.default_rng(call).integers(10, 20, blocks)).astype(float)
                enc = np.where(np.arange(blocks) % 5 == 4, 0.0, scale)  # as lost blocks are
                q = fastquant.encode(x, vpp, enc)
                fused = datapath.Fused(x, enc, scale, np.zeros(n, np.float32))
                sent = ref.start(q, now)
                nat.start(np.zeros(n, np.int32), out, now, fused)
            else:
                q = np.random.default_rng((seed, call)).integers(-(2**20), 2**20, n, np.int32)
                sent = ref.start(q, now)
                nat.start(q, out, now)
            assert nat.take() == sent
            for _ in sent:
                sw.take(_)
            failed = False
            for _step in range(4000):
                if nat.done:
                    break
                now += rng.randrange(0, 400_000)
                d = ref_engine.next_deadline()
                assert nat.next_deadline() == d
                if d is not None and d <= now:
                    sent = ref.timer(now)
                    gave_up = nat.on_timer(now)
                    assert gave_up == (ref.failed is not None)
                    if gave_up:
                        assert nat.w.fail_seq == ref.failed
                        assert nat.take() == sent == []
                        failed = True
                        break
                else:
                    batch = sw.release()
                    if rng.random() < 0.3:
                        batch.insert(rng.randrange(len(batch) + 1), sw.bad(ref.call.first))
                    sent = []
                    for data in batch:
                        sent += ref.datagram(data, now)
                        nat.datagram(data, now)
                got = nat.take()
                assert got == sent
                for s in sent:
                    sw.take(s)
            assert ref.call is not None
            err = nat.error()
            assert (err is None) == (ref.call.error is None)
            if err is not None:
                assert str(err) == str(ref.call.error)
            if failed or not nat.done:
                nat.finish()
                _same_state(ref_engine, nat_engine)
                return
            assert ref_engine.idle
            if err is None:
                np.testing.assert_array_equal(out, ref.call.result)
                if fused is not None:  # decoded as each result came, as the whole is at once
                    want = fastquant.decode(ref.call.result, vpp, fused.dec_scale)
                    np.testing.assert_array_equal(fused.out.view(np.int32), want.view(np.int32))
            nat.finish()
            _same_state(ref_engine, nat_engine)
    finally:
        nat.close()


def _same_state(a: ResumableWorker, b: ResumableWorker) -> None:
    """The native call handed back what the reference holds (live timers only)."""
    for attr in ("base", "next_seq", "cwnd", "recover_seq", "highest", "fast_seq", "fast_from",
                 "done_above"):  # fmt: skip
        assert getattr(a, attr) == getattr(b, attr), attr
    assert {k: v for k, v in a.counters.items() if v} == {
        k: v for k, v in b.counters.items() if v and k in datapath.ENGINE_COUNTERS
    }

    def out(e: ResumableWorker) -> dict[int, tuple[bytes, int, int]]:
        return {s: (encode(o[0]), o[1], o[2]) for s, o in e.out.items()}

    assert out(a) == out(b)
    live = sorted((d, s) for d, s in a.timers if s in a.out and a.out[s][1] == d)
    assert live == list(b.timers)
    assert [(*x[:2], bytes(x[2])) for x in a.queue] == [(*x[:2], bytes(x[2])) for x in b.queue]
    low = a.base - a.keep
    kept = {s: encode(p) for s, p in a.kept.items() if s >= low}
    assert kept == {s: encode(p) for s, p in b.kept.items()}


@pytest.mark.parametrize("policy", ["switchml", "atp", "ps"])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_native_worker_equals_the_reference_datagram_for_datagram(policy: str, seed: int) -> None:
    _scenario(seed, policy)
