"""The switch daemon's control plane: one JSON object per line over TCP.

* ``register``: a job of N workers (and, on the ATP family, SA-ATP help); the
  answer is its id, its secret token and the protocol parameters its workers
  need (the ``Ticket``). The job's engines come from the scheme registry
  (``proto.schemes``), as every driver's do.
* ``hello``: a worker's UDP address.
* ``missing``: the ranks the job's engines wait on, or gave up on.
* ``stats``: every counter and the aggregator pool's occupancy.
* ``unregister``: the job leaves; what it held is released.

An error is answered as ``{"error": ...}`` and counted, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net.udp import Address
from gradfabric.proto.actions import Aggregator
from gradfabric.proto.schemes import Placement
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import MAX_FAN_IN

if TYPE_CHECKING:
    from gradfabric.emu.switchd import SwitchDaemon

BACKGROUND: Final = "background"  # a DLCP job kind: traffic that only loads the port


@dataclass
class DaemonJob:
    job_id: int
    token: bytes
    workers: int
    slot_base: int
    kind: str
    placement: Placement
    entry: str  # the hosted engine the job's datagrams go to
    shaped: bool = False  # its datagrams cross the daemon's shaped, prioritised port
    addrs: dict[int, Address] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)  # datagrams that named this job


def worker_name(job_id: int, rank: int) -> str:
    return f"j{job_id}w{rank}"


def server_name(job_id: int) -> str:
    return f"j{job_id}ps"


class ControlPlane:
    def __init__(self, daemon: SwitchDaemon) -> None:
        self.d = daemon
        self.next_job = 1

    def register(
        self, workers: int, sa_atp: dict[str, Any] | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        """A new job of ``workers``; ``sa_atp`` (ATP family only) turns on
        SA-ATP straggler help with these ``HelpConfig`` fields
        (``iteration_packets`` required). ``kind``: one of the scheme's job
        kinds (DLCP: ``dlcp``, or ``background`` traffic for its port)."""
        d, cfg, scheme = self.d, self.d.cfg, self.d.scheme
        if not 1 <= workers <= MAX_FAN_IN:
            raise ConfigError("workers", f"must be in 1..{MAX_FAN_IN}")
        kind = kind or scheme.job_kinds[0]
        if kind not in scheme.job_kinds:
            kinds = ", ".join(scheme.job_kinds)
            raise ConfigError("kind", f"the {cfg.policy} switch takes {kinds} jobs")
        helping = None
        if sa_atp is not None:
            if not scheme.can_help:
                raise ConfigError("help", "SA-ATP help runs on the atp and esa policies")
            helping = HelpConfig(**sa_atp)
            if helping.iteration_packets < 1:
                raise ConfigError("iteration_packets", "SA-ATP needs packets per iteration")
        job_id = self._new_id()
        base = self._free_range() if scheme.static_slots else 0
        names = tuple(worker_name(job_id, r) for r in range(workers))
        window = cfg.job_slots
        p = Placement(
            job_id, names, {d.SWITCH: names}, servers=(server_name(job_id),),
            window=window, pool_slots=cfg.slots, slot_base=base,
            keep_results=4 * window,  # a Python PS answers late retransmissions longer
            rto_ns=cfg.rto_ns, values_per_packet=cfg.values_per_packet,
            streams=cfg.omni_streams, push_bound=cfg.push_bound, help=helping,
        )  # fmt: skip
        if kind != BACKGROUND:
            for name, engine in scheme.attach(p, d.switch).items():
                d.host(name, engine)
        job = DaemonJob(
            job_id, secrets.token_bytes(TOKEN_BYTES), workers, base, kind, p,
            entry=scheme.entry(p), shaped=scheme.shaped_port and cfg.port_mbps > 0,
        )  # fmt: skip
        d.jobs[job_id] = job
        d.counters["jobs_registered"] += 1
        assert d.sock is not None
        return {
            "switch": list(d.sock.getsockname()[:2]),
            "job_id": job_id,
            "token": job.token.hex(),
            "policy": cfg.policy,
            "workers": workers,
            "pool_slots": cfg.slots,
            "slot_base": base,
            "window": window,
            "values_per_packet": cfg.values_per_packet,
            "rto_ns": cfg.rto_ns,
            "entry": job.entry,
            "kind": kind,
            "streams": cfg.omni_streams,
            "push_bound": cfg.push_bound,
            "pull_bound": cfg.pull_bound,
        }

    def _new_id(self) -> int:
        if len(self.d.jobs) >= 0xFFFF:
            raise ConfigError("jobs", "the switch is full")
        while True:
            job_id = self.next_job
            self.next_job = self.next_job % 0xFFFF + 1
            if job_id not in self.d.jobs:
                return job_id

    def _free_range(self) -> int:
        """The first free range of ``job_slots`` slots (first fit)."""
        cfg, base = self.d.cfg, 0
        taken = sorted((j.slot_base, j.slot_base + cfg.job_slots) for j in self.d.jobs.values())
        for lo, hi in taken:
            if base + cfg.job_slots <= lo:
                break
            base = max(base, hi)
        if base + cfg.job_slots > cfg.slots:
            raise ConfigError("slots", f"no free range of {cfg.job_slots} slots left")
        return base

    def _job(self, req: dict[str, Any]) -> DaemonJob:
        job = self.d.jobs.get(int(req.get("job_id", -1)))
        if job is None or not secrets.compare_digest(
            bytes.fromhex(str(req.get("token", ""))), job.token
        ):
            raise ConfigError("job_id", "unknown job or wrong token")
        return job

    def missing(self, job: DaemonJob) -> list[int]:
        """Ranks some hosted engine waits on, or gave up on."""
        names = set(self.d.gave_up.get(job.job_id, ()))
        for engine in self.d.engines():
            if isinstance(engine, Aggregator):
                names |= set(engine.missing_peers(job.job_id))
        return [r for r in range(job.workers) if worker_name(job.job_id, r) in names]

    def handle(self, req: dict[str, Any], peer: str) -> dict[str, Any]:
        d = self.d
        op = req.get("op")
        if op == "register":
            kind = req.get("kind")
            return self.register(
                int(req.get("workers", 0)), req.get("help"), None if kind is None else str(kind)
            )
        if op == "stats":
            return d.stats()
        job = self._job(req)
        if op == "hello":
            rank = int(req["rank"])
            if not 0 <= rank < job.workers:
                raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
            addr = (str(req.get("host") or peer), int(req["port"]))
            job.addrs[rank] = addr
            d.book[worker_name(job.job_id, rank)] = (job, addr)
            return {"ok": True, "ready": len(job.addrs) == job.workers}
        if op == "missing":
            return {"missing": self.missing(job)}
        if op == "unregister":
            d.scheme.detach(job.placement, d.switch)
            d.unhost(server_name(job.job_id))
            for r in range(job.workers):
                d.book.pop(worker_name(job.job_id, r), None)
            d.gave_up.pop(job.job_id, None)
            del d.jobs[job.job_id]
            return {"ok": True}
        raise ConfigError("op", f"unknown operation {op!r}")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        try:
            while line := await reader.readline():
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ConfigError("request", "must be a JSON object")
                    reply = self.handle(req, peer)
                except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
                    self.d.counters["control_errors"] += 1
                    reply = {"error": str(e)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def control_call(
    addr: Address, req: dict[str, Any], timeout_s: float = 5.0
) -> dict[str, Any]:
    """One request to a switch daemon's control port; raises ``ConfigError``
    with the switch's message if it answers an error."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), timeout_s)
    try:
        writer.write(json.dumps(req).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
    if not line:
        raise ConnectionError(f"switch at {addr[0]}:{addr[1]} closed the control connection")
    reply = json.loads(line)
    if "error" in reply:
        raise ConfigError(str(req.get("op")), str(reply["error"]))
    return cast(dict[str, Any], reply)
