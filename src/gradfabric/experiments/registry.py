"""The reproduction suite: experiments registered by name.

An experiment runs in a quick mode (minutes, for CI and first contact) or in
full, writes its plots into the directory it is given, and returns rows (raw
results) and claims (a paper's figure next to ours, with their ratio).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry

Tick = Callable[[str], None]


Setting = Literal["sim", "udp", "training"]
Kind = Literal["paper", "goal", "check"]
SETTINGS: dict[str, str] = {"sim": "simulated", "udp": "over UDP", "training": "in training"}


@dataclass
class Claim:
    """One figure of ours beside what it is held to.

    ``kind``: a paper's claim, a goal of our own, or a check against an
    analytic bound or a reference. ``setting``: where ours was measured.
    ``speedup`` is oriented so that above 1 is better (ours over the
    baseline's time, or a bound's time over ours), whatever the paper's
    wording; ``met`` says whether ours reaches the paper's figure or the
    target (None where there is nothing to meet), judged on the estimate:
    where an interval is shown, a "not met" inside it is not resolved either
    way. ``headline`` marks the claims per system and setting that the
    README's table shows.
    """

    system: str
    claim: str
    setting: Setting
    baseline: str  # what ours is against (the strongest there), or the bound
    ours: str  # as read, with its interval where the study has one
    paper: str  # the paper's figure, or the target
    met: bool | None
    kind: Kind = "paper"
    speedup: float | None = None
    headline: bool = False
    note: str = ""


# A test accuracy is a fraction of the test set counted in float32 (324 of
# 360 is 0.89999998), so a target equal to such a fraction is reached at it:
# the comparison allows this much, far below one test sample's share.
ACCURACY_SLACK = 1e-7  # (float32 is within 6e-8 of a fraction below 1)


def at_target(accuracy: float, target: float) -> bool:
    """Whether a test accuracy reaches ``target`` (``ACCURACY_SLACK``)."""
    return accuracy >= target - ACCURACY_SLACK


def reaches(speedup: float | None, target: float) -> bool | None:
    """A speed-up meets ``target`` when its estimate reaches it."""
    return None if speedup is None else speedup >= target


@dataclass
class ExperimentResult:
    name: str
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config it ran
    seconds: float = 0.0  # how long it ran (wall clock), where the runner timed it


class Experiment(Protocol):
    name: str
    title: str
    # ``main_job``: an experiment whose class sets it False is left out of
    # ``reproduce --quick`` (too long for a first contact; its own command runs it)

    def run(self, quick: bool, out: Path, tick: Tick) -> ExperimentResult: ...


EXPERIMENTS: Registry[Experiment] = Registry("experiment")


S = TypeVar("S")


def chosen(every: dict[str, S], names: str) -> dict[str, S]:
    """The settings of a study that ``names`` picks, comma-separated, a
    setting named "a, b" spelled "a-b" (``ConfigError`` naming any other)."""
    picked = [x.strip() for x in names.split(",") if x.strip()]
    known = {k.replace(", ", "-"): k for k in every}
    bad = [x for x in picked if x not in known]
    if bad or not picked:
        raise ConfigError("settings", f"unknown {bad}; valid: {', '.join(known)}")
    return {known[x]: every[known[x]] for x in picked}
