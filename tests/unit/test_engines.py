"""Engines driven by hand: scripted time, scripted drops, exact timers."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import ListSink
from gradfabric.proto.actions import Deliver, Fail, Multicast, Send
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.schemes import SCHEMES, InaConfig
from gradfabric.proto.switch import SwitchEngine, SwitchJob
from gradfabric.proto.switch.atp import atp_index
from gradfabric.proto.worker import HashedPool, StaticSlots, WorkerConfig, WorkerEngine
from gradfabric.wire.packet import Flag, Packet, ina_packet

RTO = 1_000


def _worker(i: int, n: int = 2, window: int = 2, route: object = None) -> WorkerEngine:
    cfg = WorkerConfig(
        job_id=1,
        worker_id=i,
        fan_in=n,
        window=window,
        rto_ns=RTO,
        values_per_packet=4,
        max_retries=3,
    )
    return WorkerEngine(f"w{i}", cfg, route or StaticSlots("sw", 0, window))  # type: ignore[arg-type]


def _sends(actions: list) -> list[Send]:
    return [a for a in actions if isinstance(a, Send)]


def test_worker_window_timers_and_retransmission() -> None:
    w = _worker(0)
    acts = w.push(12, 0, np.arange(12, dtype=np.int32))  # 3 packets, window 2
    assert [a.pkt.seq for a in _sends(acts)] == [0, 1]
    assert [a.pkt.agg_index for a in _sends(acts)] == [0, 1]
    assert w.next_deadline() == RTO
    assert w.on_timer(RTO - 1) == []
    again = _sends(w.on_timer(RTO))
    assert [a.pkt.seq for a in again] == [0, 1]
    assert not again[0].pkt.flags & Flag.RESEND  # SwitchML retransmits plainly
    assert w.next_deadline() == 2 * RTO
    res = Packet(1, 0, 0, 0, 0b11, 2, Flag.ACK, count=4, payload=np.zeros(4, np.int32))
    acts = w.on_packet(res, 1500)
    assert [a.pkt.seq for a in _sends(acts)] == [2]  # slot 0 reused for seq 2
    assert _sends(acts)[0].pkt.agg_index == 0
    assert [a.seq for a in acts if isinstance(a, Deliver)] == [0]
    assert w.on_packet(res, 1600) == []  # a second copy is not delivered again
    assert w.counters["drop_duplicate_result"] == 1
    assert w.next_deadline() == 2 * RTO  # seq 1 still pending


def test_worker_gives_up_naming_the_peer() -> None:
    w = _worker(0)
    w.push(4, 0, np.zeros(4, np.int32))
    for k in range(1, 4):
        assert _sends(w.on_timer(k * RTO))
    fail = w.on_timer(4 * RTO)
    assert len(fail) == 1 and isinstance(fail[0], Fail) and fail[0].peer == "sw"


def test_atp_worker_marks_resends_and_halves_on_ecn() -> None:
    cfg = WorkerConfig(job_id=1, worker_id=0, fan_in=2, window=8, rto_ns=RTO, ecn_window=True)
    w = WorkerEngine("w0", cfg, HashedPool("sw", 1, 64))
    acts = _sends(w.push(8 * 256, 0))
    assert [a.pkt.agg_index for a in acts] == [atp_index(1, s, 64) for s in range(8)]
    assert all(a.pkt.flags & Flag.RESEND for a in _sends(w.on_timer(RTO)))
    w.on_packet(Packet(1, 0, 0, 0, 3, 2, Flag.ACK | Flag.ECN, count=256), 1)
    assert w.cwnd == 4.0
    w.on_packet(Packet(1, 0, 1, 0, 3, 2, Flag.ACK | Flag.ECN, count=256), 2)
    assert w.cwnd == 4.0  # at most one halving per window of data
    w.on_packet(Packet(1, 0, 2, 0, 3, 2, Flag.ACK, count=256), 3)
    assert w.cwnd == 4.25


def _grad(
    job: int, w: int, seq: int, idx: int, vals: list[int], n: int = 2, flags: int = 0
) -> Packet:
    return Packet(
        job, w, seq, idx, 1 << w, n, flags, count=len(vals), payload=np.array(vals, dtype=np.int32)
    )


def test_switchml_aggregates_multicasts_and_answers_retransmission() -> None:
    sw = SwitchEngine.build("sw", "switchml", 4, (SwitchJob(1, ("w0", "w1"), slot_count=2),))
    assert sw.on_packet(_grad(1, 0, 0, 0, [1, 2]), 10) == []
    acts = sw.on_packet(_grad(1, 1, 0, 0, [10, 20]), 20)
    assert len(acts) == 1 and isinstance(acts[0], Multicast)
    assert acts[0].dsts == ("w0", "w1")
    assert acts[0].pkt.payload is not None and list(acts[0].pkt.payload) == [11, 22]
    again = sw.on_packet(_grad(1, 0, 0, 0, [1, 2]), 30)  # w0 lost the result
    assert isinstance(again[0], Send) and again[0].dst == "w0"
    assert list(again[0].pkt.payload) == [11, 22]  # type: ignore[arg-type]
    # Next use of slot 0 (seq 2) goes to the shadow copy; seq 0 stays answerable.
    sw.on_packet(_grad(1, 0, 2, 0, [5, 5]), 40)
    assert sw.on_packet(_grad(1, 1, 0, 0, [10, 20]), 50)[0].dst == "w1"  # type: ignore[union-attr]
    # seq 4 reuses copy 0: a late duplicate of seq 0 is now stale.
    sw.on_packet(_grad(1, 0, 4, 0, [7, 7]), 60)
    assert sw.on_packet(_grad(1, 1, 0, 0, [10, 20]), 70) == []
    assert sw.counters["drop_stale"] == 1
    assert sw.policy.stats.busy_ns == 10


def test_switch_drops_foreign_and_malformed_packets() -> None:
    sw = SwitchEngine.build(
        "sw",
        "switchml",
        8,
        (
            SwitchJob(1, ("a", "b"), slot_count=2),
            SwitchJob(2, ("c", "d"), slot_base=2, slot_count=2),
        ),
    )
    assert sw.on_packet(_grad(9, 0, 0, 0, [1]), 0) == []  # unknown job
    assert sw.on_packet(_grad(2, 0, 0, 0, [1]), 0) == []  # job 2 naming job 1's slot
    assert sw.on_packet(_grad(1, 2, 0, 0, [1], n=3), 0) == []  # worker outside the job
    bad_bitmap = _grad(1, 0, 0, 0, [1])
    bad_bitmap.bitmap = 0b11
    assert sw.on_packet(bad_bitmap, 0) == []
    assert sw.counters["drop_unknown_job"] == 1
    assert sw.counters["drop_bad_slot"] == 1
    assert sw.counters["drop_bad_worker"] == 2


def test_switch_drops_a_sender_outside_its_job_whatever_its_bits() -> None:
    """The wire passes any u16 sender; the switch drops one outside the job
    with a valid bit (a gradient, a helper's share) or on a result for one
    worker (ATP's PS answering a retransmission), and forwards nothing."""
    ml = SwitchEngine.build("sw", "switchml", 8, (SwitchJob(1, ("a", "b"), slot_count=2),))
    for sender in (2, 64, 2**16 - 1):
        grad = ina_packet(job_id=1, worker_id=sender, seq=0, agg_index=0, bitmap=1 << 1,
                          fan_in=2, count=1, values=np.ones(1, np.int32))  # fmt: skip
        assert ml.on_packet(grad, 0) == []
        grad.flags = Flag.HELP  # a helper's share under b's bit, sent by no one of the job
        assert ml.on_packet(grad, 0) == []
    assert ml.counters["drop_bad_worker"] == 6 and ml.counters["rx_help"] == 0
    atp = SwitchEngine.build("sw", "atp", 8, (SwitchJob(1, ("a", "b"), parent="ps"),))
    for sender in (2, 64, 2**16 - 1):
        res = ina_packet(job_id=1, worker_id=sender, seq=0, agg_index=0, bitmap=0b11, fan_in=2,
                         flags=Flag.ACK | Flag.RESEND, count=1,
                         values=np.ones(1, np.int32))  # fmt: skip
        assert atp.on_packet(res, 0) == []
    assert atp.counters["drop_bad_result"] == 3


def test_switch_drops_are_traced_as_records() -> None:
    sink = ListSink()
    sw = SwitchEngine.build("sw", "switchml", 4, (SwitchJob(1, ("a", "b"), slot_count=2),))
    sw.trace = sink
    sw.on_packet(_grad(9, 0, 5, 0, [1]), 42)
    assert sink.records == [
        {
            "kind": "drop",
            "now_ns": 42,
            "switch": "sw",
            "reason": "unknown_job",
            "job": 9,
            "worker": 0,
            "seq": 5,
        }
    ]


def test_atp_collision_goes_to_ps_and_ps_merges_by_bitmap() -> None:
    pool = 4
    sw = SwitchEngine.build(
        "sw",
        "atp",
        pool,
        (SwitchJob(1, ("w0", "w1"), parent="ps"), SwitchJob(2, ("x0", "x1"), parent="ps")),
    )
    ps = ParameterServer("ps", (PsJob(1, ("w0", "w1"), via="sw"), PsJob(2, ("x0", "x1"), via="sw")))
    i1 = atp_index(1, 0, pool)
    # job 2 takes the aggregator first; job 1's packets collide and go to the PS
    sw.on_packet(_grad(2, 0, 5, i1, [100]), 0)
    fwd = sw.on_packet(_grad(1, 0, 0, i1, [1]), 1) + sw.on_packet(_grad(1, 1, 0, i1, [2]), 2)
    assert all(isinstance(a, Send) and a.dst == "ps" and a.pkt.flags & Flag.COLLISION for a in fwd)
    assert sw.counters["ps_collision"] == 2
    out = ps.on_packet(fwd[0].pkt, 3) + ps.on_packet(fwd[1].pkt, 4)  # type: ignore[union-attr]
    assert len(out) == 1 and isinstance(out[0], Send) and out[0].dst == "sw"
    assert list(out[0].pkt.payload) == [3]  # type: ignore[arg-type]
    # the result passing back does not free job 2's aggregator (different key)
    down = sw.on_packet(out[0].pkt, 5)
    assert isinstance(down[0], Multicast) and down[0].dsts == ("w0", "w1")
    assert sw.policy.pool[i1].job == 2  # type: ignore[attr-defined]


def test_atp_resend_flushes_partial_and_ps_never_double_counts() -> None:
    sw = SwitchEngine.build("sw", "atp", 8, (SwitchJob(1, ("w0", "w1", "w2"), parent="ps"),))
    ps = ParameterServer("ps", (PsJob(1, ("w0", "w1", "w2"), via="sw"),))
    idx = atp_index(1, 0, 8)
    sw.on_packet(_grad(1, 0, 0, idx, [1], n=3), 0)
    sw.on_packet(_grad(1, 1, 0, idx, [2], n=3), 1)
    flush = sw.on_packet(_grad(1, 0, 0, idx, [1], n=3, flags=Flag.RESEND), 2)
    assert [a.pkt.bitmap for a in flush] == [0b011, 0b001]  # type: ignore[union-attr]
    assert flush[0].pkt.flags & Flag.PARTIAL  # type: ignore[union-attr]
    for a in flush:
        assert ps.on_packet(a.pkt, 3) == []  # type: ignore[union-attr]
    assert ps.counters["drop_duplicate"] == 1  # w0's resend was already in the partial
    # a late duplicate of w0 claims a fresh aggregator with w2; that partial overlaps
    sw.on_packet(_grad(1, 0, 0, idx, [1], n=3), 4)
    sw.on_packet(_grad(1, 2, 0, idx, [4], n=3), 5)
    flush2 = sw.on_packet(_grad(1, 2, 0, idx, [4], n=3, flags=Flag.RESEND), 6)
    results = [r for a in flush2 for r in ps.on_packet(a.pkt, 7)]  # type: ignore[union-attr]
    assert ps.counters["drop_overlap"] == 1
    assert len(results) == 1 and list(results[0].pkt.payload) == [7]  # type: ignore[union-attr]
    # a resend after completion is answered from the stored result
    again = ps.on_packet(_grad(1, 1, 0, idx, [2], n=3, flags=Flag.RESEND), 8)
    assert again[0].pkt.flags & Flag.RESEND and again[0].pkt.worker_id == 1  # type: ignore[union-attr]


def test_ps_takes_a_whole_sum_over_a_partial_merge() -> None:
    """A packet of every contribution is the result, whatever the PS merged:
    the switch's complete aggregate, sent again after a resend, completes a
    sequence whose partial merge overlaps it (ATP at scale: the last worker's
    own resends kept losing a congested port, and the sequence never ended)."""
    ps = ParameterServer("ps", (PsJob(1, ("w0", "w1", "w2"), via="sw"),))
    assert ps.on_packet(_grad(1, 0, 0, 0, [1], n=3, flags=Flag.ECN), 0) == []  # w0's, marked
    assert ps.on_packet(_grad(1, 1, 0, 0, [2], n=3), 1) == []  # w0 and w1 merged
    whole = _grad(1, 0, 0, 0, [7], n=3)
    whole.bitmap = 0b111  # w0 + w1 + w2, as the switch summed them (1 + 2 + 4)
    (res,) = ps.on_packet(whole, 2)
    assert list(res.pkt.payload) == [7]  # type: ignore[union-attr,arg-type]
    assert res.pkt.flags & Flag.ECN  # type: ignore[union-attr]  # the partial's mark kept
    assert ps.counters["partial_superseded"] == 1 and ps.counters["drop_overlap"] == 0
    short = _grad(1, 0, 1, 0, [1, 1], n=3)  # another sequence, two values each
    assert ps.on_packet(short, 4) == []
    forged = _grad(1, 0, 1, 0, [9], n=3)
    forged.bitmap = 0b111  # "every contribution", but of another length: not the sum
    assert ps.on_packet(forged, 5) == [] and ps.counters["drop_overlap"] == 1
    assert ps.missing_workers(1) == ["w1", "w2"]
    (late,) = ps.on_packet(_grad(1, 2, 0, 0, [4], n=3), 3)  # w2's own share, late: answered
    assert list(late.pkt.payload) == [7] and late.pkt.worker_id == 2  # type: ignore[union-attr,arg-type]


def test_atp_sends_a_complete_aggregate_again_once_a_round_of_resends() -> None:
    """A complete aggregate may have been lost on its way to the PS: the first
    resend of its key sends it again, the rest of that round's do not (one
    copy per worker per round congested a rack's uplink at scale)."""
    sw = SwitchEngine.build("sw", "atp", 8, (SwitchJob(1, ("w0", "w1", "w2"), parent="ps"),))
    idx = atp_index(1, 0, 8)
    for w, v in enumerate((1, 2, 4)):
        sw.on_packet(_grad(1, w, 0, idx, [v], n=3), w)
    copies = []
    for r in range(6):  # two rounds of the three workers' resends
        out = sw.on_packet(_grad(1, r % 3, 0, idx, [1 << r % 3], n=3, flags=Flag.RESEND), 10 + r)
        copies.append([a.pkt.bitmap for a in out])  # type: ignore[union-attr]
    assert copies == [[0b111, 0b001], [0b010], [0b100], [0b111, 0b001], [0b010], [0b100]]


def test_atp_second_level_counts_a_round_of_resends_over_every_worker_below() -> None:
    """At ATP's second level a round is every worker of every rack below
    (five here, in racks of 2 and 3), not its two children."""
    spine = SwitchEngine.build("sp", "atp", 8, (SwitchJob(1, ("l0", "l1"), ps_shards=("ps",),
                                                          below=(2, 3)),))  # fmt: skip
    assert spine.on_packet(_rack_sum(0, [3]), 0) == []
    (whole,) = spine.on_packet(_rack_sum(1, [4]), 1)  # both racks' sums: complete, to the PS
    assert whole.pkt.layer == 0 and whole.pkt.bitmap == 0b11  # type: ignore[union-attr]
    copies = []
    for k in range(10):  # two rounds of the five workers' resends, passed up by their racks
        rack, w, n = (0, k % 5, 2) if k % 5 < 2 else (1, k % 5 - 2, 3)
        out = spine.on_packet(_rack_grad(w, n, rack + 1, [1], flags=Flag.RESEND), 10 + k)
        copies.append(sum(1 for a in out if a.pkt.layer == 0))  # type: ignore[union-attr]
    assert copies == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0]


def test_esa_preempts_lower_priority_and_reuses_complete_aggregators() -> None:
    jobs = (SwitchJob(1, ("w0", "w1"), parent="ps"), SwitchJob(2, ("x0", "x1"), parent="ps"))
    sw = SwitchEngine.build("sw", "esa", 4, jobs)
    ps = ParameterServer("ps", (PsJob(1, ("w0", "w1"), via="sw"), PsJob(2, ("x0", "x1"), via="sw")))
    i1 = atp_index(1, 0, 4)
    low = _grad(1, 0, 0, i1, [5])
    low.priority = 1
    assert sw.on_packet(low, 0) == []
    high = _grad(2, 0, 9, i1, [100])
    high.priority = 7
    evict = sw.on_packet(high, 1)  # job 2 outranks job 1: job 1's partial goes to the PS
    assert len(evict) == 1 and evict[0].pkt.flags & Flag.PARTIAL  # type: ignore[union-attr]
    assert evict[0].pkt.job_id == 1 and evict[0].pkt.bitmap == 0b01  # type: ignore[union-attr]
    assert sw.counters["preemptions"] == 1 and sw.policy.pool[i1].job == 2  # type: ignore[attr-defined]
    ps.on_packet(evict[0].pkt, 2)  # type: ignore[union-attr]
    # job 1's second worker now collides (lower priority) and completes at the PS
    late = _grad(1, 1, 0, i1, [6])
    late.priority = 1
    fwd = sw.on_packet(late, 3)
    assert fwd[0].pkt.flags & Flag.COLLISION  # type: ignore[union-attr]
    res = ps.on_packet(fwd[0].pkt, 4)  # type: ignore[union-attr]
    assert list(res[0].pkt.payload) == [11]  # type: ignore[union-attr]
    # job 2 completes: its aggregator is COMPLETE, awaiting the PS ...
    done = sw.on_packet(_grad(2, 1, 9, i1, [1]), 5)
    assert list(done[0].pkt.payload) == [101]  # type: ignore[union-attr]
    # ... and ESA lets any packet take it at once (ATP would collide)
    other = _grad(1, 0, 4, i1, [3])
    assert sw.on_packet(other, 6) == []
    assert sw.counters["reclaimed_complete"] == 1 and sw.policy.pool[i1].job == 1  # type: ignore[attr-defined]


def _result(seq: int) -> Packet:
    return Packet(1, 0, seq, seq % 8, 0b11, 2, Flag.ACK, count=4, payload=np.zeros(4, np.int32))


def test_fast_retransmit_resends_a_loss_after_k_later_results_not_a_timeout() -> None:
    """Window 8, k = 3: seq 0's result is lost, so the window stays at 0..7;
    the results of 1 and 2 change nothing, that of 3 (three past it) resends
    0 at once, due again one RTO later (its stale timer does nothing); the
    next resend waits for 3 more results past the highest one seen at the
    last (3), or for the timer; the deadlines it supersedes fire nothing.
    Off (k = 0), only the timer resends."""
    cfg = WorkerConfig(job_id=1, worker_id=0, fan_in=2, window=8, rto_ns=RTO,
                       values_per_packet=4, max_retries=5, fast_retransmit=3)  # fmt: skip
    w = WorkerEngine("w0", cfg, StaticSlots("sw", 0, 8))
    assert [a.pkt.seq for a in _sends(w.push(40, 0, np.zeros(40, np.int32)))] == list(range(8))
    for seq in (1, 2):
        assert _sends(w.on_packet(_result(seq), 100 + seq)) == []
    again = _sends(w.on_packet(_result(3), 200))
    assert [a.pkt.seq for a in again] == [0] and w.counters["fast_retransmits"] == 1
    for seq in (4, 5):
        assert _sends(w.on_packet(_result(seq), 300 + seq)) == []
    assert [a.pkt.seq for a in _sends(w.on_packet(_result(6), 400))] == [0]
    assert w.counters["fast_retransmits"] == 2
    # at RTO only 7 (never answered) is resent: 0's first two deadlines are stale
    assert [a.pkt.seq for a in _sends(w.on_timer(RTO))] == [7]
    assert w.next_deadline() == 400 + RTO  # 0's latest
    assert [a.pkt.seq for a in _sends(w.on_packet(_result(0), 1100))] == [8, 9]
    assert w.base == 7  # 0 answered, 1..6 were in
    off = WorkerEngine("w0", replace(cfg, fast_retransmit=0), StaticSlots("sw", 0, 8))
    off.push(40, 0, np.zeros(40, np.int32))
    assert all(_sends(off.on_packet(_result(seq), 100)) == [] for seq in range(1, 8))
    assert off.counters["fast_retransmits"] == 0
    assert [a.pkt.seq for a in _sends(off.on_timer(RTO))] == [0]  # the timer, at last


def test_with_fast_retransmit_the_timer_resends_the_lowest_due_packet_and_rearms_the_rest() -> None:
    """A window of 8 waits on a peer (no result comes): with k = 3 each RTO
    resends only the lowest due sequence and re-arms the other seven (TCP's
    rule), until that one runs out of retries and the worker fails naming it;
    once 0 is answered, 1 is the one resent. With k = 0 the timer is the only
    repair and resends all eight."""
    cfg = WorkerConfig(job_id=1, worker_id=0, fan_in=2, window=8, rto_ns=RTO,
                       values_per_packet=4, max_retries=2, fast_retransmit=3)  # fmt: skip
    w = WorkerEngine("w0", cfg, StaticSlots("sw", 0, 8))
    w.push(40, 0, np.zeros(40, np.int32))
    for t in (1, 2):
        assert [a.pkt.seq for a in _sends(w.on_timer(t * RTO))] == [0]
        assert w.next_deadline() == (t + 1) * RTO
    assert w.counters["timer_rearmed"] == 14 and w.counters["retransmits"] == 2
    fail = w.on_timer(3 * RTO)
    assert len(fail) == 1 and isinstance(fail[0], Fail) and "sequence 0 " in fail[0].reason
    w = WorkerEngine("w0", cfg, StaticSlots("sw", 0, 8))
    w.push(40, 0, np.zeros(40, np.int32))
    w.on_timer(RTO)
    assert [a.pkt.seq for a in _sends(w.on_packet(_result(0), RTO + 1))] == [8]
    assert [a.pkt.seq for a in _sends(w.on_timer(2 * RTO))] == [1]
    off = WorkerEngine("w0", replace(cfg, fast_retransmit=0), StaticSlots("sw", 0, 8))
    off.push(40, 0, np.zeros(40, np.int32))
    assert [a.pkt.seq for a in _sends(off.on_timer(RTO))] == list(range(8))
    assert off.counters["timer_rearmed"] == 0


def _star(nack: bool, lose: set[tuple[str, int]]) -> tuple[SwitchEngine, list[WorkerEngine], dict]:
    """Three workers (window 4, 4 values a packet) and a SwitchML switch, every
    datagram delivered at once in order, except the workers' shares in
    ``lose`` (name, seq) the first time they are sent; no timer fires. Returns
    the engines and each worker's delivered results."""
    names = ("w0", "w1", "w2")
    sw = SwitchEngine.build("sw", "switchml", 4, (SwitchJob(1, names, slot_count=4),))
    workers = [
        WorkerEngine(n, WorkerConfig(job_id=1, worker_id=i, fan_in=3, window=4, rto_ns=RTO,
                                     values_per_packet=4, nack=nack), StaticSlots("sw", 0, 4))
        for i, n in enumerate(names)
    ]  # fmt: skip
    by_name = {w.name: w for w in workers}
    got: dict[str, dict[int, list[int]]] = {n: {} for n in names}
    queue: list[tuple[str, Packet]] = []
    lose = set(lose)

    def run(actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                queue.append((a.dst, a.pkt))
            elif isinstance(a, Multicast):
                queue.extend((d, a.pkt.clone()) for d in a.dsts)

    data = [np.arange(24, dtype=np.int32) * (i + 1) for i in range(3)]  # 6 packets each
    for w, x in zip(workers, data, strict=True):
        run(w.push(24, 0, x))
    while queue:
        dst, pkt = queue.pop(0)
        if dst == "sw":
            key = (names[pkt.worker_id], pkt.seq)
            if key in lose:
                lose.discard(key)
                continue
            run(sw.on_packet(pkt, 1))
        else:
            acts = by_name[dst].on_packet(pkt, 1)
            for a in acts:
                if isinstance(a, Deliver):
                    got[dst][a.seq] = list(a.pkt.payload)  # type: ignore[arg-type]
            run(acts)
    return sw, workers, got


def test_switchml_notices_name_the_worker_whose_share_was_lost_and_only_it_resends() -> None:
    """w1's share of seq 1 is lost: its share of seq 2 tells the switch so
    (shares leave in order), the switch notices w1 alone, w1 resends, and
    every worker gets every sum, exact (the int64 sum of the three tensors).
    Nobody else resends anything and no timer was needed. Workers that ask
    for no notices get none: the same loss then waits for the timer."""
    sw, workers, got = _star(True, {("w1", 1)})
    want = (np.arange(24, dtype=np.int64) * 6).reshape(6, 4).tolist()
    assert all([got[w.name][s] for s in range(6)] == want for w in workers)
    assert sw.counters["nack_sent"] == 1
    assert [w.counters["nack_resends"] for w in workers] == [0, 1, 0]
    assert all(w.counters["retransmits"] == 0 and w.idle for w in workers)
    # two losses in a row: seq 3 notices 2, and 2's resend notices 1
    sw, workers, got = _star(True, {("w2", 1), ("w2", 2)})
    assert all([got[w.name][s] for s in range(6)] == want for w in workers)
    assert sw.counters["nack_sent"] == 2 and workers[2].counters["nack_resends"] == 2
    sw, workers, got = _star(False, {("w1", 1)})
    assert sw.counters["nack_sent"] == 0 and not workers[1].idle
    assert all(sorted(got[w.name]) == [0, 2, 3, 4] for w in workers)  # the window waits on 1


def test_a_worker_takes_only_notices_meant_for_it() -> None:
    """A notice for a sequence already answered (or never sent) is a counted
    stale drop; one naming another worker, or sent to a worker that asked
    for none, is foreign."""
    cfg = WorkerConfig(job_id=1, worker_id=0, fan_in=2, window=2, rto_ns=RTO,
                       values_per_packet=4, nack=True)  # fmt: skip
    w = WorkerEngine("w0", cfg, StaticSlots("sw", 0, 2))
    w.push(8, 0, np.zeros(8, np.int32))

    def notice(seq: int, worker: int = 0) -> Packet:
        return Packet(1, worker, seq, seq % 2, 1 << worker, 2, Flag.NACK)

    again = _sends(w.on_packet(notice(1), 5))
    assert [a.pkt.seq for a in again] == [1] and w.counters["nack_resends"] == 1
    assert again[0].pkt.flags & Flag.NACK  # (its shares keep asking)
    assert w.on_packet(notice(7), 6) == [] and w.counters["drop_stale_nack"] == 1
    assert w.on_packet(notice(0, worker=1), 7) == [] and w.counters["drop_foreign"] == 1
    deaf = WorkerEngine("w0", replace(cfg, nack=False), StaticSlots("sw", 0, 2))
    deaf.push(8, 0, np.zeros(8, np.int32))
    assert deaf.on_packet(notice(1), 5) == [] and deaf.counters["drop_foreign"] == 1


def _two_levels() -> tuple[SwitchEngine, SwitchEngine, SwitchEngine, ParameterServer]:
    """ATP's two levels by hand: racks l0 (w0, w1) and l1 (w2) under spine sp."""
    l0 = SwitchEngine.build("l0", "atp", 8, (SwitchJob(
        1, ("w0", "w1"), parent="sp", index_at_parent=0, parent_fan_in=2, group=1),))
    l1 = SwitchEngine.build("l1", "atp", 8, (SwitchJob(
        1, ("w2",), parent="sp", index_at_parent=1, parent_fan_in=2, group=2),))
    sp = SwitchEngine.build("sp", "atp", 8, (SwitchJob(
        1, ("l0", "l1"), ps_shards=("ps",), below=(2, 1)),))
    ps = ParameterServer("ps", (PsJob(1, ("w0", "w1", "w2"), via="sp", groups=(2, 1)),))
    return l0, l1, sp, ps  # fmt: skip


def _rack_grad(w: int, n: int, group: int, vals: list[int], seq: int = 0, flags: int = 0) -> Packet:
    pkt = _grad(1, w, seq, atp_index(1, seq, 8), vals, n=n, flags=flags)
    pkt.layer = group
    return pkt


def test_atp_two_levels_sum_racks_at_the_spine_and_readdress_results() -> None:
    l0, l1, sp, ps = _two_levels()
    assert l0.on_packet(_rack_grad(0, 2, 1, [1]), 0) == []
    (up0,) = l0.on_packet(_rack_grad(1, 2, 1, [2]), 1)  # rack 0's sum: child 0 of the spine
    assert isinstance(up0, Send) and up0.dst == "sp"
    assert (up0.pkt.worker_id, up0.pkt.bitmap, up0.pkt.fan_in, up0.pkt.layer) == (0, 1, 2, 0)
    (up1,) = l1.on_packet(_rack_grad(0, 1, 2, [4]), 2)
    assert sp.on_packet(up0.pkt, 3) == []  # type: ignore[union-attr]
    (agg,) = sp.on_packet(up1.pkt, 4)  # type: ignore[union-attr]
    assert isinstance(agg, Send) and agg.dst == "ps" and list(agg.pkt.payload) == [7]  # type: ignore[arg-type]
    (res,) = ps.on_packet(agg.pkt, 5)
    assert isinstance(res, Send) and (res.pkt.fan_in, res.pkt.bitmap) == (2, 0b11)
    (down,) = sp.on_packet(res.pkt, 6)
    assert isinstance(down, Multicast) and down.dsts == ("l0", "l1")
    (to0,) = l0.on_packet(down.pkt, 7)
    (to1,) = l1.on_packet(down.pkt, 8)
    assert isinstance(to0, Multicast) and to0.dsts == ("w0", "w1")
    assert (to0.pkt.fan_in, to0.pkt.bitmap, to0.pkt.layer) == (2, 0b11, 1)
    assert isinstance(to1, Multicast) and (to1.pkt.fan_in, to1.pkt.bitmap) == (1, 1)
    # a worker asking again after the PS completed: answered through both levels
    (ans,) = ps.on_packet(_rack_grad(0, 1, 2, [4], flags=Flag.RESEND), 9)
    assert isinstance(ans, Send) and ans.pkt.flags & Flag.RESEND and ans.pkt.layer == 2
    (hop,) = sp.on_packet(ans.pkt, 10)
    assert isinstance(hop, Send) and hop.dst == "l1"
    (last,) = l1.on_packet(hop.pkt, 11)
    assert isinstance(last, Send) and last.dst == "w2" and list(last.pkt.payload) == [7]  # type: ignore[arg-type]


def test_atp_two_levels_drop_packets_of_the_wrong_level() -> None:
    l0, _, sp, ps = _two_levels()
    assert l0.on_packet(_rack_grad(0, 2, 2, [1]), 0) == []  # another rack's group
    assert l0.on_packet(_rack_grad(0, 2, 0, [1]), 0) == []  # no group at all
    assert sp.on_packet(_rack_grad(0, 2, 3, [1]), 0) == []  # no rack 2 below
    assert sp.on_packet(_rack_grad(0, 3, 1, [1]), 0) == []  # rack 0 has 2 workers, not 3
    assert l0.counters["drop_bad_level"] == 2 and sp.counters["drop_bad_level"] == 2
    # the PS: a packet whose bits do not fit its group, or a group it lacks
    assert ps.on_packet(_rack_grad(0, 2, 3, [1]), 0) == []
    assert ps.on_packet(_rack_grad(1, 1, 2, [1]), 0) == []
    assert ps.counters["drop_bad_packet"] == 2
    # a rack's fallback passes the spine to the PS untouched
    (fwd,) = sp.on_packet(_rack_grad(1, 2, 1, [5], flags=Flag.COLLISION), 1)
    assert isinstance(fwd, Send) and fwd.dst == "ps" and fwd.pkt.layer == 1


def _rack_sum(rack: int, vals: list[int], job: int = 1, priority: int = 0) -> Packet:
    """Rack ``rack``'s whole sum as its switch sends it up (one child of 2)."""
    return ina_packet(job_id=job, worker_id=rack, seq=0, agg_index=atp_index(job, 0, 8),
                      bitmap=1 << rack, fan_in=2, priority=priority, count=len(vals),
                      values=np.array(vals, np.int32))  # fmt: skip


def test_esa_preempts_at_the_second_level_too() -> None:
    """Two jobs' rack sums on one aggregator of the spine: the higher
    priority takes it, the lower's partial goes to its own PS."""
    jobs = tuple(SwitchJob(j, ("l0", "l1"), ps_shards=(f"ps{j}",), below=(2, 2)) for j in (1, 2))
    sp = SwitchEngine.build("sp", "esa", 8, jobs)
    low = _rack_sum(0, [3], job=1, priority=1)
    high = _rack_sum(0, [5], job=2, priority=9)
    high.agg_index = low.agg_index  # (the jobs' hashes collide here)
    assert sp.on_packet(low, 0) == []
    (evict,) = sp.on_packet(high, 1)
    assert isinstance(evict, Send) and evict.dst == "ps1" and evict.pkt.flags & Flag.PARTIAL
    assert (evict.pkt.bitmap, list(evict.pkt.payload)) == (0b01, [3])  # type: ignore[arg-type]
    assert sp.counters["preemptions"] == 1


def test_ps_merges_across_levels_by_worker_never_twice() -> None:
    """A rack's whole sum and one of its workers' shares hold that worker
    both: whichever comes second is refused (overlap or duplicate) and the
    result counts each worker once."""
    *_, ps = _two_levels()
    assert ps.on_packet(_rack_grad(0, 2, 1, [1]), 0) == []  # w0 alone (a fallback)
    rack0 = _rack_sum(0, [3])
    assert ps.on_packet(rack0, 1) == [] and ps.counters["drop_overlap"] == 1
    assert ps.missing_workers(1) == ["w1", "w2"]
    rack1 = _rack_sum(1, [4])
    assert ps.on_packet(rack1, 2) == []
    assert ps.on_packet(_rack_grad(0, 1, 2, [4]), 3) == []  # w2 again: in rack 1's sum
    assert ps.counters["drop_duplicate"] == 1
    (res,) = ps.on_packet(_rack_grad(1, 2, 1, [2]), 4)
    assert list(res.pkt.payload) == [7]  # type: ignore[union-attr,arg-type]


def test_levels_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ConfigError, match="summing"):
        PsJob(1, ("a", "b", "c"), groups=(1, 1))
    with pytest.raises(ConfigError, match=r"1\.\.64 workers"):
        PsJob(1, tuple(f"w{i}" for i in range(65)))
    with pytest.raises(ConfigError, match="parent"):
        SwitchJob(1, ("a",), group=1)  # a rack's switch with nowhere to send its sum
    with pytest.raises(ConfigError, match="one fan-in"):
        SwitchJob(1, ("l0", "l1"), below=(2,))
    with pytest.raises(ConfigError, match="every level"):
        SwitchEngine.build("s", "switchml", 8, (SwitchJob(1, ("a",), parent="p", group=1),))
    with pytest.raises(ConfigError, match="place at the parent"):  # its sum and fallbacks differ
        SwitchJob(1, ("a",), parent="p", index_at_parent=0, parent_fan_in=2, group=2)
    with pytest.raises(ConfigError, match="own child"):
        SwitchEngine.build("l0", "atp", 8, (SwitchJob(1, ("l0", "l1"), below=(2, 2)),))
    p = SCHEMES.get("atp").place(("a", "b"), {"l0": ("a",), "l1": ("b",)}, InaConfig(),
                                 root="l0", servers=("ps0",))  # fmt: skip
    with pytest.raises(ConfigError, match="not one of theirs"):
        SCHEMES.get("atp").levels(p)


def test_a_ticket_s_fast_retransmit_reaches_its_workers_and_survives_a_save(tmp_path) -> None:
    """The clients' rule where the ticket leaves it (None: 3 for ATP); a
    launcher's 0 (fast retransmit off: repairs wait for the timeout) reaches
    the worker engines ``InaClient`` runs, through the file every rank loads,
    and a ticket file written before the field existed loads with None."""
    from gradfabric.runtime.ticket import FAST_RETRANSMIT, Ticket, scheme_worker

    t = Ticket(switch=("127.0.0.1", 1), control=("127.0.0.1", 2), job_id=1, token="00",
               policy="atp", workers=2, pool_slots=64, slot_base=0, window=8,
               values_per_packet=4, rto_ns=RTO, entry="sw")  # fmt: skip
    assert scheme_worker(t, 0, timeout_s=1.0).fast == FAST_RETRANSMIT
    t.save(str(tmp_path / "ticket.json"))
    off = replace(Ticket.load(str(tmp_path / "ticket.json")), fast_retransmit=0)
    off.save(str(tmp_path / "off.json"))
    off = Ticket.load(str(tmp_path / "off.json"))  # what each rank loads
    assert off.fast_retransmit == 0 and scheme_worker(off, 1, timeout_s=1.0).fast == 0
    old = json.loads((tmp_path / "ticket.json").read_text())
    del old["fast_retransmit"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Ticket.load(str(tmp_path / "old.json")).fast_retransmit is None
