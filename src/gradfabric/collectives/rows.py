"""``rows_hook``: embedding gradients exchanged as the rows the batch looked up.

(No ``from __future__ import annotations`` here: DDP inspects the hook's
``bucket`` annotation at runtime and wants the class itself.)

Theory of operation. An embedding table's gradient is zero outside the rows
its forward passes looked up; ``nn.Embedding(sparse=True)`` sends exactly
those rows, but only optimizers that take sparse gradients (SGD, Adagrad,
SparseAdam) can use them. Here the model keeps dense gradients, so any
optimizer works (Adam, AdamW), and the hook moves what ``sparse=True`` would:
``RowState.track(model)`` puts a forward hook on every ``nn.Embedding`` and
``nn.EmbeddingBag`` that records the ids it looks up; at the bucket, each
tracked table's gradient (a view into the bucket, ``bucket.gradients()``)
gives up the rows of those ids, and the ranks all-gather (ids, rows) and sum
them in place. No pass over the whole table: the block scan of
``omnireduce_hook`` reads every value of every table each call, which on
NeuMF was most of its time, not its bytes.

Arithmetic, as DDP's default hook: each rank's values are divided by the
world size before the sum, and every rank adds the ranks' rows in rank order
into zeroed rows (``0 + g0 + g1 + ...``), so replicas stay identical to the
bit and, at 2 ranks, equal to DDP's all-reduce to the bit. Other parameters
in the bucket (dense layers, untracked tables) are all-reduced together.

The ids are a promise: a table whose weight is also used outside its lookup
(tied to an output layer, a regulariser on the whole table) has gradient
rows nobody looked up, and a model run by ``torch.compile`` does not call
the forward hooks that record the ids. Every ``verify_every`` calls of a
bucket (and its first) each rank checks the promise by scanning the table's
gradient, and at every other call ``PROBE_ROWS`` random rows; a table found
with a non-zero row outside its ids on any rank is all-reduced densely from
then on, on every rank alike (the flag travels with the counts), and
``state.untracked`` names it. A few stray rows that the sample misses are
caught at the next full check, not before: a model whose tables are touched
outside their lookups should not use this hook. Collectives per bucket: one all-gather of the
counts and flags, one all-gather of ids and one of rows (padded to the
largest rank's count per table), and one all-reduce for the rest. Where the
ring all-reduce of the tables would move fewer bytes (most rows touched), the
call all-reduces them instead (``_rows_pay``; ``state.dense_by_bytes``).
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.collectives.paths import ROWS
from gradfabric.collectives.skip import LayoutCheck
from gradfabric.collectives.sparse import ring_bytes
from gradfabric.net.overlap import Overlapped
from gradfabric.net.peers import keep_alive, name_the_missing


def tables(
    model: nn.Module, sparse: bool = False
) -> list[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """The embedding tables of ``model`` with dense gradients (what
    ``RowState.track`` tracks), or with ``sparse`` ones."""
    return [
        (name, mod) for name, mod in model.named_modules()
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag) and mod.sparse == sparse
    ]  # fmt: skip


PROBE_ROWS = 256  # rows outside the ids checked at each call between full checks


@dataclass
class RowState(LayoutCheck, Overlapped):
    """The tables a model's hook exchanges by rows, and its statistics."""

    verify_every: int = 100
    peer_timeout_s: float = 10.0  # a dead peer is named after this (``net.peers``)
    calls: int = 0
    rows_sent: int = 0  # rows this rank sent, over all calls
    values_dense: int = 0  # values all-reduced densely (the rest of the buckets)
    untracked: list[str] = field(default_factory=list)  # tables that broke their promise
    names: dict[int, str] = field(default_factory=dict)  # a table's weight (id) -> its name
    pending: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # ids since last bucket
    checks: dict[int, int] = field(default_factory=dict)  # calls per bucket index
    sent: dict[int, int] = field(default_factory=dict)  # bytes per bucket index, last call
    dense_by_bytes: int = 0  # calls whose tables went dense: the ring moved fewer bytes
    rng: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    @classmethod
    def track(cls, model: nn.Module, verify_every: int = 100, **kw: Any) -> "RowState":
        """A state that tracks every embedding table of ``model`` (before
        wrapping it in DDP or after: the modules are the same)."""
        state = cls(verify_every=verify_every, **kw)
        for name, mod in tables(model):
            state.names[id(mod.weight)] = name.removeprefix("module.")
            mod.register_forward_hook(state._looked_up)
        if not state.names:
            raise ValueError("the model has no dense nn.Embedding or nn.EmbeddingBag to track")
        return state

    def _looked_up(self, mod: nn.Module, inputs: tuple[Any, ...], _: Any) -> None:
        if torch.is_grad_enabled():
            self.pending.setdefault(id(mod.weight), []).append(inputs[0].detach().reshape(-1))

    def holds_tables(self, params: list[torch.Tensor]) -> bool:
        """Whether a bucket of ``params`` holds a table this state still tracks."""
        return any(self.names.get(id(p), "") not in ("", *self.untracked) for p in params)

    def take(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """For each of a bucket's parameters: its looked-up ids since the last
        bucket (unique), or None where it is not tracked (or no longer)."""
        out: list[torch.Tensor | None] = []
        for p in params:
            name = self.names.get(id(p))
            if name is None or name in self.untracked:
                out.append(None)
                continue
            seen = self.pending.pop(id(p), [])
            ids = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.int64)
            out.append(torch.unique(ids.to(torch.int64)))
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["pending"] = {}
        state["rng"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, rng=torch.Generator().manual_seed(state["calls"]))


