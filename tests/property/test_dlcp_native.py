"""The differential harness for DLCP's worker: the native endpoint
(``net.dlcpath``) and the reference (``proto.dlcp.DlcpEndpoint`` behind the
UDP driver's envelope), driven by the same hypothesis-drawn sequences, must
send the same datagrams byte for byte, arm the same timer, deliver the same
sums bit for bit, and count the same things under the same names.

The sequences: tensors begun (lengths around the packet size, values with
ties in their packets' norms, both halves of the model, reliable and
bounded), the server's sums arriving in any order, duplicated, cut short,
past the tensor's end, as probes, from another sender or job, as integers;
ACKs and range requests for tensors pushed, unknown or already ACKed (ranges
past the end, of any length); random and truncated bytes, forged tokens,
non-finite floats; and time passing, so requests, probes and back-off all
fire; tensors given up. Tensor ids are drawn mostly from a few, so a later
tensor reuses an id the worker still remembers, sometimes from many, so the
C's vectors fill with holes and compact, and ``keep`` is small, so
finished sums are forgotten.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.core.errors import ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.net import dlcpath
from gradfabric.proto.actions import Action, Deliver, Send
from gradfabric.proto.dlcp import (
    PROBE,
    DlcpEndpoint,
    DlcpReceiver,
    DlcpSender,
    dlcp_control,
    dlcp_data,
)
from gradfabric.wire.envelope import drop_reason, seal, unseal
from gradfabric.wire.packet import Flag, Packet
from tests.native import require

require("the DLCP client", dlcpath.PATH, dlcpath.WHY_NOT, module=True)

SETTINGS = settings(max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 300)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
JOB, RANK, TOKEN, RTO = 3, 1, bytes(range(8)), 1000


class Reference:
    """``DlcpClient``'s engine as the UDP driver runs it, with the native
    endpoint's interface."""

    def __init__(self, pp: int, keep: int, job: int = JOB, token: bytes = TOKEN,
                 rto: int = RTO) -> None:  # fmt: skip
        name = "w"
        self.ep = DlcpEndpoint(name, DlcpReceiver(name, job, RANK, ["ps"], rto, keep_done=keep),
                               [DlcpSender(name, job, RANK, "ps", pp, rto)])  # fmt: skip
        self.token = token
        self.out: list[bytes] = []
        self.sums: dict[int, np.ndarray] = {}

    def _do(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.out.append(seal(self.token, a.pkt))
            elif isinstance(a, Deliver):
                assert a.pkt.payload is not None
                self.sums[a.seq] = np.asarray(a.pkt.payload, dtype=np.float32).copy()

    def begin(self, tensor: int, x: np.ndarray, back: bool, bound: float, now: int) -> None:
        self.sums.pop(tensor, None)
        self.ep.rx.expect(0, tensor, len(x), bound, now)
        self._do(self.ep.tx[0].send(tensor, len(x), int(back), 2, values=x, now_ns=now))

    def receive_datagram(self, data: bytes, now: int) -> None:
        try:
            pkt = unseal(data, self.token)
        except ProtocolError as e:
            self.ep.counters[drop_reason(e)] += 1
            return
        self._do(self.ep.on_packet(pkt, now))

    def datagrams_to_send(self) -> list[bytes]:
        out, self.out = self.out, []
        return out

    def handle_timer(self, now: int) -> None:
        self._do(self.ep.on_timer(now))


def _nonzero(c: Counters) -> dict[str, int]:
    return {k: v for k, v in c.items() if v}


def _values(draw: st.DrawFn, n: int) -> np.ndarray:
    """Small integers (ties between packets' norms) or wide floats."""
    if draw(st.booleans()):
        return np.asarray(draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)),
                          dtype=np.float32)  # fmt: skip
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)


