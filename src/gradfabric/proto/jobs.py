"""Build the engines of one aggregation job: the same objects whether a
simulator or a UDP driver runs them (so both run exactly one protocol).

Names are addresses: workers ``w0..``, switches as the caller names them, the
PS ``ps0`` (ATP) or ``ps0..`` (sharded PS baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.proto.actions import Engine
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.switch import SwitchEngine, SwitchJob
from gradfabric.proto.worker import HashedPool, Sharded, StaticSlots, WorkerConfig, WorkerEngine
from gradfabric.wire.quant import INT32_MAX

JOB_ID = 1


@dataclass(frozen=True)
class InaConfig:
    """Protocol knobs of an aggregation job (windows in real packets)."""

    values_per_packet: int = 256
    train_packets: int = 1
    switchml_slots: int = 128
    atp_pool_slots: int = 4096
    atp_window: int = 128
    ps_window: int = 2048
    ps_servers: int = 0
    rto_ns: int = 1_000_000
    omni_streams: int = 64
    omni_aggregators: int = 0

    def __post_init__(self) -> None:
        for name in (
            "values_per_packet",
            "train_packets",
            "switchml_slots",
            "atp_pool_slots",
            "atp_window",
            "ps_window",
            "rto_ns",
            "omni_streams",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("ps_servers", "omni_aggregators"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0 (0: one per worker)")

    @property
    def values_per_sim_packet(self) -> int:
        return self.values_per_packet * self.train_packets

    def windowed(self, packets: int) -> int:
        """A window of ``packets`` real packets, in simulated packets (trains)."""
        return max(1, packets // self.train_packets)


def _worker(
    name: str, index: int, fan_in: int, window: int, ina: InaConfig, ecn: bool = False
) -> WorkerConfig:
    return WorkerConfig(
        job_id=JOB_ID,
        worker_id=index,
        fan_in=fan_in,
        window=window,
        rto_ns=ina.rto_ns,
        values_per_packet=ina.values_per_sim_packet,
        ecn_window=ecn,
    )


def switchml_engines(
    racks: dict[str, list[str]], root: str | None, ina: InaConfig
) -> dict[str, Engine]:
    """SwitchML over ``racks`` (first-hop switch -> its workers). With more than
    one rack, ``root`` aggregates the racks' aggregates (a two-level tree)."""
    if len(racks) > 1 and root is None:
        raise ConfigError("root", "several racks need a root switch")
    slots = ina.windowed(ina.switchml_slots)
    leaves = list(racks)
    top = root if len(leaves) > 1 else None
    engines: dict[str, Engine] = {}
    for li, leaf in enumerate(leaves):
        kids = racks[leaf]
        engines[leaf] = SwitchEngine.build(
            leaf,
            "switchml",
            slots,
            (
                SwitchJob(
                    JOB_ID,
                    tuple(kids),
                    parent=top,
                    index_at_parent=li if top else 0,
                    parent_fan_in=len(leaves) if top else 1,
                    slot_count=slots,
                ),
            ),
        )
        for i, w in enumerate(kids):
            engines[w] = WorkerEngine(
                w, _worker(w, i, len(kids), slots, ina), StaticSlots(leaf, 0, slots)
            )
    if top is not None:
        engines[top] = SwitchEngine.build(
            top, "switchml", slots, (SwitchJob(JOB_ID, tuple(leaves), slot_count=slots),)
        )
    return engines


def atp_engines(
    switch: str, workers: list[str], ina: InaConfig, ps: str = "ps0", keep_results: int = 0
) -> dict[str, Engine]:
    """ATP's switch, PS and workers. The PS keeps each result for a window of
    sequences to answer retransmissions; ``keep_results`` raises that (SA-ATP:
    with help, the job can run ahead of a straggler by more than a window)."""
    pool = ina.atp_pool_slots
    window = ina.windowed(ina.atp_window)
    engines: dict[str, Engine] = {
        switch: SwitchEngine.build(
            switch, "atp", pool, (SwitchJob(JOB_ID, tuple(workers), parent=ps, window=window),)
        ),
        ps: ParameterServer(
            ps, (PsJob(JOB_ID, tuple(workers), via=switch, window=max(window, keep_results)),)
        ),
    }
    for i, w in enumerate(workers):
        engines[w] = WorkerEngine(
            w, _worker(w, i, len(workers), window, ina, ecn=True), HashedPool(switch, JOB_ID, pool)
        )
    return engines


def ps_engines(servers: list[str], workers: list[str], ina: InaConfig) -> dict[str, Engine]:
    window = ina.windowed(ina.ps_window)
    engines: dict[str, Engine] = {
        s: ParameterServer(s, (PsJob(JOB_ID, tuple(workers), window=window),)) for s in servers
    }
    for i, w in enumerate(workers):
        engines[w] = WorkerEngine(
            w, _worker(w, i, len(workers), window, ina), Sharded(tuple(servers))
        )
    return engines


def worker_input(seed: int, rank: int, workers: int, values: int) -> np.ndarray:
    """Worker ``rank``'s int32 data for a seeded run: uniform in the range that
    keeps the sum of ``workers`` contributions inside int32. The simulator and
    the UDP driver draw from this same function."""
    lim = INT32_MAX // workers
    return np.random.default_rng((seed, rank)).integers(-lim, lim, values, dtype=np.int32)
