"""Every hook under the DDP features users turn on, against DDP's own all-reduce.

Each rank trains two copies of one model from the same weights on the same
batches: one under plain DDP (its built-in all-reduce: the reference) and one
with the hook, with the feature on in both. After the steps, the parameters
must agree. Tolerances: with 2 ranks every all-reduce here adds two float
values, and ``a + b == b + a`` exactly, so ``omnireduce_hook`` and
``auto_hook`` (dense ring, gather or sharded exchange) must match to the bit
(``assert_close`` with zero tolerance, NaN-aware). ``ina_hook`` quantises each
1024-value block on a shared exponent: its error is at most ``2 * 2**e /
(2 * (2**31 - 1))`` per value, ~5e-10 of the block's largest gradient, far
under float32 rounding of the result (1.2e-7 relative), then three SGD steps
at lr 0.1 with gradients under 10: 1e-6 absolute leaves room. fp16 and bf16
buckets: the sum of two half values rounded once is what DDP computes too.
``nonfinite``: at the second step rank 0's gradient holds a NaN and rank 1's
an infinity; every hook must spread them exactly as DDP's all-reduce does
(``ina_hook`` sums such blocks as floats outside the switch), except
``dlcp_hook``, whose wire carries finite floats only: it must say so, naming
the rank, rather than let a loss bound zero them.

``-compiled``: the same hook registered with ``collectives.fast.register_hook``,
its skipped (dense) calls run by the C++ hook, on a model with a dense bucket,
under each feature: it must give the bits the same hook gives in Python (the
same arithmetic: divide, then sum; the Python path is held to DDP's above)
and count the calls it ran.

Also here: the hooks return before their bucket is reduced (the overlap
``net.overlap`` exists for), ``auto_hook`` takes the sparse path on sparse
buckets and the dense one on dense buckets alike on every rank, counts every
call whichever side runs its dense calls, and its state pickles.
"""

from __future__ import annotations

import pickle
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.collectives import AutoState, OmniState, auto_hook, omnireduce_hook
from gradfabric.collectives.auto import by_bytes
from gradfabric.collectives.fast import register_hook, why_not
from gradfabric.collectives.rows import RowState, rows_hook
from gradfabric.core.errors import PeerTimeoutError
from gradfabric.net.launch import spawn
from gradfabric.net.overlap import Overlapped

FEATURES = (
    "plain", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
    "no_sync", "join", "fp16", "bf16", "compile", "nonfinite",
)  # fmt: skip


# what PyTorch itself cannot train with a sparse=True table on CPU (without
# a hook): half-precision sparse sums ("cadd_sparse" not implemented)
NO_SPARSE = ("fp16",)


