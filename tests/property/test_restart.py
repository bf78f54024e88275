"""A switch that restarts empty mid-collective, driven without any I/O.

The job's engines exchange packets through an in-memory network that loses,
duplicates and reorders them. At a random moment the switch (and its PS)
are replaced by fresh engines and every packet in flight is lost (those
towards the switch died with it; the emulator's workers take new sockets,
so the old switch's late results cannot reach them), and the workers
resynchronise as the daemon makes them (``runtime.control``): the floor is the
smallest ``base`` at that moment, and each worker replays from it at its own
later moment, taking the new switch's results meanwhile. Every worker must
end with the int64 sum.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradfabric.proto.actions import Deliver, Fail, Multicast, Send
from gradfabric.proto.interface import Engine
from gradfabric.proto.schemes import SCHEMES, InaConfig, Placement
from gradfabric.proto.worker import ResumableWorker, WorkerEngine
from gradfabric.runtime.client import fast_retransmit
from gradfabric.wire.packet import Packet

VPP = 16


def _job(
    scheme: str, workers: int, window: int, repair: bool
) -> tuple[Placement, dict[str, Engine]]:
    """``repair``: the emulator's workers' (fast retransmit, loss notices where
    the switch sends them, and with them the timer's lowest-first rule)."""
    names = tuple(f"w{r}" for r in range(workers))
    s = SCHEMES.get(scheme)
    p = Placement(
        1, names, {"sw": names}, servers=("ps",), window=window, pool_slots=4 * window,
        rto_ns=50_000, values_per_packet=VPP, max_retries=2_000, resumable=True,
        fast_retransmit=fast_retransmit(s.sends_notices, window) if repair else 0, nack=repair,
    )  # fmt: skip
    return p, s.engines(p, InaConfig(values_per_packet=VPP))


def _run(
    scheme: str, workers: int, window: int, repair: bool, n: int, loss: float, dup: float,
    restart_at: int, seed: int,
) -> tuple[list[np.ndarray], np.ndarray, int]:  # fmt: skip
    rng = random.Random(seed)
    p, engines = _job(scheme, workers, window, repair)
    xs = [np.random.default_rng((seed, r)).integers(-1000, 1000, n, dtype=np.int32)
          for r in range(workers)]  # fmt: skip
    outs = [np.zeros(n, dtype=np.int64) for _ in range(workers)]
    wire: list[tuple[str, Packet]] = []
    now = 0
    replay_at: dict[str, int] = {}  # worker -> event at which it replays
    floor = 0
    events = 0

    def run(src: str, actions: list) -> None:  # type: ignore[type-arg]
        for a in actions:
            if isinstance(a, Send):
                wire.append((a.dst, a.pkt))
            elif isinstance(a, Multicast):
                wire.extend((d, a.pkt.clone()) for d in a.dsts)
            elif isinstance(a, Deliver):
                r = p.workers.index(src)
                lo = a.seq * VPP
                outs[r][lo : lo + a.pkt.count] = a.pkt.payload
            elif isinstance(a, Fail):
                raise AssertionError(f"{src} gave up: {a}")

    for r, w in enumerate(p.workers):
        eng = engines[w]
        assert isinstance(eng, ResumableWorker)
        run(w, eng.push(n, now, xs[r]))
    workers_ = [engines[w] for w in p.workers]
    # until every result is in and no worker sends anything any more
    while replay_at or any(not w.idle or w.out for w in workers_ if isinstance(w, WorkerEngine)):
        events += 1
        now += 1_000
        if events == restart_at:  # the switch dies; a fresh one (and PS) comes up
            fresh = _job(scheme, workers, window, repair)[1]
            for name in fresh:
                if name not in p.workers:
                    engines[name] = fresh[name]
            wire = []
            floor = min(w.base for w in workers_ if isinstance(w, WorkerEngine))
            replay_at = {w: events + rng.randrange(1, 50) for w in p.workers}
        for w, at in list(replay_at.items()):
            if at == events:
                eng = engines[w]
                assert isinstance(eng, ResumableWorker)
                run(w, eng.replay(floor, now))
                del replay_at[w]
        if wire and rng.random() < 0.9:
            dst, pkt = wire.pop(rng.randrange(len(wire)))  # any order
            if rng.random() < loss:
                continue
            if rng.random() < dup:
                wire.append((dst, pkt.clone()))
            run(dst, engines[dst].on_packet(pkt, now))
        else:  # time passes: due retransmissions
            for w in p.workers:
                eng = engines[w]
                d = eng.next_deadline()
                if d is not None and d <= now:
                    run(w, eng.on_timer(now))
        assert events < 2_000_000, "no progress"
    ref = np.sum([x.astype(np.int64) for x in xs], axis=0)
    return outs, ref, events


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(["switchml", "atp", "esa"]),
    workers=st.integers(2, 4),
    window=st.integers(1, 8),
    repair=st.booleans(),
    packets=st.integers(1, 40),
    loss=st.floats(0.0, 0.2),
    dup=st.floats(0.0, 0.1),
    restart_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_restart_anywhere_then_replay_from_the_floor_is_exact(
    scheme: str, workers: int, window: int, repair: bool, packets: int, loss: float,
    dup: float, restart_frac: float, seed: int,
) -> None:  # fmt: skip
    n = packets * VPP - seed % VPP
    # how long an undisturbed run takes, to place the restart inside it
    _, _, span = _run(scheme, workers, window, repair, n, loss, dup, -1, seed)
    at = int(restart_frac * span) + 1
    outs, ref, _ = _run(scheme, workers, window, repair, n, loss, dup, at, seed)
    for o in outs:
        np.testing.assert_array_equal(o, ref)
