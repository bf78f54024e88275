"""Event loop and link model against hand-computed timings."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.proto.actions import Action, NoTimers
from gradfabric.proto.schemes import SCHEMES, InaConfig
from gradfabric.sim.collective import Bucket, FabricConfig
from gradfabric.sim.loop import EventLoop
from gradfabric.sim.multijob import JobSpec, TenancyConfig, run_tenancy
from gradfabric.sim.network import FIFO_BACKLOG_BYTES, TIMER_SLACK_NS, LinkSpec, Network
from gradfabric.wire.packet import HEADER_BYTES, Flag, Packet, traffic_class


def test_ties_break_by_insertion_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    for name in "abc":
        loop.at(5, seen.append, name)
    loop.at(1, seen.append, "first")
    loop.run()
    assert seen == ["first", "a", "b", "c"] and loop.now == 5 and loop.events == 4
    with pytest.raises(ValueError):
        loop.at(4, seen.append, "past")


class _Sink(NoTimers):
    name = "sink"

    def __init__(self) -> None:
        from gradfabric.core.trace import Counters

        self.counters = Counters()
        self.got: list[tuple[int, Packet]] = []
        self.loop: EventLoop | None = None

    def on_packet(self, pkt: Packet, now_ns: int) -> list[Action]:
        self.got.append((now_ns, pkt))
        return []


def _pair(spec: LinkSpec, priority: bool = False) -> tuple[Network, _Sink, object]:
    net = Network(EventLoop(), random.Random(0), values_per_packet=256, priority=priority)
    link, _ = net.connect("a", "b", spec, spec)
    sink = _Sink()
    net.bind("b", sink)
    return net, sink, link


def test_link_serialisation_and_propagation_exact() -> None:
    # 100 Gbit/s: a 256-value packet is 32 + 1024 = 1056 B = 84.48 ns on the wire.
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=1000, queue_bytes=0))
    for s in range(3):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    net.loop.run()
    # finishes at 84.48, 168.96, 253.44 ns -> rounded up to whole ns, plus 1000
    assert [t for t, _ in sink.got] == [1085, 1169, 1254]


def _serialised_ns(k: int) -> int:
    """When packet ``k`` of a back-to-back burst of 256-value packets has left
    a 100 Gbit/s link (84.48 ns each), rounded up to whole ns."""
    return -(-(k + 1) * 8448 // 100)


def test_a_backlog_s_packets_in_flight_wait_off_the_heap_and_land_in_order() -> None:
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=1000, queue_bytes=0))
    for s in range(1000):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    # the first 61 went out behind a backlog under FIFO_BACKLOG_BYTES (one
    # entry each); the other 939 wait behind one entry for the FIFO's head
    assert net.loop.pending == FIFO_BACKLOG_BYTES // (HEADER_BYTES + 1024) + 2 == 62
    net.loop.run()
    assert [(t, p.seq) for t, p in sink.got] == [(_serialised_ns(k) + 1000, k)
                                                 for k in range(1000)]  # fmt: skip
    assert net.loop.events == 1000 and not link.flight  # type: ignore[attr-defined]


def test_packets_that_overtake_the_wire_land_in_time_then_send_order() -> None:
    # up to 5 us of jitter over 84 ns a packet: most packets overtake others.
    # Reference: each packet's arrival from the same draws (one per send, in
    # send order), sorted by (time, send order) as a heap of them all would be.
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=1000, queue_bytes=0,
                                     jitter_ns=5000))  # fmt: skip
    for s in range(300):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    net.loop.run()
    draws = random.Random(0)
    want = sorted((_serialised_ns(k) + 1000 + draws.randrange(5001), k) for k in range(300))
    assert [(t, p.seq) for t, p in sink.got] == want


def test_a_paced_worker_sends_a_resend_ahead_of_the_data_it_holds() -> None:
    # 100 Gbit/s, 84.48 ns a packet: seqs 0-2 queue back to back; a resend of
    # seq 1 at t=0 leaves at once (done at 84.48 ns, as seq 0), and seq 3,
    # new, queues behind all four, the fifth on the wire: done at 422.4 ns
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=1000, queue_bytes=0))
    link.resends_first = True  # type: ignore[attr-defined]
    for s in (0, 1, 2, 1, 3):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    net.loop.run()
    assert [(t, p.seq) for t, p in sink.got] == [(1085, 0), (1085, 1), (1169, 1), (1254, 2),
                                                 (1423, 3)]  # fmt: skip
    # without the pacer the resend waits its turn
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=1000, queue_bytes=0))
    for s in (0, 1, 2, 1, 3):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    net.loop.run()
    assert [p.seq for _, p in sink.got] == [0, 1, 2, 1, 3]


def test_tail_drop_and_ecn_marking() -> None:
    size = HEADER_BYTES + 1024
    net, sink, link = _pair(
        LinkSpec(link_gbps=10, prop_delay_ns=0, queue_bytes=3 * size, ecn_bytes=size)
    )
    for s in range(6):
        link.send("b", Packet(1, 0, s, count=256))  # type: ignore[attr-defined]
    net.loop.run()
    # backlog before each send: 0, 1, 2, 3(full) ... packets
    assert [p.seq for _, p in sink.got] == [0, 1, 2]
    assert [bool(p.flags & Flag.ECN) for _, p in sink.got] == [False, False, True]
    assert net.counters["queue_drop"] == 3


def test_priority_port_serves_queues_in_strict_priority_back_to_back() -> None:
    # 100 Gbit/s, 1056 B packets: 84.48 ns each, back to back in picoseconds.
    net, sink, link = _pair(LinkSpec(link_gbps=100, prop_delay_ns=0, queue_bytes=100_000), True)
    order = [(0, 1), (1, 1), (2, 0), (3, 1), (4, 0), (5, 3)]  # (seq, queue)
    for s, q in order:  # 0 starts at once; the rest wait and leave by queue, FIFO within
        link.send("b", Packet(1, 0, s, count=256, priority=traffic_class(q, 0)))  # type: ignore[attr-defined]
    net.loop.run()
    assert [p.seq for _, p in sink.got] == [0, 2, 4, 1, 3, 5]
    assert [t for t, _ in sink.got] == [-(-k * 8448 // 100) for k in range(1, 7)]


def test_priority_port_drops_by_precedence_under_congestion() -> None:
    """A backlog of 5/8 of the buffer (not counting the packet in service):
    precedence 3 (WRED from 1/2 to 5/8) is all dropped, precedence 0 (tail
    drop at the full buffer) only once the buffer is full."""
    q = 1056 * 64
    net, sink, link = _pair(LinkSpec(link_gbps=1, prop_delay_ns=0, queue_bytes=q), True)
    for s in range(41):  # one in service, a backlog of 40 packets = 5/8 of the buffer
        link.send("b", Packet(1, 0, s, count=256, priority=traffic_class(0, 0)))  # type: ignore[attr-defined]
    for s in range(100, 110):
        link.send("b", Packet(1, 0, s, count=256, priority=traffic_class(0, 3)))  # type: ignore[attr-defined]
    for s in range(200, 224):  # precedence 0 fills the buffer to exactly 64 packets
        link.send("b", Packet(1, 0, s, count=256, priority=traffic_class(0, 0)))  # type: ignore[attr-defined]
    link.send("b", Packet(1, 0, 999, count=256, priority=traffic_class(0, 0)))  # type: ignore[attr-defined]
    net.loop.run()
    seqs = [p.seq for _, p in sink.got]
    assert seqs == [*range(41), *range(200, 224)]
    assert net.counters["queue_drop_precedence3"] == 10
    assert net.counters["queue_drop_precedence0"] == 1


def test_link_spec_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="loss"):
        LinkSpec(loss=1.5)
    with pytest.raises(ConfigError, match="link_gbps"):
        LinkSpec(link_gbps=0)


def _lockstep(slack: int) -> TenancyConfig:
    """Two ATP jobs' rack where retries in lockstep lose every time (below)."""
    return TenancyConfig(
        scheme="atp", racks=2, hosts=8, pool_slots=4096, seed=0, models=("resnet50",),
        workers_choices=(4,), ps_shards=1, ina=InaConfig(train_packets=64),
        fabric=FabricConfig(topology="leaf_spine", link=LinkSpec(queue_bytes=200_000),
                            timer_slack_ns=slack),
    )  # fmt: skip


