"""The differential harness: both implementations of an engine, driven through
the one datagram interface by the same hypothesis-generated sequences, must
send the same datagrams and count the same drops.

An engine with a native core has two implementations: the Python reference
(what the simulator runs, and what serves under ``GRADFABRIC_PURE``) and
the C core. Here each pair is driven, step by step, by sequences of
operations that hypothesis draws (so a failure shrinks to a short sequence):
well-formed traffic from several jobs' workers (windows of sequences, every
slot reuse, retransmissions, duplicates, reordering, priorities that
preempt, shares that overflow into floats) mixed with what a stranger or a
confused token holder sends (random and truncated bytes, forged tokens,
unknown jobs, a sender outside the job, another worker's bit, another job's
slot, results from below, non-finite floats), jobs that resynchronise after
a restart and jobs that leave. The edges are drawn too: fan-in 64, the
largest datagram (16,000 values), sequence numbers at the wire's limit, many
jobs on a pool small enough that they collide.

After every step both must have the same datagrams to send (to the same
job and rank, byte for byte) and name the same missing workers; at the end,
the same counters under the same names, where they were counted, and the
same pool accounting.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradfabric.core.trace import Counters
from gradfabric.net import switchpath
from gradfabric.net.switchpath import HELPERS_NATIVE, NativeSwitchNode
from gradfabric.proto.dlcp import MAX_TENSOR, PROBE, dlcp_control, dlcp_data
from gradfabric.proto.node import LINK_HOLD, NodeConfig, SwitchNode
from gradfabric.proto.routes import atp_index
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.proto.worker import ResumableWorker
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import HEADER_BYTES, MAX_WIRE_VALUES, Flag, Packet, decode, encode
from tests.native import require

require("the switch node", switchpath.PATH, switchpath.WHY_NOT, module=True)

SEQ_LIMIT = 2**32  # the wire's sequence field
# GRADFABRIC_EXAMPLES=5000: a longer search than the default suite's
SETTINGS = settings(max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 300)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


# a job: id, token, workers, slot base, values a packet, first sequence, SA-ATP's help
Job = tuple[int, bytes, int, int, int, int, HelpConfig | None]


def _nonzero(c: object) -> dict[str, int]:
    assert isinstance(c, Counters)
    return {k: v for k, v in c.items() if v}


# -- the switch node ---------------------------------------------------------------


@st.composite
def node_setups(draw: st.DrawFn) -> tuple[NodeConfig, list[Job]]:
    """A node and its jobs: (id, token, workers, slot base, values a packet,
    the sequence the job starts at, SA-ATP's help or None)."""
    scheme = draw(st.sampled_from(["switchml", "atp", "esa", "ps"]))
    ids = draw(st.lists(st.integers(1, 0xFFFF), min_size=1, max_size=4, unique=True))
    job_slots = draw(st.sampled_from([1, 2, 4]))
    slots = max(len(ids) * job_slots, draw(st.sampled_from([4, 8, 16])))
    # ATP's and ESA's PS behind modelled links: 0 (none), or slow enough that
    # what they hold crosses over several steps, or over many
    # (3000 and 16000: nanoseconds per byte with a fraction, halves included, to round)
    links = (draw(st.sampled_from([0.0, 0.0, 1000.0, 100.0, 3000.0, 16000.0]))
             if scheme in ("atp", "esa") else 0.0)  # fmt: skip
    cfg = NodeConfig(scheme=scheme, slots=slots, job_slots=job_slots, values_per_packet=300,
                     ps_link_mbps=links)  # fmt: skip
    jobs = []
    for k, job_id in enumerate(ids):
        workers = draw(st.sampled_from([1, 2, 3, 4, 64]))
        vpp = draw(st.sampled_from([1, 5, 300, MAX_WIRE_VALUES]))
        start = draw(st.sampled_from([0, 0, 1000, SEQ_LIMIT - 64]))
        token = draw(st.binary(min_size=TOKEN_BYTES, max_size=TOKEN_BYTES))
        help = None
        if scheme in ("atp", "esa") and draw(st.booleans()):  # SA-ATP's monitor on the job
            help = HelpConfig(
                helper=draw(st.sampled_from(HELPERS_NATIVE)), lag_packets=draw(st.integers(1, 8)),
                replicas=draw(st.integers(1, 4)), max_requests=draw(st.integers(1, 3)),
                iteration_packets=draw(st.integers(1, 12)),
            )  # fmt: skip
        jobs.append((job_id, token, workers, k * job_slots, vpp, start, help))
    return cfg, jobs


# What a step sends: well-formed shares most of the time, then every kind of
# trouble (see the module doc).
KINDS = ("share", "share", "share", "share", "again", "random", "forged", "truncated", "mutated",
         "unknown", "bit", "slot", "float", "nonfinite", "count", "below", "help", "sender",
         "resync", "leave")  # fmt: skip
steps = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 3),  # which job
        st.integers(0, 63),  # which worker (mod the job's)
        st.integers(0, 24),  # the sequence, past the job's start
        st.sampled_from([0, 0, Flag.NACK, Flag.ECN, Flag.RESEND, Flag.FLOAT | Flag.OVERFLOW]),
        st.integers(0, 3),  # priority (ESA preempts on it)
        st.integers(0, 2**16),  # what the values, the mutation, the junk come from
        st.integers(0, 5_000),  # time that passes
    ),
    min_size=10,
    max_size=300,
)


