"""The native switch node (``net/native/switch_*.c``) and the native UDP driver
(``net/native/udp.c``).

``NativeSwitchNode`` is a second implementation of ``proto.node.SwitchNode``
for the schemes SwitchML, ATP, ESA, the PS baseline and DLCP's server: the same control
calls (``add_job``, ``remove_job``, ``resync``, ``missing``, ``occupancy``),
the same datagram interface (``receive_datagram``, ``datagrams_to_send``,
``get_timer``, ``handle_timer``) and the same counters under the same names,
held equal to the reference datagram for datagram by the differential
harness (``tests/property/test_differential.py``), the PS behind modelled
links (``ps_link_mbps``) and SA-ATP's straggler monitor (its registered
detector and helper policies) included, and DLCP's server
(``proto.dlcp.DlcpServer``, ``switch_dlcp.c``) with its timers. What the
reference models besides (DLCP's shaped port, ``--port-mbps``) it does
not: ``unsuitable`` says why, and the daemon serves such a node from the
reference.

``UdpBook`` is the native driver's half that a driver owns: the workers'
addresses and the multicast groups, and ``drain``, which reads a few
batches of datagrams from the daemon's socket, hands each to the native
engine and sends what it answers, with no Python per datagram (recvmmsg,
sendmmsg): the daemon's event loop calls it when its socket is readable.

The boundary is checked at construction: the library's digest against its
sources (``core.native``), the node's parameters by the C side (a job it
cannot hold is refused, not assumed); nothing outside the C code reads or
writes its state but through these functions.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Final

from gradfabric.core import native
from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.dlcp import MAX_TENSOR
from gradfabric.proto.node import (
    BACKGROUND,
    NodeConfig,
    NodeJob,
    Outgoing,
    server_name,
    worker_name,
)
from gradfabric.proto.ps import PsJob
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES

HERE = Path(__file__).parent
NATIVE = HERE / "native"
SOURCES = [NATIVE / f for f in ("switch_node.c", "switch_pool.c", "switch_ps.c", "switch_help.c",
                                "switch_dlcp.c", "switch_dlcp_classes.c", "switch.h", "dlcp.h",
                                "wire.h")]  # fmt: skip
UDP_SOURCES = [NATIVE / "udp.c", NATIVE / "wire.h"]
SCHEMES_NATIVE: Final = ("switchml", "atp", "esa", "ps", "dlcp")  # in the C node's order
HELPERS_NATIVE: Final = ("most-ahead", "next-holder")  # SA-ATP's helper policies, in C's order
DETECTORS_NATIVE: Final = ("progress-gap",)
# The C node's counters, in its order: the node's, then the switch engine's
NODE_COUNTERS: Final = ("rx_datagrams", "drop_unknown_job", "drop_malformed")
ENGINE_COUNTERS: Final = (
    "rx_gradient", "rx_help", "drop_bad_worker", "drop_bad_result", "drop_bad_slot",
    "drop_float_payload", "drop_stale", "drop_duplicate", "retx_answered",
    "drop_count_mismatch", "drop_stale_result", "nack_sent",
    "ps_overflow", "ps_resend", "flush_partial", "ps_collision", "drop_late", "stale_reclaimed",
    "reclaimed_complete", "preemptions", "help_requests",
)  # fmt: skip
# the node's, after the engine's in C
NODE_TAIL: Final = ("drop_outbox_full", "drop_link_full", "bg_delivered")
JOB_COUNTERS: Final = ("rx_datagrams", "drop_bad_token", "drop_malformed", "drop_resyncing")
SERVER_COUNTERS: Final = (
    "merged", "resend_answered", "drop_bad_packet", "drop_stale", "drop_late_partial",
    "drop_duplicate", "drop_overlap", "drop_count_mismatch", "drop_pending_full",
    "partial_superseded",
)  # fmt: skip (a job's PS's, after the job's own in C)
DLCP_COUNTERS: Final = (
    "drop_foreign", "drop_malformed", "duplicate", "probes_answered", "completed", "values_lost",
    "nacks", "packets", "resent_ranges", "probes", "drop_mismatch", "values_incomplete", "sums",
    "drop_too_long", *(f"late_values_p{k}" for k in range(16)),
)  # fmt: skip (a DLCP job's server's, switch.h's D_* order)
DRIVER_COUNTERS: Final = (
    "tx_datagrams", "drop_tx_full", "socket_error", "drop_no_address", "native_syscalls",
    "drop_no_memory", "gso_sends", "gro_reads",
)  # fmt: skip (udp.c's)
PS_SCALE: Final = PsJob.__dataclass_fields__["scale"].default  # the PS's integer scale

_i64, _p, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_I64P = ctypes.POINTER(_i64)

_LIB, WHY_NOT = native.load(HERE / "_switch", SOURCES, (
    ("gf_s_new", [_i64, _i64], _p), ("gf_s_free", [_p], None),
    ("gf_s_job", [_p, _i64, ctypes.c_char_p, _i64, _i64, _i64, _i64, _i64, _i64, _f64],
     ctypes.c_int),
    ("gf_s_forget", [_p, _i64], None), ("gf_s_floor", [_p, _i64, _i64], None),
    ("gf_s_missing", [_p, _i64], ctypes.c_uint64),
    ("gf_s_counters", [_p], _I64P), ("gf_s_job_counters", [_p, _i64], _I64P),
    ("gf_s_pool", [_p], _I64P), ("gf_s_occupied", [_p], _i64),
    ("gf_s_datagram", [_p, ctypes.c_char_p, _i64, _i64], ctypes.c_int),
    ("gf_s_take", [_p, _p, _i64], _i64), ("gf_s_ops", [], _p),
    ("gf_s_links", [_p, _f64], ctypes.c_int), ("gf_s_timer", [_p], _i64),
    ("gf_s_help", [_p, _i64, _i64, _i64, _i64, _i64, _i64], ctypes.c_int),
    ("gf_s_handle_timer", [_p, _i64], ctypes.c_int),
    ("gf_s_dlcp", [_p, _i64, _f64, _i64, _i64, _i64, _i64], ctypes.c_int),
    ("gf_s_dlcp_counters", [_p, _i64], _I64P),
))  # fmt: skip
_UDP, UDP_WHY_NOT = native.load(HERE / "_udp", UDP_SOURCES, (
    ("gf_book_new", [], _p), ("gf_book_free", [_p], None), ("gf_book_counters", [_p], _I64P),
    ("gf_book_job", [_p, _i64, _i64], ctypes.c_int),
    ("gf_book_set", [_p, _i64, _i64, ctypes.c_char_p, _i64], ctypes.c_int),
    ("gf_book_forget", [_p, _i64], None),
    ("gf_udp_drain", [_p, _p, _p, ctypes.c_int, _i64], _i64),
    ("gf_udp_flush", [_p, _p, _p, ctypes.c_int], None),
))  # fmt: skip
if _LIB is not None and _UDP is None:
    _LIB, WHY_NOT = None, f"its driver: {UDP_WHY_NOT}"
PATH = native.COMPILED if _LIB is not None else native.PYTHON
DRAIN_BATCHES: Final = 4  # reads of 64 datagrams per wake-up, then the control plane runs


def unsuitable(cfg: NodeConfig) -> str | None:
    """Why the native node cannot run ``cfg`` (None: it can)."""
    if _LIB is None:
        return str(WHY_NOT)
    if cfg.scheme not in SCHEMES_NATIVE:
        return f"it runs {', '.join(SCHEMES_NATIVE)}, not {cfg.scheme}"
    if cfg.scheme == "dlcp" and cfg.port_mbps > 0:
        return "DLCP's shaped port (port_mbps) runs in the reference"
    return None


class NativeSwitchNode:
    """``proto.node.SwitchNode`` for ``cfg``, in C (see the module doc)."""

    def __init__(self, cfg: NodeConfig) -> None:
        why = unsuitable(cfg)
        if why is not None:
            raise ConfigError("datapath", f"the native switch node cannot serve: {why}")
        assert _LIB is not None
        self.cfg, self.lib = cfg, _LIB
        self.scheme = SCHEMES.get(cfg.scheme)
        self.s = self.lib.gf_s_new(cfg.slots, SCHEMES_NATIVE.index(cfg.scheme))
        if not self.s:
            raise MemoryError("the native switch's pool")
        links = cfg.ps_link_mbps and self.scheme.policy in ("atp", "esa")  # as SwitchNode's
        if links and self.lib.gf_s_links(self.s, cfg.ps_link_mbps):
            self.close()
            raise ConfigError("ps_link_mbps", f"links of {cfg.ps_link_mbps} Mbit/s refused")
        self.ops = int(self.lib.gf_s_ops())
        self.counters = Counters()  # the node's, folded from C (``fold``)
        self.switch_counters = Counters()
        self.jobs: dict[int, NodeJob] = {}
        self.servers: dict[int, Counters] = {}
        self.lost_to_memory = 0
        self._buf = ctypes.create_string_buffer(1 << 22)

    def close(self) -> None:
        if self.s:
            self.lib.gf_s_free(self.s)
            self.s = None

    # -- the control plane's calls (as SwitchNode's) ---------------------------
    def add_job(
        self, job_id: int, token: bytes, workers: int, slot_base: int = 0, kind: str | None = None,
        help: HelpConfig | None = None, resyncing: bool = False,
    ) -> NodeJob:  # fmt: skip
        cfg, scheme = self.cfg, self.scheme
        if job_id in self.jobs:
            raise ConfigError("job_id", f"job {job_id} is registered already")
        if help is not None:
            if not scheme.can_help:
                raise ConfigError("help", f"SA-ATP help does not run on {cfg.scheme}")
            if help.detector not in DETECTORS_NATIVE or help.helper not in HELPERS_NATIVE:
                raise ConfigError("help", f"the native switch detects with "
                                  f"{', '.join(DETECTORS_NATIVE)} and helps with "
                                  f"{', '.join(HELPERS_NATIVE)}: serve other policies with "
                                  "--datapath python")  # fmt: skip
            if help.iteration_packets < 1:
                raise ConfigError("iteration_packets", "the monitor needs packets per iteration")
        kind = kind or scheme.job_kinds[0]
        if kind not in scheme.job_kinds:
            raise ConfigError("kind", f"the {cfg.scheme} switch takes {scheme.job_kinds} jobs")
        static = scheme.static_slots
        if static and slot_base + cfg.job_slots > cfg.slots:
            raise ConfigError("slot_count", f"slots {slot_base}..{slot_base + cfg.job_slots}"
                              f" exceed the pool of {cfg.slots}")  # fmt: skip
        window = 0 if static else cfg.job_slots
        ps_window = max(cfg.job_slots, cfg.ps_window)
        if len(token) != TOKEN_BYTES or self.lib.gf_s_job(
            self.s, job_id, token, workers, slot_base if static else 0,
            cfg.job_slots if static else 0, int(resyncing), window, ps_window, PS_SCALE,
        ):  # fmt: skip
            raise ConfigError("job_id", f"job {job_id}: not a job the native switch can hold")
        if help is not None and self.lib.gf_s_help(
            self.s, job_id, help.lag_packets, help.replicas, help.max_requests,
            help.iteration_packets, HELPERS_NATIVE.index(help.helper),
        ):  # fmt: skip
            self.lib.gf_s_forget(self.s, job_id)
            raise MemoryError(f"job {job_id}: the native switch's straggler monitor")
        if cfg.scheme == "dlcp" and self.lib.gf_s_dlcp(
            self.s, job_id, cfg.push_bound, cfg.values_per_packet, cfg.rto_ns, MAX_TENSOR,
            int(kind == BACKGROUND),
        ):  # fmt: skip
            self.lib.gf_s_forget(self.s, job_id)
            raise MemoryError(f"job {job_id}: the native switch's DLCP server")
        names = tuple(worker_name(job_id, r) for r in range(workers))
        p = Placement(job_id, names, {"sw": names}, servers=(server_name(job_id),),
                      window=cfg.job_slots, pool_slots=cfg.slots, slot_base=slot_base,
                      help=help)  # fmt: skip
        job = self.jobs[job_id] = NodeJob(job_id, token, kind, p, scheme.entry(p),
                                          resyncing=resyncing)  # fmt: skip
        if not static and kind != BACKGROUND:
            self.servers[job_id] = Counters()
        return job

    def remove_job(self, job_id: int) -> None:
        self.fold()
        del self.jobs[job_id]
        self.servers.pop(job_id, None)
        self.lib.gf_s_forget(self.s, job_id)

    def resync(self, job_id: int, on: bool, floor: int = 0) -> None:
        job = self.jobs[job_id]
        job.resyncing = on
        cfg, static = self.cfg, self.scheme.static_slots
        self.lib.gf_s_job(
            self.s, job_id, job.token, job.workers, job.placement.slot_base if static else 0,
            cfg.job_slots if static else 0, int(on), 0 if static else cfg.job_slots,
            max(cfg.job_slots, cfg.ps_window), PS_SCALE,
        )  # fmt: skip
        if not on:
            self.lib.gf_s_floor(self.s, job_id, floor)

    def missing(self, job_id: int) -> list[int]:
        bits = int(self.lib.gf_s_missing(self.s, job_id))
        return [r for r in range(self.jobs[job_id].workers) if bits >> r & 1]

    def occupancy(self) -> int:
        if self.scheme.static_slots:
            return len(self.jobs) * self.cfg.job_slots
        return int(self.lib.gf_s_occupied(self.s))

    def pool_stats(self) -> tuple[int, int, int]:
        """``PoolStats``' busy_ns, held_ns and claims of the C pool."""
        p = self.lib.gf_s_pool(self.s)
        return int(p[0]), int(p[1]), int(p[2])

    def counter_groups(self) -> dict[str, object]:
        """As ``SwitchNode.counter_groups`` (the C counters folded first)."""
        self.fold()
        return {
            "node": self.counters,
            "jobs": {j: job.counters for j, job in self.jobs.items()},
            "switch": self.switch_counters,
            "servers": dict(self.servers),
        }

    def fold(self) -> None:
        """Move the C counters into their ``Counters`` (the reference's names)."""
        _fold(self.lib.gf_s_counters(self.s), NODE_COUNTERS + ENGINE_COUNTERS + NODE_TAIL,
              [self.counters] * len(NODE_COUNTERS)
              + [self.switch_counters] * len(ENGINE_COUNTERS)
              + [self.counters] * len(NODE_TAIL))  # fmt: skip
        for job_id, job in self.jobs.items():
            ptr = self.lib.gf_s_job_counters(self.s, job_id)
            server = self.servers.get(job_id, job.counters)
            _fold(ptr, JOB_COUNTERS + SERVER_COUNTERS,
                  [job.counters] * len(JOB_COUNTERS) + [server] * len(SERVER_COUNTERS))  # fmt: skip
            dlcp = self.lib.gf_s_dlcp_counters(self.s, job_id)
            if dlcp:
                _fold(dlcp, DLCP_COUNTERS, [server] * len(DLCP_COUNTERS))

    # -- the datagram interface ---------------------------------------------------
    def receive_datagram(self, data: bytes, now_ns: int) -> None:
        if self.lib.gf_s_datagram(self.s, data, len(data), now_ns):
            self.lost_to_memory += 1

    def datagrams_to_send(self, now_ns: int) -> list[Outgoing]:
        out: list[Outgoing] = []
        while True:
            size = int(self.lib.gf_s_take(self.s, self._buf, len(self._buf)))
            if not size:
                return out
            raw, at = self._buf.raw[:size], 0
            while at < size:
                job, rank, n = (int.from_bytes(raw[at + k : at + k + 4], "little", signed=True)
                                for k in (0, 4, 8))  # fmt: skip
                out.append((job, rank, raw[at + 12 : at + 12 + n]))
                at += 12 + n

    def get_timer(self) -> int | None:
        at = int(self.lib.gf_s_timer(self.s))
        return at if at >= 0 else None

    def handle_timer(self, now_ns: int) -> None:
        if self.lib.gf_s_handle_timer(self.s, now_ns):
            self.lost_to_memory += 1


