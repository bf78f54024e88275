"""TorchRec's ``DistributedModelParallel`` as a baseline in ``bench ddp``.

Recommender engineers train embedding-heavy models with TorchRec: tables
sharded across ranks (the planner picks table-wise, column-wise, ... per
table), lookups exchanged by all-to-all, the tables' optimizer fused into
their backward; the dense layers under DDP. ``shard(model, lr)`` builds that
from a ``workloads.trained`` model with tables (``Mixed``, ``Dlrm``, ``NeuMF``) with its
very weights (each table copied into the shards TorchRec's planner placed),
so its replica starts where the others do and is fed the same batches.
TorchRec is an optional install (``requirements-torchrec.txt``);
``why_not()`` says why it cannot run here.
On CPU its fused optimizers are the EXACT_* family, so this baseline runs
with SGD (EXACT_SGD on the tables, SGD on the rest, at the bench's rate);
TorchRec divides the tables' gradients by the world size, as DDP averages
the dense ones, so its arithmetic is the other replicas'.

Which sharding is TorchRec's best depends on the setting, so ``bench ddp``
runs two: its planner's (``torchrec``: table-wise for the large tables, here
each on its own rank, small ones data-parallel at 2 and 4 ranks) and column-wise over every
rank (``torchrec-cw``: each table cut into ``world`` column shards, so every
rank owns a slice of every table and the all-to-all is balanced, where
table-wise leaves the busiest link to the largest table's owner). The
other sharders its CPU kernels offer are not worth a replica: data-parallel
all-reduces every table whole (the 400k-row table alone is 51 MB a step),
and table-column-wise places a table's column shards on one host's ranks,
which with one rank per host is column-wise again. Row-wise needs the GPU
kernels.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def why_not() -> str | None:
    """None where TorchRec imports, else why not."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # an ImportError, or fbgemm's undefined symbols
        return f"torchrec is not importable ({e!r}): GRADFABRIC_TORCHREC=1 scripts/bootstrap.sh"
    return None


