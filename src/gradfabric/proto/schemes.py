"""The scheme registry: every aggregation scheme, once, as the engines it needs.

A job's engines are built here and nowhere else, by every driver: the
single-job simulator (``sim.collective``), the tenancy simulator
(``sim.multijob``), the UDP harness (``lab.udp_harness``), and the switch daemon
with its clients (``runtime``). So one name means one protocol wherever it runs.

A ``Scheme`` knows

* its switch's allocation policy (``policy``: SwitchML's static slots, ATP's
  hashed pool, ESA's preemptive pool; ``None`` where the switch only forwards),
* its servers (ATP's fallback PS, the sharded PS, OmniReduce's aggregators),
* the job it installs at the switch and at each server (``switch_job``,
  ``server_job``), its workers' configuration and route (``worker``),
* how a worker begins a bucket and what a ``Deliver`` names (``start``,
  ``per_bucket``: a whole bucket, or one packet sequence).

A driver describes where the job sits (``Placement``: the names it gives the
nodes, the job's share of the switch) and asks ``engines`` for a whole job or
``attach`` for a job on switches and servers it already runs. Adding a scheme
is one instance added to ``SCHEMES`` (see ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final

import numpy as np

from gradfabric.core.errors import ConfigError
from gradfabric.core.registry import Registry
from gradfabric.proto.actions import Action
from gradfabric.proto.dlcp import DlcpServer
from gradfabric.proto.host import HostEngine
from gradfabric.proto.interface import Engine
from gradfabric.proto.omni import OmniAggregator, OmniLayout, OmniWorker
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.ring import MAX_HRING_JOB, HierarchicalRingEngine, RingEngine
from gradfabric.proto.routes import HashedPool, Route, Sharded, StaticSlots
from gradfabric.proto.switch import ALLOCATORS, SwitchEngine, SwitchJob
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.proto.worker import ResumableWorker, WorkerConfig, WorkerEngine
from gradfabric.wire.packet import MAX_FAN_IN
from gradfabric.wire.quant import INT32_MAX

JOB_ID: Final = 1


@dataclass(frozen=True)
class InaConfig:
    """Protocol knobs of a single job (windows in real packets)."""

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
    fast_retransmit: int = 0  # workers resend a loss after this many later results (0: off)
    nack: bool = False  # workers ask for loss notices where the switch sends them (SwitchML)
    # workers pace to their link and send resends first (the emulator's, on shaped links):
    # their NICs hold the window's excess, where a resend jumps it (``sim.network``)
    paced: bool = False

    def __post_init__(self) -> None:
        positive = ("values_per_packet", "train_packets", "switchml_slots", "atp_pool_slots",
                    "atp_window", "ps_window", "rto_ns", "omni_streams")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("ps_servers", "omni_aggregators"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0 (0: one per worker)")
        if self.fast_retransmit < 0:
            raise ConfigError(
                "fast_retransmit", f"must be >= 0 (0: off), got {self.fast_retransmit}"
            )

    @property
    def values_per_sim_packet(self) -> int:
        return self.values_per_packet * self.train_packets

    def windowed(self, packets: int) -> int:
        """A window of ``packets`` real packets, in simulated packets (trains)."""
        return max(1, packets // self.train_packets)

    @property
    def fast_retransmit_trains(self) -> int:
        """The workers' fast retransmit in simulated packets (trains); 0: off."""
        return self.windowed(self.fast_retransmit) if self.fast_retransmit else 0


