"""The switch daemon's control plane: one JSON object per line over TCP.

* ``register``: a job of N workers (and, on the ATP family, SA-ATP help); the
  answer is its id, its secret token and the protocol parameters its workers
  need (the ``Ticket``). The job's engines come from the scheme registry
  (``proto.schemes``), as every driver's do.
* ``hello``: a worker's UDP address (the answer carries the daemon's epoch).
* ``watch``: the daemon's epoch; the worker keeps this connection open, so
  the daemon's end closing tells it at once that the daemon went away.
* ``restore``: a worker whose daemon restarted installs its job again from
  its ticket (same id, token and slot range; idempotent). The job then
  resynchronises: its datagrams are counted drops (``drop_resyncing``)
  until every rank has said ``resume`` with its ``base`` (the oldest
  sequence it has no result for); the answer to ``resume`` is then the
  floor, the smallest of those, from which the workers replay
  (``proto.worker``).
* ``missing``: the ranks the job's engines wait on, or gave up on (while it
  resynchronises: the ranks that have not said ``resume``).
* ``stats``: every counter and the aggregator pool's occupancy.
* ``unregister``: the job leaves; what it held is released.

With a state directory (``--state-dir``) every registration and worker
address is kept in ``jobs.json`` there; a daemon started on it knows those
jobs (resynchronising), so their tokens survive a restart and no other job
can take their ids or slots meanwhile.

An error is answered as ``{"error": ...}`` and counted, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.emu.links import ShardLinks
from gradfabric.net.udp import Address, group_of
from gradfabric.proto.interface import Aggregator
from gradfabric.proto.schemes import Placement
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import MAX_FAN_IN

if TYPE_CHECKING:
    from gradfabric.emu.switchd import SwitchDaemon

BACKGROUND: Final = "background"  # a DLCP job kind: traffic that only loads the port
STATE_FILE: Final = "jobs.json"  # in the state directory


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
    resync: dict[int, int] | None = None  # restored, waiting: rank -> its base
    floor: int | None = None  # where the last resynchronisation told workers to replay from
    group: Address | None = None  # its multicast group (``SwitchConfig.multicast``)


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
        scheme = self.d.scheme
        kind = self._kind(workers, kind)
        helping = None
        if sa_atp is not None:
            if not scheme.can_help:
                raise ConfigError("help", "SA-ATP help runs on the atp and esa policies")
            helping = HelpConfig(**sa_atp)
            if helping.iteration_packets < 1:
                raise ConfigError("iteration_packets", "SA-ATP needs packets per iteration")
        base = self._free_range() if scheme.static_slots else 0
        job = self._install(self._new_id(), secrets.token_bytes(TOKEN_BYTES), workers, base,
                            kind, helping)  # fmt: skip
        self.d.counters["jobs_registered"] += 1
        self.save()
        return self.ticket(job)

    def restore(self, req: dict[str, Any]) -> dict[str, Any]:
        """A job the restarted daemon lost, installed again from its ticket."""
        d, cfg = self.d, self.d.cfg
        job_id, token = int(req["job_id"]), bytes.fromhex(str(req["token"]))
        job = d.jobs.get(job_id)
        if job is not None:
            if not secrets.compare_digest(token, job.token):
                raise ConfigError("job_id", f"job {job_id} is another job's now")
            return self.ticket(job)  # restored already, by another rank or from the state dir
        theirs = {k: req.get(k) for k in ("policy", "window", "values_per_packet")}
        theirs["multicast"] = bool(req.get("multicast", False))  # whether its ranks joined a group
        ours = {"policy": cfg.policy, "window": cfg.job_slots,
                "values_per_packet": cfg.values_per_packet, "multicast": cfg.multicast}  # fmt: skip
        if theirs != ours:
            raise ConfigError("restore", f"the daemon now runs {ours}, the job had {theirs}")
        workers, base = int(req["workers"]), int(req.get("slot_base", 0))
        kind = self._kind(workers, req.get("kind"))
        if not 1 <= job_id <= 0xFFFF or len(token) != TOKEN_BYTES:
            raise ConfigError("job_id", "not a ticket this daemon could have issued")
        if d.scheme.static_slots and not self._range_free(base):
            raise ConfigError("slot_base", f"slots from {base} are another job's now")
        job = self._install(job_id, token, workers, base, kind, None)
        job.resync = {}
        d.counters["jobs_restored"] += 1
        self.save()
        return self.ticket(job)

    def resume(self, job: DaemonJob, rank: int, base: int) -> dict[str, Any]:
        """Rank ``rank`` has no result from ``base`` on; the floor once all said so."""
        if job.resync is not None:
            job.resync[rank] = base
            if len(job.resync) == job.workers:
                job.floor = min(job.resync.values())
                job.resync = None
                self.d.counters["jobs_resumed"] += 1
        if job.resync is None and job.floor is not None:
            return {"floor": job.floor, "epoch": self.d.epoch}
        return {"wait": True}

    def _kind(self, workers: int, kind: str | None) -> str:
        cfg, scheme = self.d.cfg, self.d.scheme
        if not 1 <= workers <= MAX_FAN_IN:
            raise ConfigError("workers", f"must be in 1..{MAX_FAN_IN}")
        kind = kind or scheme.job_kinds[0]
        if kind not in scheme.job_kinds:
            kinds = ", ".join(scheme.job_kinds)
            raise ConfigError("kind", f"the {cfg.policy} switch takes {kinds} jobs")
        return kind

    def _install(
        self, job_id: int, token: bytes, workers: int, base: int, kind: str,
        helping: HelpConfig | None,
    ) -> DaemonJob:  # fmt: skip
        d, cfg, scheme = self.d, self.d.cfg, self.d.scheme
        if helping is not None and d.native is not None:  # (registered, or in the state dir)
            raise ConfigError("help", "SA-ATP's straggler monitor runs in the reference "
                              "datapath: serve with --datapath python")  # fmt: skip
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
            fallback = d.local.get(server_name(job_id))
            if fallback is not None and cfg.ps_link_mbps and cfg.policy in ("atp", "esa"):
                fallback.links = ShardLinks(workers, cfg.ps_link_mbps)
        job = DaemonJob(
            job_id, token, workers, base, kind, p,
            entry=scheme.entry(p), shaped=scheme.shaped_port and cfg.port_mbps > 0,
        )  # fmt: skip
        if cfg.multicast:
            assert d.sock is not None
            job.group = group_of(job_id, d.sock.getsockname()[1])
        d.jobs[job_id] = job
        return job

    def ticket(self, job: DaemonJob) -> dict[str, Any]:
        """What a job's workers need to know (``emu.client.Ticket``)."""
        d, cfg = self.d, self.d.cfg
        assert d.sock is not None
        return {
            "switch": list(d.sock.getsockname()[:2]),
            "job_id": job.job_id,
            "token": job.token.hex(),
            "policy": cfg.policy,
            "workers": job.workers,
            "pool_slots": cfg.slots,
            "slot_base": job.slot_base,
            "window": cfg.job_slots,
            "values_per_packet": cfg.values_per_packet,
            "rto_ns": cfg.rto_ns,
            "entry": job.entry,
            "kind": job.kind,
            "streams": cfg.omni_streams,
            "push_bound": cfg.push_bound,
            "pull_bound": cfg.pull_bound,
            "epoch": d.epoch,
            "group": None if job.group is None else list(job.group),
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
        for lo, hi in sorted(self._taken()):
            if base + cfg.job_slots <= lo:
                break
            base = max(base, hi)
        if base + cfg.job_slots > cfg.slots:
            raise ConfigError("slots", f"no free range of {cfg.job_slots} slots left")
        return base

    def _taken(self) -> list[tuple[int, int]]:
        w = self.d.cfg.job_slots
        return [(j.slot_base, j.slot_base + w) for j in self.d.jobs.values()]

    def _range_free(self, base: int) -> bool:
        w = self.d.cfg.job_slots
        inside = base >= 0 and base + w <= self.d.cfg.slots
        return inside and all(hi <= base or base + w <= lo for lo, hi in self._taken())

    # -- the state directory ------------------------------------------------
    def save(self) -> None:
        """Write every registration to the state directory (if any), atomically."""
        d = self.d
        if d.cfg.state_dir is None:
            return
        jobs = [
            {"job_id": j.job_id, "token": j.token.hex(), "workers": j.workers,
             "slot_base": j.slot_base, "kind": j.kind,
             "help": None if j.placement.help is None else asdict(j.placement.help),
             "addrs": {str(r): list(a) for r, a in j.addrs.items()}}
            for j in d.jobs.values()
        ]  # fmt: skip
        state = {"config": self._identity(), "next_job": self.next_job, "jobs": jobs}
        path = os.path.join(d.cfg.state_dir, STATE_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    def load(self) -> None:
        """Know the jobs the state directory holds, each waiting to resynchronise."""
        d = self.d
        if d.cfg.state_dir is None:
            return
        os.makedirs(d.cfg.state_dir, exist_ok=True)
        path = os.path.join(d.cfg.state_dir, STATE_FILE)
        if not os.path.exists(path):
            return
        with open(path) as f:
            state = json.load(f)
        if state["config"] != self._identity():
            raise ConfigError(
                "state_dir", f"{path} was written by a daemon with {state['config']}, "
                f"this one has {self._identity()}",
            )  # fmt: skip
        for j in state["jobs"]:
            helping = None if j["help"] is None else HelpConfig(**j["help"])
            job = self._install(j["job_id"], bytes.fromhex(j["token"]), j["workers"],
                                j["slot_base"], j["kind"], helping)  # fmt: skip
            job.resync = {}
            for r, (host, port) in j["addrs"].items():
                self._hello(job, int(r), (str(host), int(port)))
            d.counters["jobs_restored"] += 1
        self.next_job = int(state["next_job"])

    def _identity(self) -> dict[str, Any]:
        """What a job's workers depend on: a daemon must match it to take the jobs over."""
        cfg = self.d.cfg
        return {"policy": cfg.policy, "slots": cfg.slots, "window": cfg.job_slots,
                "values_per_packet": cfg.values_per_packet,
                **({"multicast": True} if cfg.multicast else {})}  # fmt: skip

    def _hello(self, job: DaemonJob, rank: int, addr: Address) -> None:
        if not 0 <= rank < job.workers:
            raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
        job.addrs[rank] = addr
        self.d.book[worker_name(job.job_id, rank)] = (job, addr)

    def _job(self, req: dict[str, Any]) -> DaemonJob:
        job = self.d.jobs.get(int(req.get("job_id", -1)))
        if job is None or not secrets.compare_digest(
            bytes.fromhex(str(req.get("token", ""))), job.token
        ):
            raise ConfigError("job_id", "unknown job or wrong token")
        return job

    def missing(self, job: DaemonJob) -> list[int]:
        """Ranks some hosted engine waits on, or gave up on (while the job
        resynchronises: the ranks that have not said ``resume``)."""
        if job.resync is not None:
            return [r for r in range(job.workers) if r not in job.resync]
        names = set(self.d.gave_up.get(job.job_id, ()))
        if self.d.native is not None:  # the pool and the PS in C: their Python engines idle
            bits = self.d.native.native.missing(job.job_id)
            names |= {worker_name(job.job_id, r) for r in range(job.workers) if bits >> r & 1}
        else:
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
        if op == "restore":
            return self.restore(req)
        job = self._job(req)
        if op == "hello":
            self._hello(job, int(req["rank"]), (str(req.get("host") or peer), int(req["port"])))
            self.save()
            return {"ok": True, "ready": len(job.addrs) == job.workers, "epoch": d.epoch}
        if op == "watch":
            return {"epoch": d.epoch}
        if op == "resume":
            rank = int(req["rank"])
            if not 0 <= rank < job.workers:
                raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
            return self.resume(job, rank, int(req["base"]))
        if op == "missing":
            return {"missing": self.missing(job)}
        if op == "unregister":
            d.scheme.detach(job.placement, d.switch)
            d.unhost(server_name(job.job_id))
            for r in range(job.workers):
                d.book.pop(worker_name(job.job_id, r), None)
            d.gave_up.pop(job.job_id, None)
            del d.jobs[job.job_id]
            d.counters["jobs_unregistered"] += 1
            self.save()
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
                self.d.sync_native()  # the datapath in C learns what changed
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
