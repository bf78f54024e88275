"""DLCP's bounded-loss transport: never completes beyond its bound, exact
when reliable, indifferent to arrival order."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.proto.actions import Deliver, Send
from gradfabric.proto.dlcp import (
    DlcpReceiver,
    DlcpSender,
    DlcpServer,
    classify,
    dlcp_data,
    drop_policy,
    packet_norms,
)
from gradfabric.sim.dlcp import VARIANTS, DlcpConfig, run_dlcp
from gradfabric.wire.packet import Packet, decode, encode, traffic_class


def _transfer(
    values: np.ndarray, bound: float, loss: float, dup: float, seed: int, per_packet: int
) -> tuple[np.ndarray, float, int]:
    """Send one tensor over a lossy, duplicating, reordering channel (data,
    requests and ACKs alike) until the receiver delivers it; returns (result,
    lost fraction, timer rounds)."""
    rng = random.Random(seed)
    rx = DlcpReceiver("ps", 1, 0, ["w0"], rto_ns=1000)
    tx = DlcpSender("w0", 1, 0, "ps", per_packet, rto_ns=1000)
    nodes = {"ps": rx, "w0": tx}
    rx.expect(0, 7, len(values), bound, 0)
    wire = [a for a in tx.send(7, len(values), 0, 1, values) if isinstance(a, Send)]
    now, rounds, delivered = 0, 0, []
    while True:
        rng.shuffle(wire)  # any order
        out = []
        for a in wire:
            for _ in range(2 if rng.random() < dup else 1):
                if rng.random() >= loss:
                    out += nodes[a.dst].on_packet(a.pkt.clone(), now)
        delivered += [d for d in out if isinstance(d, Deliver)]
        wire = [a for a in out if isinstance(a, Send)]
        if not wire:
            if delivered and not tx.tensors:  # delivered and the sender knows it
                assert len(delivered) == 1
                d = delivered[0]
                return np.asarray(d.pkt.payload), rx.lost_fraction(0, 7), rounds
            deadlines = [x for x in (rx.next_deadline(), tx.next_deadline()) if x is not None]
            now = max(now, min(deadlines))
            rounds += 1
            # a livelock guard: at 50% loss of data, requests and ACKs alike a
            # reliable 22-packet transfer took 455 timer rounds (n=1345, seed 34549)
            assert rounds < 2000, "the transfer never completed"
            for eng in (rx, tx):
                if eng.next_deadline() is not None and eng.next_deadline() <= now:
                    wire += [a for a in eng.on_timer(now) if isinstance(a, Send)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    bound=st.sampled_from([0.0, 0.01, 0.1, 0.3]),
    loss=st.floats(0.0, 0.5),
    dup=st.floats(0.0, 0.2),
    seed=st.integers(0, 2**31),
    per_packet=st.sampled_from([1, 7, 64, 256]),
)
def test_bounded_loss_and_exact_when_reliable(
    n: int, bound: float, loss: float, dup: float, seed: int, per_packet: int
) -> None:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32) + 3.0
    got, lost, _ = _transfer(values, bound, loss, dup, seed, per_packet)
    assert lost <= bound + 1e-12  # never completes with more than p lost
    arrived = got != 0  # (no true zeros: every value is near 3)
    assert np.array_equal(got[arrived], values[arrived])  # what arrived is exact
    assert lost == 1 - arrived.mean()
    if bound == 0:
        assert np.array_equal(got, values)  # reliable mode: exact


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**31), keep=st.floats(0.5, 1.0))
def test_any_arrival_order_gives_the_same_result(n: int, seed: int, keep: float) -> None:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    tx = DlcpSender("w0", 1, 0, "ps", 32)
    pkts = [a.pkt for a in tx.send(3, n, 0, 1, values) if isinstance(a, Send)]
    rng = random.Random(seed)
    subset = [p for p in pkts if rng.random() < keep] or pkts[:1]
    # the bound that the whole subset, and nothing less, meets
    bound = 1 - sum(p.count for p in subset) / n
    results = []
    for _ in range(3):
        rx = DlcpReceiver("ps", 1, 0, ["w0"])
        rx.expect(0, 3, n, bound, 0)
        order = list(subset)
        rng.shuffle(order)
        acts = [a for p in order for a in rx.on_packet(p.clone(), 0)]
        (done,) = [a for a in acts if isinstance(a, Deliver)]
        results.append(done.pkt.payload)
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_policies_drop_what_they_say() -> None:
    norms = np.array([5.0, 1.0, 3.0, 0.5, 4.0, 2.0, 6.0, 0.1, 7.0, 8.0])
    rng = np.random.default_rng(0)
    assert sorted(drop_policy("magnitude", norms, 0.3, rng).tolist()) == [1, 3, 7]
    assert sorted(drop_policy("largest", norms, 0.3, rng).tolist()) == [6, 8, 9]
    r = drop_policy("random", norms, 0.3, rng)
    assert len(set(r.tolist())) == 3
    assert len(drop_policy("magnitude", norms, 0.05, rng)) == 0


def test_priority_classes_protect_large_and_front() -> None:
    norms = packet_norms(np.arange(16, dtype=np.float32), 4)  # increasing norms
    front, back = classify(norms, 0, 4), classify(norms, 3, 4)
    # queue in the high nibble (front layers 0), drop precedence in the low (largest 0)
    assert front.tolist() == [3, 2, 1, 0] and back.tolist() == [19, 18, 17, 16]


def test_packets_and_requests_are_valid_wire_packets() -> None:
    tx = DlcpSender("w0", 1, 0, "ps", 8)
    (first, *_) = tx.send(2, 20, 0, 1, np.ones(20, dtype=np.float32))
    assert isinstance(first, Send)
    assert decode(encode(first.pkt)).priority == first.pkt.priority
    rx = DlcpReceiver("ps", 1, 0, ["w0"], rto_ns=10)
    rx.expect(0, 2, 20, 0.0, 0)
    rx.on_packet(decode(encode(first.pkt)), 0)  # the tensor has started; then silence
    (req,) = rx.on_timer(10)
    assert isinstance(req, Send)
    wire = req.pkt.clone()
    wire.payload = np.zeros(0, dtype=np.int32)
    back = decode(encode(wire))
    assert (back.agg_index, back.bitmap) == (8, 12)  # "send me values 8..19"


@pytest.mark.parametrize(
    "base",
    [
        DlcpConfig(tensors=(8_192,) * 4, iterations=2, load=0.8),
        # a ring hop of 32 packets can spare one at 2 * 0.2 / 7 of them
        DlcpConfig(collective="allreduce", tensors=(65_536,), iterations=2, load=0.8,
                   push_bound=0.2),
    ],
    ids=["ps", "allreduce"],
)  # fmt: skip
def test_simulated_job_is_exact_or_within_its_bound(base: DlcpConfig) -> None:
    """The whole PS or ring job on a congested leaf-spine: reliable loses
    nothing, DLCP loses at most its bound (for the ring: of the workers'
    contributions to the sum)."""
    rel = run_dlcp(replace(base, **VARIANTS["reliable"]))
    dl = run_dlcp(base)
    assert rel.lost == 0 and rel.queue_drops > 0  # congested, yet exact
    assert 0 < dl.lost <= base.push_bound


def test_simulated_ring_meets_the_analytic_ring_time() -> None:
    """An idle fabric: one tensor's ring all-reduce takes 2 (n - 1) chunk
    transfers in sequence, each at least the chunk's wire time at 10 Gbit/s
    and at most that plus the first packet's store-and-forward and propagation
    over 4 hops (the cross-rack path)."""
    n, values = 8, 65_536
    cfg = DlcpConfig(collective="allreduce", tensors=(values,), iterations=2, load=0.0,
                     compute_ms=0.5, **VARIANTS["reliable"])  # fmt: skip
    r = run_dlcp(cfg)
    chunk = values // n
    wire_ns = (chunk * 4 + chunk // 256 * 32) * 8 / 10
    hop_ns = 500 + (256 * 4 + 32) * 8 / 10
    lo = 2 * (n - 1) * wire_ns / 1e6
    assert lo <= r.mean_comm_ms <= lo + 2 * (n - 1) * 4 * hop_ns / 1e6


def test_convergence_study_learns_but_never_beats_the_bayes_rate() -> None:
    """One lossless epoch on the teacher task: the student learns (well above
    the 10% of chance) and stays below the best accuracy any model can
    reach on it (the teacher's own, known in closed form), up to the
    binomial spread of 20,000 test examples."""
    from gradfabric.experiments.dlcp_convergence import ConvergenceConfig, train

    cfg = replace(ConvergenceConfig(), epochs=1)
    run = train(cfg, "none", 0.0, 0)
    bayes = cfg.task.bayes_accuracy
    spread = 3 * (bayes * (1 - bayes) / cfg.task.test) ** 0.5
    assert 0.5 < run.accuracy <= bayes + spread
    assert run.curve and run.steps_to(0.0) == cfg.eval_every


def test_convergence_rows_are_the_same_serially_and_in_a_pool() -> None:
    """The study's seeded runs are independent cells: two processes give the
    rows one process gives, field for field."""
    from gradfabric.experiments.dlcp_convergence import ConvergenceConfig, run_convergence
    from gradfabric.workloads.teacher import TeacherTask

    task = TeacherTask(train=4096, test=1024)
    cfg = ConvergenceConfig(policies=("magnitude", "random"), bounds=(0.3,), seeds=(0, 1),
                            epochs=1, eval_every=4, task=task)  # fmt: skip
    serial = run_convergence(cfg)
    assert run_convergence(cfg, where=2) == serial
    assert [(r["policy"], r["loss_bound"]) for r in serial] == [
        ("lossless", 0.0), ("magnitude", 0.3), ("random", 0.3)]  # fmt: skip
    assert serial[0]["delta_pp"] == 0.0 and all(r["seeds"] == 2 for r in serial)


@given(st.integers(0, 2**31 - 1), st.floats(0.05, 0.5))
@settings(max_examples=40, deadline=None)
def test_values_left_out_of_a_completed_tensor_are_counted_by_precedence(
    seed: int, bound: float
) -> None:
    """Packets that arrive after a tensor completed at its bound count once,
    by their drop precedence, as the loss the bound applied: equal to the
    values missing at completion, split as the packets' classes say."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(int(rng.integers(256, 4096))).astype(np.float32)
    rx = DlcpReceiver("ps", 1, 0, ["w0"], rto_ns=1000)
    tx = DlcpSender("w0", 1, 0, "ps", 64, rto_ns=1000)
    rx.expect(0, 7, len(values), bound, 0)
    sends = [a for a in tx.send(7, len(values), 0, 1, values) if isinstance(a, Send)]
    want = [0] * 4
    done = False
    for a in sends:  # in the sender's order: most important first
        if done:  # late: its values were never summed
            want[a.pkt.priority & 0xF] += a.pkt.count
        out = rx.on_packet(a.pkt.clone(), 0)
        done = done or any(isinstance(x, Deliver) for x in out)
    for a in sends[-3:]:  # duplicates: counted once, or not at all if summed
        rx.on_packet(a.pkt.clone(), 0)
    got = [rx.counters.get(f"late_values_p{d}", 0) for d in range(4)]
    assert sum(got) == len(values) - rx.tensors[(0, 7)].received
    assert got == want


def test_a_foreign_packet_leaves_the_servers_results_as_they_were() -> None:
    """Another job's push, or one from no worker of this job, arriving first
    about a tensor, changes nothing the server sends (its result's class
    among them: the server took it from the first push it saw)."""
    def sent(first: list[Packet]) -> list[tuple[str, int, int]]:
        srv = DlcpServer("ps", 1, ["a", "b"], push_bound=0.0, per_packet=8)
        out = []
        for pkt in [*first, *(push(1, w, 0) for w in (0, 1))]:
            out += [(a.dst, a.pkt.priority, a.pkt.count) for a in srv.on_packet(pkt, 0)
                    if isinstance(a, Send) and a.pkt.count]  # fmt: skip
        return out

    def push(job: int, sender: int, queue: int) -> Packet:
        return dlcp_data(job_id=job, sender=sender, tensor=5, offset=0, length=8,
                         priority=traffic_class(queue, 0), count=8,
                         values=np.ones(8, np.float32))  # fmt: skip

    alone = sent([])
    assert alone and {p >> 4 for _, p, _ in alone} == {0}  # the front half's class
    assert sent([push(2, 0, 1)]) == alone  # another job's
    assert sent([push(1, 7, 1)]) == alone  # no such worker


def test_a_server_takes_no_tensor_past_its_bound_and_counts_it() -> None:
    """An announcement of more values than the server takes holds nothing
    and is counted (``drop_too_long``); one at the bound is taken and sums."""

    def push(sender: int, length: int) -> Packet:
        return dlcp_data(job_id=1, sender=sender, tensor=3, offset=0, length=length, priority=0,
                         count=2, values=np.full(2, sender + 1, np.float32))  # fmt: skip

    srv = DlcpServer("ps", 1, ["a", "b"], push_bound=0.9, per_packet=8, max_values=20)
    assert srv.on_packet(push(0, 21), 0) == []
    assert srv.counters["drop_too_long"] == 1 and not srv.rx.tensors
    out = srv.on_packet(push(0, 20), 0) + srv.on_packet(push(1, 20), 0)
    pulls = [a.pkt for a in out if isinstance(a, Send) and a.pkt.count and a.dst == "a"]
    assert sum(p.count for p in pulls) == 20
    first = next(p for p in pulls if p.agg_index == 0)
    assert first.payload is not None and list(first.payload[:2]) == [3.0, 3.0]


def test_a_server_in_the_leaf_has_no_incast_at_its_port() -> None:
    """An idle fabric, reliable PS, sprayed: behind a host link of its own the server
    takes every worker's push through that one link (and sends every pull
    out of it), so a round grows with the workers; in the leaf its port
    takes them all at once, and a round stays near two wire times (each
    worker's push up its link, then the sum down it), whatever the count."""
    v = 65_536
    wire_ms = (v * 4 + v // 256 * 32) * 8 / 10 / 1e6  # one copy on a 10 Gbit/s link

    def comm(server: str, n: int) -> float:
        cfg = DlcpConfig(workers=n, tensors=(v,), iterations=2, load=0.0, compute_ms=0.5,
                         server=server, **VARIANTS["reliable+spray"])  # fmt: skip
        return run_dlcp(cfg).mean_comm_ms

    host4, host8, leaf4, leaf8 = comm("host", 4), comm("host", 8), comm("leaf", 4), comm("leaf", 8)
    assert host4 >= 4 * wire_ms and host8 >= 8 * wire_ms  # n pushes through one link
    assert 2 * wire_ms <= leaf4 < host4 and 2 * wire_ms <= leaf8 < host8 / 2
    assert abs(leaf8 - leaf4) <= 0.1 * leaf4


@pytest.mark.parametrize("per_queue", [False, True])
def test_a_port_s_queues_share_one_buffer_or_hold_one_each(per_queue: bool) -> None:
    """Queue 1 (other traffic) offered twice the buffer: a shared buffer
    fills, and then a top-queue packet of the largest gradients (precedence
    0, dropped only at a full buffer) is lost too; with a buffer per queue
    it is kept, and queue 1 loses the same packets either way. Strict
    priority serves it first."""
    from gradfabric.core.trace import Counters
    from gradfabric.proto.qos import PortQueues
    from gradfabric.wire.packet import traffic_class

    buffer, size = 10_000, 1_000
    port: PortQueues[str] = PortQueues(buffer, Counters(), per_queue=per_queue)
    kept = [port.offer(f"bg{i}", size, traffic_class(1, 0), 0.5) for i in range(20)]
    assert kept == [True] * 10 + [False] * 10  # precedence 0: tail drop at the buffer
    top = port.offer("top", size, traffic_class(0, 0), 0.5)
    assert top is per_queue
    assert port.take() == (("top", size) if per_queue else ("bg0", size))
    assert port.backlog == 10 * size + (size if per_queue else 0) - size
