"""Sparse gradients of ``sparse=True`` tables, averaged by the rows they hold.

Theory of operation. DDP hands a communication hook the gradient of an
``nn.Embedding(sparse=True)`` or ``nn.EmbeddingBag(sparse=True)`` as a COO
tensor of the rows the batch looked up, a bucket per table. Without a hook,
gloo's sparse all-reduce coalesces each and all-gathers every rank's (ids,
rows), in three rounds per table (sizes, ids, values): each rank receives the
rows of all the others. Where the ranks look up the same rows (skewed ids:
popular items, frequent tokens) the union of their rows is far smaller than
that sum, and a reduce-scatter by row moves less: row ``i`` belongs to rank
``i % n``; every rank sends each owner its rows of the owner's shard (one
all-to-all), each owner sums its shard (the aggregator of OmniReduce, with a
table's rows for blocks: a row is what a lookup makes non-zero), and the
owners' sums are all-gathered.

Per rank's link, with ``s_r`` rows on rank r, ``S`` their sum and ``U`` the
union over ranks (bytes per row: the values and an 8-byte id):

- ``gather``: receives every other rank's rows, padded to the largest count:
  ``(n-1) max s_r``;
- ``sharded``: receives the others' rows of its own shard (``~(S - s_r)/n``),
  then ``n - 1`` shards of the union, padded to the largest
  (``~(n-1)/n U``): it wins where ``U/S`` is below about ``(n-2)/(n-1)``,
  never at 2 ranks;
- ``dense``: the ring all-reduce of the whole table, ``2(n-1)/n`` of it (a
  small table most of whose rows a batch touches).

The tables of one step go together (``exchange``): one all-gather of every
rank's row counts per table and owner (each rank then knows every count, and
the paths' bytes: ``link_bytes``), then one collective per path for all the
tables that take it: one all-gather for ``gather`` (where gloo takes three
rounds per table), an all-to-all, a count round and an all-gather for
``sharded``, one all-reduce for ``dense``. Every all-gather here is one
all-to-all (``all_gathered``): one hop, where gloo's ring all-gather takes
``n - 1`` in a row; on a busy host a hop is milliseconds. The union each path needs is the
previous step's (every path ends knowing it), so the choice costs no round.
``auto_hook`` makes it (``collectives.auto``). Where the last step sent every
table by ``gather``, the counts ride in the same round as the rows
(``gather_in_one``): one round a step.

Arithmetic as DDP's: every rank's rows are divided by the world size before
the sum; each row is summed by one rank (its owner), or by every rank alike
in the same order (``gather``, ``dense``), so replicas stay identical to the
bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradfabric.collectives import fast
from gradfabric.collectives.paths import COO, DENSE, GATHER, SHARDED

ID_BYTES = 8


@dataclass
class Table:
    """One table's gradient on this rank: its size and its coalesced (ids,
    rows), the rows divided by the world size; ``counts[q, r]`` (after
    ``share_counts``): rows rank q holds of rank r's shard."""

    size: torch.Size
    ids: torch.Tensor
    rows: torch.Tensor  # (len(ids), row values)
    counts: torch.Tensor | None = None

    @classmethod
    def of(cls, grad: torch.Tensor, world: int) -> Table:
        rows = grad._values().reshape(-1, math.prod(grad.shape[1:]))
        return cls(grad.shape, *summed(grad._indices()[0], rows, grad.shape[0], world))

    @property
    def width(self) -> int:
        """A packed row's length in values: the id's bytes, then the row."""
        return ID_BYTES // self.rows.element_size() + self.rows.shape[1]

    def row_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.element_size() + ID_BYTES

    def table_bytes(self) -> int:
        return self.size.numel() * self.rows.element_size()

    def held(self) -> list[int]:
        """Rows each rank holds."""
        assert self.counts is not None
        out: list[int] = self.counts.sum(1).tolist()
        return out

    def sparse(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The gradient of (ids, rows), duplicate ids summed."""
        ids, rows = summed(ids, rows, self.size[0])
        return torch.sparse_coo_tensor(ids[None], rows.reshape(-1, *self.size[1:]), self.size,
                                       check_invariants=False, is_coalesced=True)  # fmt: skip


def summed(
    ids: torch.Tensor, rows: torch.Tensor, limit: int, divisor: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each distinct id summed (in the order they come), divided
    by ``divisor``; the ids ascending, each in ``[0, limit)`` (else a
    ``ValueError``: rows of ids outside the table came from a corrupt gradient
    or exchange). The compiled hook's ``sum_rows`` where it is built (one pass
    over the rows, where ``coalesced`` sorts and makes several tensors; its
    differential test holds it to ``coalesced``'s bits), else ``coalesced``."""
    fast_sum = _sum_rows()
    if fast_sum is None or rows.dtype not in (torch.float32, torch.float64) or limit > 2**31:
        return coalesced(ids, rows, limit, divisor)
    got = fast_sum(ids.contiguous(), rows.contiguous(), limit, divisor)
    if got is None:
        raise _outside(limit)
    return got[0], got[1]


def coalesced(
    ids: torch.Tensor, rows: torch.Tensor, limit: int, divisor: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed`` in tensor operations, the reference: ``index_add_`` adds
    the rows in the order of its index on the CPU (as documented), into
    zeros. (Not ``coalesce()``: it sums an id's rows in the order of an
    unstable sort, which no other implementation can promise to follow to
    the bit.)"""
    if len(ids) and not (int(ids.min()) >= 0 and int(ids.max()) < limit):
        raise _outside(limit)
    mine, where = torch.unique(ids, return_inverse=True)
    sums = rows.new_zeros(len(mine), rows.shape[1]).index_add_(0, where, rows)
    return mine, sums / divisor if divisor != 1 else sums


def _outside(limit: int) -> ValueError:
    return ValueError(f"row ids outside a table of {limit} rows arrived: "
                      "a rank's gradient or the exchange is corrupt")  # fmt: skip


@functools.cache
def _sum_rows() -> Any:
    """The compiled ``sum_rows``, or None where the hook is not built (``collectives.fast``)."""
    return fast.extension().sum_rows if fast.why_not() is None else None


def _owned_counts(tables: list[Table], world: int) -> list[torch.Tensor]:
    """This rank's rows of each table per owner (row ``i`` is rank ``i % world``'s)."""
    return [torch.bincount(t.ids % world, minlength=world) for t in tables]


def _lengths(tables: list[Table]) -> list[list[int]]:
    """Values each rank sends of each table, packed (``[rank][table]``; counts known)."""
    held = [t.held() for t in tables]
    return [[h[q] * t.width for t, h in zip(tables, held, strict=True)]
            for q in range(len(held[0]))]  # fmt: skip


def share_counts(tables: list[Table], extra: torch.Tensor, group: Any) -> torch.Tensor:
    """One all-gather: every rank's rows per owner for each table (into
    ``counts``) and each rank's ``extra`` int64 values, returned by rank."""
    world = dist.get_world_size(group)
    own = _owned_counts(tables, world)
    got = torch.stack(all_gathered(torch.cat([*own, extra]), group))
    for k, t in enumerate(tables):
        t.counts = got[:, k * world : (k + 1) * world]
    return got[:, len(tables) * world :]