class Pooled(nn.Module):
    """A bench model (``workloads.trained``: ``Mixed``, ``Dlrm``, ``NeuMF``) with
    its tables as one TorchRec ``EmbeddingBagCollection`` (a table and a
    feature per table; sum pooling, so an ``nn.Embedding`` looked up by one id
    per sample is a bag of one), taking the same batches: the model's own
    ``lookups`` splits them, its own ``head`` finishes from the pooled rows."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        import torchrec

        bags: list[nn.Embedding | nn.EmbeddingBag] = list(model.bags())
        tables = [
            torchrec.EmbeddingBagConfig(name=f"t{k}", embedding_dim=b.embedding_dim,
                                        num_embeddings=b.num_embeddings, feature_names=[f"f{k}"])
            for k, b in enumerate(bags)
        ]  # fmt: skip
        self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.model = [model]  # (a list: its bags are not this module's parameters)
        self.dense = nn.ModuleList(model.dense())
        self.keys = [f"f{k}" for k in range(len(bags))]
        self.shapes = [(b.num_embeddings, b.embedding_dim) for b in bags]
        self.lookups: list[tuple[int, int]] = []  # the last batch's (samples, ids per sample)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids, rest = self.model[0].lookups(*inputs)
        self.lookups = [(i.shape[0], i.shape[1]) for i in ids]
        kjt = KeyedJaggedTensor(
            keys=self.keys, values=torch.cat([i.reshape(-1) for i in ids]),
            lengths=torch.cat([torch.full((len(i),), i.shape[1], dtype=torch.int64) for i in ids]),
        )  # fmt: skip
        pooled = self.ebc(kjt).to_dict()  # by name: TorchRec returns them in sharding order
        out: torch.Tensor = self.model[0].head(*rest, [pooled[k] for k in self.keys])
        return out


# ``bench ddp``'s TorchRec replicas: the sharding each asks its planner for
# (None: the planner's own choice)
SHARDINGS: dict[str, str | None] = {"torchrec": None, "torchrec-cw": "column_wise"}
SHARDING_NAMES = {"torchrec": "its planner's", "torchrec-cw": "column-wise"}  # (for reports)


def shard(
    model: Any, lr: float, sharding: str | None = None
) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """``model`` (a ``workloads.trained`` recommender) as TorchRec would train it: the
    sharded model (its tables holding ``model``'s weights) and the dense
    layers' optimizer (the tables' is fused). ``sharding``: every table
    sharded that way (``column_wise``: into one column shard per rank, as
    narrow as TorchRec allows, 4 columns), else as the planner picks."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )

    weights = [b.weight.detach() for b in model.bags()]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    )
    pooled, world = Pooled(model), dist.get_world_size()
    plan = None
    if sharding is not None:  # the planner, held to ``sharding`` for every table
        width = {f"t{k}": max(4, dim // world) for k, (_, dim) in enumerate(pooled.shapes)}
        held = {t: ParameterConstraints(sharding_types=[sharding], min_partition=w)
                for t, w in width.items()}  # fmt: skip
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"), constraints=held
        )
        plan = planner.collective_plan(pooled, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(pooled, device=torch.device("cpu"), sharders=[sharder],
                                   plan=plan)  # fmt: skip
    state = dmp.state_dict()
    with torch.no_grad():
        for k, weight in enumerate(weights):
            for r0, c0, piece in _pieces(state[f"ebc.embedding_bags.t{k}.weight"]):
                rows, cols = piece.shape  # views of the fused kernel's own weights
                piece.copy_(weight[r0 : r0 + rows, c0 : c0 + cols])
    dense = [p for n, p in dmp.named_parameters() if ".ebc." not in n and not n.startswith("ebc.")]
    return dmp, [torch.optim.SGD(dense, lr=lr)]


def tables(dmp: nn.Module) -> list[torch.Tensor]:
    """The sharded tables whole, on every rank (each entry lives on one rank;
    DMP's data-parallel tables are whole on every rank already)."""
    state = dmp.state_dict()
    out = []
    for k in range(len(dmp.module.keys)):  # type: ignore[union-attr,arg-type]
        entry = state[f"ebc.embedding_bags.t{k}.weight"]
        if not hasattr(entry, "local_shards"):  # data-parallel: a replica, not shards
            out.append(entry.detach().clone())
            continue
        with warnings.catch_warnings():  # a ShardedTensor, which torch deprecates
            warnings.simplefilter("ignore", FutureWarning)
            full = torch.zeros(entry.size())
        for r0, c0, piece in _pieces(entry):
            full[r0 : r0 + piece.shape[0], c0 : c0 + piece.shape[1]] = piece
        dist.all_reduce(full)
        out.append(full)
    return out


def _pieces(entry: Any) -> list[tuple[int, int, torch.Tensor]]:
    """A table's state entry as (row, column, block) pieces held here: a
    ShardedTensor's local shards, or a data-parallel table whole."""
    if not hasattr(entry, "local_shards"):
        return [(0, 0, entry)]
    return [(*s.metadata.shard_offsets, s.tensor) for s in entry.local_shards()]


def plan(dmp: nn.Module) -> dict[str, str]:
    """The sharding TorchRec's planner chose, per table (``t0``, ...)."""
    return {name: f"{p.sharding_type} on {p.ranks}" for name, p in _placed(dmp).items()}


def _placed(dmp: nn.Module) -> dict[str, Any]:
    """The planner's ``ParameterSharding`` per table."""
    chosen: Any = dmp.plan
    return {name: p for params in chosen.plan.values() for name, p in params.items()}


def link_bytes(dmp: nn.Module) -> int | None:
    """The tables' bytes per step on the busiest link (one direction) by
    TorchRec's plan and the last batch's lookups, every rank's batch alike.
    Each shard of a table-wise or column-wise table is a table of its own
    columns: its owner sends each other rank their pooled rows' columns
    (forward) and receives their ids and lengths (int64) and those columns'
    gradients (backward); a data-parallel table is all-reduced, 2(n-1)/n of
    it over every link. None for a sharding this count does not model."""
    pooled: Any = dmp.module
    world = dist.get_world_size()
    sent, got = [0.0] * world, [0.0] * world
    placed = _placed(dmp)
    looked = zip(pooled.shapes, pooled.lookups, strict=True)
    for k, ((rows, dim), (batch, per)) in enumerate(looked):
        p = placed[f"t{k}"]
        if p.sharding_type == "data_parallel":
            ring = 2 * (world - 1) / world * rows * dim * 4
            sent, got = [s + ring for s in sent], [g + ring for g in got]
            continue
        if p.sharding_type not in ("table_wise", "column_wise"):
            return None
        for owner, cols in _shards(p, dim):
            back = batch * ((per + 1) * 8 + cols * 4)
            for r in range(world):
                if r != owner:
                    sent[owner] += batch * cols * 4
                    got[r] += batch * cols * 4
                    sent[r] += back
                    got[owner] += back
    return int(max(sent + got))


def _shards(p: Any, dim: int) -> list[tuple[int, int]]:
    """A table-wise or column-wise ``ParameterSharding``'s shards as (owner,
    columns)."""
    if p.sharding_spec is None:
        return [(p.ranks[0], dim)]
    return [(r, s.shard_sizes[1]) for r, s in zip(p.ranks, p.sharding_spec.shards, strict=True)]