@dataclass(frozen=True)
class Placement:
    """One job as a driver lays it out: the names of its nodes and its share
    of the switch. ``racks`` maps each first-hop switch to the workers below
    it (one entry except for SwitchML's two-level tree under ``root``)."""

    job_id: int
    workers: tuple[str, ...]
    racks: Mapping[str, tuple[str, ...]]
    servers: tuple[str, ...] = ()  # from ``Scheme.servers``
    root: str | None = None
    window: int = 1  # the workers' window, in (simulated) packets
    pool_slots: int = 1  # the switch's aggregator pool (ATP and ESA hash over it)
    slot_base: int = 0  # SwitchML: the first slot of the job's static range
    keep_results: int = 0  # results a PS keeps beyond the window (late retransmissions)
    rto_ns: int = 1_000_000
    values_per_packet: int = 256  # per (simulated) packet
    max_retries: int = 100
    streams: int = 64  # OmniReduce: streams per aggregator
    push_bound: float = 0.1  # DLCP: the loss bound of the workers' pushes
    help: HelpConfig | None = None  # SA-ATP straggler help at the switch
    resumable: bool = False  # workers keep what a restarted switch needs (ResumableWorker)
    fast_retransmit: int = 0  # workers resend a loss after this many later results (0: off)
    nack: bool = False  # workers take the switch's loss notices, where it sends them (SwitchML)
    takes_help: bool = True  # workers take results for sequences others sent for them (SA-ATP)
    first_seq: int = 0  # where the job's sequences start (tests cross the wire's limit with it)
    group: int = 0  # the workers' group (``layer``): ATP's racks, a large PS job's 64s

    @property
    def switch(self) -> str:
        """The one switch every worker sits under."""
        if len(self.racks) != 1:
            raise ConfigError("racks", "this scheme aggregates at one switch")
        return next(iter(self.racks))

    def rack_of(self, worker: str) -> str:
        return next(sw for sw, kids in self.racks.items() if worker in kids)


def _leaves(p: Placement) -> tuple[str, list[str]]:
    """The root of a job over several racks and the racks' switches below it:
    a switch of its own (a rack's switch as the root would be its own child)."""
    if p.root is None or p.root in p.racks:
        raise ConfigError("root", "a job over several racks needs a switch above them, "
                          f"not one of theirs (root {p.root!r})")  # fmt: skip
    return p.root, list(p.racks)


def worker_input(seed: int, rank: int, workers: int, values: int) -> np.ndarray:
    """Worker ``rank``'s int32 data for a seeded run: uniform in the range that
    keeps the sum of ``workers`` contributions inside int32. Every driver draws
    from this same function, so their results compare value for value."""
    lim = INT32_MAX // workers
    return np.random.default_rng((seed, rank)).integers(-lim, lim, values, dtype=np.int32)


