"""``sparse=True`` tables' gradients exchanged by rows (``collectives.coo``),
alone and under ``auto_hook`` in DDP, on real gloo process groups (CPU)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import pytest
import torch
from torch import nn

from gradfabric.collectives import coo
from gradfabric.net.launch import spawn

SHAPES = ((40, 4), (7, 5), (300, 6))  # (rows, width) per table


def _grad(rank: int, table: int) -> torch.Tensor:
    """Rank ``rank``'s uncoalesced gradient of ``table``: skewed ids with
    repeats; rank 1 holds none of the last table's rows; a NaN on rank 0 and
    an inf on rank 2 in the first table."""
    rows, width = SHAPES[table]
    g = torch.Generator().manual_seed(rank * 10 + table)
    n = 0 if (rank == 1 and table == 2) else 50
    ids = (torch.rand(n, generator=g) ** 3 * rows).long()
    vals = torch.randn(n, width, generator=g)
    if table == 0 and rank in (0, 2):
        vals[0, 1] = float("nan") if rank == 0 else float("inf")
    return torch.sparse_coo_tensor(ids[None], vals, (rows, width))


def _reference(world: int, table: int) -> torch.Tensor:
    """The float64 sum of every rank's gradient, each divided by the world."""
    ref = torch.zeros(SHAPES[table], dtype=torch.float64)
    for r in range(world):
        g = _grad(r, table).coalesce()
        ref.index_add_(0, g.indices()[0], g.values().double() / world)
    return ref


PLANS = (["gather"] * 3, ["sharded"] * 3, ["dense"] * 3, ["sharded", "dense", "gather"])
CAPS = (8, 10**5)  # ``gather_in_one``'s bound: every rank spills, none does


