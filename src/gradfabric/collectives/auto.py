"""``auto_hook``: per bucket, the path that is fastest on this job's own measurements.

(No ``from __future__ import annotations`` here: DDP inspects the hook's
``bucket`` annotation at runtime and wants the class itself.)

Theory of operation. A bucket can be averaged three ways: the dense ring
all-reduce (``dense``), the sparse exchange of non-zero blocks (``gather`` or
``sharded``, ``collectives.sparse``), or, where the job has a switch, in-network
aggregation (``ina``, ``runtime.hook``). Which is fastest depends on the bucket's
block density and on the machine: on a 1 Gbit/s link the bytes decide; on a
100 Gbit/s link or a busy host the sparse path's per-block host work and
every path's fixed cost per call can decide instead. So each path's time is
modelled as ``fixed_s + bytes / bytes_per_s`` on the busiest link, fitted
online to the last ``window`` calls that took the path, and each bucket takes
the path the model predicts fastest.

Every rank must take the same path. A call therefore starts by gathering,
with the occupancy bitmaps the sparse path needs anyway, each rank's time for
the previous call (8 more bytes per rank, no extra round trip); every rank
feeds the model the same figure (the least of the ranks' times: the rank that
arrived last waited for nobody, so its time is the collective's own), and the
same model and the same bitmaps give the same choice everywhere.

A ``sparse=True`` table's gradient (a COO tensor, a bucket of its own) is
averaged by its rows instead (``collectives.coo``), a step's tables
together: each by the all-gather of every rank's rows, the reduce-scatter by
row owner, or the dense ring, priced by its bytes on the busiest link (from
the ranks' row counts, which every rank gathers) and its hops (at the
latency of one, measured by that count round). So a model keeps PyTorch's
sparse gradients and optimizers (SGD, Adagrad, SparseAdam) and moves its
tables in one or a few rounds, where gloo's sparse all-reduce takes three
per table.

A path without measurements is predicted from one that has them by bytes
alone; a path that looks within ``explore_ratio`` of the best is tried every
``explore_every`` scans of a bucket, so a wrong first guess is corrected. A
bucket that went dense runs dense for its next calls without the scan (an
asynchronous all-reduce started on the autograd thread, like DDP's own hook;
how many: ``skip.DenseSkip``), then is scanned again: densities drift
during training.
"""

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradfabric.collectives import coo
from gradfabric.collectives.paths import AUTO, COO, DENSE, GATHER, INA, ROWS, SHARDED, SPARSE
from gradfabric.collectives.rows import RowState, rows_hook
from gradfabric.collectives.skip import DenseSkip
from gradfabric.collectives.sparse import (
    DENSE_MARGIN,
    STATS_LOCK,
    Plan,
    as_blocks,
    occupancy,
    pack,
    ring_bytes,
    run_planned,
    unpack,
)
from gradfabric.net.peers import keep_alive, name_the_missing
from gradfabric.runtime.hook import switch_sum
from gradfabric.runtime.session import Session

# every non-empty set of a table's paths, in ``COO`` order (ties: the first)
_SUBSETS = [tuple(p for k, p in enumerate(COO) if m >> k & 1) for m in range(1, 2 ** len(COO))]