class Net(nn.Module):
    """An embedding (sparse gradient rows), a dense layer, and a branch that a
    step may leave unused (``find_unused_parameters``). At ``width`` 1024 the
    branch's gradients (4 MB, 2 MB in half precision) fill DDP's first bucket
    (with ``out``'s): a dense bucket, whose calls the hooks' dense-skip (and the compiled hook)
    take over; at 64 every parameter shares one bucket."""

    def __init__(self, width: int = 64, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 32, sparse=sparse)
        self.dense = nn.Linear(32 * 4, width)
        self.branch = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.dense(self.emb(ids).flatten(1).to(self.dense.weight.dtype)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        out: torch.Tensor = self.out(h)
        return out


class _ByBytes(AutoState):
    """``auto_hook`` choosing each scan's path by its bytes alone
    (``by_bytes``, its first scan's rule). Its own choices follow the costs it
    fitted to this host's timings once two paths have been measured, so two
    runs of one job can take different paths; the runs that compare the
    compiled hook with the Python one take the same paths."""

    def _choose(self, key: int, link: dict[str, int]) -> str:
        return by_bytes(link)


def _state(
    hook: str, control: str | None, model: nn.Module, explore: bool = True
) -> tuple[Any, Callable[..., Any]]:
    """``explore`` False: ``auto_hook``'s paths by bytes alone (``_ByBytes``),
    alike in every run, not from this host's timings."""
    hook = hook.removesuffix("-compiled")
    if hook == "rows":  # verifying its ids at every call
        return RowState.track(model, verify_every=1), rows_hook
    if hook == "auto-rows":  # auto_hook, its tables by rows
        return AutoState(dense_skip=1, rows=RowState.track(model, verify_every=1)), auto_hook
    if hook == "omnireduce":
        return OmniState(dense_skip=1), omnireduce_hook
    if hook in ("auto", "auto-sparse"):  # (auto-sparse: the table's gradient sparse)
        if not explore:
            return _ByBytes(dense_skip=1), auto_hook
        return AutoState(dense_skip=1, explore_every=2), auto_hook
    from gradfabric.runtime.client import InaClient, parse_address
    from gradfabric.runtime.dlcp import DlcpClient
    from gradfabric.runtime.hook import dlcp_hook, ina_hook

    assert control is not None
    if hook == "dlcp":
        return DlcpClient.join(control=parse_address(control)), dlcp_hook
    return InaClient.join(control=parse_address(control)), ina_hook


def _train(
    feature: str, hook: str | None, control: str | None, rank: int, device: str = "cpu",
    width: int = 64, sparse: bool = False,
) -> list[torch.Tensor]:  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = Net(width, sparse).to(device)
    if feature in ("fp16", "bf16"):
        model = model.to(torch.float16 if feature == "fp16" else torch.bfloat16)
    kw: dict[str, Any] = {feature: True} if feature in FEATURES[1:4] else {}
    ddp = DDP(model, **kw)
    state = None
    if hook is not None:
        state, fn = _state(hook, control, model, explore=width == 64)  # the wide runs: by bytes
        if hook.endswith("-compiled"):
            assert register_hook(ddp, state, fn) == "compiled"
        else:
            ddp.register_comm_hook(state, fn)
    run: nn.Module = ddp
    if feature == "compile":
        run = torch.compile(ddp, backend="aot_eager")  # type: ignore[assignment]
    # the wide model's loss scaled (its fp16 gradients would underflow to zero
    # blocks, and no bucket would scan dense), its step scaled back
    scale = 1.0 if width == 64 else 1024.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / scale)
    g = torch.Generator().manual_seed(rank)
    # (the wide model: 5 steps, so its dense bucket is scanned and skipped more than once)
    steps = (3 if width == 64 else 5) + (rank if feature == "join" else 0)  # uneven inputs
    batches = [torch.randint(0, 4096, (8, 4), generator=g).to(device) for _ in range(steps * 2)]
    join: AbstractContextManager[Any] = Join([ddp]) if feature == "join" else nullcontext()
    with join:
        for step in range(steps):
            opt.zero_grad()
            use_branch = not (feature == "find_unused_parameters" and step == 1)
            if feature == "no_sync":  # accumulate a micro-batch locally, then sync
                with ddp.no_sync():
                    (run(batches[2 * step], use_branch).float().pow(2).mean() * scale).backward()
            loss = run(batches[2 * step + 1], use_branch).float().pow(2).mean() * scale
            if feature == "nonfinite" and step == 1:  # a NaN on rank 0, an inf on rank 1
                p = model.out.bias if rank == 0 else model.dense.bias  # type: ignore[union-attr]
                loss = loss + (float("nan") if rank == 0 else float("inf")) * p.float().sum()
            loss.backward()
            opt.step()
    if hook == "rows" and feature == "compile":  # compiled: no forward hooks, no ids
        assert state.untracked == ["emb"]  # seen at the first call: the table went dense
    elif hook == "rows":  # the table went by rows, its ids verified at every call
        assert state.rows_sent > 0 and state.calls > 0 and not state.untracked, feature
    if hook == "auto-rows" and feature != "compile":
        assert sum(b["paths"].get("rows", 0) for b in state.summary().values()) > 0, feature
    if state is not None and hasattr(state, "close"):
        state.close()
    if hook is not None and hook.endswith("-compiled"):  # C++ ran the skipped calls, counted
        assert state is not None
        state.fold()
        ran = int(state.table[:, 1].sum())
        assert ran > 0 and state.skipped_scans == ran and not any(state.skips_left.values())
    return [p.detach().float().cpu() for p in model.parameters()]


