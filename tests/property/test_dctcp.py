"""The DCTCP-like reliable baseline: exact under loss, duplication and
reordering; its window reacts to ECN; on a real incast it keeps its queues
below the buffer that a window-less sender overflows."""

from __future__ import annotations

import heapq
import random
from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.proto.actions import Deliver, Send
from gradfabric.proto.dctcp import INITIAL_WINDOW, DctcpReceiver, DctcpSender
from gradfabric.sim.dlcp import VARIANTS, DlcpConfig, run_dlcp
from gradfabric.wire.packet import Flag


def _transfer(
    values: np.ndarray, loss: float, dup: float, seed: int, per_packet: int,
    ecn: float = 0.0, jitter: int = 300,
) -> tuple[np.ndarray, DctcpSender]:  # fmt: skip
    """One tensor over a channel that loses, duplicates, reorders (a random
    delay of 100 to 100 + ``jitter`` ns per packet, data and ACKs alike) and
    ECN-marks data packets; an event loop with the engines' timers. Returns
    the delivered tensor and the sender."""
    rng = random.Random(seed)
    rx = DctcpReceiver("ps", 1, 0, ["w0"], rto_ns=2_000)
    tx = DctcpSender("w0", 1, 0, "ps", per_packet, rto_ns=2_000)
    nodes = {"ps": rx, "w0": tx}
    rx.expect(0, 7, len(values), 0.0, 0)
    heap: list[tuple[int, int, Send]] = []
    order = 0
    delivered: list[Deliver] = []

    def emit(actions: list, now: int) -> None:
        nonlocal order
        for a in actions:
            if isinstance(a, Deliver):
                delivered.append(a)
                continue
            for _ in range(2 if rng.random() < dup else 1):
                if rng.random() < loss:
                    continue
                pkt = a.pkt.clone()
                if pkt.count and rng.random() < ecn:
                    pkt.flags |= Flag.ECN
                order += 1
                at = now + 100 + rng.randrange(jitter + 1)
                heapq.heappush(heap, (at, order, Send(a.dst, pkt)))

    emit(tx.send(7, len(values), 0, 1, values), 0)
    now = 0
    for _ in range(200_000):  # a livelock guard
        if not tx.tensors and delivered:
            break
        deadline = tx.next_deadline()
        if heap and (deadline is None or heap[0][0] <= deadline):
            now, _, s = heapq.heappop(heap)
            emit(nodes[s.dst].on_packet(s.pkt, now), now)
        else:
            assert deadline is not None, "nothing in flight and nothing pending"
            now = deadline
            emit(tx.on_timer(now), now)
    else:
        raise AssertionError("the transfer never completed")
    (d,) = delivered
    return np.asarray(d.pkt.payload), tx


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    loss=st.floats(0.0, 0.4),
    dup=st.floats(0.0, 0.2),
    seed=st.integers(0, 2**31),
    per_packet=st.sampled_from([1, 7, 64, 256]),
)
def test_exact_under_loss_duplication_and_reordering(
    n: int, loss: float, dup: float, seed: int, per_packet: int
) -> None:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    got, tx = _transfer(values, loss, dup, seed, per_packet)
    assert np.array_equal(got, values)
    assert not tx.flight and not tx.unacked  # the sender knows it is done


def test_window_grows_without_marks_and_shrinks_with_them() -> None:
    """Slow start grows the window by one per ACK on a clean path; a path
    that marks every packet drives DCTCP's alpha towards 1 and the window to
    its floor."""
    values = np.ones(64 * 200, dtype=np.float32)
    _, clean = _transfer(values, 0.0, 0.0, 1, 64, jitter=0)
    _, marked = _transfer(values, 0.0, 0.0, 1, 64, ecn=1.0, jitter=0)
    # 200 packets ACKed, each adding one packet to the window in slow start
    assert clean.cwnd == INITIAL_WINDOW + 200 and clean.counters["ecn_cuts"] == 0
    assert marked.alpha > 0.5 and marked.cwnd < 3 and marked.counters["ecn_cuts"] > 5


def test_incast_stays_below_the_buffer_with_ecn_and_overflows_without() -> None:
    """8 workers push to one PS over an idle leaf-spine: with switches marking
    at DCTCP's threshold the windows hold the PS port's queue below its
    buffer (no drop); with marking off the same senders only learn from loss
    and overflow it. Both deliver every value, and neither beats the wire
    time of the bytes into the PS's link."""
    base = replace(DlcpConfig(tensors=(16_384,) * 8, iterations=1, load=0.0), **VARIANTS["dctcp"])
    ecn, blind = run_dlcp(base), run_dlcp(replace(base, ecn_bytes=0))
    assert ecn.queue_drops == 0 and blind.queue_drops > 0
    assert ecn.lost == 0 and blind.lost == 0
    pushed = 8 * 16_384 * 8 * (4 + 32 / 256)  # bytes into the PS's link, headers included
    floor_ms = pushed * 8 / 10e9 * 1e3
    assert ecn.iteration_ms - base.compute_ms > floor_ms