class Scheme:
    """One aggregation scheme; the subclasses below are the registered ones."""

    name: str = ""
    summary: str = ""
    policy: str | None = None  # the switch's allocation policy (None: it only forwards)
    ecn_window: bool = False  # workers halve their window on ECN (ATP's congestion control)
    static_slots: bool = False  # a job holds a fixed slot range for its whole life
    per_bucket: bool = False  # a Deliver names a whole bucket (else a packet sequence)
    lossless: bool = False  # assumes a lossless, duplicate-free network
    can_help: bool = False  # SA-ATP straggler help can run on its switch
    helps: bool = False  # it does run it (hosts keep replicas of others' data)
    server_only: bool = False  # every packet is aggregated at a server (no switch state)
    shaped_port: bool = False  # a daemon's shaped, prioritised port leads to its server
    servers_at_root: bool = False  # over several racks its servers hang off the top switch
    rack_groups: bool = False  # over several racks its workers name their rack (``layer``)
    job_kinds: tuple[str, ...] = ("ina",)  # what a daemon running it registers

    def servers(self, workers: int, ina: InaConfig) -> tuple[str, ...]:
        """The hosts the job needs besides its workers (none by default)."""
        return ()

    def window(self, ina: InaConfig) -> int:
        """A single job's window, in simulated packets."""
        return ina.windowed(ina.atp_window)

    def place(
        self,
        workers: tuple[str, ...],
        racks: Mapping[str, tuple[str, ...]],
        ina: InaConfig,
        root: str | None = None,
        servers: tuple[str, ...] = (),
        help: HelpConfig | None = None,
    ) -> Placement:
        """A single job with the whole switch to itself, sized from ``ina``
        (``help``: SA-ATP's settings, for the schemes that take them)."""
        p = Placement(
            JOB_ID, workers, racks, servers, root,
            window=self.window(ina), pool_slots=ina.atp_pool_slots,
            rto_ns=ina.rto_ns, values_per_packet=ina.values_per_sim_packet,
            streams=ina.omni_streams, nack=ina.nack,
            fast_retransmit=ina.fast_retransmit_trains,
        )  # fmt: skip
        return self.adjust(p, ina, help)

    def adjust(self, p: Placement, ina: InaConfig, help: HelpConfig | None) -> Placement:
        """What a scheme changes in a single job's placement (nothing by default)."""
        return p

    @property
    def sends_notices(self) -> bool:
        """Whether this scheme's switch sends loss notices (``proto.switch.switchml``)."""
        if self.policy is None:
            return False
        return getattr(ALLOCATORS.get(self.policy), "sends_notices", False) is True

    def check(self, p: Placement, ina: InaConfig) -> None:
        """Raise ``ConfigError`` if the scheme cannot run ``p``."""

    def switch_job(self, p: Placement) -> SwitchJob | None:
        return None

    def server_job(self, p: Placement) -> PsJob | None:
        return None

    def route(self, p: Placement, worker: str) -> Route:
        raise ConfigError("scheme", f"{self.name} has no packet route")

    def entry(self, p: Placement) -> str:
        """Where the job's workers send first."""
        return p.switch

    def worker(self, p: Placement, rank: int) -> Engine:
        name = p.workers[rank]
        if len(p.racks) > 1 and self.policy is not None:  # its rack's, under its switch
            g, leaf = next((g, sw) for g, (sw, kids) in enumerate(p.racks.items()) if name in kids)
            kids = p.racks[leaf]
            group = g + 1 if self.rack_groups else 0
            rack = replace(p, workers=kids, racks={leaf: kids}, group=group)
            return Scheme.worker(self, rack, kids.index(name))  # (a subclass wraps it once)
        cfg = WorkerConfig(
            job_id=p.job_id, worker_id=rank, fan_in=len(p.workers), window=p.window,
            rto_ns=p.rto_ns, max_retries=p.max_retries,
            values_per_packet=p.values_per_packet, ecn_window=self.ecn_window,
            fast_retransmit=p.fast_retransmit, nack=p.nack and self.sends_notices,
            # a worker that takes no help has no reason to take a result for a
            # sequence it has not sent: a forged or confused one is a drop
            max_ahead=WorkerConfig.max_ahead if p.takes_help else 0, first_seq=p.first_seq,
            group=p.group,
        )  # fmt: skip
        kind = ResumableWorker if p.resumable else WorkerEngine
        return kind(name, cfg, self.route(p, name))

    def job_servers(self, p: Placement) -> dict[str, Engine]:
        """Engines that serve only this job (OmniReduce's aggregators, DLCP's server)."""
        return {}

    def levels(self, p: Placement) -> dict[str, SwitchJob]:
        """The job at each switch it uses: the one it sits under (none where
        the switch only forwards); ATP's two levels over several racks."""
        sj = self.switch_job(p)
        return {} if sj is None else {p.switch: sj}

    def attach(
        self, p: Placement, switch: SwitchEngine | None = None, ps: ParameterServer | None = None,
        switches: Mapping[str, SwitchEngine] | None = None,
    ) -> dict[str, Engine]:  # fmt: skip
        """Install the job on a running ``switch`` (or, over several racks, on
        ``switches`` by name) and, if given, one shared ``ps`` hosting every
        job's PS role; returns the engines it adds: its servers (unless
        ``ps``) and those ``job_servers`` builds. SA-ATP's help runs at the
        switches its workers sit under (the paper's one switch)."""
        out: dict[str, Engine] = {}
        levels = self.levels(p)
        if switches is None and len(levels) > 1:
            raise ConfigError("racks", "a job over several racks attaches to each rack's switch")
        for name, sj in levels.items():
            sw = switch if switches is None else switches.get(name)
            if sw is None:
                raise ConfigError("switch", f"{self.name} needs a switch ({name})")
            sw.add_job(sj)
            if p.help is not None and not sj.below:
                if not self.can_help:
                    raise ConfigError("help", f"SA-ATP help does not run on {self.name}")
                sw.watch(p.job_id, p.help)
        pj = self.server_job(p)
        if pj is not None:
            if ps is not None:
                ps.add_job(pj)
            else:
                out |= {s: ParameterServer(s, (pj,)) for s in p.servers}
        return out | self.job_servers(p)

    def detach(
        self, p: Placement, switch: SwitchEngine | None,
        switches: Mapping[str, SwitchEngine] | None = None,
    ) -> None:  # fmt: skip
        """The job left: release what it held at ``switch`` (or ``switches``)."""
        for name in self.levels(p):
            sw = switch if switches is None else switches.get(name)
            if sw is not None and p.job_id in sw.jobs:
                sw.remove_job(p.job_id)

    def engines(self, p: Placement, ina: InaConfig) -> dict[str, Engine]:
        """Every engine of a single job (its own switches included)."""
        self.check(p, ina)
        out: dict[str, Engine] = {}
        if self.policy is not None:
            switches = {
                name: SwitchEngine.build(name, self.policy, p.pool_slots) for name in self.levels(p)
            }
            out |= switches
            out |= self.attach(p, switches=switches)
        else:
            out |= self.attach(p)
        for rank, w in enumerate(p.workers):
            out[w] = self.worker(p, rank)
        return out

    def start(
        self, engine: Engine, bucket: int, count: int, now_ns: int,
        payload: np.ndarray | None, first_seq: int, mask: np.ndarray | None = None,
    ) -> list[Action]:  # fmt: skip
        """A worker begins ``bucket`` (sequences from ``first_seq``)."""
        assert isinstance(engine, WorkerEngine | HostEngine)
        return engine.push(count, now_ns, payload, at_seq=first_seq)