def rows_hook(
    state: RowState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket, tracked tables by rows."""
    buf, key = bucket.buffer(), bucket.index()
    state.agree_layout(key, buf, "rows_hook")
    params, grads = list(bucket.parameters()), list(bucket.gradients())
    ids = state.take(params)  # here, on the autograd thread: the forward's ids of this step
    # (a bucket without tables is all-reduced on the thread as well, not from
    # here as ``Overlapped.dense`` would: there a dead peer is named)
    state.checks[key] = calls = state.checks.get(key, 0) + 1
    verify = calls == 1 or calls % state.verify_every == 0
    names = [state.names.get(id(p), "") for p in params]

    def job(group: Any) -> torch.Tensor:
        keep_alive()
        try:
            state.sent[key] = _rows_allreduce(state, buf, grads, ids, names, verify, group)
        except RuntimeError as e:  # gloo: a closed connection or the group's timeout
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            raise name_the_missing(
                ROWS, group, world, rank, state.calls, state.peer_timeout_s, e
            ) from e
        out: torch.Tensor = buf
        return out

    return state.run(buf, job)


def _rows_allreduce(
    state: RowState,
    buf: torch.Tensor,
    grads: list[torch.Tensor],
    ids: list[torch.Tensor | None],
    names: list[str],
    verify: bool,
    group: Any,
) -> int:
    """The bucket averaged; the bytes this rank sent (the all-gathers'
    and ring's shares, as ``ring_bytes`` counts a dense call)."""
    world = dist.get_world_size(group)
    tracked = [k for k, i in enumerate(ids) if i is not None]
    if not tracked:
        by_rows: list[int] = []
    else:
        counts, by_rows = _promises(state, grads, ids, names, tracked, verify, group)
        if by_rows and not _rows_pay(grads, by_rows, counts, world):
            state.dense_by_bytes += 1
            by_rows = []
    state.calls += 1
    if not by_rows:  # the whole bucket, in place
        dist.all_reduce(buf.div_(world), group=group)
        state.values_dense += buf.numel()
        return ring_bytes(buf, world)
    dense = [g for k, g in enumerate(grads) if k not in by_rows]
    work = None
    if dense:  # one all-reduce of the rest, in flight while the rows are gathered
        flat = torch.cat([g.reshape(-1) for g in dense]).div_(world)
        work = dist.all_reduce(flat, group=group, async_op=True)
        state.values_dense += flat.numel()
    sent = _gather_rows(state, [grads[k] for k in by_rows], [ids[k] for k in by_rows], counts,
                        group)  # fmt: skip
    if work is not None:
        work.wait()
        at = 0
        for g in dense:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
        sent += ring_bytes(flat, world)
    return sent


def _rows_pay(grads: list[torch.Tensor], by_rows: list[int], counts: torch.Tensor,
              world: int) -> bool:  # fmt: skip
    """Whether the rows' all-gather puts fewer bytes on each rank's link than
    the ring all-reduce of the same tables: each rank receives every other
    rank's rows (padded to the largest count, with 8-byte ids), the ring
    ``2(n-1)/n`` of the tables. Where most rows are touched (a small table, a
    large batch, many ranks) the ring wins; every rank decides alike, from the
    gathered counts."""
    widest: list[int] = counts.max(0).values.tolist()
    rows: int = sum(w * (grads[k][0].numel() * grads[k].element_size() + 8)
               for w, k in zip(widest, by_rows, strict=True))  # fmt: skip
    ring: float = sum(2 * grads[k].numel() * grads[k].element_size() / world for k in by_rows)
    return rows < ring  # (both sides times n-1)


def _promises(
    state: RowState,
    grads: list[torch.Tensor],
    ids: list[torch.Tensor | None],
    names: list[str],
    tracked: list[int],
    verify: bool,
    group: Any,
) -> tuple[torch.Tensor, list[int]]:
    """The tables that go by rows, those whose promise no rank found broken
    (the rest are untracked from now on, alike on every rank), and every
    rank's count of ids for each of them (a column per table)."""
    world = dist.get_world_size(group)
    mine = torch.zeros(2 * len(tracked), dtype=torch.int64)
    for j, k in enumerate(tracked):
        own = ids[k]
        assert own is not None
        mine[j] = len(own)
        rows = grads[k].reshape(len(grads[k]), -1)
        if verify:  # every row
            hit = rows.ne(0).any(1)
            hit[own] = False
        else:  # a sample of rows: a table used elsewhere shows at once
            probe = torch.randint(len(rows), (min(len(rows), PROBE_ROWS),), generator=state.rng)
            hit = rows.index_select(0, probe).ne(0).any(1) & ~torch.isin(probe, own)
        mine[len(tracked) + j] = int(hit.any())
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    counts = torch.stack(every)[:, : len(tracked)]
    broken = torch.stack(every)[:, len(tracked) :].any(0)
    for j in broken.nonzero().flatten().tolist():
        state.untracked.append(names[tracked[j]])
    kept = [j for j in range(len(tracked)) if not broken[j]]
    return counts[:, kept], [tracked[j] for j in kept]


def _gather_rows(
    state: RowState,
    grads: list[torch.Tensor],
    ids: list[Any],
    counts: torch.Tensor,
    group: Any,
) -> int:
    """All-gather each table's (ids, rows), padded to the largest rank's
    count, and sum them into the zeroed rows in rank order; the bytes this
    rank sent (a ring all-gather forwards the others' shares: n-1 of them)."""
    world = dist.get_world_size(group)
    tables = [g.reshape(len(g), -1) for g in grads]
    widest = counts.max(0).values.tolist()
    dims = [t.shape[1] for t in tables]
    send_ids = torch.full((sum(widest),), -1, dtype=torch.int64)
    send_rows = tables[0].new_zeros(sum(w * d for w, d in zip(widest, dims, strict=True)))
    at_i = at_v = 0
    for t, own, w, d in zip(tables, ids, widest, dims, strict=True):
        send_ids[at_i : at_i + len(own)] = own
        send_rows[at_v : at_v + len(own) * d] = t.index_select(0, own).reshape(-1)
        at_i, at_v = at_i + w, at_v + w * d
    send_rows.div_(world)  # as DDP's default hook: divided, then summed
    state.rows_sent += sum(len(own) for own in ids)
    got_ids = [torch.empty_like(send_ids) for _ in range(world)]
    got_rows = [torch.empty_like(send_rows) for _ in range(world)]
    works = [dist.all_gather(got_ids, send_ids, group=group, async_op=True),
             dist.all_gather(got_rows, send_rows, group=group, async_op=True)]  # fmt: skip
    for t, own in zip(tables, ids, strict=True):
        t.index_fill_(0, own, 0)  # only this rank's own rows can be non-zero here
    for w in works:
        assert w is not None
        w.wait()
    for s in range(world):  # in rank order on every rank: the same floats, the same sums
        at_i = at_v = 0
        for j, (t, w, d) in enumerate(zip(tables, widest, dims, strict=True)):
            n = int(counts[s, j])
            t.index_add_(0, got_ids[s][at_i : at_i + n],
                         got_rows[s][at_v : at_v + n * d].view(n, d))  # fmt: skip
            at_i, at_v = at_i + w, at_v + w * d
    per_rank = send_ids.numel() * 8 + send_rows.numel() * send_rows.element_size()
    return (world - 1) * per_rank