def _datagram(
    kind: str, job: Job, wid: int, off: int, flags: int, prio: int, seed: int, cfg: NodeConfig,
) -> bytes:  # fmt: skip
    """The bytes a step sends."""
    job_id, token, workers, base, vpp, start, _ = job
    rng = np.random.default_rng(seed)
    wid %= workers
    seq = start + off
    agg = (base + seq % cfg.job_slots) if cfg.scheme == "switchml" else atp_index(job_id, seq,
                                                                                    cfg.slots)
    values: np.ndarray = rng.integers(-(2**30), 2**30, vpp, dtype=np.int32)
    if seed % 5 == 0:  # a wrapped sum at the integer domain's edge (the PS: an overflow)
        values[seed % vpp] = np.iinfo(np.int32).min
    if flags & Flag.FLOAT:
        values = (values / 7.0).astype(np.float32)
    pkt = Packet(job_id, wid, seq, agg, 1 << wid, workers, flags, prio, 0, vpp, values)
    if kind == "unknown":
        pkt.job_id = 0 if job_id != 0 else 1
    elif kind == "bit":  # another worker's bit, or a bitmap of two
        pkt.bitmap = (1 << workers) - 1 if workers > 1 else 2
    elif kind == "slot":
        pkt.agg_index = (agg + 1 + int(rng.integers(cfg.slots))) % (cfg.slots + 2)
    elif kind == "float" and not flags & Flag.FLOAT:
        pkt.flags |= Flag.FLOAT
        pkt.payload = values.astype(np.float32)
    elif kind == "count":
        pkt.count = max(0, vpp - 1)
        pkt.payload = values[: pkt.count]
    elif kind == "below":  # a result forged from below, as a token holder could
        pkt.flags = Flag.ACK | flags & (Flag.FLOAT | Flag.RESEND)
        pkt.bitmap, pkt.fan_in = [((1 << workers) - 1, workers), (1, 1)][seed % 2]
    elif kind == "help":  # SA-ATP's help under another's bit
        pkt.flags |= Flag.HELP
        pkt.bitmap = 1 << int(rng.integers(workers))
    elif kind == "sender":  # a sender past the job, below or past one bitmap word
        below_word = seed % 2 == 0 and workers < 64
        pkt.worker_id = int(rng.integers(workers, 64 if below_word else 1 << 16))
        if seed % 3 == 1:  # as a helper's share under its own bit
            pkt.flags |= Flag.HELP
        elif seed % 3 == 2:  # as a result for one worker (the PS answering a retransmission)
            pkt.flags = Flag.ACK | Flag.RESEND | flags & Flag.FLOAT
            pkt.bitmap = (1 << workers) - 1
    data = token + encode(pkt)
    if kind == "random":
        return rng.bytes(int(rng.integers(0, 80)))
    if kind == "forged":
        return rng.bytes(TOKEN_BYTES) + data[TOKEN_BYTES:]
    if kind == "truncated":
        return data[: int(rng.integers(TOKEN_BYTES + HEADER_BYTES - 4, len(data)))]
    if kind == "mutated":  # a header byte (not the job id's)
        b = bytearray(data)
        at = int(rng.choice([i for i in range(HEADER_BYTES) if i not in (6, 7)]))
        b[TOKEN_BYTES + at] = int(rng.integers(256))
        return bytes(b)
    if kind == "nonfinite":
        b = bytearray(token + encode(Packet(job_id, wid, seq, agg, 1 << wid, workers, Flag.FLOAT,
                                            prio, 0, 1, np.zeros(1, np.float32))))  # fmt: skip
        b[-4:] = np.array([np.inf], np.float32).tobytes()
        return bytes(b)
    return data