def _rank(rank: int, world: int, hook: str, control: str | None, out: str) -> None:
    results = {}
    for feature in FEATURES:
        if hook.endswith("-compiled"):  # against the same hook in Python, with a dense bucket
            ref = _train(feature, hook.removesuffix("-compiled"), control, rank, width=1024)
            got = _train(feature, hook, control, rank, width=1024)
        elif hook == "dlcp" and feature == "nonfinite":  # DLCP's wire carries finite floats
            with pytest.raises(ValueError, match=rf"rank {rank}'s bucket 0 holds \d+ NaN or inf"):
                _train(feature, hook, control, rank)  # (both ranks' buckets hold one)
            continue
        elif hook == "auto-sparse" and feature in NO_SPARSE:
            continue
        else:  # (auto-sparse: against DDP's own sparse all-reduce of the same table)
            sparse = hook == "auto-sparse"
            ref = _train(feature, None, control, rank, sparse=sparse)
            got = _train(feature, hook, control, rank, sparse=sparse)
        results[feature] = (ref, got)
        spread = [p.clone() for p in got]
        for p in spread:
            dist.broadcast(p, 0)
        results[feature + "/replica0"] = (spread, got)
    torch.save(results, f"{out}/{rank}.pt")


def _daemon(hook: str) -> tuple[str, ...]:
    from gradfabric.runtime.dlcp import DlcpClient

    if hook == "dlcp":
        return ("--policy", "dlcp", *DlcpClient.DAEMON_OPTIONS)
    return ("--policy", "atp")


@pytest.mark.parametrize(
    "hook",
    [pytest.param("omnireduce", marks=pytest.mark.long),  # (the compiled path's twin)
     pytest.param("auto", marks=pytest.mark.long),
     pytest.param("rows", marks=pytest.mark.long),  # (auto-rows sends rows under each feature)
     "auto-rows", "auto-sparse",
     pytest.param("ina", marks=pytest.mark.long),  # (trains through the switch by default)
     pytest.param("dlcp", marks=pytest.mark.long),  # (trains through a congested port)
     "omnireduce-compiled", pytest.param("auto-compiled", marks=pytest.mark.long)],
)  # fmt: skip
def test_each_hook_matches_ddp_under_each_feature(hook: str) -> None:
    """Each hook against DDP's default hook, to the bit where the arithmetic
    allows it: on 2 ranks every summed value has two addends, and IEEE
    addition commutes (a + b == b + a), so no reduction order (the ring's
    chunking, a sparse exchange, the switch's arrival order) can change a
    float sum; DDP's 1/world scaling before the sum and the hooks' after it
    are the same exact halving (bar half precision, below).
    (``dlcp_hook`` through an uncongested switch loses nothing; its server
    adds the two ranks' float32 values, exactly as the ring does.)"""
    from gradfabric.lab.daemon import switch_daemon

    if hook.endswith("-compiled") and (reason := why_not()) is not None:
        pytest.skip(f"the C++ hook: {reason}")
    # Half buckets: DDP scales each gradient by 1/world as it copies it into the
    # bucket and then sums; the hooks sum, then divide. In half precision the two
    # roundings may land one ulp apart (2**-10 relative, bf16 2**-7), or one
    # subnormal step near zero; three SGD steps at lr 0.1 carry that into weights.
    half = {"fp16": {"atol": 1e-6, "rtol": 2**-10}, "bf16": {"atol": 1e-5, "rtol": 2**-7}}
    exact = {"atol": 1e-6, "rtol": 0.0} if hook == "ina" else {"atol": 0.0, "rtol": 0.0}
    sw: AbstractContextManager[Any] = (
        switch_daemon(*_daemon(hook)) if hook in ("ina", "dlcp") else nullcontext()
    )
    with sw as daemon, tempfile.TemporaryDirectory() as tmp:
        control = daemon.control_text if daemon is not None else None
        # one intra-op thread a rank: the wide model's matmuls split their sums
        # by thread, and how many threads they get can change on a busy host (the
        # first training of a process, now and then), so two runs on default
        # threads can differ in every weight whatever the hook (measured: plain
        # DDP against itself under load, the same signature as 1 thread against 2)
        spawn(_rank, 2, (hook, control, tmp), deadline_s=300, threads=1)
        for r in range(2):
            results = torch.load(f"{tmp}/{r}.pt")
            for feature, (ref, got) in results.items():
                for a, b in zip(ref, got, strict=True):
                    if feature.endswith("/replica0"):  # replicas identical after training
                        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0, equal_nan=True,
                                                   msg=feature)  # fmt: skip
                    else:  # the compiled path: the Python path's arithmetic, to the bit
                        tol = exact if "-compiled" in hook else half.get(feature, exact)
                        torch.testing.assert_close(b, a, msg=feature, equal_nan=True, **tol)


