"""torch.distributed collectives: OmniReduce-style sparse all-reduce and DDP hooks."""

from gradfabric.collectives.sparse import OmniState, omnireduce_hook, sparse_allreduce

__all__ = ["OmniState", "omnireduce_hook", "sparse_allreduce"]
