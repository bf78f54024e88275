"""torch.distributed collectives: OmniReduce-style sparse all-reduce, embedding
rows by lookup, and DDP hooks."""

from gradfabric.collectives.auto import AutoState, auto_hook
from gradfabric.collectives.fast import register_hook
from gradfabric.collectives.rows import RowState, rows_hook
from gradfabric.collectives.sparse import OmniState, omnireduce_hook, sparse_allreduce

__all__ = [
    "AutoState", "OmniState", "RowState", "auto_hook", "omnireduce_hook", "register_hook",
    "rows_hook", "sparse_allreduce",
]  # fmt: skip