def _overlap_rank(rank: int, world: int, out: str) -> None:
    """A bucket's future must come back before its reduction is done: time the
    hook's return against the future's completion on a 16 MB bucket."""
    model = nn.Linear(2048, 2048)
    ddp = DDP(model, bucket_cap_mb=64)
    returned: list[float] = []
    done: list[float] = []
    state = OmniState(dense_skip=0)

    def timed(state: OmniState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = omnireduce_hook(state, bucket)
        returned.append(time.perf_counter())
        return fut.then(lambda f: (done.append(time.perf_counter()), f.value())[1])

    # DDP checks the annotations themselves (this module's are strings)
    timed.__annotations__ = {"state": OmniState, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}  # fmt: skip
    ddp.register_comm_hook(state, timed)
    began, spans = [], []
    for _ in range(3):
        began.append(time.perf_counter())
        ddp(torch.randn(16, 2048)).sum().backward()
        spans.append(state.spans_since(began[-1]))
    torch.save((returned, done, began, spans), f"{out}/{rank}.pt")


def test_the_hook_returns_before_its_bucket_is_reduced() -> None:
    """...and the hook's thread tells when it held each bucket
    (``Overlapped.spans_since``, what ``bench ddp`` draws as a step's
    timeline): after the step began, before the bucket's future completed."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_overlap_rank, 2, (tmp,))
        for r in range(2):
            returned, done, began, spans = torch.load(f"{tmp}/{r}.pt")
            assert len(returned) == len(done) == 3
            # every call returned before its own future completed
            assert all(a < b for a, b in zip(returned, done, strict=True))
            for t0, step, end in zip(began, spans, done, strict=True):
                ((start, work, stop),) = step  # one bucket a step, one job, not staged
                assert 0 <= start == work <= stop <= end - t0


class _Tied(nn.Module):
    """An embedding whose weight, from ``tie`` on, is also the output layer:
    every row's gradient is non-zero, looked up or not."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 16)
        self.dense = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, tie: bool) -> torch.Tensor:
        h = torch.tanh(self.dense(self.emb(ids).mean(1)))
        out: torch.Tensor = h @ self.emb.weight.T if tie else h
        return out


def _rows_rank(rank: int, world: int, out: str) -> None:
    results = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = _Tied()
        ddp = DDP(model)
        state = None
        if hooked:
            state = RowState.track(model)  # full checks every 100 calls: the probe must see it
            ddp.register_comm_hook(state, rows_hook)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            opt.zero_grad()
            ddp(torch.randint(0, 1000, (8, 3), generator=g), step >= 2).pow(2).mean().backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
        if state is not None:
            results.append((state.untracked, state.calls, state.rows_sent))
    torch.save(results, f"{out}/{rank}.pt")