def link_bytes(table: Table, union: float) -> dict[str, int]:
    """The busiest rank's received bytes per path, from the table's counts
    and an estimate of its union's row count (each shard's share of it by
    its share of the rows)."""
    counts = table.counts
    assert counts is not None
    world = len(counts)
    held = counts.sum(1)
    total = int(held.sum())
    per_row = table.row_bytes()
    arriving = counts.sum(0)  # rows of each shard, over ranks
    ratio = min(1.0, union / total) if total else 1.0
    widest = float(arriving.max()) * ratio
    sharded = float((arriving - counts.diagonal()).max()) + (world - 1) * widest
    return {
        GATHER: (world - 1) * int(held.max()) * per_row,
        SHARDED: int(sharded * per_row),
        DENSE: 2 * (world - 1) * table.table_bytes() // world,
    }


def hops(path: str, world: int) -> int:
    """Sequential network hops a path takes after the counts: one per
    all-to-all (``all_gathered`` is one), ``2(n-1)`` for gloo's ring."""
    return {GATHER: 1, SHARDED: 3}.get(path, 2 * (world - 1))


def exchange(tables: list[Table], paths: list[str], group: Any) -> list[torch.Tensor]:
    """Every table's averaged gradient (coalesced), each by its path, the
    tables of a path in one collective (see the module doc)."""
    out: list[torch.Tensor | None] = [None] * len(tables)
    take = {p: [k for k, q in enumerate(paths) if q == p] for p in COO}
    work, flat = None, None
    if take[DENSE]:  # in flight while the others move
        dense = [tables[k] for k in take[DENSE]]
        flat = torch.cat([_dense(t).reshape(-1) for t in dense])
        work = dist.all_reduce(flat, group=group, async_op=True)
    if take[GATHER]:
        for k, g in zip(take[GATHER], _gathered([tables[k] for k in take[GATHER]], group),
                        strict=True):  # fmt: skip
            out[k] = g
    if take[SHARDED]:
        for k, g in zip(take[SHARDED], _sharded([tables[k] for k in take[SHARDED]], group),
                        strict=True):  # fmt: skip
            out[k] = g
    if work is not None and flat is not None:
        work.wait()
        at = 0
        for k in take[DENSE]:
            t = tables[k]
            n = t.size.numel()
            out[k] = flat[at : at + n].view(t.size).to_sparse(1)
            at += n
    assert all(g is not None for g in out)
    return out  # type: ignore[return-value]


