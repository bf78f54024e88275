"""Cluster and job specifications for the planner (YAML or built in).

A cluster is a list of device types (peak TFLOPS, memory, price, NIC) and how
many of each; links between devices run at the slower NIC's rate with one
latency. Loaded with ``core.config.load``: every error names its field.

    device_types:
      - {name: h100, peak_tflops: 989, mem_gb: 80, cost_per_hour: 6.0, nic_gbps: 200}
    devices:
      - {type: h100, count: 4}
    link_latency_us: 5
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gradfabric.core.errors import ConfigError

# The emulated cluster's reference device (speed 1), GFLOP/s: slow enough that
# a host core shared by two processes computes its work, the per-call Python
# of small pipeline micro-batches included, within the device's time, so that
# the deadline throttle holds (``planner.pipeline.Throttled``). On a 2-core
# host with 4 processes, ``bench plan`` saw 21% of calls overrun at 8 GFLOP/s
# (most in pipelines, ~20 ms a step) and 4.5% at 4.
REFERENCE_GFLOPS = 4.0


@dataclass(frozen=True)
class DeviceType:
    name: str
    peak_tflops: float
    mem_gb: float
    cost_per_hour: float
    nic_gbps: float
    efficiency: float = 0.4  # achieved share of peak on training kernels

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "mem_gb", "nic_gbps"):
            if getattr(self, f) <= 0:
                raise ConfigError(f, f"must be > 0, got {getattr(self, f)}")
        if self.cost_per_hour < 0 or not 0 < self.efficiency <= 1:
            raise ConfigError("cost_per_hour", "cost must be >= 0 and efficiency in (0, 1]")

    @property
    def flops(self) -> float:
        """Sustained FLOP/s."""
        return self.peak_tflops * 1e12 * self.efficiency


@dataclass(frozen=True)
class DeviceCount:
    type: str
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count", f"must be >= 1, got {self.count}")


@dataclass(frozen=True)
class ClusterSpec:
    device_types: tuple[DeviceType, ...]
    devices: tuple[DeviceCount, ...]
    link_latency_us: float = 5.0

    def __post_init__(self) -> None:
        names = [t.name for t in self.device_types]
        if len(set(names)) != len(names):
            raise ConfigError("device_types", "device type names must be unique")
        for i, d in enumerate(self.devices):
            if d.type not in names:
                raise ConfigError(
                    f"devices[{i}].type", f"unknown {d.type!r}; valid: {', '.join(names)}"
                )
        if self.link_latency_us < 0:
            raise ConfigError("link_latency_us", "must be >= 0")

    def expand(self) -> list[DeviceType]:
        """One entry per device, in the order given."""
        by = {t.name: t for t in self.device_types}
        return [by[d.type] for d in self.devices for _ in range(d.count)]


# Data-sheet peaks (dense fp16 tensor cores), list prices per GPU-hour of the
# public clouds, rounded; three generations.
V100 = DeviceType("v100", 125.0, 32, 2.5, 25, 0.35)
A100 = DeviceType("a100", 312.0, 80, 4.0, 100, 0.4)
H100 = DeviceType("h100", 989.0, 80, 7.0, 200, 0.4)


def example_cluster(h100: int = 4, a100: int = 6, v100: int = 6) -> ClusterSpec:
    """The built-in example: 16 devices of three GPU generations."""
    counts = [DeviceCount(t.name, n) for t, n in ((H100, h100), (A100, a100), (V100, v100)) if n]
    return ClusterSpec((H100, A100, V100), tuple(counts))


def load_cluster(path: Path) -> ClusterSpec:
    from gradfabric.core.config import load_yaml

    return load_yaml(ClusterSpec, path)