@st.composite
def _script(draw: st.DrawFn) -> tuple[int, int, list[tuple]]:
    pp = draw(st.sampled_from([1, 3, 8, 64]))
    keep = draw(st.integers(1, 4))
    ids = st.integers(0, 5) | st.just(0xFFFF) | st.integers(6, 150)  # (many: holes compacted)
    steps: list[tuple] = []
    lengths: dict[int, int] = {}
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["begin", "whole", "sum", "sum", "control", "junk", "time",
                                     "forget"]))  # fmt: skip
        if kind == "begin" or not lengths:
            t = draw(ids)
            n = draw(st.integers(1, 4 * pp + 3))
            lengths[t] = n
            steps.append(("begin", t, _values(draw, n), draw(st.booleans()),
                          draw(st.sampled_from([0.0, 0.1, 0.5]))))  # fmt: skip
        elif kind == "whole":  # a sum all at once, its packets in any order
            t = draw(st.sampled_from(sorted(lengths)))
            n = lengths[t]
            vals = _values(draw, n)
            starts = draw(st.permutations(range(0, n, pp)))
            prio = draw(st.integers(0, 255))
            steps += [("sum", t, lo, vals[lo : lo + pp], prio, 0, "ok") for lo in starts]
        elif kind == "sum":
            t = draw(st.sampled_from(sorted(lengths)) | ids)
            n = lengths.get(t, 8)
            lo = draw(st.integers(0, n + 2))
            count = draw(st.integers(0, pp + 2))
            vals = _values(draw, count)
            steps.append(("sum", t, lo, vals, draw(st.integers(0, 255)),
                          draw(st.sampled_from([0, 0, 0, PROBE, 7])),
                          draw(st.sampled_from(["ok"] * 6 + ["ints", "sender", "job",
                                                             "length"]))))  # fmt: skip
        elif kind == "control":
            t = draw(st.sampled_from(sorted(lengths)) | ids)
            steps.append(("control", t, draw(st.sampled_from([Flag.ACK, Flag.RESEND])),
                          draw(st.integers(0, lengths.get(t, 8) + 2)),
                          draw(st.sampled_from([0, 1, 2, pp, 2**40])),
                          draw(st.sampled_from(["ok"] * 4 + ["job", "sender"]))))  # fmt: skip
        elif kind == "forget":  # a caller that timed out gives its tensor up
            steps.append(("forget", draw(st.sampled_from(sorted(lengths)) | ids)))
        elif kind == "junk":
            steps.append(("junk", draw(st.binary(max_size=60)),
                          draw(st.sampled_from(["raw", "token", "nan", "short"]))))  # fmt: skip
        else:
            steps.append(("time", draw(st.sampled_from([1, RTO // 2, RTO, 3 * RTO, 70 * RTO]))))
    return pp, keep, steps


def _datagram(step: tuple) -> bytes:
    """The bytes a step's packet arrives as."""
    if step[0] == "sum":
        _, t, lo, vals, prio, seq, how = step
        length = len(vals) + lo if how != "length" else max(1, lo)
        pkt = dlcp_data(job_id=JOB + (how == "job"), sender=int(how == "sender"), tensor=t,
                        offset=lo, length=length, priority=prio, count=len(vals),
                        values=vals, seq=seq)  # fmt: skip
        if how == "ints":
            pkt = Packet(JOB, 0, seq, lo, length, 64, 0, prio, t, len(vals),
                         vals.astype(np.int32))  # fmt: skip
        return seal(TOKEN, pkt)
    if step[0] == "control":
        _, t, flag, lo, span, how = step
        pkt = dlcp_control(job_id=JOB + (how == "job"), sender=0, flags=int(flag), tensor=t,
                           about=RANK + (how == "sender"), offset=lo, span=span)  # fmt: skip
        return seal(TOKEN, pkt)
    _, raw, how = step
    if how == "raw":
        return raw
    if how == "token":
        return bytes(8) + seal(TOKEN, dlcp_control(job_id=JOB, sender=0, flags=Flag.ACK,
                                                   tensor=0, about=RANK))[8:]  # fmt: skip
    good = seal(TOKEN, dlcp_data(job_id=JOB, sender=0, tensor=0, offset=0, length=4, priority=0,
                                 count=2, values=np.ones(2, np.float32)))  # fmt: skip
    if how == "nan":
        return good[:-4] + np.float32("nan").tobytes()
    return good[: 8 + len(raw) % 40]


def _client_equals_the_reference(script: tuple[int, int, list[tuple]]) -> None:
    pp, keep, steps = script
    ref = Reference(pp, keep)
    nat = dlcpath.NativeDlcpEndpoint(JOB, RANK, pp, RTO, TOKEN, keep=keep)
    outs: dict[int, np.ndarray] = {}
    now = 1_000_000
    try:
        for step in steps:
            if step[0] == "begin":
                _, t, x, back, bound = step
                ref.begin(t, x, back, bound, now)
                outs[t] = np.full(len(x), -1.0, np.float32)
                nat.begin(t, x, back, bound, outs[t], now)
            elif step[0] == "forget":
                ref.ep.rx.forget(0, step[1])
                ref.sums.pop(step[1], None)
                nat.forget(step[1])
                outs.pop(step[1], None)
            elif step[0] == "time":
                now += step[1]
                due = ref.ep.next_deadline()
                assert nat.get_timer() == due
                if due is not None and due <= now:
                    ref.handle_timer(now)
                    nat.handle_timer(now)
            else:
                data = _datagram(step)
                ref.receive_datagram(data, now)
                nat.receive_datagram(data, now)
            assert nat.datagrams_to_send(now) == ref.datagrams_to_send(), step[0]
            assert nat.get_timer() == ref.ep.next_deadline()
            for t, got in ref.sums.items():  # each sum as it is delivered, bit for bit
                assert nat.ready(t)
                np.testing.assert_array_equal(outs.pop(t).view(np.int32), got.view(np.int32))
            ref.sums.clear()  # (a sum's caller takes it: the engine may then forget it)
            for t in outs:
                assert not nat.ready(t)
        assert _nonzero(nat.fold()) == _nonzero(ref.ep.counters)
    finally:
        nat.close()



# The default suite searches 150 scripts (its 10 minutes); CI's second pass
# (``-m long``) 1,000, as GRADFABRIC_EXAMPLES would.
test_native_dlcp_client_equals_the_reference = settings(
    SETTINGS, max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 150))
)(given(_script())(_client_equals_the_reference))
test_native_dlcp_client_equals_the_reference_searched_longer = pytest.mark.long(settings(
    SETTINGS, max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 1000))
)(given(_script())(_client_equals_the_reference)))

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "dlcp_client"


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.iterdir()))
def test_the_dlcp_client_corpus_runs_alike(name: str) -> None:
    """The fuzzer's corpus (``fuzz/dlcp_client.c``'s ops, read as it reads
    them) through both: the same datagrams at every take, the same sums."""
    data = (CORPUS / name).read_bytes().ljust(2, b"\0")
    pp, keep, token = (1, 3, 256, 2048)[data[0] % 4], 1 + data[1] % 8, bytes([7]) * 8
    ref = Reference(pp, keep, 7, token, 10_000)
    nat = dlcpath.NativeDlcpEndpoint(7, RANK, pp, 10_000, token, keep=keep)
    outs: dict[int, np.ndarray] = {}
    now, at = 0, 2
    try:
        while at + 3 <= len(data):
            kind, n = data[at] % 6, int.from_bytes(data[at + 1 : at + 3], "little")
            p, at = data[at + 3 : at + 3 + n], at + 3 + n
            if kind == 0:
                ref.receive_datagram(p, now)
                nat.receive_datagram(p, now)
            elif kind == 1:
                assert nat.datagrams_to_send(now) == ref.datagrams_to_send()
            elif kind == 2:
                now += int.from_bytes(p[:4].ljust(4, b"\0"), "little")
                due = ref.ep.next_deadline()
                if due is not None and due <= now:
                    ref.handle_timer(now)
                    nat.handle_timer(now)
            elif kind == 3:
                t = p[0] % 8 if p else 0
                count = 1 + (int.from_bytes(p[:4].ljust(4, b"\0"), "little") & 0xFFFF)
                x = np.asarray([np.int8(p[i % len(p)] - 256 * (p[i % len(p)] > 127)) if p else 0
                                for i in range(count)], np.float32)  # fmt: skip
                bound, back = (p[1] if len(p) > 1 else 0) / 512, len(p) > 2 and bool(p[2] & 1)
                ref.begin(t, x, back, bound, now)
                outs[t] = np.zeros(count, np.float32)
                nat.begin(t, x, back, bound, outs[t], now)
            elif kind == 4:
                t = p[0] % 8 if p else 0
                nat.forget(t)
                outs.pop(t, None)
            assert nat.get_timer() == ref.ep.next_deadline()
        assert nat.datagrams_to_send(now) == ref.datagrams_to_send()
        for t, out in outs.items():
            if t in ref.sums:
                np.testing.assert_array_equal(out.view(np.int32), ref.sums[t].view(np.int32))
        assert _nonzero(nat.fold()) == _nonzero(ref.ep.counters)
    finally:
        nat.close()