@dataclass
class PathCost:
    """``seconds = fixed_s + bytes / bytes_per_s`` over a path's recent calls."""

    window: int = 32
    calls: deque[tuple[float, float]] = field(default_factory=deque)  # (bytes, seconds)
    _fitted: tuple[float, float] | None = None  # kept until the next call is added

    def add(self, nbytes: float, seconds: float) -> None:
        self.calls.append((nbytes, seconds))
        while len(self.calls) > self.window:
            self.calls.popleft()
        self._fitted = None

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, s_per_byte) by least squares, or None before any call.
        With one size seen (or a line that would go negative), the line
        through the origin at the median seconds per byte."""
        if not self.calls:
            return None
        if self._fitted is None:
            self._fitted = _line(list(self.calls))
        return self._fitted

    def predict(self, nbytes: float) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + nbytes * f[1]


def _line(calls: list[tuple[float, float]]) -> tuple[float, float]:
    # (closed form in plain Python: this runs on the hook's thread every scan,
    # beside the training loop's own Python, and a few dozen points need no LAPACK)
    b = [x for x, _ in calls]
    if len(calls) >= 3 and max(b) > 1.5 * min(b):
        n = len(calls)
        mb, mt = math.fsum(b) / n, math.fsum(t for _, t in calls) / n
        cov = math.fsum((x - mb) * (t - mt) for x, t in calls)
        slope = cov / math.fsum((x - mb) ** 2 for x in b)
        fixed = mt - slope * mb
        if slope > 0 and fixed >= 0:
            return fixed, slope
    return 0.0, statistics.median(t / max(x, 1.0) for x, t in calls)


@dataclass
class BucketLog:
    """What one bucket did: calls per path, bytes and seconds against dense."""

    paths: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_dense: int = 0
    seconds: float = 0.0  # measured, scanned calls
    seconds_dense: float = 0.0  # the dense model's prediction for the same calls


def by_bytes(link: dict[str, int]) -> str:
    """A scan's path by the bytes on the busiest link alone (what ``auto_hook``
    takes before anything is measured): sparse within its usual margin of
    dense, else in-network where offered, else dense."""
    if link[SPARSE] <= DENSE_MARGIN * link[DENSE]:
        return SPARSE
    return INA if INA in link else DENSE


@dataclass
class AutoState(DenseSkip):
    """Picklable state of ``auto_hook`` (without its thread and switch client).

    ``switch``: a ``runtime`` client of the job (``InaClient.join()``) to offer
    the ``ina`` path; None: dense and sparse only. ``rows``: a
    ``RowState.track(model)`` of the model, to take a bucket that holds
    embedding tables by the rows its batch looked up (``collectives.rows``:
    no scan of the tables, any optimizer); its buckets of other parameters,
    and tables found used outside their lookups, take the paths above.
    ``threshold``: values of at most this magnitude count as zero (0: exact)."""

    block_size: int = 256
    threshold: float = 0.0
    explore_every: int = 8
    explore_ratio: float = 2.0
    window: int = 32
    switch: Session | None = None
    rows: RowState | None = None  # ``RowState.track(model)``: tables by their looked-up rows
    costs: dict[str, PathCost] = field(default_factory=dict)
    buckets: dict[int, BucketLog] = field(default_factory=dict)
    scans: dict[int, int] = field(default_factory=dict)
    # the last scan: (path, its link bytes, this rank's seconds, bucket, dense ring bytes)
    last: tuple[str, float, float, int, int] | None = None
    # ``sparse=True`` tables (``_coo_part``): their buckets once known, while
    # learning them this step's and the last step's, those of this step so
    # far, and each one's last union
    coo_tables: list[int] = field(default_factory=list)
    coo_keys: list[int] = field(default_factory=list)
    coo_last_step: list[int] = field(default_factory=list)
    coo_pending: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)
    unions: dict[int, int] = field(default_factory=dict)
    # each path's bytes over all calls (and the chosen paths', ``chosen``)
    coo_bytes: dict[str, int] = field(default_factory=dict)
    hop_s: deque[float] = field(default_factory=lambda: deque(maxlen=32))  # one hop's latency
    counts_s: float = 0.0  # this rank's last counts round
    coo_next: list[str] = field(default_factory=list)  # the next step's paths, as last chosen
    coo_cap: int = 0  # ``coo.gather_in_one``'s bound for the next step (0: none yet)
    coo_one_round: int = 0  # steps whose tables went in one round
    coo_calls: int = 0  # exchanges so far (alike on every rank: a dead peer's roll call)
    peer_timeout_s: float = 10.0  # a peer that fails a table's exchange is named after this

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.threshold < 0 or self.dense_skip < 0:
            raise ValueError("block_size must be >= 1, threshold >= 0, dense_skip >= 0")
        if self.explore_every < 1 or self.explore_ratio < 1 or self.window < 1:
            raise ValueError("explore_every >= 1, explore_ratio >= 1 and window >= 1 are needed")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["switch"] = None  # a socket and a loop: this process's only
        return state

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per bucket: calls per path, the bytes it sent against the dense
        ring's, and the seconds its measured calls took against what the dense
        model predicts they would have (positive ``saved_s``: faster)."""
        self.fold()
        with STATS_LOCK:
            return {
                k: {
                    "paths": dict(b.paths),
                    "bytes_sent": b.bytes_sent,
                    "bytes_dense": b.bytes_dense,
                    "saved_bytes": b.bytes_dense - b.bytes_sent,
                    "saved_s": b.seconds_dense - b.seconds,
                }
                for k, b in sorted(self.buckets.items())
            }

    def skipped(self, key: int, calls: int, ring: int) -> None:
        self._log(key, DENSE, ring, ring, calls)

    def _log(self, key: int, path: str, sent: int, dense: int, calls: int = 1) -> BucketLog:
        with STATS_LOCK:
            log = self.buckets.setdefault(key, BucketLog())
            log.paths[path] = log.paths.get(path, 0) + calls
            log.bytes_sent += sent
            log.bytes_dense += dense
            return log

    def _cost(self, path: str) -> PathCost:
        return self.costs.setdefault(path, PathCost(self.window))

    def _choose(self, key: int, link: dict[str, int]) -> str:
        """The path for this scan of bucket ``key``, from the shared model and
        the busiest-link bytes of each candidate path (``link``)."""
        scan = self.scans[key] = self.scans.get(key, 0) + 1
        guesses = {p: self._cost(p).predict(b) for p, b in link.items()}
        known = [(link[p], t) for p, t in guesses.items() if t is not None]
        if not known:
            return by_bytes(link)
        # unmeasured paths: the measured ones' seconds per byte (bytes alone)
        rate = min(t / max(b, 1) for b, t in known)
        pred = {p: t if t is not None else link[p] * rate for p, t in guesses.items()}
        ranked = sorted(pred, key=lambda p: (pred[p], AUTO.index(p)))
        if len(ranked) > 1 and scan % self.explore_every == 0:
            second = ranked[1]
            if pred[second] <= self.explore_ratio * pred[ranked[0]]:
                return second
        return ranked[0]

    def _coo_paths(self, links: list[dict[str, int]], world: int) -> list[str]:
        """A step's tables' paths, chosen together: the paths used cost their
        hops (``coo.hops``; tables on one path share its collectives) plus the
        counts round unless every table is all-gathered (then the counts ride
        with the rows: ``coo.gather_in_one``), at the latency of one hop,
        measured by the counts round (the least over ranks: the last to arrive
        waits for nobody); the bytes cost the dense ring's fitted seconds per
        byte. Each set of paths is tried, every table taking its fewest bytes
        within it: the optimum over all assignments. Before both rates are
        measured, each table's fewest bytes."""
        fit = self._cost(DENSE).fit()
        if fit is None or not self.hop_s:
            return [min(COO, key=link.__getitem__) for link in links]
        hop, per_byte = statistics.median(self.hop_s), fit[1]
        best: tuple[float, list[str]] | None = None
        for used in _SUBSETS:
            paths = [min(used, key=link.__getitem__) for link in links]
            rounds = sum(coo.hops(p, world) for p in used) + (used != (GATHER,))
            moved = sum(link[p] for link, p in zip(links, paths, strict=True))
            cost = rounds * hop + moved * per_byte
            if best is None or cost < best[0]:
                best = (cost, paths)
        assert best is not None
        return best[1]

    def _learn(self, times: torch.Tensor) -> None:
        """Feed the previous scan's time (the least over ranks) to its path."""
        if self.last is None:
            return
        path, nbytes, _, key, dense_bytes = self.last
        seconds = float(times.min())
        self._cost(path).add(nbytes, seconds)
        dense = self._cost(DENSE).predict(dense_bytes)
        with STATS_LOCK:
            log = self.buckets[key]
            log.seconds += seconds
            log.seconds_dense += seconds if dense is None else dense
        self.last = None