def _same_state(ref: SwitchNode, nat: NativeSwitchNode, jobs: list[int], now: int) -> None:
    assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
    for j in jobs:
        assert nat.missing(j) == ref.missing(j)
    assert nat.occupancy() == ref.occupancy()
    assert nat.get_timer() == ref.get_timer()
    if not ref.cfg.ps_link_mbps and ref.cfg.scheme != "dlcp":
        assert ref.get_timer() is None  # no modelled links, no DLCP server: nothing waits


def _fire(ref: SwitchNode, nat: NativeSwitchNode, jobs: list[int], now: int) -> None:
    """What the modelled links have carried by ``now`` goes on, in both."""
    at = ref.get_timer()
    if at is not None and at <= now:
        ref.handle_timer(now)
        nat.handle_timer(now)
        _same_state(ref, nat, jobs, now)


def _same_counters(ref: SwitchNode, nat: NativeSwitchNode) -> None:
    r, n = ref.counter_groups(), nat.counter_groups()
    for group in ("node", "switch"):
        assert _nonzero(n[group]) == _nonzero(r[group]), group
    for group in ("jobs", "servers"):
        rg, ng = r[group], n[group]
        assert isinstance(rg, dict) and isinstance(ng, dict)
        assert {j: _nonzero(c) for j, c in ng.items()} == {j: _nonzero(c) for j, c in rg.items()}
    st_ = ref.switch.policy.stats
    assert nat.pool_stats() == (st_.busy_ns, st_.held_ns, st_.claims)


def _control(
    kind: str, ref: SwitchNode, nat: NativeSwitchNode, job_id: int, live: list[int], floor: int,
    now: int,
) -> None:  # fmt: skip
    """A live job leaves (its counters checked first: they leave with it), or
    resynchronises after a restart, or resumes from ``floor``, in both."""
    if job_id not in live:
        return
    if kind == "leave":
        _same_counters(ref, nat)
        ref.remove_job(job_id)
        nat.remove_job(job_id)
        live.remove(job_id)
    else:
        on = not ref.jobs[job_id].resyncing
        ref.resync(job_id, on, floor)
        nat.resync(job_id, on, floor)
    _same_state(ref, nat, live, now)


def _settle(
    ref: SwitchNode, nat: NativeSwitchNode, live: list[int], now: int, rounds: int | None = None
) -> None:
    """The timers after the last step (at most ``rounds`` of them), then the
    same counters in both, and nothing lost to memory."""
    while (at := ref.get_timer()) is not None and (rounds is None or rounds > 0):
        now = max(now, at)
        _fire(ref, nat, live, now)
        rounds = None if rounds is None else rounds - 1
    _same_counters(ref, nat)
    assert nat.lost_to_memory == 0


@SETTINGS
@given(setup=node_setups(), script=steps)
def test_the_native_switch_node_equals_the_reference(
    setup: tuple[NodeConfig, list[Job]],
    script: list[tuple[str, int, int, int, int, int, int, int]],
) -> None:
    cfg, jobs = setup
    ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)
    try:
        for job_id, token, workers, base, _, _, help in jobs:
            ref.add_job(job_id, token, workers, base, help=help)
            nat.add_job(job_id, token, workers, base, help=help)
        live = [j[0] for j in jobs]
        now, sent = 0, list[bytes]()
        for kind, k, wid, off, flags, prio, seed, dt in script:
            now += dt
            _fire(ref, nat, live, now)
            job = jobs[k % len(jobs)]
            if kind in ("resync", "leave"):  # on resuming, the floor the workers agreed on
                _control(kind, ref, nat, job[0], live, job[5] + off, now)
                continue
            if kind == "again" and sent:
                data = sent[seed % len(sent)]  # a duplicate, a retransmission, a late copy
            else:
                data = _datagram(kind, job, wid, off, flags, prio, seed, cfg)
            sent.append(data)
            ref.receive_datagram(data, now)
            nat.receive_datagram(data, now)
            _same_state(ref, nat, live, now)
        _settle(ref, nat, live, now)  # what the links still hold arrives
    finally:
        nat.close()