_TWO_JOBS = [JobSpec(1, 0, "resnet50", 4, 1), JobSpec(2, 0, "resnet50", 4, 1)]


def test_workers_that_lose_trains_together_do_not_retry_in_lockstep_forever() -> None:
    """Two ATP jobs of 4 workers in one rack, queues of 200 KB, 64-packet
    trains: a collision in the rack's pool sends a sequence's four 64 KB
    trains to the job's PS at once, and its port takes two. With timers on
    time the same two workers lose every retry until they give up, naming
    their switch; with a host's timer slack (``TIMER_SLACK_NS``) the retries
    spread and both jobs finish."""
    with pytest.raises(PeerTimeoutError, match="leaf0"):
        run_tenancy(_lockstep(0), _TWO_JOBS)
    done = run_tenancy(_lockstep(TIMER_SLACK_NS), _TWO_JOBS).counters  # (unfinished: raises)
    assert done["ps_collision"] > 0 and done["ps_resend"] > 0  # the PS took retries


def test_a_trace_whose_workers_give_up_is_a_row_of_the_scale_study() -> None:
    """``esa-scale``'s cell keeps a trace that ended in a worker giving up
    (the lockstep rack above) as a row naming the switch, which the study
    leaves out of its pairs and states beside its claims."""
    from gradfabric.experiments.esa_scale import failures, run_cell

    cfg = _lockstep(0)
    cell = replace(cfg, jobs=2, workers_choices=(4,), iterations_range=(1, 1), load=50.0)
    row = run_cell(cell)
    assert "leaf0" in row["failed"] and "avg_jct_s" not in row
    assert gc.isenabled()  # (the loop's exit by the error restored it)
    ok = {**row, "seed": 1}
    del ok["failed"]
    assert failures([row, ok]) == ["ATP at pool 4096: a worker gave up in 1 of 2 traces (seeds 0)"]