def test_rows_hook_with_adam_and_a_table_used_outside_its_lookups() -> None:
    """``rows_hook`` under Adam (which ``sparse=True`` cannot serve) equals
    DDP's all-reduce to the bit on 2 ranks; from step 2 the table is also the
    output layer, so rows outside the looked-up ids carry gradient: the
    sampled check of the first such call (not a full one) sees it, the table
    goes dense on both ranks, and the result is still DDP's."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rows_rank, 2, (tmp,))
        for r in range(2):
            ref, got, (untracked, calls, rows_sent) = torch.load(f"{tmp}/{r}.pt")
            for a, b in zip(ref, got, strict=True):
                torch.testing.assert_close(b, a, atol=0.0, rtol=0.0)
            # steps 0-1 by rows, step 2's probe found the tie, step 3 all-reduced whole
            assert untracked == ["emb"] and calls == 4 and 0 < rows_sent <= 2 * 8 * 3


def _rows_bytes_rank(rank: int, world: int, out: str) -> None:
    results = []
    for rows in (50, 100_000):  # every row touched each step; a few of many
        results_for: list[Any] = []
        for hook in (False, True):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Embedding(rows, 8), nn.Flatten(), nn.Linear(8 * 64, 1))
            ddp = DDP(m)
            state = None
            if hook:
                state = RowState.track(m)
                ddp.register_comm_hook(state, rows_hook)
            g = torch.Generator().manual_seed(rank)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                ids = torch.randint(0, rows, (16, 64), generator=g)
                ddp(ids).pow(2).mean().backward()
                opt.step()
            results_for.append([p.detach().clone() for p in m.parameters()])
            if state is not None:
                results_for.append((state.dense_by_bytes, state.rows_sent))
        results.append(results_for)
    torch.save(results, f"{out}/{rank}.pt")


def test_rows_hook_takes_the_ring_where_it_moves_fewer_bytes() -> None:
    """3 ranks, 1,024 lookups a step: a 50-row table is touched everywhere, so
    the rows' all-gather would move more than the ring (each rank receives 2
    others' 50 rows against the ring's 2/3 of 50 rows): those calls all-reduce
    the table; a 100,000-row table goes by rows. Both end where DDP's
    all-reduce does (3 addends in another order: float32 rounding)."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rows_bytes_rank, 3, (tmp,))
        for r in range(3):
            (small_ref, small, (small_dense, _)), (big_ref, big, (big_dense, big_rows)) = (
                torch.load(f"{tmp}/{r}.pt")
            )
            assert small_dense == 3 and big_dense == 0 and big_rows > 0
            for a, b in [*zip(small_ref, small, strict=True), *zip(big_ref, big, strict=True)]:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _rows_dying_rank(rank: int, world: int, out: str) -> None:
    import os

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    state = RowState.track(model, peer_timeout_s=3.0)
    ddp.register_comm_hook(state, rows_hook)
    g = torch.Generator().manual_seed(rank)
    msg = "no error"
    try:
        for step in range(4):
            if step == 2 and rank == 2:  # dies in the middle of its backward pass
                model.dense.weight.register_hook(lambda _: os._exit(0))
            ddp(torch.randint(0, 4096, (8, 4), generator=g)).pow(2).mean().backward()
    except RuntimeError as e:  # DDP re-raises the hook's error; the state keeps it typed
        failure = state.failure
        ok = isinstance(failure, PeerTimeoutError) and str(failure) in str(e)
        msg = f"{failure.peer}|{e}" if ok and isinstance(failure, PeerTimeoutError) else f"-|{e}"
    with open(f"{out}/{rank}.txt", "w") as f:
        f.write(msg)


@pytest.mark.long
def test_rows_hook_names_a_rank_that_died_in_backward() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rows_dying_rank, 3, (tmp,), timeout_s=20, deadline_s=90, barrier_at_exit=False)
        for r in (0, 1):
            with open(f"{tmp}/{r}.txt") as f:
                peer, msg = f.read().split("|", 1)
            assert peer == "rank 2", msg


class _Staged(Overlapped):
    pass


