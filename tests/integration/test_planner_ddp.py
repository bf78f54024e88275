"""The planner's runtime: DDP with uneven per-rank batches gives the
full-batch gradient (float64 reference), and runs on throttled ranks."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.net.launch import spawn
from gradfabric.planner.cost import split
from gradfabric.planner.uneven import UnevenConfig, loss_weight, run_uneven

SHARES = [3, 9, 1]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(sum(SHARES), 5, generator=g, dtype=torch.float64),
        torch.randn(sum(SHARES), 1, generator=g, dtype=torch.float64),
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()


def _worker(rank: int, world: int, out: str) -> None:
    x, y = _data()
    lo = sum(SHARES[:rank])
    xs, ys = x[lo : lo + SHARES[rank]], y[lo : lo + SHARES[rank]]
    ddp = DDP(_model())
    loss = torch.nn.functional.mse_loss(ddp(xs), ys)
    (loss * loss_weight(len(xs), len(x), world)).backward()
    torch.save([p.grad for p in ddp.module.parameters()], f"{out}/{rank}.pt")


def test_uneven_batches_give_the_full_batch_gradient() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, len(SHARES), (tmp,))
        got = [torch.load(f"{tmp}/{r}.pt") for r in range(len(SHARES))]
    x, y = _data()
    model = _model()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for r in range(len(SHARES)):
        for a, ref in zip(got[r], model.parameters(), strict=True):
            # float64 sums of 3 terms in another order: a few ulps
            torch.testing.assert_close(a, ref.grad, rtol=1e-12, atol=1e-14)


def test_split_is_proportional_and_whole() -> None:
    assert split(512, [1.0, 0.4]) == [366, 146]
    assert sum(split(10, [1, 1, 1])) == 10


@pytest.mark.long  # (11 s; the uneven batches' exact gradient stays in the default suite)
def test_planned_shares_run_on_throttled_ranks() -> None:
    rec = run_uneven(UnevenConfig(speeds=(1.0, 0.5), batch=96, steps=3, width=128))
    assert rec["shares"]["planned"] == [64, 32] and rec["shares"]["even"] == [48, 48]
    # every step of both variants timed on the slowest rank (the speedup is the command's)
    assert all(len(rec["times_s"][k]) == 3 for k in ("even", "planned"))