def test_the_scale_study_pairs_only_the_seeds_both_schemes_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EsaScale.run`` on rows where ATP gave up at one pool: that pool
    pairs nothing (a gap in the plots), the claims come from the other and
    name the failure; where no pool pairs a seed, both claims are unmet and
    say why, not a crash."""
    from gradfabric.experiments import esa_scale

    def row(scheme: str, pool: int, seed: int, jct: float | None) -> dict[str, object]:
        key = {"scheme": scheme, "pool_slots": pool, "load": 0.9, "jitter_us": 500.0,
               "seed": seed, "racks": 2}  # fmt: skip
        if jct is None:
            return {**key, "failed": "peer leaf1 did not answer within 0.101 s"}
        return {**key, "avg_jct_s": jct, "p99_jct_s": 2 * jct}

    grid = esa_scale.EsaScaleGrid(racks=2, workers=(64,), pool_slots=(256, 1024), seeds=(0, 1))
    study = esa_scale.EsaScale("t", "t", grid, grid)
    rows = [row("atp", 256, 0, None), row("esa", 256, 0, 0.1), row("atp", 256, 1, None),
            row("esa", 256, 1, 0.1), row("atp", 1024, 0, 0.2), row("esa", 1024, 0, 0.1),
            row("atp", 1024, 1, None), row("esa", 1024, 1, 0.1)]  # fmt: skip
    monkeypatch.setattr(esa_scale, "run_grid", lambda *_: rows)
    res = study.run(False, tmp_path, lambda *_: None)
    paper, goal = res.claims
    assert paper.speedup == 2.0 and "1 seeded traces" in paper.note
    assert "ATP at pool 256: a worker gave up in 2 of 2 traces (seeds 0, 1)" in paper.note
    assert "ATP at pool 1024: a worker gave up in 1 of 2 traces (seeds 1)" in goal.note
    assert all((tmp_path / p).exists() for p in res.plots)
    monkeypatch.setattr(esa_scale, "run_grid", lambda *_: rows[:4])
    paper, goal = study.run(False, tmp_path, lambda *_: None).claims
    assert paper.ours == goal.ours == "-" and paper.met is goal.met is False
    assert "2 of 2 traces" in paper.note


def test_esa_at_scale_pairs_atp_and_esa_by_seed_on_a_small_leaf_spine() -> None:
    """``esa-scale``'s grid, shrunk to two racks of four: every cell runs, the
    comparison pairs each seed's ATP and ESA traces, and the claim reads
    ATP's average JCT over ESA's."""
    from gradfabric.experiments.esa import compare
    from gradfabric.experiments.esa_scale import EsaScaleGrid, claims, run_grid

    grid = EsaScaleGrid(racks=2, hosts=4, workers=(2, 6), jobs=3, iterations=(1, 1),
                        pool_slots=(256,), seeds=(0, 1), train=64)  # fmt: skip
    rows = run_grid(grid, lambda *_: None)
    assert sorted((r["scheme"], r["seed"]) for r in rows) == [
        ("atp", 0), ("atp", 1), ("esa", 0), ("esa", 1)]  # fmt: skip
    assert all(r["jobs"] == 3 and r["largest_job"] == 6 for r in rows)  # one spans both racks
    (cmp,) = compare(rows)
    by = {(r["scheme"], r["seed"]): r["avg_jct_s"] for r in rows}
    gains = [by["atp", s] / by["esa", s] for s in (0, 1)]
    assert cmp["seeds"] == 2 and cmp["improvement"] == pytest.approx(sum(gains) / 2)
    paper, goal = claims(grid, [cmp])  # (one pool: best and worst alike)
    assert paper.speedup == goal.speedup == cmp["improvement"]
    assert paper.paper == "1.35x" and goal.kind == "goal" and not paper.headline



def _garbage_made_by(run: Callable[[], object]) -> int:
    """Objects the collector finds unreachable after ``run()``, the setup's
    garbage collected first and the run's network still referenced by the
    caller: cycles its events made. ``DEBUG_SAVEALL`` keeps what any pass
    finds, so an automatic pass between the loop's return and ours cannot
    hide them."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        assert gc.isenabled()  # the caller's setting, restored
        gc.collect()
        return len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_the_cycle_check_finds_a_cycle_an_event_makes() -> None:
    loop = EventLoop()
    for t in range(5):
        loop.at(t, lambda _: (x := []).append(x))
    assert _garbage_made_by(loop.run) == 5


