"""The switch data plane: an aggregator pool behind an allocation policy."""

from gradfabric.proto.switch import atp as _atp  # noqa: F401  (registers "atp")
from gradfabric.proto.switch import esa as _esa  # noqa: F401  (registers "esa")
from gradfabric.proto.switch import switchml as _switchml  # noqa: F401  (registers "switchml")
from gradfabric.proto.switch.engine import ALLOCATORS, PoolStats, SwitchEngine
from gradfabric.proto.switch.job import SwitchJob

__all__ = ["ALLOCATORS", "PoolStats", "SwitchEngine", "SwitchJob"]
