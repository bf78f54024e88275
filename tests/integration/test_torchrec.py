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

from gradfabric.net.launch import spawn

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


def _counted_rank(rank: int, world: int, sharding: str, out: str) -> None:
    """One DLRM step through ``trec.shard(sharding)``, counting the bytes each
    of TorchRec's all-to-alls hands gloo for the other ranks (its inputs'
    split sizes times a row's bytes), against ``trec.link_bytes``; and the
    sharded tables gathered whole against the model's own weights."""
    from gradfabric.lab import trec
    from gradfabric.workloads.trained import Dlrm

    sent, got = [0] * world, [0] * world
    plain = dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                input_split_sizes: Any = None, *rest: Any, **kw: Any) -> Any:  # fmt: skip
        for tensor, splits, into in ((input, input_split_sizes, sent),
                                     (output, output_split_sizes, got)):  # fmt: skip
            row = tensor[:1].numel() * tensor.element_size() if len(tensor) else 0
            for r, n in enumerate(splits or [len(tensor) // world] * world):
                into[r] += n * row if r != rank else 0
        return plain(output, input, output_split_sizes, input_split_sizes, *rest, **kw)

    torch.manual_seed(0)
    model = Dlrm(rows=(1000, 300, 50), dim=16)
    weights = [b.weight.detach().clone() for b in model.bags()]
    dmp, opts = trec.shard(model, lr=0.01, sharding=sharding)
    whole = trec.tables(dmp)
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randint(0, n, (64,), generator=g) for n in (1000, 300, 50)], 1)
    dist.all_to_all_single = counted  # type: ignore[assignment]
    try:
        dmp(torch.randn(64, 13, generator=g), ids).sum().backward()
    finally:
        dist.all_to_all_single = plain
    for o in opts:
        o.step()
    counts = torch.tensor([sum(sent), sum(got)], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, counts)
    torch.save({"plan": trec.plan(dmp), "model": trec.link_bytes(dmp), "weights": weights,
                "whole": whole, "counted": max(float(c.max()) for c in every)},
               f"{out}/{rank}.pt")  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_link_bytes_are_the_bytes_torchrecs_all_to_alls_send(sharding: str) -> None:
    """4 ranks, 3 tables of 16 columns: column-wise cuts each into 4 shards
    of 4 columns, one per rank. The model counts ids, lengths, pooled rows
    and their gradients; the count adds only the splits' few int64s."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_counted_rank, 4, (sharding, tmp), deadline_s=240)
        got = [torch.load(f"{tmp}/{r}.pt") for r in range(4)]
    for r in got:
        assert all(p.startswith(sharding) for p in r["plan"].values())
        if sharding == "column_wise":
            assert all(p.endswith("[0, 1, 2, 3]") for p in r["plan"].values())
        for w, whole in zip(r["weights"], r["whole"], strict=True):
            assert torch.equal(w, whole)  # the shards hold the model's own weights
        assert 0 <= r["counted"] - r["model"] <= 256, (r["counted"], r["model"])


@pytest.mark.long
@pytest.mark.timeout(300)
def test_bench_ddp_runs_torchrec_beside_the_hooks_from_the_same_weights() -> None:
    """``bench ddp --hooks default,torchrec`` on the mixed model: TorchRec's
    replica starts from the default replica's weights, is fed its batches,
    and after the steps its table (gathered) and dense layers are where the
    default hook's are, to float32 rounding of the sums' order."""
    from gradfabric.lab.ddp_bench import DdpBenchConfig, run_ddp_bench

    hooks = ("default", "torchrec", "torchrec-cw")
    rows = run_ddp_bench(DdpBenchConfig(models=("mixed",), hooks=hooks, steps=4, warmup=1))
    got = {r["hook"]: r for r in rows}
    assert set(got) == set(hooks)
    for h in hooks[1:]:  # both shardings: the default hook's weights, to rounding
        assert got[h]["max_param_diff_vs_default"] < 1e-6
        assert got[h]["grad_mb"] == got["default"]["grad_mb"]
        assert got[h]["iter_ms"] > 0
    assert all(p.startswith("column_wise") for p in got["torchrec-cw"]["sharding"].values())
