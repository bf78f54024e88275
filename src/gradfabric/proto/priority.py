"""Job priorities for preemptive switch memory (ESA), chosen by name.

A priority is one byte in every packet header; higher wins an aggregator.
Workers compute it from what they know of their own job: how much gradient
traffic it still has to aggregate and how long it has existed.

* ``srpt-aging`` (default): least remaining work first, where a job's work
  counts as ``remaining / (1 + age / aging_s)`` (a response ratio, as in
  highest-response-ratio-next): 12 levels per halving, in 64 KiB units. A long
  job therefore climbs past newcomers at a rate set by ``aging_s`` instead of
  starving, and ages never saturate the byte (old jobs keep their order).
* ``fifo``: oldest job first (12 levels per doubling of age in ``aging_s``).
* ``none``: every job equal (nobody preempts; ESA then only reuses completed
  aggregators early).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gradfabric.core.registry import Registry

Priority = Callable[[float, float, float], int]  # (remaining_bytes, age_s, aging_s) -> 0..255
PRIORITIES: Registry[Priority] = Registry("priority policy")


def _clamp(x: float) -> int:
    return max(0, min(255, int(x)))


@PRIORITIES.register("srpt-aging")
def srpt_aging(remaining_bytes: float, age_s: float, aging_s: float) -> int:
    effective = remaining_bytes / (1 + age_s / aging_s)
    return _clamp(240 - 12 * math.log2(1 + effective / 2**16))


@PRIORITIES.register("fifo")
def fifo(remaining_bytes: float, age_s: float, aging_s: float) -> int:
    return _clamp(12 * math.log2(1 + age_s / aging_s))


@PRIORITIES.register("none")
def none(remaining_bytes: float, age_s: float, aging_s: float) -> int:
    return 0
