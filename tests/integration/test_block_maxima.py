"""The block exponents' agreement (``runtime.client.block_maxima``) on a real gloo
group: every rank ends with the maximum over all ranks' exponents per block,
the "not finite" mark included, against numpy's maximum of the same seeded
arrays."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from gradfabric.net.launch import spawn
from gradfabric.runtime.client import NON_FINITE, block_maxima

BLOCKS = 37


def _exponents(rank: int) -> np.ndarray:
    e = np.random.default_rng(rank).integers(-140, 128, BLOCKS).astype(np.int32)
    if rank == 1:
        e[5] = NON_FINITE  # a block with a NaN or an inf at one rank only
    return e


def _worker(rank: int, world: int, out: str) -> None:
    want = np.max([_exponents(r) for r in range(world)], axis=0)
    stage = dist.new_group(list(range(world)))  # (as the hook's stage thread has its own)
    for group in (None, stage):
        got = block_maxima(torch.from_numpy(_exponents(rank)), group)
        assert got.dtype == torch.int32 and np.array_equal(got.numpy(), want), (rank, group)
    assert block_maxima(torch.zeros(0, dtype=torch.int32)).numel() == 0  # (an empty bucket)
    with open(os.path.join(out, f"ok{rank}"), "w"):
        pass


def test_every_rank_gets_the_maximum_of_every_rank_s_exponents() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, 3, (tmp,), threads=1)
        assert sorted(os.listdir(tmp)) == ["ok0", "ok1", "ok2"]
    assert NON_FINITE > 127  # (so the maximum carries the mark: no finite float32 has it)
