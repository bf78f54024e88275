"""The switch daemon's native datapath (``_switchpath.c``): SwitchML, ATP, ESA, PS.

Per datagram the Python daemon spends a dozen calls (read, job and token,
decode, engine, policy, encode, send): on 8 KB datagrams that was the
daemon's CPU per sum and the switch's bound on shaped links
(NOTEBOOK.md). ``_switchpath.c`` does the same work in C, a batch of
datagrams per call (recvmmsg, sendmmsg), from the daemon's own event loop:
the control plane runs in the same thread between calls, so it needs no
locks. It tells the C table what it decides (jobs, tokens, worker
addresses, resynchronisation after a restart: ``NativeSwitch.job``) and
reads back what the daemon reports (``missing``, occupancy, counters folded
into the daemon's, the engine's, each job's and each job's PS's
``Counters`` under the reference's names, so ``stats`` and the metrics read
the same).

The reference is ``emu.switchd.accept`` plus ``SwitchEngine`` with the
policy (``SwitchMLPolicy``, ``ATPPolicy``, ``ESAPolicy``) and, for ATP and
ESA, each job's ``ParameterServer`` hosted in the daemon (the fallback that
merges what the pool could not, and sends every result back through the
switch), or the PS baseline's ``ParameterServer`` alone (it answers the
workers itself). ``tests/property/test_switchpath.py`` holds the two equal datagram
for datagram on seeded traffic with loss, duplicates, reordering,
collisions, retransmissions, float payloads, preemptions, stale, foreign,
forged and malformed datagrams and a job that resynchronises. The daemon
serves through it only where it is built and nothing else is in the way
(no impairments, the PS at the switch rather than behind modelled links, no
SA-ATP job: its straggler monitor runs in the reference; ``--datapath
python`` keeps the reference), and says so in ``stats`` (``datapath``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Final

from gradfabric.core import native
from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.proto.actions import Action
from gradfabric.proto.switch.engine import PoolStats
from gradfabric.proto.switch.job import SwitchJob
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import Packet

SOURCE = Path(__file__).with_name("_switchpath.c")
DRAIN_BATCHES: Final = 4  # reads of 64 datagrams per wake-up, then the control plane runs
# The C core's counters, in its order: the daemon's, then the switch engine's,
DAEMON_COUNTERS: Final = (
    "rx_datagrams", "drop_unknown_job", "drop_malformed", "drop_no_address", "tx_datagrams",
    "drop_tx_full", "socket_error", "native_syscalls",
)  # fmt: skip
ENGINE_COUNTERS: Final = (
    "rx_gradient", "rx_help", "drop_bad_worker", "drop_bad_result", "drop_bad_slot",
    "drop_float_payload", "drop_stale", "drop_duplicate", "retx_answered",
    "drop_count_mismatch", "drop_stale_result", "nack_sent",
    "ps_overflow", "ps_resend", "flush_partial", "ps_collision", "drop_late", "stale_reclaimed",
    "reclaimed_complete", "preemptions",
)  # fmt: skip
JOB_COUNTERS: Final = ("rx_datagrams", "drop_bad_token", "drop_malformed", "drop_resyncing")
SERVER_COUNTERS: Final = (
    "merged", "resend_answered", "drop_bad_packet", "drop_stale", "drop_late_partial",
    "drop_duplicate", "drop_overlap", "drop_count_mismatch",
)  # fmt: skip (a job's PS's, after the job's own in C)
POLICIES: Final = ("switchml", "atp", "esa", "ps")  # in the C core's order

_i64, _p, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
_I64P = ctypes.POINTER(_i64)


_LIB, WHY_NOT = native.load(SOURCE, (
    ("gf_s_new", [_i64, _i64], _p), ("gf_s_free", [_p], None),
    ("gf_s_job", [_p, _i64, ctypes.c_char_p, _i64, _i64, _i64, _i64, _i64, _i64, _f64],
     ctypes.c_int),
    ("gf_s_addr", [_p, _i64, _i64, ctypes.c_char_p, _i64], ctypes.c_int),
    ("gf_s_forget", [_p, _i64], None), ("gf_s_missing", [_p, _i64], ctypes.c_uint64),
    ("gf_s_counters", [_p], _I64P), ("gf_s_job_counters", [_p, _i64], _I64P),
    ("gf_s_pool", [_p], _I64P), ("gf_s_occupied", [_p], _i64),
    ("gf_s_datagram", [_p, ctypes.c_char_p, _i64, _i64], None),
    ("gf_s_take", [_p, _p, _i64], _i64), ("gf_s_drain", [_p, ctypes.c_int, _i64], _i64),
))  # fmt: skip
PATH = native.COMPILED if _LIB is not None else native.PYTHON


class NativeSwitch:
    """The C pool and job table of one daemon (``slots`` aggregators of
    ``policy``, one of ``POLICIES``)."""

    def __init__(self, slots: int, policy: str = "switchml") -> None:
        if _LIB is None:
            raise ValueError(f"the native switch datapath is not available: {WHY_NOT}")
        if policy not in POLICIES:
            raise ValueError(f"the native switch runs {', '.join(POLICIES)}, not {policy!r}")
        self.lib = _LIB
        self.s = self.lib.gf_s_new(slots, POLICIES.index(policy))
        if not self.s:
            raise MemoryError("the native switch's pool")
        self.known: dict[int, tuple[object, ...]] = {}  # job -> what C was last told
        self._buf: ctypes.Array[ctypes.c_char] | None = None

    def close(self) -> None:
        if self.s:
            self.lib.gf_s_free(self.s)
            self.s = None

    # -- what the control plane decided ------------------------------------
    def job(
        self, job_id: int, token: bytes, workers: int, slot_base: int, slot_count: int,
        resync: bool, addrs: dict[int, bytes], window: int = 0, ps: tuple[int, float] = (1, 1e6),
    ) -> None:  # fmt: skip
        """Install or update a job (only what changed is written). SwitchML:
        its slot range; ATP and ESA: the switch job's ``window`` and its PS's
        (``ps``: the results it keeps, its integer scale; ``proto.ps.PsJob``).
        ``addrs``: raw sockaddrs by rank; rank -1 is the job's multicast group,
        where what goes to every worker is sent once (``drain``, not ``take``)."""
        state = (token, workers, slot_base, slot_count, resync, tuple(sorted(addrs.items())),
                 window, ps)  # fmt: skip
        if self.known.get(job_id) == state:
            return
        if len(token) != TOKEN_BYTES or self.lib.gf_s_job(
            self.s, job_id, token, workers, slot_base, slot_count, int(resync), window, *ps
        ):
            raise ValueError(f"job {job_id}: not a job the native switch can hold")
        for rank, raw in addrs.items():
            if self.lib.gf_s_addr(self.s, job_id, rank, raw, len(raw)):
                raise ValueError(f"job {job_id}: rank {rank}'s address")
        self.known[job_id] = state

    def forget(self, job_id: int) -> None:
        self.lib.gf_s_forget(self.s, job_id)
        self.known.pop(job_id, None)

    def missing(self, job_id: int) -> int:
        return int(self.lib.gf_s_missing(self.s, job_id))

    # -- the datapath ---------------------------------------------------------
    def drain(self, fd: int) -> int:
        """Read, aggregate and answer what ``fd`` holds (a few batches)."""
        return int(self.lib.gf_s_drain(self.s, fd, DRAIN_BATCHES))

    def datagram(self, data: bytes, now_ns: int) -> None:
        self.lib.gf_s_datagram(self.s, data, len(data), now_ns)

    def take(self) -> list[tuple[int, bytes]]:
        """The datagrams queued to send, as (rank, bytes) (for tests)."""
        if self._buf is None:  # one buffer for every call: a batch's results at most
            self._buf = ctypes.create_string_buffer(1 << 24)
        size = self.lib.gf_s_take(self.s, self._buf, len(self._buf))
        raw, out, at = ctypes.string_at(self._buf, max(size, 0)), [], 0
        while at < size:
            rank, n = (
                int.from_bytes(raw[at : at + 4], "little"),
                int.from_bytes(raw[at + 4 : at + 8], "little"),
            )
            out.append((rank, raw[at + 8 : at + 8 + n]))
            at += 8 + n
        return out

    def fold(
        self, daemon: Counters, engine: Counters, jobs: dict[int, Counters],
        servers: dict[int, Counters] | None = None,
    ) -> None:  # fmt: skip
        """Move the C counters into the daemon's, the engine's, the jobs' and
        the jobs' PS's (``servers``; a job without one there: its job's)."""
        _fold(self.lib.gf_s_counters(self.s), DAEMON_COUNTERS + ENGINE_COUNTERS,
              [daemon] * len(DAEMON_COUNTERS) + [engine] * len(ENGINE_COUNTERS))  # fmt: skip
        for job_id, counters in jobs.items():
            ptr = self.lib.gf_s_job_counters(self.s, job_id)
            if ptr:
                server = (servers or {}).get(job_id, counters)
                _fold(ptr, JOB_COUNTERS + SERVER_COUNTERS, [counters] * len(JOB_COUNTERS)
                      + [server] * len(SERVER_COUNTERS))  # fmt: skip

    def occupied(self) -> int:
        """ATP's and ESA's aggregators now held by some job."""
        return int(self.lib.gf_s_occupied(self.s))

    def pool(self) -> tuple[int, int, int]:
        """``PoolStats``' busy_ns, held_ns and claims of the C pool."""
        p = self.lib.gf_s_pool(self.s)
        return int(p[0]), int(p[1]), int(p[2])


def _fold(
    ptr: ctypes._Pointer[ctypes.c_int64], names: tuple[str, ...], into: list[Counters]
) -> None:
    for i, (name, counters) in enumerate(zip(names, into, strict=True)):
        v = ptr[i]
        if v:
            counters[name] += v
            ptr[i] = 0


class NativePolicy:
    """An allocation policy (``proto.switch.engine.Policy``: ``switchml``,
    ``atp`` or ``esa``; ``ps``: the idle switch of a PS daemon, whose servers
    run in C too) whose pool lives in a ``NativeSwitch``: the data never
    reaches Python, so ``on_gradient`` and ``on_result`` are never called;
    ``missing``, occupancy and the pool's statistics come from C, and a job
    that leaves is cleared there (with its PS, for ATP and ESA)."""

    def __init__(self, policy: str, pool_slots: int, counters: Counters) -> None:
        self.name, self.slots, self.counters = policy, pool_slots, counters
        self.stats = PoolStats(aggregators=(2 if policy == "switchml" else 1) * pool_slots)
        self.native = NativeSwitch(pool_slots, policy)

    def on_gradient(self, job: SwitchJob, pkt: Packet, now_ns: int) -> list[Action]:
        raise RuntimeError("the native switch datapath takes its datagrams in C")

    on_result = on_gradient

    def result_fan_in(self, job: SwitchJob) -> int:
        return job.parent_fan_in if self.name == "switchml" else job.fan_in

    def admit(self, job: SwitchJob) -> None:
        if job.slot_base + job.slot_count > self.slots:
            raise ConfigError(
                "slot_count",
                f"slots {job.slot_base}..{job.slot_base + job.slot_count}"
                f" exceed the pool of {self.slots}",
            )

    def retire(self, job: SwitchJob) -> None:
        self.native.forget(job.job_id)

    def missing(self, job: SwitchJob) -> int:
        return self.native.missing(job.job_id)

    def occupied(self) -> int:
        return self.native.occupied()

    def refresh_stats(self) -> None:
        self.stats.busy_ns, self.stats.held_ns, self.stats.claims = self.native.pool()
