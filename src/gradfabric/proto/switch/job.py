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

    ATP's two levels (``proto.switch.atp``) use two more fields. ``group``
    (``g + 1`` at the switch of rack ``g``; 0 elsewhere): the ``layer`` its
    workers' packets carry; its complete aggregates go up to ``parent`` as
    child ``index_at_parent`` of ``parent_fan_in`` (so ``group`` is
    ``index_at_parent + 1``), all else it forwards in the rack's own terms.
    ``below`` (at the second level): the fan-in of each child's group, so it
    can check the racks' fallback packets it passes on. Both levels hold
    pools of one size: a rack's sum names the aggregator the workers' hash
    chose there.
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
    group: int = 0
    below: tuple[int, ...] = ()
    fan_in: int = field(init=False)
    full: int = field(init=False)
    workers: int = field(init=False)  # ATP's: sum(below) at its second level, else fan_in

    def __post_init__(self) -> None:
        object.__setattr__(self, "fan_in", len(self.children))
        object.__setattr__(self, "full", (1 << len(self.children)) - 1)
        object.__setattr__(self, "workers", sum(self.below) or len(self.children))
        if not 1 <= len(self.children) <= MAX_FAN_IN:
            raise ConfigError(
                "children", f"need 1..{MAX_FAN_IN} children, got {len(self.children)}"
            )
        if not 0 <= self.index_at_parent < self.parent_fan_in <= MAX_FAN_IN:
            raise ConfigError("index_at_parent", "must satisfy 0 <= index < parent_fan_in <= 64")
        if self.group < 0 or (self.group and (self.parent is None or self.ps_shards or self.below)):
            raise ConfigError("group", "a rack's group is >= 1 and sends all to its parent")
        # a rack's sum reaches the PS as its bit at the parent, its fallbacks by
        # group: the two must name the same rack
        if self.group and self.group != self.index_at_parent + 1:
            raise ConfigError("group", "a rack's group is its place at the parent, plus 1")
        fits = all(1 <= b <= MAX_FAN_IN for b in self.below)
        if self.below and (len(self.below) != len(self.children) or not fits):
            raise ConfigError("below", f"one fan-in of 1..{MAX_FAN_IN} per child")

    def ps_for(self, seq: int) -> str | None:
        """Where sequence ``seq``'s fallback traffic goes (see the class doc)."""
        if self.ps_shards:
            return self.ps_shards[seq % len(self.ps_shards)]
        return self.parent