class SwitchML(Scheme):
    name = "switchml"
    summary = "SwitchML: static per-job slot ranges at the switch, shadow copies"
    policy = "switchml"
    static_slots = True

    def window(self, ina: InaConfig) -> int:
        return ina.windowed(ina.switchml_slots)

    def adjust(self, p: Placement, ina: InaConfig, help: HelpConfig | None) -> Placement:
        """A single job's switch holds just its own slots."""
        return replace(p, pool_slots=p.window)

    def switch_job(self, p: Placement) -> SwitchJob:
        return SwitchJob(p.job_id, p.workers, slot_base=p.slot_base, slot_count=p.window)

    def route(self, p: Placement, worker: str) -> Route:
        return StaticSlots(p.rack_of(worker), p.slot_base, p.window)

    def levels(self, p: Placement) -> dict[str, SwitchJob]:
        """With several racks, ``root`` aggregates the racks' aggregates (a
        two-level tree, every level holding the job's slots)."""
        if len(p.racks) == 1:
            return super().levels(p)
        root, leaves = _leaves(p)
        out = {
            leaf: SwitchJob(p.job_id, p.racks[leaf], parent=root, index_at_parent=li,
                            parent_fan_in=len(leaves), slot_count=p.window)
            for li, leaf in enumerate(leaves)
        }  # fmt: skip
        return out | {root: SwitchJob(p.job_id, tuple(leaves), slot_count=p.window)}


class ATP(Scheme):
    name = "atp"
    summary = "ATP: a shared hashed aggregator pool, PS fallback, ECN window"
    policy = "atp"
    ecn_window = True
    can_help = True
    servers_at_root = True  # the PS beside the second level (``levels``)
    rack_groups = True

    def servers(self, workers: int, ina: InaConfig) -> tuple[str, ...]:
        return ("ps0",)

    def check(self, p: Placement, ina: InaConfig) -> None:
        big = max(len(kids) for kids in p.racks.values())
        if big > MAX_FAN_IN or len(p.racks) > MAX_FAN_IN:
            raise ConfigError(
                "topology",
                f"ATP aggregates in two levels of at most {MAX_FAN_IN}: racks of at most "
                f"{MAX_FAN_IN} workers (here {big}), at most {MAX_FAN_IN} racks "
                f"(here {len(p.racks)})",
            )  # fmt: skip

    def switch_job(self, p: Placement) -> SwitchJob:
        return SwitchJob(p.job_id, p.workers, window=p.window, ps_shards=p.servers)

    def levels(self, p: Placement) -> dict[str, SwitchJob]:
        """Over several racks, ATP's two levels: each rack's switch aggregates
        its workers and sends the sum up to ``root``, which aggregates the
        racks for the PS; whatever a level cannot aggregate goes on to the PS,
        which merges by (rack, worker) bits (``PsJob.groups``). The paper puts
        the second level at the PS's rack switch, the PS one hop below it;
        here it is the spine ``root`` (as SwitchML's), the PS one hop below
        it where the driver can lay it so (``servers_at_root``): the racks'
        sums arrive on links of their own rather than converging on one rack
        switch's downlinks, and no switch holds two levels of one job."""
        if len(p.racks) == 1:
            return super().levels(p)
        root, leaves = _leaves(p)
        out = {
            leaf: SwitchJob(p.job_id, p.racks[leaf], parent=root, index_at_parent=g,
                            parent_fan_in=len(leaves), window=p.window, group=g + 1)
            for g, leaf in enumerate(leaves)
        }  # fmt: skip
        top = SwitchJob(p.job_id, tuple(leaves), window=p.window, ps_shards=p.servers,
                        below=tuple(len(p.racks[leaf]) for leaf in leaves))  # fmt: skip
        return out | {root: top}

    def server_job(self, p: Placement) -> PsJob:
        # The PS answers retransmissions for a window of sequences, or longer
        # where the job may run ahead of its slowest worker (``keep_results``).
        window = max(p.window, p.keep_results)
        if len(p.racks) == 1:
            return PsJob(p.job_id, p.workers, via=p.switch, window=window)
        racks = list(p.racks.values())
        return PsJob(p.job_id, tuple(w for r in racks for w in r), via=p.root, window=window,
                     groups=tuple(len(r) for r in racks))  # fmt: skip

    def route(self, p: Placement, worker: str) -> Route:
        return HashedPool(p.switch, p.job_id, p.pool_slots)