def _exchange_worker(rank: int, world: int, out: str) -> None:
    got = []
    for paths in PLANS:
        tables = [coo.Table.of(_grad(rank, k), world) for k in range(len(SHAPES))]
        extra = coo.share_counts(tables, torch.tensor([rank]), None)
        assert extra.flatten().tolist() == list(range(world))
        got.append([g.to_dense() for g in coo.exchange(tables, paths, None)])
    for cap in CAPS:  # counts and rows in one round; past the bound, a second
        tables = [coo.Table.of(_grad(rank, k), world) for k in range(len(SHAPES))]
        grads, extra, longest = coo.gather_in_one(tables, torch.tensor([rank, 7]), cap, None)
        assert extra.tolist() == [[r, 7] for r in range(world)]
        assert longest == coo.gather_length(tables, 2)  # the bound the next step is given
        assert all(t.counts is not None and int(t.counts.sum()) > 0 for t in tables)
        got.append([g.to_dense() for g in grads])
    torch.save(got, os.path.join(out, f"{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3])
def test_each_path_sums_every_table_as_float64_does_on_every_rank(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_exchange_worker, world, (tmp,))
        ranks = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
    for p, paths in enumerate([*PLANS, *(["gather"] * 3 for _ in CAPS)]):
        for k, path in enumerate(paths):
            ref = _reference(world, k)
            mine = ranks[0][p][k]
            finite = ref.isfinite()
            assert torch.allclose(mine.double()[finite], ref[finite], atol=1e-6), (paths, k)
            # NaN and inf where the float64 sum has them (inf + finite stays inf)
            assert torch.equal(mine.isnan(), ref.isnan()), (path, k)
            assert torch.equal(mine.isinf(), ref.isinf()), (path, k)
            for other in ranks[1:]:  # replicas identical, NaNs included
                assert torch.equal(other[p][k].nan_to_num(), mine.nan_to_num())


def _counts(per_rank: list[list[int]], world: int) -> coo.Table:
    """A table whose count matrix is built from each rank's row ids."""
    t = coo.Table(torch.Size((64, 4)), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))
    t.counts = torch.stack([torch.bincount(torch.tensor(ids) % world, minlength=world)
                            for ids in per_rank])  # fmt: skip
    return t


def test_link_bytes_count_what_each_path_delivers_to_the_busiest_rank() -> None:
    """Against a count of the rows each rank receives, path by path (4 ranks,
    disjoint ids: the union is the sum, so the estimate is exact)."""
    world, per_row = 4, 4 * 4 + coo.ID_BYTES
    per_rank = [[0, 1, 2, 5, 9], [3, 13, 17], [6, 10, 14, 18, 22, 26], [7]]
    t = _counts(per_rank, world)
    union = sum(len(ids) for ids in per_rank)
    got = coo.link_bytes(t, union)
    # gather: each rank receives the others' rows, padded to the longest list
    assert got["gather"] == (world - 1) * max(map(len, per_rank)) * per_row
    # sharded: its own shard's rows from the others, then the others' shards
    # (each padded to the largest shard)
    shard = [[i for ids in per_rank for i in ids if i % world == r] for r in range(world)]
    into = [sum(1 for q, ids in enumerate(per_rank) if q != r for i in ids if i % world == r)
            for r in range(world)]  # fmt: skip
    assert got["sharded"] == (max(into) + (world - 1) * max(map(len, shard))) * per_row
    assert got["dense"] == 2 * (world - 1) * 64 * 4 * 4 // world
    # where the ranks share their rows, the union shrinks the sharded path only
    assert coo.link_bytes(t, union / 4)["sharded"] < got["sharded"]
    assert coo.link_bytes(t, union / 4)["gather"] == got["gather"]


class _Recommender(nn.Module):
    """Two ``sparse=True`` bags (a large skewed one, a smaller uniform one)
    and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.EmbeddingBag(5000, 8, mode="sum", sparse=True)
        self.small = nn.EmbeddingBag(2000, 8, mode="sum", sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, big: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.cat([self.big(big), self.small(small)], 1))
        return out.squeeze(1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    big = (torch.rand(64, 3, generator=g) ** 4 * 5000).long()  # skewed: shared hot rows
    return big, torch.randint(0, 2000, (64, 2), generator=g), torch.randn(64, generator=g)


def _ddp_worker(rank: int, world: int, out: str, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradfabric.collectives.auto import AutoState, auto_hook
    from gradfabric.collectives.fast import register_hook

    replicas: list[tuple[Any, Any, Any]] = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = _Recommender()
        ddp = DDP(model)
        state = AutoState() if hooked else None
        if hooked:
            register_hook(ddp, state, auto_hook)
        replicas.append((model, ddp, torch.optim.SGD(model.parameters(), lr=0.1)))
    for step in range(steps):
        big, small, y = _batch(rank, step)
        for _, ddp, opt in replicas:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(big, small), y).backward()
            opt.step()
    assert state is not None
    paths: dict[str, int] = {}
    for b in state.summary().values():
        for p, n in b["paths"].items():
            paths[p] = paths.get(p, 0) + n
    weights = [[p.detach() for p in m.parameters()] for m, _, _ in replicas]
    torch.save({"weights": weights, "paths": paths, "tables": state.coo_tables,
                "one_round": state.coo_one_round, "hook_cpu": state.thread_cpu_s,
                "cpu": time.process_time()},
               os.path.join(out, f"{rank}.pt"))  # fmt: skip


def test_auto_hook_trains_sparse_tables_as_ddp_does() -> None:
    """3 ranks, 8 steps: the hooked replica's weights within float32 rounding
    of DDP's own sparse all-reduce, identical on every rank; the step's two
    tables grouped from the fourth step (DDP renumbers buckets after the
    first), counts and rows in one round."""
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_ddp_worker, world, (tmp, 8))
        got = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
    for mine in got:
        stock, hooked = mine["weights"]
        for a, b in zip(stock, hooked, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
        for a, b in zip(got[0]["weights"][1], hooked, strict=True):
            assert torch.equal(a, b)
        assert len(mine["tables"]) == 2
        coo_calls = {p: n for p, n in mine["paths"].items() if p.startswith("coo-")}
        assert sum(coo_calls.values()) == 2 * 8, mine["paths"]
        # both tables by all-gather, so from the fourth step on, in one round
        assert mine["paths"]["coo-gather"] >= 12 and mine["one_round"] >= 4, mine
        # the hook's thread did the tables' work: some CPU, within the process's
        assert 0 < mine["hook_cpu"] <= mine["cpu"], mine


def _dying_worker(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradfabric.collectives.auto import AutoState, auto_hook
    from gradfabric.core.errors import PeerTimeoutError

    torch.manual_seed(0)
    table = nn.Embedding(4096, 8, sparse=True)  # the only bucket: a table's
    ddp = DDP(table)
    state = AutoState(peer_timeout_s=3.0)
    ddp.register_comm_hook(state, auto_hook)
    g = torch.Generator().manual_seed(rank)
    msg = "no error"
    try:
        for step in range(4):
            if step == 2 and rank == 2:  # dies in its backward, before the exchange
                table.weight.register_hook(lambda _: os._exit(0))
            ddp(torch.randint(0, 4096, (16,), generator=g)).pow(2).mean().backward()
    except RuntimeError as e:  # DDP re-raises the hook's error; the state keeps it typed
        failure = state.failure
        named = isinstance(failure, PeerTimeoutError) and str(failure) in str(e)
        msg = f"{failure.peer}|{e}" if named and isinstance(failure, PeerTimeoutError) else f"-|{e}"
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(msg)


@pytest.mark.long  # (the default suite's 10 minutes; CI's second pass runs it)
def test_auto_hook_names_a_rank_that_died_before_the_tables_exchange() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_dying_worker, 3, (tmp,), timeout_s=20, deadline_s=90, barrier_at_exit=False)
        for r in (0, 1):
            with open(os.path.join(tmp, f"{r}.txt")) as f:
                peer, msg = f.read().split("|", 1)
            assert peer == "rank 2", msg


def test_row_ids_outside_the_table_are_an_error_not_memory_corruption() -> None:
    """The exchange builds gradients without PyTorch's invariant checks (they
    cost a pass per table); ids that no table holds are caught first."""
    t = coo.Table.of(torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 4), (5, 4)), 1)
    assert torch.equal(t.sparse(t.ids, t.rows).to_dense()[[1, 3]], torch.ones(2, 4))
    for bad in ([5], [-1]):
        with pytest.raises(ValueError, match="outside a table of 5 rows"):
            t.sparse(torch.tensor(bad), torch.ones(1, 4))


def _unlike_worker(rank: int, world: int, hook: str, unlike: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradfabric.collectives.auto import AutoState, auto_hook
    from gradfabric.collectives.fast import register_hook
    from gradfabric.collectives.rows import RowState, rows_hook
    from gradfabric.collectives.sparse import OmniState, omnireduce_hook

    torch.manual_seed(0)
    sparse = unlike == "sparse" and rank == 0  # rank 0's table only
    model = nn.Sequential(nn.EmbeddingBag(1000, 8, mode="sum", sparse=sparse), nn.Linear(8, 1))
    if unlike == "dtype" and rank == 1:
        model.double()  # (DDP checks the ranks' shapes, not their dtypes)
    ddp = DDP(model)
    rows = RowState() if sparse else RowState.track(model)  # (tracks dense tables only)
    states = {"auto_hook": (AutoState(rows=rows), auto_hook),
              "omnireduce_hook": (OmniState(), omnireduce_hook), "rows_hook": (rows, rows_hook)}
    register_hook(ddp, *states[hook])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    msg = "no error"
    try:
        for _ in range(3):
            loss = ddp(torch.randint(0, 1000, (64, 3))).float().sum()
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    except (RuntimeError, ValueError) as e:  # the hook's (DDP may wrap it)
        msg = str(e)
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(msg)


@pytest.mark.parametrize(
    ("hook", "unlike"),
    [("auto_hook", "sparse"), ("omnireduce_hook", "dtype"),
     *(pytest.param(h, u, marks=pytest.mark.long) for h, u in
       [("auto_hook", "dtype"), ("omnireduce_hook", "sparse"), ("rows_hook", "sparse"),
        ("rows_hook", "dtype")])],
)  # fmt: skip
def test_ranks_whose_buckets_differ_get_an_error_naming_them(hook: str, unlike: str) -> None:
    """A table ``sparse=True`` on rank 0 only, or rank 1's model in float64:
    DDP builds unlike buckets on the ranks (its default hook then dies in
    gloo's size check: the process aborts). The hooks agree
    on their buckets first, so every rank gets an error naming rank 1, and
    the processes end normally (``spawn`` fails on an abort)."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_unlike_worker, 2, (hook, unlike, tmp), timeout_s=20, deadline_s=90)
        for r in (0, 1):
            with open(os.path.join(tmp, f"{r}.txt")) as f:
                msg = f.read()
            assert f"{hook}: ranks [1] hold a bucket unlike rank 0's" in msg, msg