def _staged_rank(rank: int, world: int, out: str) -> None:
    """Six buckets in two stages, each stage a collective on its own group:
    the first a MAX, the second a SUM of the first's result. Bucket 3's first
    stage fails on both ranks before its collective: on rank 1 as a rank
    whose exponent round names a dead peer would, on rank 0 otherwise."""
    state = _Staged()
    futures = []
    for k in range(6):
        buf = torch.full((4,), float(10 * k + rank))

        def first(group: Any, buf: torch.Tensor = buf, k: int = k) -> torch.Tensor:
            if k == 3:
                raise PeerTimeoutError("rank 7", 1.0) if rank else ValueError("bad bucket")
            m = buf.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            return m

        def then(group: Any, m: torch.Tensor, buf: torch.Tensor = buf) -> torch.Tensor:
            dist.all_reduce(m, group=group)
            return buf.copy_(m)

        futures.append(state.run_staged(buf, first, then))
    got: list[Any] = []
    for f in futures:
        try:
            got.append(f.wait().tolist())
        except RuntimeError as e:
            got.append(str(e))
    torch.save((got, repr(state.failure)), f"{out}/{rank}.pt")


def test_staged_buckets_pair_up_in_order_and_keep_their_errors() -> None:
    """``Overlapped.run_staged``: each bucket's second stage gets its own
    first stage's result, the collectives of both stages pair up across ranks
    in submission order (a bucket out of order would sum another bucket's
    maximum), and an error in a first stage fails that bucket alone, with its
    text, and stays typed as the state's ``failure``."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_staged_rank, 2, (tmp,))
        (got0, failure0), (got1, failure1) = (torch.load(f"{tmp}/{r}.pt") for r in range(2))
    for k in (0, 1, 2, 4, 5):  # max over ranks is 10k + 1; summed over 2 ranks
        assert got0[k] == got1[k] == [2.0 * (10 * k + 1)] * 4
    assert "bad bucket" in got0[3] and failure0.startswith("ValueError")
    assert "rank 7" in got1[3] and failure1.startswith("PeerTimeoutError")


def _auto_rank(rank: int, world: int, compiled: bool, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(200_000, 16), nn.Flatten(), nn.Linear(64, 512),
                          nn.Tanh(), nn.Linear(512, 512))  # fmt: skip
    summaries = []
    for fast in (False, True) if compiled else (False,):
        ddp = DDP(model, bucket_cap_mb=1)
        state = AutoState(dense_skip=2, explore_every=3)
        if fast:
            assert register_hook(ddp, state, auto_hook) == "compiled"
        else:
            ddp.register_comm_hook(state, auto_hook)
        g = torch.Generator().manual_seed(rank)
        for _ in range(12):
            ddp.zero_grad()
            ddp(torch.randint(0, 200_000, (32, 4), generator=g)).pow(2).mean().backward()
        summaries.append(state.summary())
    clone = pickle.loads(pickle.dumps(state))
    torch.save((summaries, clone.summary(), clone._comm), f"{out}/{rank}.pt")


def test_auto_hook_takes_sparse_for_sparse_buckets_and_decides_alike_everywhere() -> None:
    """An embedding of 200,000 x 16 (a batch touches <= 128 rows: under 1% of
    its blocks) and dense layers in their own buckets: the embedding's bucket
    goes sparse, the dense buckets never cost more bytes than the ring, every
    rank logs the same paths, and the state pickles without its thread."""
    compiled = why_not() is None  # then also with the dense calls in C++
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_auto_rank, 2, (compiled, tmp))
        (runs0, c0, comm0), (runs1, _, _) = (torch.load(f"{tmp}/{r}.pt", weights_only=False)
                                             for r in range(2))  # fmt: skip
        for r0, r1 in zip(runs0, runs1, strict=True):  # every rank logs the same paths
            assert r0.keys() == r1.keys() and all(r0[k]["paths"] == r1[k]["paths"] for k in r0)
        s0 = runs0[0]  # the Python run's paths (the compiled run's explorations may differ)
        for other in runs0[1:]:  # every call counted, whichever side ran it (the paths
            # themselves follow measured times, which differ from run to run)
            assert {k: (sum(b["paths"].values()), b["bytes_dense"]) for k, b in other.items()} == {
                k: (sum(b["paths"].values()), b["bytes_dense"]) for k, b in s0.items()
            }
        emb = max(s0, key=lambda k: s0[k]["bytes_dense"])  # the embedding's bucket
        assert s0[emb]["paths"].get("sparse", 0) >= 10
        calls = s0[emb]["paths"]  # (a dense call is an exploration: it saves nothing)
        share = calls["sparse"] / sum(calls.values())
        assert s0[emb]["saved_bytes"] > 0.95 * share * s0[emb]["bytes_dense"]
        # A dense bucket's sparse exchange moves exactly the ring's bytes at 2
        # ranks (each rank's every block to the other), so there the measured
        # times pick, and either path is right; neither may cost more bytes.
        dense = [k for k in s0 if k != emb]
        assert dense and all(set(s0[k]["paths"]) <= {"dense", "sparse"} for k in dense), runs0
        assert all(s0[k]["saved_bytes"] >= 0 for k in dense), runs0
        assert comm0 is None and c0 == runs0[-1]  # the last run's state, pickled


def _cuda_rank(rank: int, world: int, hook: str, out: str) -> None:
    results = {}
    for feature in ("plain", "gradient_as_bucket_view", "fp16", "no_sync"):
        results[feature] = (_train(feature, None, None, rank, "cuda"),
                            _train(feature, hook, None, rank, "cuda"))  # fmt: skip
    torch.save(results, f"{out}/{rank}.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hook", ["omnireduce", "auto"])
def test_each_hook_on_cuda_tensors_matches_ddp(hook: str) -> None:
    """The hooks on CUDA buckets (gloo ranks sharing one GPU): the thread runs
    on its own stream after the bucket's event (``net.overlap``); the same
    tolerances as on the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_cuda_rank, 2, (hook, tmp), deadline_s=300)
        for r in range(2):
            for feature, (ref, got) in torch.load(f"{tmp}/{r}.pt").items():
                exact = feature != "fp16"
                tol = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 1e-6, "rtol": 2**-10}
                for a, b in zip(ref, got, strict=True):
                    torch.testing.assert_close(b, a, msg=feature, **tol)