@SETTINGS
@given(
    scheme=st.sampled_from(["atp", "esa"]),
    workers=st.integers(2, 6),
    help=st.builds(
        HelpConfig, helper=st.sampled_from(HELPERS_NATIVE), lag_packets=st.integers(1, 6),
        replicas=st.integers(1, 5), max_requests=st.integers(1, 3),
        iteration_packets=st.integers(1, 10),
    ),
    script=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans(), st.integers(0, 3)),
        min_size=5, max_size=200,
    ),
)  # fmt: skip
def test_the_native_straggler_monitor_equals_the_reference(
    scheme: str, workers: int, help: HelpConfig, script: list[tuple[int, int, bool, int]]
) -> None:
    """SA-ATP's monitor where it has work: workers that send their sequences
    in order, some far behind the others (each step: a worker, how many of
    its next sequences it sends, whether instead it helps another worker
    with that one's next, and the time that passes)."""
    cfg = NodeConfig(scheme=scheme, slots=16, job_slots=4, values_per_packet=300)
    token, job_id = WTOKEN, 3
    ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)
    try:
        ref.add_job(job_id, token, workers, 0, help=help)
        nat.add_job(job_id, token, workers, 0, help=help)
        sent, now = [0] * workers, 0
        for who, burst, helps, dt in script:
            now += 1000 * dt
            w = who % workers
            for _ in range(burst):
                owner = (w + 1 + dt) % workers if helps else w  # a helper sends for ``owner``
                seq = sent[owner]
                sent[owner] += 1
                pkt = Packet(job_id, w, seq, atp_index(job_id, seq, cfg.slots), 1 << owner,
                             workers, Flag.HELP if helps else 0, 0, 0, 2,
                             np.full(2, seq, np.int32))  # fmt: skip
                data = token + encode(pkt)
                ref.receive_datagram(data, now)
                nat.receive_datagram(data, now)
                _same_state(ref, nat, [job_id], now)
        _same_counters(ref, nat)
    finally:
        nat.close()


# -- DLCP's server in the switch node ----------------------------------------------


@st.composite
def dlcp_setups(draw: st.DrawFn) -> tuple[NodeConfig, list[tuple[int, int, bool]], list[int]]:
    """A DLCP node, its jobs (id, workers, background) and the tensors'
    lengths by id (a few ids, so that pushes meet, complete and sum)."""
    cfg = NodeConfig(
        scheme="dlcp", values_per_packet=draw(st.sampled_from([1, 3, 8, 9, 256])),
        rto_ns=draw(st.sampled_from([1_000, 5_000, 20_000])),
        push_bound=draw(st.sampled_from([0.0, 0.1, 0.5])),
    )  # fmt: skip
    ids = draw(st.lists(st.integers(1, 0xFFFF), min_size=1, max_size=2, unique=True))
    jobs = [(j, draw(st.sampled_from([1, 2, 3, 4, 64])), k == 1 and draw(st.booleans()))
            for k, j in enumerate(ids)]  # fmt: skip
    lengths = draw(st.lists(st.sampled_from([1, 5, 17, 40, 300]), min_size=4, max_size=4))
    return cfg, jobs, lengths


# What a worker sends DLCP's server: a whole push (some packets lost), one
# packet of it, a probe, an ACK or a range request for the pull, and trouble
DLCP_KINDS = (*["whole"] * 6, "packet", "packet", "probe", "ack", "resend", "resend", "resend",
              "again", "int", "long", "huge", "sender", "malformed", "random", "forged", "resync",
              "leave")  # fmt: skip
dlcp_steps = st.lists(
    st.tuples(
        st.sampled_from(DLCP_KINDS),
        st.integers(0, 1),  # which job
        st.integers(0, 63),  # which worker (mod the job's)
        st.integers(0, 3),  # which tensor
        st.integers(0, 2**16),  # the values, the losses, the junk
        st.integers(0, 8_000),  # time that passes
    ),
    min_size=10,
    max_size=200,
)


def _dlcp_values(job: int, worker: int, tensor: int, length: int) -> np.ndarray:
    """A worker's copy of a tensor, the same whenever it is sent again:
    magnitudes over many decades, and ties (equal packets) on some."""
    rng = np.random.default_rng([job, worker, tensor])
    if (job + tensor) % 3 == 0:
        return np.full(length, 0.5, np.float32)
    return (rng.standard_normal(length) * 10.0 ** rng.integers(-6, 6, length)).astype(np.float32)