def _run(state: AutoState, buf: torch.Tensor, key: int, group: Any) -> torch.Tensor:
    """One scanned call, on the state's thread: gather bitmaps and the last
    call's times, learn, choose, run, time it."""
    t0 = time.perf_counter()
    state.fold()  # the calls the compiled hook ran since, into the log
    world = dist.get_world_size(group)
    flat = buf.view(-1)
    blocks, nb = as_blocks(flat, state.block_size)
    mask = occupancy(blocks, state.threshold)
    last = state.last[2] if state.last is not None else 0.0
    # built on the bucket's device (nccl moves device tensors): one copy to the
    # host per scanned call, the gathered bitmaps, where the plan is made
    times = torch.tensor([last], dtype=torch.float64, device=buf.device).view(torch.uint8)
    mine = torch.cat([pack(mask), times])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu()
    state._learn(rows[:, -8:].contiguous().view(torch.float64).flatten())
    plan = Plan.of(unpack(rows[:, :-8].contiguous(), nb))
    block_bytes = state.block_size * flat.element_size()
    sharded = torch.stack(plan.link_vectors()).max() * block_bytes
    gather = torch.stack(plan.gather_vectors()).max() * block_bytes
    dense = ring_bytes(flat, world)
    link = {DENSE: dense, SPARSE: int(min(sharded, gather))}
    if state.switch is not None:  # each worker sends and receives the whole bucket once
        link[INA] = flat.numel() * 4
    path = state._choose(key, link)
    if path == INA:
        assert state.switch is not None  # only offered with a switch
        switch_sum(state.switch, flat, group)
        sent = link[INA]
    elif path == SPARSE:
        sent = run_planned(blocks, plan, GATHER if gather <= sharded else SHARDED,
                           group, state.threshold)  # fmt: skip
        if blocks.data_ptr() != flat.data_ptr():
            flat.copy_(blocks.reshape(-1)[: flat.numel()])
    else:
        dist.all_reduce(flat, group=group)
        sent = dense
    state.scanned(key, dense=path == DENSE)
    flat.div_(world)
    state._log(key, path, sent, dense)
    state.last = (path, float(link[path]), time.perf_counter() - t0, key, dense)
    return buf