def gather_in_one(
    tables: list[Table], extra: torch.Tensor, cap: int, group: Any
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """``exchange`` with every table on ``gather``, the counts in the same
    round: each rank's buffer leads with its length, its counts per owner and
    ``extra`` (int64s viewed as the rows' dtype), then its rows, padded to
    ``cap`` values (a bound from the last step: ``cap_after``). A rank with
    more sends the rest in a second round, which every rank knows to run from
    the lengths. Fills each table's ``counts``; returns the gradients,
    ``extra`` by rank and the longest buffer (for the next bound)."""
    world = dist.get_world_size(group)
    dtype = tables[0].rows.dtype
    own = _owned_counts(tables, world)
    data = torch.cat([_packed(t.ids, t.rows) for t in tables])
    head = torch.cat([torch.tensor([len(data)]), *own, extra]).view(dtype)
    send = data.new_zeros(max(cap, len(head)))
    mine = torch.cat([head, data])[: len(send)]
    send[: len(mine)] = mine
    got = all_gathered(send, group)
    heads = torch.stack([g[: len(head)] for g in got]).view(torch.int64)
    lengths: list[int] = heads[:, 0].tolist()
    room = len(send) - len(head)
    spill = max(lengths) - room
    more = all_gathered(_padded(data[room:], spill), group) if spill > 0 else None
    datas = [g[len(head) : len(head) + min(n, room)] for g, n in zip(got, lengths, strict=True)]
    if more is not None:
        datas = [torch.cat([d, m[: max(0, n - room)]])
                 for d, m, n in zip(datas, more, lengths, strict=True)]  # fmt: skip
    for k, t in enumerate(tables):
        t.counts = heads[:, 1 + k * world : 1 + (k + 1) * world]
    split = _lengths(tables)
    parts = _split(torch.cat(datas), split)
    grads = [t.sparse(*_unpacked(p, t.width)) for t, p in zip(tables, parts, strict=True)]
    return grads, heads[:, 1 + len(tables) * world :], len(head) + max(lengths)


def gather_length(tables: list[Table], extras: int) -> int:
    """The longest buffer ``gather_in_one`` would send for ``tables`` (their
    counts known) with ``extras`` int64 values."""
    world = len(tables[0].held())
    head = (1 + len(tables) * world + extras) * (ID_BYTES // tables[0].rows.element_size())
    return head + max(map(sum, _lengths(tables)))


def cap_after(longest: int) -> int:
    """The next step's bound for ``gather_in_one``: the longest buffer this
    step, with room for a tenth more (row counts drift from step to step)."""
    return longest + longest // 10 + 64


def _padded(values: torch.Tensor, length: int) -> torch.Tensor:
    out = values.new_zeros(length)
    out[: len(values)] = values[:length]
    return out


def all_gathered(mine: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``mine`` (of one length on every rank), by rank: an
    all-gather done as one all-to-all. gloo's all-gather is a ring, ``n - 1``
    hops one after the other; here every rank sends to every other at once,
    the same bytes on each link in one hop (a table's rows are kilobytes:
    the hops' latency, not the bytes, is what a ring costs them)."""
    world = dist.get_world_size(group)
    out = mine.new_empty(world * len(mine))
    dist.all_to_all_single(out, mine.repeat(world), group=group)
    return list(out.view(world, len(mine)))


def _dense(t: Table) -> torch.Tensor:
    return t.rows.new_zeros(t.size[0], t.rows.shape[1]).index_add_(0, t.ids, t.rows)


def _packed(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows with their ids in front, the ids' bytes viewed as the rows' dtype,
    flattened (one buffer: one collective for ids and values)."""
    head = ids.to(torch.int64).reshape(-1, 1).contiguous().view(rows.dtype)
    return torch.cat([head, rows], 1).reshape(-1)


def _unpacked(buf: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    both = buf.reshape(len(buf) // width, width)
    head = ID_BYTES // buf.element_size()
    return both[:, :head].contiguous().view(torch.int64).reshape(-1), both[:, head:]


def _gathered(tables: list[Table], group: Any) -> list[torch.Tensor]:
    """All-gather every rank's packed rows of all ``tables``, padded to the
    longest rank's; every rank sums them alike."""
    lengths = _lengths(tables)
    send = tables[0].rows.new_zeros(max(map(sum, lengths)))
    mine = torch.cat([_packed(t.ids, t.rows) for t in tables])
    send[: len(mine)] = mine
    # (summed in rank order: the same sums on every rank)
    return _rebuilt(tables, all_gathered(send, group), lengths)


def _sharded(tables: list[Table], group: Any) -> list[torch.Tensor]:
    """Reduce-scatter by row owner (one all-to-all for all ``tables``), each
    owner's sums, then an all-gather of the owners' sums."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    counts = [t.counts for t in tables if t.counts is not None]
    assert len(counts) == len(tables)
    mine = []  # each table's packed rows, by owner
    for t in tables:
        order = torch.argsort(t.ids % world, stable=True)
        mine.append(_packed(t.ids[order], t.rows[order]).reshape(-1, t.width))
    starts = [torch.cat([c.new_zeros(1), c[me].cumsum(0)]).tolist() for c in counts]
    chunks = [torch.cat([m[s[r] : s[r + 1]].reshape(-1) for m, s in zip(mine, starts, strict=True)])
              for r in range(world)]  # fmt: skip
    widths = [t.width for t in tables]
    into = [[int(c[q, me]) * w for c, w in zip(counts, widths, strict=True)] for q in range(world)]
    recv = tables[0].rows.new_empty(sum(map(sum, into)))
    dist.all_to_all_single(recv, torch.cat(chunks), [sum(i) for i in into],
                           [len(c) for c in chunks], group=group)  # fmt: skip
    sums = [_owned(t, p) for t, p in zip(tables, _split(recv, into), strict=True)]
    sizes = torch.tensor([len(s) for s in sums], dtype=torch.int64)
    lengths: list[list[int]] = [e.tolist() for e in all_gathered(sizes, group)]
    send = tables[0].rows.new_zeros(max(map(sum, lengths)))
    joined = torch.cat(sums)
    send[: len(joined)] = joined
    shards = all_gathered(send, group)
    return _rebuilt(tables, shards, lengths)  # (shards are disjoint: the coalesce only sorts)


def _owned(t: Table, arrived: torch.Tensor) -> torch.Tensor:
    """The packed sums of this rank's shard of ``t`` from the rows that arrived."""
    return _packed(*summed(*_unpacked(arrived, t.width), t.size[0]))


def _rebuilt(
    tables: list[Table], got: list[torch.Tensor], lengths: list[list[int]]
) -> list[torch.Tensor]:
    """Each table's gradient from an all-gather's padded buffers, one per rank."""
    parts = _split(torch.cat(got), lengths, len(got[0]))
    return [t.sparse(*_unpacked(p, t.width)) for t, p in zip(tables, parts, strict=True)]


def _split(buf: torch.Tensor, lengths: list[list[int]], stride: int = 0) -> list[torch.Tensor]:
    """Per table, its pieces of ``buf`` joined in rank order: ``lengths[q][k]``
    values of table k from rank q, rank q's pieces at ``q * stride`` (or right
    after rank q-1's where ``stride`` is 0)."""
    parts: list[list[torch.Tensor]] = [[] for _ in lengths[0]]
    at = 0
    for q, row in enumerate(lengths):
        at = q * stride if stride else at
        for k, n in enumerate(row):
            parts[k].append(buf[at : at + n])
            at += n
    return [torch.cat(p) for p in parts]
