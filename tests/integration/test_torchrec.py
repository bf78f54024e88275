"""The optional TorchRec baseline (``GRADFABRIC_TORCHREC=1 bash
scripts/bootstrap.sh``; skipped where it is not installed): the pinned pair
runs ``DistributedModelParallel`` on CPU over gloo, and its answers are the
arithmetic's. Two ranks, two tables sharded by TorchRec's own planner; each
rank's pooled embeddings must equal the sums of the looked-up rows of the
full tables (gathered from their owners' shards), and one fused EXACT_SGD
step must move exactly the looked-up rows, by lr times the rows' gradients
averaged over both ranks' batches."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradfabric.collectives.spawn import spawn

pytest.importorskip("torchrec", reason="the TorchRec extra is not installed")

ROWS, DIM, BATCH, LR = (1000, 2000), 16, 8, 0.1


def _full(model: Any, name: str, rows: int) -> torch.Tensor:
    """Table ``name`` whole on every rank, from its owner's shards."""
    sharded = model.state_dict()[f"embedding_bags.{name}.weight"]
    full = torch.zeros(rows, DIM)
    for s in sharded.local_shards():
        r0, c0 = s.metadata.shard_offsets
        full[r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]] = s.tensor
    dist.all_reduce(full)  # each entry lives on exactly one rank
    return full


def _rank(rank: int, world: int, out: str) -> None:
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n,
                                          feature_names=[f"f{i}"])
              for i, n in enumerate(ROWS)]  # fmt: skip
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    )
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder])
    g = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, n, (BATCH, 2), generator=g) for n in ROWS]  # 2 ids per sample
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"], values=torch.cat([i.reshape(-1) for i in ids]),
        lengths=torch.full((2 * BATCH,), 2, dtype=torch.int64),
    )  # fmt: skip
    before = [_full(model, f"t{i}", n) for i, n in enumerate(ROWS)]
    pooled = model(kjt).to_dict()  # by name: a KeyedTensor comes back in sharding order
    weights = torch.arange(BATCH * DIM, dtype=torch.float32).reshape(BATCH, DIM) / 100
    sum((pooled[f"f{i}"] * weights).sum() for i in range(2)).backward()
    after = [_full(model, f"t{i}", n) for i, n in enumerate(ROWS)]
    every_ids = [torch.zeros(world, BATCH, 2, dtype=torch.int64) for _ in ROWS]
    for i, own in enumerate(ids):  # the step sums every rank's batch
        every_ids[i][rank] = own
        dist.all_reduce(every_ids[i])
    torch.save({"ids": ids, "every_ids": every_ids, "before": before, "after": after,
                "pooled": pooled, "weights": weights}, f"{out}/{rank}.pt")  # fmt: skip


@pytest.mark.timeout(300)
def test_torchrec_dmp_pools_and_steps_as_the_arithmetic_says() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, 2, (tmp,), deadline_s=240)
        got = [torch.load(f"{tmp}/{r}.pt") for r in range(2)]
    for r in got:
        for i in range(2):
            ref = r["before"][i][r["ids"][i]].sum(1)  # sum pooling of each sample's ids
            torch.testing.assert_close(r["pooled"][f"f{i}"], ref, rtol=1e-6, atol=1e-6)
            grad = torch.zeros_like(r["before"][i])
            for ids in r["every_ids"][i]:  # each sample's output gradient, to each of its rows
                grad.index_add_(0, ids.reshape(-1), r["weights"].repeat_interleave(2, 0))
            # TorchRec divides the embeddings' gradients by the world size (its
            # all-to-all's gradient division), as DDP averages dense ones
            expect = r["before"][i] - LR * grad / 2
            torch.testing.assert_close(r["after"][i], expect, rtol=1e-5, atol=1e-6)
            still = grad.abs().sum(1) == 0  # rows no rank looked up: not moved at all
            assert still.any() and torch.equal(r["after"][i][still], r["before"][i][still])


@pytest.mark.long
@pytest.mark.timeout(300)
def test_bench_ddp_runs_torchrec_beside_the_hooks_from_the_same_weights() -> None:
    """``bench ddp --hooks default,torchrec`` on the mixed model: TorchRec's
    replica starts from the default replica's weights, is fed its batches,
    and after the steps its table (gathered) and dense layers are where the
    default hook's are, to float32 rounding of the sums' order."""
    from gradfabric.collectives.ddpbench import DdpBenchConfig, run_ddp_bench

    rows = run_ddp_bench(DdpBenchConfig(models=("mixed",), hooks=("default", "torchrec"),
                                        steps=4, warmup=1))  # fmt: skip
    got = {r["hook"]: r for r in rows}
    assert set(got) == {"default", "torchrec"}
    assert got["torchrec"]["max_param_diff_vs_default"] < 1e-6
    assert got["torchrec"]["grad_mb"] == got["default"]["grad_mb"]
    assert got["torchrec"]["iter_ms"] > 0
