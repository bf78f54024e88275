"""Compute time per layer from a device profile, and DDP-style gradient buckets.

A device runs a layer's FLOPs at ``peak_tflops * efficiency``. The iteration
is forward, then backward in reverse layer order; each layer's gradient is
ready when its backward finishes. Gradients are grouped into buckets in
backward order as PyTorch DDP does (the first bucket capped at 1 MiB, the rest
at ``bucket_mb``), and a bucket may start communicating once its last
gradient is ready, overlapping the rest of backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradfabric.core.errors import ConfigError
from gradfabric.core.units import NS_PER_S
from gradfabric.workloads.catalog import ModelSpec


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_tflops: float
    efficiency: float = 0.4

    def __post_init__(self) -> None:
        if self.peak_tflops <= 0 or not 0 < self.efficiency <= 1:
            raise ConfigError("device", "peak_tflops must be > 0 and efficiency in (0, 1]")

    def time_ns(self, flops: float) -> int:
        return int(flops / (self.peak_tflops * 1e12 * self.efficiency) * NS_PER_S)


# Dense half-precision tensor-core peaks from vendor data sheets.
DEVICES = {
    "v100": DeviceProfile("v100", 125.0, 0.35),
    "a100": DeviceProfile("a100", 312.0, 0.4),
    "h100": DeviceProfile("h100", 989.0, 0.4),
    "t4": DeviceProfile("t4", 65.0, 0.35),
}


def device(name: str) -> DeviceProfile:
    if name not in DEVICES:
        raise ConfigError("device", f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[name]


@dataclass(frozen=True)
class GradBucket:
    ready_ns: int
    values: int


@dataclass(frozen=True)
class Timeline:
    forward_ns: int
    backward_ns: int
    buckets: tuple[GradBucket, ...]

    @property
    def compute_ns(self) -> int:
        return self.forward_ns + self.backward_ns

    def scaled(self, compute_ns: int) -> Timeline:
        """The same schedule stretched (or shrunk) to take ``compute_ns``."""
        f = compute_ns / self.compute_ns
        fwd = round(self.forward_ns * f)
        buckets = tuple(GradBucket(round(b.ready_ns * f), b.values) for b in self.buckets)
        return Timeline(fwd, compute_ns - fwd, buckets)


def timeline(
    model: ModelSpec,
    batch: int,
    dev: DeviceProfile,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    overlap: bool = True,
) -> Timeline:
    """Compute schedule of one iteration; ``overlap=False`` releases every bucket
    at the end of backward (communication after compute)."""
    if batch < 1:
        raise ConfigError("batch", f"must be >= 1, got {batch}")
    fwd = sum(dev.time_ns(layer.fwd_flops * batch) for layer in model.layers)
    t = fwd
    buckets: list[GradBucket] = []
    cap = int(first_bucket_mb * 2**20) // 4
    pending = 0
    for layer in reversed(model.layers):
        t += dev.time_ns(layer.bwd_flops * batch)
        pending += layer.params
        if pending >= cap:
            buckets.append(GradBucket(t, pending))
            pending = 0
            cap = int(bucket_mb * 2**20) // 4
    if pending:
        buckets.append(GradBucket(t, pending))
    if not overlap:
        buckets = [GradBucket(t, b.values) for b in buckets]
    return Timeline(fwd, t - fwd, tuple(buckets))