@pytest.mark.parametrize("scheme", SCHEMES.names())
def test_events_make_no_reference_cycles_so_the_collector_can_stay_off(scheme: str) -> None:
    """``EventLoop.run`` turns the cyclic collector off (its passes walk the
    event heap and every engine); that is safe only while events make no
    reference cycles. Each scheme runs an all-reduce over lossy, duplicating,
    jittered links where it tolerates them (so retries, duplicates and
    timers run); DLCP its PS and its ring (``sim.dlcp``); ATP two jobs on a
    leaf-spine, once finishing and once giving up (the error's exit); ESA's
    tenancy two jobs that contend for an 8-slot pool; SA-ATP a training step
    with a straggler that gets help."""
    from gradfabric.sim.collective import CollectiveRun, _starter
    from gradfabric.sim.dlcp import COLLECTIVES, DlcpConfig
    from gradfabric.sim.multijob import _Tenancy
    from gradfabric.sim.stragglers import StragglerConfig
    from gradfabric.sim.training import TrainingConfig, _Trainer

    if scheme == "dlcp":
        # (each twice: the first run in a process has ``inspect`` parse a
        # compiled function's signature once, which leaves cycles behind)
        made = {}
        for coll in [*COLLECTIVES] * 2:  # (the second round's counts stay)
            job = COLLECTIVES[coll](DlcpConfig(collective=coll, workers=4, iterations=1,
                                               tensors=(20_000,) * 2, load=0.5))  # fmt: skip
            made[coll] = _garbage_made_by(job.result)
        assert made == {"ps": 0, "allreduce": 0}
        return
    lossless = SCHEMES.get(scheme).lossless
    link = LinkSpec(link_gbps=10, prop_delay_ns=2000, loss=0.0 if lossless else 0.02,
                    dup=0.0 if lossless else 0.02, jitter_ns=0 if lossless else 500)  # fmt: skip
    fabric = FabricConfig(link=link)
    ina = InaConfig(train_packets=1 if scheme == "omnireduce" else 4)
    run = CollectiveRun(scheme, 4, [Bucket(0, 80_000)], fabric, ina, seed=1, values=True,
                        density=0.1 if scheme == "omnireduce" else 1.0)  # fmt: skip
    start = run.build()
    for w in range(4):
        run.loop.at(0, _starter(start, w, 0))
    assert _garbage_made_by(run.loop.run) == 0 and run.finished == 4
    if scheme == "atp":
        done = _Tenancy(_lockstep(TIMER_SLACK_NS), _TWO_JOBS, False)
        assert _garbage_made_by(done.loop.run) == 0 and done.finished == 2

        lost = _Tenancy(_lockstep(0), _TWO_JOBS, False)

        def gives_up() -> None:
            with pytest.raises(PeerTimeoutError):
                lost.loop.run()

        assert _garbage_made_by(gives_up) == 0
    if scheme == "esa":
        cfg = TenancyConfig(scheme="esa", hosts=4, pool_slots=8, models=("mlp",),
                            workers_choices=(4,), fabric=fabric, ina=ina)  # fmt: skip
        ten = _Tenancy(cfg, [JobSpec(1, 0, "mlp", 4, 1), JobSpec(2, 0, "mlp", 4, 1)],
                       False)  # fmt: skip
        assert _garbage_made_by(ten.loop.run) == 0 and ten.finished == 2
    if scheme == "saatp":
        st = StragglerConfig(model="fixed", workers=(1,), slowdown=4.0)
        tr = _Trainer(TrainingConfig(scheme="saatp", model="mlp", workers=4, iterations=1,
                                     batch=16384, stragglers=st, load_gbps=10_000.0,
                                     fabric=fabric, ina=ina), False)  # fmt: skip
        for w in range(4):
            tr.begin(w, 0)
        assert _garbage_made_by(tr.run.loop.run) == 0 and tr.run.finished == 4
        assert tr.helps_started > 0