def _dlcp_datagrams(
    kind: str, job: tuple[int, int, bool], wid: int, tensor: int, seed: int, length: int,
    cfg: NodeConfig,
) -> list[bytes]:  # fmt: skip
    job_id, workers, _ = job
    rng = np.random.default_rng(seed)
    w, pp = wid % workers, cfg.values_per_packet
    if kind == "long" and seed % 2:  # this worker's copy longer than the others'
        length += 1
    if kind == "huge":  # a copy past what a server takes (announced; a few values sent)
        pkt = dlcp_data(job_id=job_id, sender=w, tensor=tensor, offset=0, length=MAX_TENSOR + 1,
                        priority=0, count=1, values=np.ones(1, np.float32))  # fmt: skip
        return [WTOKEN + encode(pkt)]
    vals = _dlcp_values(job_id, w, tensor, length)
    token = WTOKEN

    def push(lo: int, seq: int = 0, sender: int = w) -> bytes:
        hi = min(length, lo + pp)
        prio = int(rng.integers(0, 0x14))
        pkt = dlcp_data(job_id=job_id, sender=sender, tensor=tensor, offset=lo, length=length,
                        priority=prio, count=hi - lo, values=vals[lo:hi], seq=seq)  # fmt: skip
        return token + encode(pkt)

    starts = list(range(0, length, pp))
    if kind in ("whole", "long"):
        lost = rng.random(len(starts)) < [0.0, 0.05, 0.3][seed % 3]
        order = rng.permutation(len(starts)) if seed % 4 == 0 else range(len(starts))
        return [push(starts[i]) for i in order if not lost[i]]
    if kind == "packet":
        return [push(starts[int(rng.integers(len(starts)))])]
    if kind == "probe":
        return [push(starts[-1], seq=PROBE)]
    if kind == "sender":  # outside the job, below or past one bitmap word
        below_word = seed % 2 == 1 and workers < 64
        return [push(0, sender=int(rng.integers(workers, 64 if below_word else 1 << 16)))]
    if kind == "int":  # int32 values, as a worker that forgot the float flag
        pkt = decode(push(0)[TOKEN_BYTES:])
        pkt.flags, pkt.payload = 0, rng.integers(-(2**31), 2**31, pkt.count, dtype=np.int32)
        return [token + encode(pkt)]
    if kind == "malformed":  # values past the tensor's end
        pkt = decode(push(0)[TOKEN_BYTES:])
        pkt.agg_index = length - pkt.count + 1 + int(rng.integers(3))
        return [token + encode(pkt)]
    if kind in ("ack", "resend"):
        off = int(rng.integers(0, length + 2))
        span = int(rng.integers(0, length + 2)) if kind == "resend" else 0
        flags = Flag.ACK if kind == "ack" else Flag.RESEND
        pkt = dlcp_control(job_id=job_id, sender=w if seed % 7 else 64 + seed % 100, flags=flags,
                           tensor=tensor, about=0, offset=off, span=span)  # fmt: skip
        return [token + encode(pkt)]
    if kind == "forged":
        return [rng.bytes(TOKEN_BYTES) + push(0)[TOKEN_BYTES:]]
    return [rng.bytes(int(rng.integers(0, 80)))]


def _dlcp_server_equals_the_reference(
    setup: tuple[NodeConfig, list[tuple[int, int, bool]], list[int]],
    script: list[tuple[str, int, int, int, int, int]],
) -> None:
    """DLCP's server (pushes within the bound, the float64 sum, the pull in
    priority order, range requests, probes, ACKs and their timers) in both,
    with losses, duplicates, reordering, a worker's copy of another length,
    int payloads, senders outside the job and junk; a background job's
    datagrams are counted only."""
    cfg, jobs, lengths = setup
    ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)
    try:
        for job_id, workers, bg in jobs:
            for n in (ref, nat):
                n.add_job(job_id, WTOKEN, workers, kind="background" if bg else "dlcp")
        live = [j[0] for j in jobs]
        now, sent = 0, list[bytes]()
        for kind, k, wid, tensor, seed, dt in script:
            now += dt
            _fire(ref, nat, live, now)
            job = jobs[k % len(jobs)]
            if kind in ("resync", "leave"):
                _control(kind, ref, nat, job[0], live, 0, now)
                continue
            if kind == "again" and sent:
                batch = [sent[seed % len(sent)]]
            else:
                batch = _dlcp_datagrams(kind, job, wid, tensor, seed, lengths[tensor], cfg)
            for data in batch:
                sent.append(data)
                ref.receive_datagram(data, now)
                nat.receive_datagram(data, now)
                _same_state(ref, nat, live, now)
        _settle(ref, nat, live, now, rounds=40)  # (probes go on until ACKed)
    finally:
        nat.close()


