"""The reproduction suite: experiments registered by name.

An experiment runs in a quick mode (minutes, for CI and first contact) or in
full, writes its plots into the directory it is given, and returns rows (raw
results) and claims (a paper's figure next to ours, with their ratio).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gradfabric.core.registry import Registry

Tick = Callable[[str], None]


@dataclass
class Claim:
    system: str
    claim: str
    paper: str
    ours: str
    ratio: float | None
    note: str = ""


@dataclass
class ExperimentResult:
    name: str
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config it ran


class Experiment(Protocol):
    name: str
    title: str

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult: ...


EXPERIMENTS: Registry[Experiment] = Registry("experiment")
