"""Impairments of the switch daemon's datagrams (this kernel has no netem).

Every datagram in and out is independently lost with ``loss`` and
duplicated with ``dup``; outgoing ones are also held for ``delay_ns`` plus a
uniform ``jitter_ns`` (which reorders). All fates come from one seeded
generator, so with one seed and one arrival order a run's impairments repeat.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters


@dataclass(frozen=True)
class Impairment:
    loss: float = field(default=0.0, metadata={"help": "drop probability per datagram"})
    dup: float = field(default=0.0, metadata={"help": "duplication probability"})
    delay_ns: int = field(default=0, metadata={"help": "delay of every datagram"})
    jitter_ns: int = field(default=0, metadata={"help": "uniform extra delay (reorders)"})
    seed: int = field(default=0, metadata={"help": "seed of the impairments"})

    def __post_init__(self) -> None:
        for name in ("loss", "dup"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.delay_ns < 0 or self.jitter_ns < 0:
            raise ConfigError("delay_ns", "delays must be >= 0")


class Impairer:
    """Draws each datagram's fate (counted in ``counters``)."""

    def __init__(self, imp: Impairment, counters: Counters) -> None:
        self.imp = imp
        self.rng = random.Random(imp.seed)
        self.counters = counters

    def lost(self) -> bool:
        if self.imp.loss and self.rng.random() < self.imp.loss:
            self.counters["impair_loss"] += 1
            return True
        return False

    def copies(self) -> int:
        """How many copies of a datagram go on: 0 (lost), 1, or 2 (duplicated)."""
        if self.lost():
            return 0
        if self.imp.dup and self.rng.random() < self.imp.dup:
            self.counters["impair_dup"] += 1
            return 2
        return 1

    def delays_s(self) -> list[float]:
        """The delay of each copy of an outgoing datagram (none if it is lost)."""
        imp, rng = self.imp, self.rng
        return [(imp.delay_ns + rng.random() * imp.jitter_ns) / 1e9 for _ in range(self.copies())]