def _fold(
    ptr: ctypes._Pointer[ctypes.c_int64], names: tuple[str, ...], into: list[Counters]
) -> None:
    for i, (name, counters) in enumerate(zip(names, into, strict=True)):
        v = ptr[i]
        if v:
            counters[name] += v
            ptr[i] = 0


class UdpBook:
    """The native driver's address book and its drain (see the module doc),
    for a native engine: the switch node, or a helped host
    (``net.hostpath``, whose one peer is rank 0 of its job)."""

    def __init__(self, ops: int, engine: int) -> None:
        assert _UDP is not None
        self.lib, self.ops, self.engine = _UDP, ops, engine
        self.b = self.lib.gf_book_new()
        if not self.b:
            raise MemoryError("the native driver's buffers")
        self.known: dict[int, tuple[object, ...]] = {}  # job -> what C was last told

    def close(self) -> None:
        if self.b:
            self.lib.gf_book_free(self.b)
            self.b = None

    def job(self, job_id: int, workers: int, addrs: dict[int, bytes]) -> None:
        """Job ``job_id``'s ``workers`` and addresses (raw sockaddrs by rank;
        rank -1: its multicast group). Only what changed is written."""
        state = (workers, tuple(sorted(addrs.items())))
        if self.known.get(job_id) == state:
            return
        self.lib.gf_book_forget(self.b, job_id)
        if self.lib.gf_book_job(self.b, job_id, workers):
            raise ValueError(f"job {job_id}: {workers} workers")
        for rank, raw in addrs.items():
            if self.lib.gf_book_set(self.b, job_id, rank, raw, len(raw)):
                raise ValueError(f"job {job_id}: rank {rank}'s address")
        self.known[job_id] = state

    def forget(self, job_id: int) -> None:
        self.lib.gf_book_forget(self.b, job_id)
        self.known.pop(job_id, None)

    def drain(self, fd: int) -> int:
        """Read, aggregate and answer what ``fd`` holds (a few batches)."""
        return int(self.lib.gf_udp_drain(self.ops, self.engine, self.b, fd, DRAIN_BATCHES))

    def flush(self, fd: int) -> None:
        """Send what the engine queued outside a drain."""
        self.lib.gf_udp_flush(self.ops, self.engine, self.b, fd)

    def fold(self, into: Counters) -> None:
        """Move the driver's counters into the daemon's."""
        _fold(self.lib.gf_book_counters(self.b), DRIVER_COUNTERS, [into] * len(DRIVER_COUNTERS))
