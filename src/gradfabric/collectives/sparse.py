"""Sparse all-reduce that moves only non-zero blocks (OmniReduce's idea).

(No ``from __future__ import annotations`` here: DDP inspects the hook's
``bucket`` annotation at runtime and wants the class itself.)

The flat tensor is cut into blocks of ``block_size`` values; a block counts as
zero when every value's magnitude is at most ``threshold``. First an
``all_gather`` of every rank's occupancy bitmap (one bit per block, 1/8192 of
the dense bytes for float32 and 256-value blocks): from the bitmaps every rank
knows every transfer size and the union of non-zero blocks, so no block
indices travel and every rank picks the same path without another round trip.
Then one of two sparse exchanges, or the dense all-reduce:

* *sharded* (OmniReduce's aggregators): block ``b`` is owned by rank
  ``b % world``. One ``all_to_all_single`` takes each rank's non-zero blocks of
  an owner's shard to that owner, which sums them into its shard's union; a
  second sends each owner's summed union to every rank, which writes it in
  place. Rank ``r`` sends its blocks outside its shard plus ``(n-1)`` times
  its shard's union.
* *gather*: one ``all_to_all_single`` sends every rank's non-zero blocks to
  every other rank; each rank sums all of them itself, in rank order, so every
  rank adds the same floats in the same order and the replicas stay bitwise
  identical. With ``|N_r|`` the non-zero blocks of rank ``r``, it sends
  ``(n-1) |N_r|`` and receives the others' ``|N_s|``: with 2 ranks never more
  than the sharded path, and exactly the data-volume floor
  (``Plan.floor_vectors``); with more ranks, fewer bytes while few blocks are
  shared.

The values stay on their device (a GPU with nccl: every collective here moves
device tensors); the bitmaps come to the host, where the plan is made, since
the transfer sizes must be known there anyway. The tests run gloo on CPU; the
GPU path has not been run yet.

OmniReduce's switch/aggregator protocol announces the next non-zero index with
each block because a switch cannot hold a bitmap per worker; between hosts the
bitmap is cheaper (1 bit per block against 8 bytes per index), and its
streaming form is simulated in ``gradfabric.proto.omni``.

The decision, per chunk, from the bitmaps alone: the path whose busiest rank's
link (the larger of the bytes it sends and receives) carries fewer bytes; if
even that is more than ``dense_margin`` times what a ring all-reduce sends
(``2(n-1)/n * N`` values per rank), the dense ``all_reduce`` runs. Below 1
the margin charges the sparse paths' per-block host work (gather, sum,
scatter), which matters where the host and not the wire is the bottleneck.
"""

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradfabric.collectives.paths import DENSE, GATHER, SHARDED
from gradfabric.collectives.skip import DTYPES, DenseSkip, dtype_name, unlike_ranks
from gradfabric.net.peers import keep_alive, name_the_missing

# The sparse paths' block bookkeeping (gather, sum, scatter) costs host time the
# dense ring does not; at 2 ranks either exchange of a fully dense tensor moves
# exactly the ring's bytes. A 25% byte saving is asked for before the
# sparse path runs; lower it on links fast enough for the host to be the limit.
DENSE_MARGIN = 0.75


@dataclass
class OmniState(DenseSkip):
    """Picklable state of the DDP hook: knobs and running statistics (its
    communication thread, ``net.overlap``, is made again after unpickling).

    ``dense_margin``: the sparse path runs only where its busiest link moves
    at most this fraction of the dense ring's bytes (1.0: bytes alone; lower
    for fast links where the host's block bookkeeping, not the wire, limits).

    ``dense_skip``: see ``DenseSkip`` (the scan and bitmap round cost 15-17%
    of a dense call at 10 Gbit/s here).
    """

    block_size: int = 256
    threshold: float = 0.0
    dense_margin: float = DENSE_MARGIN
    bytes_sent: int = 0  # by this rank
    bytes_dense: int = 0  # a ring all-reduce would send per rank
    bytes_busiest_link: int = 0  # the busier direction of the busiest rank's link
    bytes_floor: int = 0  # the fewest any exchange could put there (``Plan.floor_vectors``)
    calls: int = 0
    sparse_calls: int = 0
    chunks: dict[str, int] = field(default_factory=dict)  # pipeline chunks by path taken
    density_seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.threshold < 0 or not 0 < self.dense_margin <= 1:
            raise ValueError("block_size must be >= 1, threshold >= 0, 0 < dense_margin <= 1")
        if self.dense_skip < 0:
            raise ValueError("dense_skip must be >= 0")

    def count(self, dense_bytes: int, sent: int, calls: int = 1) -> None:
        with STATS_LOCK:
            self.calls += calls
            self.bytes_dense += dense_bytes
            self.bytes_sent += sent

    def skipped(self, key: int, calls: int, ring: int) -> None:
        self.count(ring, ring, calls)