# The default suite searches 100 scripts (its 10 minutes); CI's second pass
# (``-m long``) 600, as GRADFABRIC_EXAMPLES would.
test_the_native_dlcp_server_equals_the_reference = settings(
    SETTINGS, max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 100))
)(given(setup=dlcp_setups(), script=dlcp_steps)(_dlcp_server_equals_the_reference))
test_the_native_dlcp_server_equals_the_reference_searched_longer = pytest.mark.long(settings(
    SETTINGS, max_examples=int(os.environ.get("GRADFABRIC_EXAMPLES", 600))
)(given(setup=dlcp_setups(), script=dlcp_steps)(_dlcp_server_equals_the_reference)))


def test_a_copy_forgotten_and_announced_again_while_its_sum_waits_in_both() -> None:
    """Worker 0's copy of tensor 0 is summed, then forgotten after 4,096
    newer copies finish, then announced again shorter while worker 1's copy
    is still to come: the sum counts what the copies it summed had (the
    receiver's present copy is another), and both send and count alike."""
    cfg = NodeConfig(scheme="dlcp", values_per_packet=4, rto_ns=10**9, push_bound=0.0)
    ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)

    def push(w: int, tensor: int, length: int) -> bytes:
        pkt = dlcp_data(job_id=1, sender=w, tensor=tensor, offset=0, length=length, priority=0,
                        count=length, values=np.full(length, w + 1.5, np.float32))  # fmt: skip
        return WTOKEN + encode(pkt)

    try:
        for n in (ref, nat):
            n.add_job(1, WTOKEN, 2)
        for data in [push(0, 0, 4), *(push(0, t, 1) for t in range(1, 4098)), push(0, 0, 2),
                     push(1, 0, 4)]:  # fmt: skip
            ref.receive_datagram(data, 0)
            nat.receive_datagram(data, 0)
            _same_state(ref, nat, [1], 0)
        server = ref.counter_groups()["servers"][1]  # type: ignore[index]
        assert server["sums"] == 1 and server["drop_mismatch"] == 1
        _settle(ref, nat, [1], 0, rounds=0)
    finally:
        nat.close()


def test_the_modelled_links_hold_a_bounded_flood_and_count_the_rest_in_both() -> None:
    """A token holder's retransmissions, each of which ATP sends on to its PS
    over a slow modelled link: the links hold ``LINK_HOLD`` packets, every
    one after that is a counted drop (``drop_link_full``), the same in both
    implementations; once the time comes, what they held arrives."""
    cfg = NodeConfig(scheme="atp", slots=16, job_slots=4, values_per_packet=300,
                     ps_link_mbps=1.0)  # fmt: skip
    ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)
    try:
        for n in (ref, nat):
            n.add_job(3, WTOKEN, 2, 0)
        extra = 100
        for seq in range(LINK_HOLD + extra):
            pkt = Packet(3, 0, seq, atp_index(3, seq, cfg.slots), 1, 2, Flag.RESEND, 0, 0, 1,
                         np.ones(1, np.int32))  # fmt: skip
            ref.receive_datagram(WTOKEN + encode(pkt), 0)
            nat.receive_datagram(WTOKEN + encode(pkt), 0)
        _same_counters(ref, nat)
        assert nat.counter_groups()["node"]["drop_link_full"] == extra  # type: ignore[index]
        at = ref.get_timer()
        assert at is not None and nat.get_timer() == at
        _fire(ref, nat, [3], at)
    finally:
        nat.close()