def test_a_tenancy_s_workers_repair_split_sequences_as_the_clients_do() -> None:
    """Two ATP jobs whose windows overfill the pool: a collision splits a
    sequence (some shares in a partial aggregate, the others at the PS),
    which only a worker's resend flushes. With the clients' fast retransmit
    (``runtime.ticket``) a worker resends once 3 later results are back;
    without, it waits out its timeout, so each split costs a job 20 ms more.
    The tenancy's workers take ``InaConfig.fast_retransmit`` as a single
    job's do (``TIMEOUTS``: the clients' fast retransmit off)."""
    from gradfabric.experiments import esa_train
    from gradfabric.lab.esa_train import TIMEOUTS, EsaTrainConfig

    cfg = EsaTrainConfig(jobs=2, pool_slots=40, steps=(40,), mean_gap_s=0.0, jitter_ms=5.0,
                         link_gbps=1.0, seed=3)  # fmt: skip
    fast = esa_train.simulated(cfg, "atp")["mean_jct_s"]
    slow = esa_train.simulated(cfg, TIMEOUTS)["mean_jct_s"]
    assert fast < 0.9 * slow  # (measured: 0.44 against 0.60 s)


def test_the_prediction_sweep_finds_esa_no_gain_in_an_ample_pool_and_one_in_a_scarce() -> None:
    """``experiments.esa_train.predicted_gain``, the sweep that picks the
    study's scarce pool: where every window fits (4096 aggregators) nothing
    collides and preemption has nothing to act on, so ESA ties ATP; where
    two jobs' windows overfill one window's pool and workers are out of
    lockstep, ESA's preemption must pay."""
    from dataclasses import replace
    from statistics import fmean

    from gradfabric.experiments import esa_train
    from gradfabric.lab.esa_train import EsaTrainConfig

    cfg = EsaTrainConfig(jobs=2, steps=(40,), mean_gap_s=0.0, jitter_ms=5.0, link_gbps=1.0,
                         seed=4)  # fmt: skip
    ample, scarce = esa_train.predicted_gain(cfg, [4096, 32], seeds=2)
    assert [r["pool_slots"] for r in (ample, scarce)] == [4096, 32]
    assert ample["per_trace"] == pytest.approx([1.0, 1.0], abs=0.01)
    assert min(scarce["per_trace"]) > 1.02
    assert scarce["predicted_speedup"] == pytest.approx(fmean(scarce["per_trace"]))
    # the second trace is the config's seed + 1, at the hybrid level
    second = replace(cfg, pool_slots=32, seed=5)
    atp, esa = (esa_train.simulated(second, p, 0.0, "hybrid")["mean_jct_s"] for p in ("atp", "esa"))
    assert scarce["per_trace"][1] == pytest.approx(atp / esa)