def _coo_part(
    state: AutoState, key: int, grad: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """A ``sparse=True`` table's bucket. Until the tables' buckets are known,
    each goes alone; then the step's tables wait for the last of them and go
    together: one round of counts and one collective per path for all of
    them. DDP calls a step's buckets in rising index order, the same on every
    rank, and renumbers them once, after the first step: a step has ended
    where an index does not rise, and the tables are known when two steps in
    a row called the same ones."""
    if not state.coo_tables:
        seen = state.coo_keys
        if seen and key <= seen[-1]:  # a new step
            if seen == state.coo_last_step:
                state.coo_tables = list(seen)
            state.coo_last_step, state.coo_keys = seen, []
    if not state.coo_tables:
        state.coo_keys.append(key)
        return state.run(grad, lambda group: _run_coo(state, [(key, grad)], group)[0])
    if key not in state.coo_tables:  # (the same on every rank: an error, not a hang)
        raise ValueError(f"auto_hook: bucket {key} holds a sparse gradient, but the step's "
                         f"sparse buckets were {state.coo_tables}")  # fmt: skip
    raw, fut = state.later()
    state.coo_pending.append((key, grad, raw))
    if key == state.coo_tables[-1]:
        parts, state.coo_pending = state.coo_pending, []
        tables = [(k, g) for k, g, _ in parts]
        state.run_together([r for _, _, r in parts], grad,
                           lambda group: _run_coo(state, tables, group))  # fmt: skip
    return fut


def _run_coo(
    state: AutoState, parts: list[tuple[int, torch.Tensor]], group: Any
) -> list[torch.Tensor]:
    """``_coo_step``, with a peer that fails the exchange (it died, or its
    buckets are not this rank's) named after ``peer_timeout_s`` (``net.peers``)."""
    call, state.coo_calls = state.coo_calls, state.coo_calls + 1
    keep_alive()
    try:
        return _coo_step(state, parts, group)
    except RuntimeError as e:  # gloo: a closed connection or the group's timeout
        tag = f"coo-{dist.distributed_c10d._get_process_group_name(group)}"
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        raise name_the_missing(tag, group, world, rank, call, state.peer_timeout_s, e) from e


def _coo_step(
    state: AutoState, parts: list[tuple[int, torch.Tensor]], group: Any
) -> list[torch.Tensor]:
    """Tables' sparse gradients averaged (``collectives.coo``): one gather of
    the row counts per owner and the last scan's time, then each table on the
    path predicted fastest, the tables of a path together; where the last
    step chose ``gather`` for every table, rows and counts in one round."""
    state.fold()
    world = dist.get_world_size(group)
    tables = [coo.Table.of(g, world) for _, g in parts]
    last = state.last[2] if state.last is not None else 0.0
    one_round = (state.coo_cap > 0 and len({t.rows.dtype for t in tables}) == 1
                 and state.coo_next == [GATHER] * len(tables))  # fmt: skip
    times = torch.tensor([last, 0.0 if one_round else state.counts_s], dtype=torch.float64)
    t0 = time.perf_counter()
    if one_round:
        outs, got, longest = coo.gather_in_one(tables, times.view(torch.int64), state.coo_cap,
                                               group)  # fmt: skip
        state.coo_cap = coo.cap_after(longest)
        state.coo_one_round += 1
    else:
        got = coo.share_counts(tables, times.view(torch.int64), group)
        state.counts_s = time.perf_counter() - t0
    extra = got.contiguous().view(torch.float64)
    state._learn(extra[:, 0])
    if float(extra[:, 1].min()) > 0:
        state.hop_s.append(float(extra[:, 1].min()))
    links = [coo.link_bytes(t, state.unions.get(key, sum(t.held())))  # none seen: no overlap
             for (key, _), t in zip(parts, tables, strict=True)]  # fmt: skip
    paths = state._coo_paths(links, world)
    if one_round:  # this step's went by all-gather; the choices are the next step's
        state.coo_next, paths = paths, [GATHER] * len(tables)
    else:
        outs = coo.exchange(tables, paths, group)
        state.coo_next = paths
        state.coo_cap = coo.cap_after(coo.gather_length(tables, len(times)))
    for link, path in zip(links, paths, strict=True):
        for p, b in link.items():  # what each path would have moved: the bytes model's view
            state.coo_bytes[p] = state.coo_bytes.get(p, 0) + b
        state.coo_bytes["chosen"] = state.coo_bytes.get("chosen", 0) + link[path]
    for (key, _), out, link, path in zip(parts, outs, links, paths, strict=True):
        state.unions[key] = out._nnz()
        state._log(key, f"coo-{path}", link[path], link[DENSE])
    return outs


def auto_hook(
    state: AutoState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average each bucket on the path ``state``
    predicts fastest (see the module doc). Returns at once."""
    buf, key = bucket.buffer(), bucket.index()
    state.agree_layout(key, buf, "auto_hook")
    if buf.is_sparse:  # a ``sparse=True`` table (a bucket of its own)
        return _coo_part(state, key, buf)
    rows = state.rows
    if rows is not None and rows.holds_tables(list(bucket.parameters())):
        ring = ring_bytes(buf, dist.get_world_size())

        def logged(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            state._log(key, ROWS, rows.sent.get(key, ring), ring)
            return fut.value()

        rows.layouts_checked[key] = rows.layout_checks  # (compared above, once is enough)
        return rows_hook(rows, bucket).then(logged)
    if state.take_skip(key):
        world = dist.get_world_size()
        ring = ring_bytes(buf, world)
        state._log(key, DENSE, ring, ring)
        return state.dense(buf, world)
    return state.run(buf, lambda group: _run(state, buf, key, group))