def test_a_complete_aggregate_goes_again_once_a_round_of_resends_in_both() -> None:
    """Every worker's share completes an aggregate, then two rounds and more
    of resends (round robin, and one worker alone) reach it: both send it
    again with the first resend of each round of ``n`` and their PS counts
    the same copies (the old rule, a copy with each resend, shows in the PS's
    ``drop_late_partial`` once the slow links have carried them)."""
    for scheme in ("atp", "esa"):
        for n in (1, 2, 3, 64):
            for round_robin in (True, False):
                cfg = NodeConfig(scheme=scheme, slots=16, job_slots=4, values_per_packet=300,
                                 ps_link_mbps=1.0)  # fmt: skip
                ref, nat = SwitchNode(cfg), NativeSwitchNode(cfg)
                try:
                    for x in (ref, nat):
                        x.add_job(3, WTOKEN, n, 0)
                    idx, now = atp_index(3, 0, cfg.slots), 0
                    sends = [(w, 0) for w in range(n)]
                    sends += [(r % n if round_robin else 0, Flag.RESEND) for r in range(2 * n + 3)]
                    for w, flag in sends:
                        pkt = Packet(3, w, 0, idx, 1 << w, n, flag, 0, 0, 1,
                                     np.array([w + 1], np.int32))  # fmt: skip
                        now += 1
                        for x in (ref, nat):
                            x.receive_datagram(WTOKEN + encode(pkt), now)
                        assert nat.datagrams_to_send(now) == ref.datagrams_to_send(now)
                    while (at := ref.get_timer()) is not None:
                        now = max(now, at)
                        _fire(ref, nat, [3], now)
                    _same_counters(ref, nat)
                    late = ref.counter_groups()["servers"][3].get("drop_late_partial", 0)  # type: ignore[index]
                    # a copy per round of n (with n = 1 each copy is one worker's
                    # share, answered as a resend): every copy after the first
                    # result is a late partial
                    assert late == (-(-(2 * n + 3) // n) if n > 1 else 0)
                finally:
                    nat.close()


# -- the worker node ---------------------------------------------------------------

WTOKEN = bytes.fromhex("0123456789abcdef")
WJOB = 7


@st.composite
def worker_setups(draw: st.DrawFn) -> dict[str, object]:
    """A worker's job: its scheme's route, window, packet size, repair knobs,
    pace; the fused quantiser or the integer path."""
    return {
        "policy": draw(st.sampled_from(["switchml", "atp", "esa", "ps"])),
        "workers": draw(st.sampled_from([2, 3, 64])),
        "window": draw(st.integers(1, 8)),
        "vpp": draw(st.sampled_from([1, 3, 300, MAX_WIRE_VALUES])),
        "fast": draw(st.sampled_from([0, 0, 2, 3])),
        "nack": draw(st.booleans()),
        "retries": draw(st.integers(1, 6)),
        "pace_gbps": draw(st.sampled_from([0.0, 0.0, 1.0, 10.0])),
        "fused": draw(st.booleans()),
        "priority": draw(st.integers(0, 3)),
        "first_seq": draw(st.sampled_from([0, 0, SEQ_LIMIT - 300])),
    }


def _worker_engine(setup: dict[str, object]) -> ResumableWorker:
    workers = int(setup["workers"])  # type: ignore[call-overload]
    names = tuple(f"w{r}" for r in range(workers))
    p = Placement(
        WJOB, names, {"sw": names}, servers=("sw",), window=int(setup["window"]),  # type: ignore[call-overload]
        pool_slots=64, slot_base=5, rto_ns=10_000, max_retries=int(setup["retries"]),  # type: ignore[call-overload]
        values_per_packet=int(setup["vpp"]), resumable=True,  # type: ignore[call-overload]
        fast_retransmit=int(setup["fast"]), nack=bool(setup["nack"]), takes_help=False,  # type: ignore[call-overload]
        first_seq=int(setup["first_seq"]),  # type: ignore[call-overload]
    )  # fmt: skip
    e = SCHEMES.get(str(setup["policy"])).worker(p, 1)
    assert isinstance(e, ResumableWorker)
    return e


ANSWERS = ("result", "result", "result", "ecn", "again", "float", "short", "foreign", "notice",
           "forged", "malformed", "time", "time", "time", "replay", "push")  # fmt: skip
worker_steps = st.lists(
    st.tuples(st.sampled_from(ANSWERS), st.integers(0, 2**16), st.integers(0, 30_000)),
    min_size=5, max_size=250,
)  # fmt: skip


def _result(seq: int, count: int, workers: int, flags: int, seed: int) -> Packet:
    values: np.ndarray = np.random.default_rng(seed).integers(-(2**20), 2**20, count, np.int32)
    if flags & Flag.FLOAT:
        values = values.astype(np.float32)
    return Packet(WJOB, 0, seq, 0, (1 << workers) - 1, workers, Flag.ACK | flags, 0, 0, count,
                  values)  # fmt: skip


@SETTINGS
@given(setup=worker_setups(), script=worker_steps)
def test_the_native_worker_node_equals_the_reference(
    setup: dict[str, object], script: list[tuple[str, int, int]]
) -> None:
    from gradfabric.net import datapath
    from gradfabric.net.datapath import NativeWorkerNode
    from gradfabric.proto.worker_node import Fused, WorkerNode
    from gradfabric.wire import fastquant

    require("the worker node", datapath.PATH, datapath.WHY_NOT)
    pace, prio = float(setup["pace_gbps"]), int(setup["priority"])  # type: ignore[arg-type,call-overload]
    ref_engine = _worker_engine(setup)
    ref = WorkerNode(ref_engine, WTOKEN, prio, pace)
    nat = NativeWorkerNode(_worker_engine(setup), WTOKEN, prio, pace)
    vpp, workers = int(setup["vpp"]), int(setup["workers"])  # type: ignore[call-overload]
    sent: list[tuple[int, int]] = []  # (seq, count) of what was sent
    now, calls = 0, 0
    arrays: list[tuple[np.ndarray, ...]] = []

    def push(seed: int) -> None:
        nonlocal calls
        n = int(np.random.default_rng(seed).integers(1, 6 * vpp + 2))
        x = np.random.default_rng(seed + 1).standard_normal(n).astype(np.float32)
        blocks = -(-n // vpp)
        scale = np.full(blocks, 2.0**20)
        for node in (ref, nat):
            q = np.random.default_rng(seed).integers(-(2**20), 2**20, n, np.int32)
            out = np.zeros(n, np.int64)
            fused = None
            if bool(setup["fused"]) and fastquant.functions() is not None:
                fused = Fused(x, scale, scale, np.zeros(n, np.float32))
            node.push(q, out, now, fused)
            arrays.append((q, out) + (() if fused is None else (fused.out,)))
        calls += 1

    def compare() -> None:
        a, b = ref.datagrams_to_send(now), nat.datagrams_to_send(now)
        assert b == a
        for d in a:
            pkt = decode(d[TOKEN_BYTES:])
            sent.append((pkt.seq, pkt.count))
        assert nat.get_timer() == ref.get_timer()
        assert (nat.base, nat.next_seq, nat.done, nat.quiet) == (ref.base, ref.next_seq,
                                                                 ref.done, ref.quiet)  # fmt: skip
        assert str(nat.error) == str(ref.error)
        assert (nat.failed is None) == (ref.failed is None)
        assert nat.read_wait_ns(now) == ref.read_wait_ns(now)
        for r, n_ in zip(arrays[-2], arrays[-1], strict=True):
            assert np.array_equal(r, n_)

    try:
        push(1)
        compare()
        for kind, seed, dt in script:
            now += dt
            if ref.failed is not None:
                break
            if kind == "time":
                ref.handle_timer(now)
                nat.handle_timer(now)
            elif kind == "replay":
                floor = ref.base - seed % (3 * int(setup["window"]) + 1)  # type: ignore[call-overload]
                ref.replay(floor, now)
                nat.replay(floor, now)
            elif kind == "push":
                if ref.done:
                    push(seed)
            else:
                data = _worker_datagram(kind, seed, sent, workers)
                if data is None:
                    continue
                ref.receive_datagram(data, now)
                nat.receive_datagram(data, now)
            compare()
        nat.fold()
        assert _nonzero(nat.counters) == _nonzero(ref.counters)
    finally:
        nat.close()


def _worker_datagram(
    kind: str, seed: int, sent: list[tuple[int, int]], workers: int
) -> bytes | None:
    """What the switch (or a stranger) sends the worker in a step."""
    if not sent:
        return None
    seq, count = sent[seed % len(sent)]
    flags = {"ecn": Flag.ECN, "float": Flag.FLOAT}.get(kind, 0)
    pkt = _result(seq, count - (kind == "short" and count > 0), workers, flags, seed)
    if kind == "foreign":
        pkt.job_id = WJOB + 1
    if kind == "notice":  # a loss notice for this worker's share
        pkt = Packet(WJOB, 1, seq, 0, 1 << 1, workers, Flag.NACK, 0, 0, 0,
                     np.zeros(0, np.int32))  # fmt: skip
    data = WTOKEN + encode(pkt)
    if kind == "forged":
        return bytes(8) + data[TOKEN_BYTES:]
    if kind == "malformed":
        return data[: TOKEN_BYTES + HEADER_BYTES - 1 - seed % 5]
    return data
