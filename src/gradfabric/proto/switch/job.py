"""A job as one switch sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from gradfabric.core.errors import ConfigError
from gradfabric.wire.packet import MAX_FAN_IN


@mypyc_attr(native_class=False)  # compiled, a frozen class would not unpickle
@dataclass(frozen=True)
class SwitchJob:
    """One job as this switch sees it.

    ``children`` are the addresses below this switch (workers, or leaf switches
    at a spine); child ``i`` owns bit ``i``. ``parent`` is where a complete
    aggregate goes next: the next switch up (SwitchML hierarchy) or the
    parameter server (ATP); None makes this switch the root. ``ps_shards``:
    the PS sharded by sequence (BytePS style, ATP's deployment): sequence
    ``s`` goes to ``ps_shards[s % len(ps_shards)]`` instead of ``parent``.
    """

    job_id: int
    children: tuple[str, ...]
    parent: str | None = None
    index_at_parent: int = 0
    parent_fan_in: int = 1
    slot_base: int = 0
    slot_count: int = 0
    window: int = 0
    ps_shards: tuple[str, ...] = ()
    fan_in: int = field(init=False)
    full: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fan_in", len(self.children))
        object.__setattr__(self, "full", (1 << len(self.children)) - 1)
        if not 1 <= len(self.children) <= MAX_FAN_IN:
            raise ConfigError(
                "children", f"need 1..{MAX_FAN_IN} children, got {len(self.children)}"
            )
        if not 0 <= self.index_at_parent < self.parent_fan_in <= MAX_FAN_IN:
            raise ConfigError("index_at_parent", "must satisfy 0 <= index < parent_fan_in <= 64")

    def ps_for(self, seq: int) -> str | None:
        """Where sequence ``seq``'s fallback traffic goes (see the class doc)."""
        if self.ps_shards:
            return self.ps_shards[seq % len(self.ps_shards)]
        return self.parent