def as_blocks(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """``flat`` as (blocks, block_size): a view when it divides evenly, else a
    zero-padded copy (the caller copies results back)."""
    n = flat.numel()
    nb = -(-n // block_size)
    if n == nb * block_size and flat.is_contiguous():
        return flat.view(nb, block_size), nb
    padded = flat.new_zeros(nb * block_size)
    padded[:n] = flat
    return padded.view(nb, block_size), nb


def occupancy(blocks: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which rows of ``blocks`` hold a value of magnitude above ``threshold``,
    or a NaN: a NaN or an infinity must reach every rank's sum, as with a dense
    all-reduce (AMP's gradient scaler looks for them there to skip a step).

    Two reductions (max and min) instead of ``abs().amax()``: no full-size
    temporary, about 7x faster on a 100 MB tensor. (Also measured, all slower
    on one core: ``any``, ``count_nonzero``, ``aminmax``, vector norms. An
    ``aminmax`` of the rows read as int64 is 1.4x faster but counts a block
    of negative zeros, which ``grad * mask`` makes, as occupied.)"""
    # ``~(m <= t)`` rather than ``m > t``: a row's max or min is NaN if it holds one
    return ~(blocks.amax(dim=1) <= threshold) | ~(blocks.amin(dim=1) >= -threshold)


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack(mask: torch.Tensor) -> torch.Tensor:
    pad = (-len(mask)) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    return (m.view(-1, 8).to(torch.uint8) * _BITS.to(m.device)).sum(dim=1, dtype=torch.uint8)


def unpack(bits: torch.Tensor, n: int) -> torch.Tensor:
    return (bits.unsqueeze(-1) & _BITS).ne(0).flatten(-2)[..., :n]


@dataclass(frozen=True)
class Plan:
    """Who sends which blocks where, derived alike on every rank from the
    gathered occupancy bitmaps ``masks`` (world x blocks)."""

    masks: torch.Tensor
    owner: torch.Tensor
    union: torch.Tensor
    share: torch.Tensor  # [r, o]: rank r's non-zero blocks in owner o's shard
    shard_union: torch.Tensor  # [o]: blocks of o's shard non-zero somewhere

    @staticmethod
    def of(masks: torch.Tensor) -> "Plan":
        world, nb = masks.shape
        owner = torch.arange(nb) % world
        union = masks.any(dim=0)
        # block b sits in column b % world once padded to whole rows of ``world``
        pad = (-nb) % world
        cols = torch.cat([masks, masks.new_zeros(world, pad)], 1).view(world, -1, world)
        share = cols.sum(dim=1)
        shard_union = cols.any(dim=0).sum(dim=0)
        return Plan(masks, owner, union, share, shard_union)

    def link_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks each rank sends and receives."""
        world = self.masks.shape[0]
        own, u = self.share.diagonal(), self.shard_union
        send = self.share.sum(1) - own + (world - 1) * u
        recv = self.share.sum(0) - own + u.sum() - u
        return send, recv

    def gather_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks each rank sends and receives on the gather path."""
        counts = self.masks.sum(1)
        return (self.masks.shape[0] - 1) * counts, counts.sum() - counts

    def floor_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fewest blocks each rank must send and receive, whatever the
        exchange: every non-zero block of its own must leave it once, and it
        must learn one block of others' sum for each block non-zero at some
        other rank (``|N_r|`` and ``|U_{-r}|``)."""
        held = self.masks.to(torch.int32)
        others = held.sum(0) - held  # per rank and block: how many others hold it
        return held.sum(1), (others > 0).sum(1)

    def most_to_one_peer(self) -> tuple[int, int]:
        """The most blocks any rank sends one peer in phase 1 and in phase 2."""
        off = self.share - torch.diag(self.share.diagonal())
        return int(off.max()), int(self.shard_union.max())


def sparse_allreduce(
    tensor: torch.Tensor,
    group: Any = None,
    block_size: int = 256,
    threshold: float = 0.0,
    op: str = "sum",
    state: OmniState | None = None,
    dense_margin: float = DENSE_MARGIN,
    peer_timeout_s: float = 10.0,
    key: int | None = None,
    check_layout: bool = True,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place (SUM or AVG) moving only non-zero blocks.

    Works for float32, float16, bfloat16 and int32 and any length. Raises
    ``ValueError`` for an unknown ``op`` or dtype. With ``state`` its
    ``block_size``, ``threshold`` and ``dense_margin`` replace the arguments
    and its statistics are updated; with ``state`` and a ``key`` naming the
    tensor (the same on every rank), a key whose last scan went all dense
    skips the scan for ``state.dense_skip`` calls (see ``OmniState``).

    If a peer fails mid-call (gloo reports a closed connection, or the process
    group's timeout passes), raises ``PeerTimeoutError`` naming the ranks that
    did not report within ``peer_timeout_s`` through the rendezvous store.

    ``check_layout``: the ranks first agree that their tensors have the same
    length and dtype (one small all-gather), and every rank raises
    ``ValueError`` naming those that differ from rank 0 (without it, gloo
    aborts the process on the first collective whose sizes differ). DDP's
    hook passes False: DDP checks its parameters' shapes across ranks once,
    at construction.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        raise ValueError(f"unsupported dtype {tensor.dtype}")
    if state is not None:
        block_size, threshold, dense_margin = state.block_size, state.threshold, state.dense_margin
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    dense_bytes = ring_bytes(flat, world)
    sent = dense_bytes
    if world > 1:
        name = dist.distributed_c10d._get_process_group_name(
            group or dist.distributed_c10d._get_default_group()
        )
        call = _CALLS[name] = _CALLS.get(name, -1) + 1
        keep_alive()
        try:
            if check_layout:
                _agree_layout(flat, group)
            if state is not None and state.take_skip(key):
                dist.all_reduce(flat, group=group)
            else:
                sent, went_sparse = _allreduce(
                    flat, group, world, rank, block_size, threshold, state, dense_margin
                )  # fmt: skip
                if state is not None:
                    state.scanned(key, dense=not went_sparse)
        except RuntimeError as e:  # gloo: a closed connection or the group's timeout
            tag = f"sparse-{name}"
            raise name_the_missing(tag, group, world, rank, call, peer_timeout_s, e) from e
    if work is not tensor:
        tensor.copy_(work)
    if state is not None:
        state.count(dense_bytes, sent)
    if op == "avg":
        if tensor.is_floating_point():
            tensor.div_(world)
        else:
            tensor.floor_divide_(world)
    return tensor


# Calls per group (by its name): collective, so every member counts alike.
_CALLS: dict[str, int] = {}
STATS_LOCK = threading.Lock()  # hook statistics: the autograd thread and a hook's thread


def ring_bytes(flat: torch.Tensor, world: int) -> int:
    """What a ring all-reduce of ``flat`` sends per rank: ``2(n-1)/n`` of it."""
    # in integers, as the compiled hook counts it (``_fast_hook.cpp``)
    return 2 * (world - 1) * flat.numel() * flat.element_size() // world if world > 1 else 0


def _agree_layout(flat: torch.Tensor, group: Any) -> None:
    odd, seen = unlike_ranks([flat.numel(), DTYPES.index(flat.dtype)], group)
    if odd:
        said = ", ".join(f"rank {r}: {n} values of {dtype_name(c)}"
                         for r, (n, c) in enumerate(seen))  # fmt: skip
        raise ValueError(
            f"sparse_allreduce: ranks {odd} hold a tensor unlike rank 0's ({said})"
        )


def _allreduce(
    flat: torch.Tensor,
    group: Any,
    world: int,
    rank: int,
    block_size: int,
    threshold: float,
    state: OmniState | None,
    dense_margin: float,
) -> tuple[int, bool]:
    """The collective part, as a three-stage software pipeline over chunks of
    ``CHUNK_BYTES``: while chunk k is scanned and its bitmap gathered, chunk
    k-1 runs phase 1 and chunk k-2 is summed and runs phase 2 (gloo works
    asynchronously; every rank starts the same operations in the same order).
    Each chunk takes its own path (gather, sharded or dense). Returns the
    bytes this rank sent and whether any chunk took a sparse path."""
    blocks, nb = as_blocks(flat, block_size)
    per_chunk = max(1, CHUNK_BYTES // (block_size * flat.element_size()))
    chunks: list[_Chunk] = []
    sent = 0
    link = torch.zeros(2, world, dtype=torch.int64)
    floor = torch.zeros(2, world, dtype=torch.int64)
    for k in range(-(-nb // per_chunk) + 2):
        lo = k * per_chunk
        if lo < nb:
            chunks.append(_Chunk(blocks[lo : lo + per_chunk], threshold, world, group))
        if 0 <= k - 1 < len(chunks):
            s, lk, fl = chunks[k - 1].start_phase1(rank, group, dense_margin)
            sent, link, floor = sent + s, link + lk, floor + fl
        if 0 <= k - 2 < len(chunks):
            chunks[k - 2].start_phase2(rank, group, threshold > 0)
    for c in chunks:
        c.finish(threshold > 0)
    if blocks.data_ptr() != flat.data_ptr():
        flat.copy_(blocks.reshape(-1)[: flat.numel()])
    went_sparse = any(c.path != DENSE for c in chunks)
    if state is not None:
        state.density_seen.append(sum(int(c.mask.sum()) for c in chunks) / max(1, nb))
        state.bytes_busiest_link += int(link.max())  # over ranks and directions, whole call
        state.bytes_floor += int(floor.max())
        state.sparse_calls += went_sparse
        for c in chunks:
            state.chunks[c.path] = state.chunks.get(c.path, 0) + 1
    return sent, went_sparse


# One gloo all_to_all of many megabytes moves at about half the link rate on
# shaped links here (a call's send and receive stop overlapping once they
# outgrow the socket buffers); rounds of at most this many bytes per peer, all
# in flight at once, reach the line rate (isend/irecv pieces were slower).
ROUND_BYTES = 512 * 1024
# The pipeline's unit: small enough to overlap scanning with the wire, large
# enough that per-chunk round trips stay a small share of it.
CHUNK_BYTES = 32 * 2**20


Pieces = list[list[tuple[int, torch.Tensor]]]


def _exchange(
    parts: list[torch.Tensor], recv_rows: list[int], rounds: int, rank: int, group: Any
) -> tuple[Pieces, list[Any]]:
    """Start an all-to-all of per-peer block rows in ``rounds`` asynchronous
    rounds (every rank passes the same ``rounds``: it comes from the shared
    plan). Returns, per peer, the pieces that will arrive as (first row, rows),
    and the works to wait for."""
    bs = parts[rank].shape[1]
    got: list[list[tuple[int, torch.Tensor]]] = [[] for _ in parts]
    pending = []
    for c in range(rounds):
        send = [
            p[c * len(p) // rounds : (c + 1) * len(p) // rounds] if i != rank else p[:0]
            for i, p in enumerate(parts)
        ]
        starts = [0 if i == rank else c * n // rounds for i, n in enumerate(recv_rows)]
        rows = [
            0 if i == rank else (c + 1) * n // rounds - starts[i] for i, n in enumerate(recv_rows)
        ]
        out = parts[rank].new_empty(sum(rows), bs)
        pending.append(
            dist.all_to_all_single(
                out.view(-1),
                torch.cat(send).view(-1),
                [k * bs for k in rows],
                [len(p) * bs for p in send],
                group=group,
                async_op=True,
            )
        )
        for i, piece in enumerate(torch.split(out, rows)):
            if len(piece):
                got[i].append((starts[i], piece))
    return got, pending


class _Chunk:
    """One chunk of blocks on its way through the pipeline: occupancy scan and
    bitmap gather, then phase 1 (the one exchange of the gather path, or the
    sharded path's first, or a dense all-reduce), then phase 2 (the sums)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        threshold: float,
        world: int,
        group: Any,
        plan: Plan | None = None,
    ) -> None:
        """Scan the chunk and start gathering the bitmaps, or take ``plan``
        (made from bitmaps gathered elsewhere: ``run_planned``)."""
        self.blocks = blocks
        self.path = DENSE
        self.got: Pieces = []
        self.works: list[Any] = []
        if plan is not None:
            self.plan, self.mask = plan, plan.masks[dist.get_rank(group)]
            return
        self.mask = occupancy(blocks, threshold)
        nbytes = -(-len(blocks) // 8)
        self.gathered = [  # on the data's device: nccl moves only GPU tensors
            torch.empty(nbytes, dtype=torch.uint8, device=blocks.device) for _ in range(world)
        ]
        self.works = [dist.all_gather(self.gathered, pack(self.mask), group=group, async_op=True)]

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []

    def start_phase1(
        self, rank: int, group: Any, dense_margin: float, force: str | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Plan the chunk, choose its path (``force``: that path) and start it.
        Returns (bytes this rank sends, bytes each rank sends and receives on
        that path, and the fewest any path could: both 2 x world)."""
        self.wait()
        blocks = self.blocks
        world, (nb, bs), elem = dist.get_world_size(group), blocks.shape, blocks.element_size()
        if force is None:  # the plan is made on the host (one bit per block): it sets the sizes
            self.plan = Plan.of(unpack(torch.stack(self.gathered).cpu(), nb))
        plan = self.plan
        on, block_bytes = blocks.device, bs * elem
        floor = torch.stack(plan.floor_vectors()) * block_bytes
        sharded = torch.stack(plan.link_vectors()) * block_bytes
        gather = torch.stack(plan.gather_vectors()) * block_bytes
        link = gather if int(gather.max()) <= int(sharded.max()) else sharded
        if force is not None:
            link = {GATHER: gather, SHARDED: sharded}.get(force, link)
        dense = ring_bytes(blocks, world)
        if force == DENSE or (force is None and int(link.max()) > dense_margin * dense):
            self.works = [dist.all_reduce(blocks, group=group, async_op=True)]
            return dense, torch.full_like(link, dense), floor
        self.per_round = max(1, ROUND_BYTES // block_bytes)
        if link is gather:
            self.path = GATHER
            self.held = [torch.nonzero(m).flatten() for m in plan.masks]
            self.mine = blocks[self.held[rank].to(on)]
            rows = [len(h) for h in self.held]
            rounds = -(-max(rows) // self.per_round)
            self.got, self.works = _exchange([self.mine] * world, rows, rounds, rank, group)
            return int(gather[0, rank]), link, floor
        self.path = SHARDED
        mine = plan.owner == rank
        self.shard_union = torch.nonzero(plan.union & mine).flatten()
        own_idx = torch.nonzero(plan.masks[rank]).flatten()
        self.from_r = [torch.nonzero(plan.masks[r] & mine).flatten() for r in range(world)]
        self.sends = [
            blocks[(self.from_r[rank] if o == rank else own_idx[plan.owner[own_idx] == o]).to(on)]
            for o in range(world)
        ]
        most1, self.most2 = plan.most_to_one_peer()
        rows = [len(f) for f in self.from_r]
        self.got, self.works = _exchange(self.sends, rows, -(-most1 // self.per_round), rank, group)
        return int(sharded[0, rank]), link, floor

    def start_phase2(self, rank: int, group: Any, zero_rest: bool) -> None:
        """Gather path: sum every rank's blocks, in rank order, and write the
        sums. Sharded path: sum what phase 1 brought into the shard's union
        and start sending it."""
        if self.path == DENSE:
            return  # its all-reduce is in flight
        self.wait()
        plan, on, width = self.plan, self.blocks.device, self.blocks.shape[1]
        if self.path == GATHER:
            union = torch.nonzero(plan.union).flatten()
            acc = self.blocks.new_zeros(len(union), width)
            for r, held in enumerate(self.held):
                at = torch.searchsorted(union, held).to(on)
                if r == rank:
                    acc.index_add_(0, at, self.mine)
                for lo, piece in self.got[r]:
                    acc.index_add_(0, at[lo : lo + len(piece)], piece)
            self._write(union, acc, zero_rest)
            self.got = []
            return
        self.acc = acc = self.blocks.new_zeros(len(self.shard_union), width)
        pos = [torch.searchsorted(self.shard_union, f).to(on) for f in self.from_r]
        acc.index_add_(0, pos[rank], self.sends[rank])
        for r in range(len(self.from_r)):
            for lo, piece in self.got[r]:
                acc.index_add_(0, pos[r][lo : lo + len(piece)], piece)
        self.unions = [
            torch.nonzero(plan.union & (plan.owner == o)).flatten().to(on)
            for o in range(len(self.from_r))
        ]
        rounds = -(-self.most2 // self.per_round)
        self.got, self.works = _exchange(
            [acc] * len(self.from_r), [len(u) for u in self.unions], rounds, rank, group
        )

    def _write(self, rows: torch.Tensor, sums: torch.Tensor, zero_rest: bool) -> None:
        if zero_rest:  # blocks under the threshold were not sent: they read as zero
            self.blocks.masked_fill_(~self.plan.union.unsqueeze(1).to(self.blocks.device), 0)
        # (with threshold 0 every block outside the union is zero already)
        self.blocks.index_copy_(0, rows.to(self.blocks.device), sums)

    def finish(self, zero_rest: bool) -> None:
        """Write the sharded path's sums in place."""
        self.wait()
        if self.path != SHARDED:
            return
        self._write(self.shard_union, self.acc, zero_rest)
        for o, pieces in enumerate(self.got):
            for lo, piece in pieces:
                self.blocks.index_copy_(0, self.unions[o][lo : lo + len(piece)], piece)


def run_planned(blocks: torch.Tensor, plan: Plan, path: str, group: Any, threshold: float) -> int:
    """Sum ``blocks`` (rows of one block) over ``group`` in place on ``path``
    (``dense``, ``gather`` or ``sharded``) with ``plan``, which every rank
    made from the same gathered bitmaps. Returns the bytes this rank sent."""
    chunk, rank = _Chunk(blocks, threshold, 0, group, plan=plan), dist.get_rank(group)
    sent, _, _ = chunk.start_phase1(rank, group, 1.0, force=path)
    chunk.start_phase2(rank, group, threshold > 0)
    chunk.finish(threshold > 0)
    return sent


def omnireduce_hook(
    state: OmniState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # DDP checks this exact annotation
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with ``sparse_allreduce``.

    Returns at once (``net.overlap``): the exchange runs on the state's
    communication thread, or, for a bucket whose scans went dense
    (``OmniState.dense_skip``), as an asynchronous all-reduce started here."""
    buf, key, world = bucket.buffer(), bucket.index(), dist.get_world_size()
    state.agree_layout(key, buf, "omnireduce_hook")
    if state.take_skip(key):
        ring = ring_bytes(buf, world)
        state.count(ring, ring)
        return state.dense(buf, world)

    def job(group: Any) -> torch.Tensor:
        state.fold()  # here, off the autograd thread
        return sparse_allreduce(buf, group=group, op="avg", state=state, key=key,
                                check_layout=False)  # (DDP checked its shapes)  # fmt: skip

    return state.run(buf, job)