class ESA(ATP):
    name = "esa"
    summary = "ESA: ATP's pool with priority preemption of aggregators"
    policy = "esa"


class SAATP(ATP):
    """ATP plus straggler help: the switch watches progress, hosts run
    shadow streams. Helped, the others may finish iterations while a
    straggler still waits on an old result: the PS keeps two iterations."""

    name = "saatp"
    summary = "SA-ATP: ATP with in-switch straggler detection and peer help"
    helps = True

    def adjust(self, p: Placement, ina: InaConfig, help: HelpConfig | None) -> Placement:
        if help is None or help.iteration_packets < 1:
            raise ConfigError("help", "SA-ATP needs the packets of one iteration")
        lag = ina.windowed(help.lag_packets)  # in simulated packets (trains)
        return replace(
            p, keep_results=2 * help.iteration_packets, help=replace(help, lag_packets=lag)
        )

    def worker(self, p: Placement, rank: int) -> Engine:
        own = super().worker(p, rank)
        assert isinstance(own, WorkerEngine)
        return HostEngine(own)


class PS(Scheme):
    name = "ps"
    summary = "BytePS-style parameter server, sharded by sequence over the servers"
    server_only = True

    def servers(self, workers: int, ina: InaConfig) -> tuple[str, ...]:
        return tuple(f"ps{i}" for i in range(ina.ps_servers or workers))

    def window(self, ina: InaConfig) -> int:
        return ina.windowed(ina.ps_window)

    def entry(self, p: Placement) -> str:
        return p.servers[0]

    def server_job(self, p: Placement) -> PsJob:
        """Past 64 workers, in groups of 64 in rank order (``PsJob.groups``)."""
        n = len(p.workers)
        groups = () if n <= MAX_FAN_IN else tuple(
            min(MAX_FAN_IN, n - at) for at in range(0, n, MAX_FAN_IN)
        )  # fmt: skip
        return PsJob(p.job_id, p.workers, window=max(p.window, p.keep_results), groups=groups)

    def worker(self, p: Placement, rank: int) -> Engine:
        if len(p.workers) <= MAX_FAN_IN:
            return super().worker(p, rank)
        g, i = divmod(rank, MAX_FAN_IN)
        group = replace(p, workers=p.workers[g * MAX_FAN_IN : (g + 1) * MAX_FAN_IN], group=g + 1)
        return super().worker(group, i)

    def route(self, p: Placement, worker: str) -> Route:
        return Sharded(p.servers)


class Ring(Scheme):
    name = "ring"
    summary = "Ring all-reduce, streamed packet by packet (the non-INA baseline)"
    per_bucket = True
    lossless = True

    def worker(self, p: Placement, rank: int) -> Engine:
        n = len(p.workers)
        return RingEngine(
            p.workers[rank], p.job_id, rank, n, p.workers[(rank + 1) % n], p.values_per_packet
        )

    def entry(self, p: Placement) -> str:
        return p.workers[0]

    def start(
        self, engine: Engine, bucket: int, count: int, now_ns: int,
        payload: np.ndarray | None, first_seq: int, mask: np.ndarray | None = None,
    ) -> list[Action]:  # fmt: skip
        assert isinstance(engine, RingEngine | HierarchicalRingEngine)
        return engine.start(bucket, count, now_ns, payload)