def _auto_switch_rank(rank: int, world: int, control: str, out: str) -> None:
    from gradfabric.runtime.client import InaClient, parse_address

    params, paths = [], {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        ddp = DDP(model)
        if hooked:
            client = InaClient.join(control=parse_address(control))
            state = AutoState(switch=client, dense_skip=0, explore_every=2)
            ddp.register_comm_hook(state, auto_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(8):
            opt.zero_grad()
            ddp(torch.randn(16, 256, generator=g)).pow(2).mean().backward()
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
        if hooked:
            paths = _paths_of(state)
            client.close()
    torch.save((params, paths), f"{out}/{rank}.pt")


def _paths_of(state: AutoState) -> dict[str, int]:
    total: dict[str, int] = {}
    for b in state.summary().values():
        for p, n in b["paths"].items():
            total[p] = total.get(p, 0) + n
    return total


def test_auto_hook_with_a_switch_takes_the_in_network_path_too() -> None:
    """With a switch configured, a dense bucket's first call goes through it
    (no measurement yet; its bytes tie with the ring's at 2 ranks and the ring
    is taken on a tie only once measured), then the paths are measured and
    explored: both ``ina`` and ``dense`` run, and the weights follow DDP's
    (``ina``'s block quantisation, ~5e-10 of a block's peak: 1e-6 absolute
    after 8 steps)."""
    from gradfabric.lab.daemon import switch_daemon

    with switch_daemon("--policy", "atp") as sw, tempfile.TemporaryDirectory() as tmp:
        spawn(_auto_switch_rank, 2, (sw.control_text, tmp), deadline_s=120)
        for r in range(2):
            (ref, got), paths = torch.load(f"{tmp}/{r}.pt")
            assert paths.get("ina", 0) >= 1 and paths.get("dense", 0) >= 1, paths
            for a, b in zip(ref, got, strict=True):
                torch.testing.assert_close(b, a, atol=1e-6, rtol=0.0)
