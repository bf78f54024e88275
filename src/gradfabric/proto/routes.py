"""Where a worker's packets go: the route of one job's sequences.

A route answers, for sequence ``seq``, which node gets it and which
aggregator it names, and how large a window its slot reuse allows. Both the
worker engine and the switch policies read these rules, so they live here,
below both: ``atp_index`` is the hash ATP's pool and its workers share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gradfabric.core.errors import ConfigError

UNBOUNDED = 1 << 62


def atp_index(job_id: int, seq: int, pool_slots: int) -> int:
    """Aggregator of ``(job, seq)``: consecutive sequences of one job take
    consecutive aggregators from a per-job offset (Knuth's multiplicative
    hash of the job id), so a job never collides with itself while its window
    is at most the pool, and different jobs overlap as hashed."""
    return (seq + job_id * 2654435761) % pool_slots


class Route(Protocol):
    """Where sequence ``seq`` goes and which aggregator it names."""

    @property
    def resend_flag(self) -> bool: ...

    @property
    def max_window(self) -> int: ...

    def dst(self, seq: int) -> str: ...

    def agg_index(self, seq: int) -> int: ...


@dataclass(frozen=True)
class StaticSlots:
    """SwitchML: the job's own slot range at its first-hop switch; ``seq``
    reuses the slot of ``seq - slot_count``, so the window is at most that."""

    switch: str
    slot_base: int
    slot_count: int
    resend_flag: bool = False

    def __post_init__(self) -> None:
        if self.slot_count < 1 or self.slot_base < 0:
            raise ConfigError("slot_count", "a range of >= 1 slots from a base >= 0")

    @property
    def max_window(self) -> int:
        return self.slot_count

    def dst(self, seq: int) -> str:
        return self.switch

    def agg_index(self, seq: int) -> int:
        return self.slot_base + seq % self.slot_count


@dataclass(frozen=True)
class HashedPool:
    """ATP: the shared pool, indexed by ``atp_index(job, seq)``."""

    switch: str
    job_id: int
    pool_slots: int
    resend_flag: bool = True
    max_window: int = UNBOUNDED

    def dst(self, seq: int) -> str:
        return self.switch

    def agg_index(self, seq: int) -> int:
        return atp_index(self.job_id, seq, self.pool_slots)


@dataclass(frozen=True)
class Sharded:
    """BytePS-style PS: packets round-robin over the server shards."""

    servers: tuple[str, ...]
    resend_flag: bool = False
    max_window: int = UNBOUNDED

    def dst(self, seq: int) -> str:
        return self.servers[seq % len(self.servers)]

    def agg_index(self, seq: int) -> int:
        return 0