class HierarchicalRing(Ring):
    name = "hring"
    summary = "Hierarchical (2D) ring: reduce-scatter in the rack, all-reduce across, all-gather"

    def check(self, p: Placement, ina: InaConfig) -> None:
        sizes = {len(r) for r in p.racks.values()}
        if len(sizes) != 1:
            raise ConfigError("workers", "a hierarchical ring wants every rack's workers "
                              f"alike (racks of {sorted(sizes)})")  # fmt: skip
        if not 0 <= p.job_id <= MAX_HRING_JOB:
            raise ConfigError("job_id", f"a hierarchical ring's is 0..{MAX_HRING_JOB}")

    def worker(self, p: Placement, rank: int) -> Engine:
        name = p.workers[rank]
        rank_of = {w: i for i, w in enumerate(p.workers)}
        racks = [sorted(r, key=rank_of.__getitem__) for r in p.racks.values()]
        rack = next(r for r in racks if name in r)
        across = tuple(r[rack.index(name)] for r in racks)
        return HierarchicalRingEngine(name, p.job_id, tuple(rack), across, p.values_per_packet)


class OmniReduce(Scheme):
    name = "omnireduce"
    summary = "OmniReduce: only non-zero blocks stream to aggregators"
    per_bucket = True

    def servers(self, workers: int, ina: InaConfig) -> tuple[str, ...]:
        return tuple(f"agg{i}" for i in range(ina.omni_aggregators or workers))

    def check(self, p: Placement, ina: InaConfig) -> None:
        if ina.train_packets != 1:
            raise ConfigError("train_packets", "OmniReduce streams real packets: use 1")

    def entry(self, p: Placement) -> str:
        return p.servers[0]

    def _layout(self, p: Placement) -> OmniLayout:
        return OmniLayout(list(p.servers), p.streams, p.values_per_packet)

    def job_servers(self, p: Placement) -> dict[str, Engine]:
        streams = self._layout(p).streams
        return {
            a: OmniAggregator(a, p.job_id, i, list(p.workers), streams)
            for i, a in enumerate(p.servers)
        }

    def worker(self, p: Placement, rank: int) -> Engine:
        return OmniWorker(p.workers[rank], p.job_id, rank, self._layout(p), p.rto_ns, p.max_retries)

    def adjust(self, p: Placement, ina: InaConfig, help: HelpConfig | None) -> Placement:
        return replace(p, max_retries=400)  # a stream's give-up: 400 floors (proto.omni)

    def start(
        self, engine: Engine, bucket: int, count: int, now_ns: int,
        payload: np.ndarray | None, first_seq: int, mask: np.ndarray | None = None,
    ) -> list[Action]:  # fmt: skip
        assert isinstance(engine, OmniWorker)
        return engine.start(bucket, count, now_ns, payload, mask)


class DLCP(Scheme):
    """DLCP's bounded-loss push to one server per job (the daemon hosts it;
    the packet-level study runs in ``sim.dlcp``)."""

    name = "dlcp"
    summary = "DLCP: loss-tolerant, prioritised gradient transport"
    job_kinds = ("dlcp", "background")
    shaped_port = True

    def entry(self, p: Placement) -> str:
        return p.servers[0]

    def job_servers(self, p: Placement) -> dict[str, Engine]:
        s = p.servers[0]
        return {
            s: DlcpServer(s, p.job_id, list(p.workers), p.push_bound, p.values_per_packet, p.rto_ns)
        }


SCHEMES: Registry[Scheme] = Registry("scheme")
for _scheme in (SwitchML(), ATP(), ESA(), SAATP(), PS(), Ring(), HierarchicalRing(),
                OmniReduce(), DLCP()):
    SCHEMES.add(_scheme.name, _scheme)
SCHEMES.alias("omni", "omnireduce")

# The schemes that all-reduce a job's buckets (``DLCP`` is a transport: its
# study has its own simulator and client).
COLLECTIVES: Final = ("switchml", "atp", "esa", "saatp", "ps", "ring", "hring", "omnireduce")


def collective(name: str, field: str = "scheme") -> Scheme:
    """The scheme ``name`` if it all-reduces buckets, else a ``ConfigError``
    naming ``field`` and the valid names (every driver's one check)."""
    if name not in COLLECTIVES:
        raise ConfigError(field, f"unknown scheme {name!r}; valid: {', '.join(COLLECTIVES)}")
    return SCHEMES.get(name)
