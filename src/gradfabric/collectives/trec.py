"""TorchRec's ``DistributedModelParallel`` as a baseline in ``bench ddp``.

Recommender engineers train embedding-heavy models with TorchRec: tables
sharded across ranks (the planner picks table-wise, column-wise, ... per
table), lookups exchanged by all-to-all, the tables' optimizer fused into
their backward; the dense layers under DDP. ``shard(mixed, lr)`` builds that
from a ``ddpbench.Mixed`` model with its very weights (the table copied into
the shards TorchRec's planner placed), so its replica starts where the
others do and is fed the same batches. TorchRec is an optional install
(``requirements-torchrec.txt``); ``why_not()`` says why it cannot run here.
On CPU its fused optimizers are the EXACT_* family, so this baseline runs
with SGD (EXACT_SGD on the table, SGD on the rest, at the bench's rate);
TorchRec divides the tables' gradients by the world size, as DDP averages
the dense ones, so its arithmetic is the other replicas'.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FEATURE = "ids"


def why_not() -> str | None:
    """None where TorchRec imports, else why not."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # an ImportError, or fbgemm's undefined symbols
        return f"torchrec is not importable ({e!r}): GRADFABRIC_TORCHREC=1 scripts/bootstrap.sh"
    return None


class Pooled(nn.Module):
    """``Mixed`` with its embedding bag as TorchRec's ``EmbeddingBagCollection``
    (one table, one feature; sum pooling), taking the same id batches."""

    def __init__(self, rows: int, dim: int, mlp: nn.Module) -> None:
        super().__init__()
        import torchrec

        table = torchrec.EmbeddingBagConfig(
            name="t", embedding_dim=dim, num_embeddings=rows, feature_names=[FEATURE]
        )
        self.ebc = torchrec.EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
        self.mlp = mlp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(
            keys=[FEATURE], values=ids.reshape(-1),
            lengths=torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64),
        )  # fmt: skip
        out: torch.Tensor = self.mlp(self.ebc(kjt).to_dict()[FEATURE]).squeeze(1)
        return out


def shard(mixed: Any, lr: float) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """``mixed`` (a ``ddpbench.Mixed``) as TorchRec would train it: the
    sharded model (its table holding ``mixed``'s weights) and the dense
    layers' optimizer (the table's is fused)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    weight = mixed.emb.weight.detach()
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    )
    dmp = DistributedModelParallel(
        Pooled(weight.shape[0], weight.shape[1], mixed.mlp), device=torch.device("cpu"),
        sharders=[sharder],
    )  # fmt: skip
    sharded = dmp.state_dict()["ebc.embedding_bags.t.weight"]
    with torch.no_grad():
        for s in sharded.local_shards():  # views of the fused kernel's own weights
            r0, c0 = s.metadata.shard_offsets
            rows, cols = s.tensor.shape
            s.tensor.copy_(weight[r0 : r0 + rows, c0 : c0 + cols])
    dense = [p for n, p in dmp.named_parameters() if ".ebc." not in n and not n.startswith("ebc.")]
    return dmp, [torch.optim.SGD(dense, lr=lr)]


def table(dmp: nn.Module) -> torch.Tensor:
    """The sharded table whole, on every rank (each entry lives on one rank)."""
    sharded = dmp.state_dict()["ebc.embedding_bags.t.weight"]
    with warnings.catch_warnings():  # TorchRec's state is a ShardedTensor, which torch deprecates
        warnings.simplefilter("ignore", FutureWarning)
        full = torch.zeros(sharded.size())
    for s in sharded.local_shards():
        r0, c0 = s.metadata.shard_offsets
        full[r0 : r0 + s.tensor.shape[0], c0 : c0 + s.tensor.shape[1]] = s.tensor
    dist.all_reduce(full)
    return full
