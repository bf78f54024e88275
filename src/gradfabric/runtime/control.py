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
* ``probe`` and ``multicast``: where the daemon offers a job a multicast
  group, each worker asks for a probe datagram to the group (on a port of
  its own choosing, apart from the data) and says whether it came. Results
  go to the group once every rank got it; a rank that did not gets the job
  its results one by one, with a log line saying why.
* ``missing``: the ranks the job's engines wait on, or gave up on (while it
  resynchronises: the ranks that have not said ``resume``).
* ``stats``: every counter and the aggregator pool's occupancy.
* ``unregister``: the job leaves; what it held is released.

Who may ask: with ``allow`` the control port answers only peers in those
networks; with a ``secret`` a registration (and a restart's restore) must
carry it (compared in constant time); one client address holds at most
``max_jobs_per_client`` jobs, its share of the pool. What is refused is
answered as an error and counted by why (``control_refused_network``,
``control_refused_secret``, ``register_refused_cap``), never a job.

With a state directory (``--state-dir``) every registration and worker
address is kept in ``jobs.json`` there; a daemon started on it knows those
jobs (resynchronising), so their tokens survive a restart and no other job
can take their ids or slots meanwhile.

An error is answered as ``{"error": ...}`` and counted, never a crash.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol, cast

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net.udp import Address, group_of
from gradfabric.proto.node import BACKGROUND as BACKGROUND
from gradfabric.proto.node import NodeConfig, NodeJob
from gradfabric.proto.node import server_name as server_name
from gradfabric.proto.node import worker_name as worker_name
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES
from gradfabric.wire.packet import MAX_FAN_IN

STATE_FILE: Final = "jobs.json"  # in the state directory
LOG = logging.getLogger("gradfabric.switch")


@dataclass
class DaemonJob:
    """A registered job as the control plane keeps it: what its workers were
    told, where they are, and the node's job (its engines' side)."""

    job_id: int
    token: bytes
    workers: int
    slot_base: int
    kind: str
    node: NodeJob
    help: HelpConfig | None = None
    addrs: dict[int, Address] = field(default_factory=dict)
    resync: dict[int, int] | None = None  # restored, waiting: rank -> its base
    floor: int | None = None  # where the last resynchronisation told workers to replay from
    group: Address | None = None  # its multicast group (``SwitchConfig.multicast``)
    delivered: set[int] = field(default_factory=set)  # ranks that got the group's probe
    unicast: str | None = None  # why results go to each worker (a rank got no probe)

    @property
    def multicasting(self) -> bool:
        """Results go to the group: every rank got its probe there."""
        return self.group is not None and self.unicast is None and \
            len(self.delivered) == self.workers  # fmt: skip

    @property
    def counters(self) -> Counters:
        """The datagrams that named this job (the node counts them)."""
        return self.node.counters


class Node(Protocol):
    """What the control plane asks of the switch node (``proto.node.SwitchNode``
    or its native twin)."""

    cfg: NodeConfig

    def add_job(
        self, job_id: int, token: bytes, workers: int, slot_base: int = 0, kind: str | None = None,
        help: HelpConfig | None = None, resyncing: bool = False,
    ) -> NodeJob: ...  # fmt: skip

    def remove_job(self, job_id: int) -> None: ...

    def resync(self, job_id: int, on: bool, floor: int = 0) -> None: ...

    def missing(self, job_id: int) -> list[int]: ...


class Daemon(Protocol):
    """What the control plane asks of the daemon that runs it."""

    @property
    def node(self) -> Node: ...

    jobs: dict[int, DaemonJob]
    counters: Counters
    epoch: str
    multicast: bool
    state_dir: str | None
    secret: str | None  # a cluster secret registrations carry (None: none asked)
    networks: list[Any]  # where the control port answers from (empty: anywhere)
    max_jobs_per_client: int
    pull_bound: float  # DLCP: what the ticket tells workers of their pulls

    def data_address(self) -> Address: ...

    def addresses_changed(self, job: DaemonJob) -> None: ...

    def probe(self, job: DaemonJob, port: int, nonce: bytes) -> bool: ...

    def forget(self, job: DaemonJob) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class ControlPlane:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.next_job = 1
        self.owners: dict[int, str] = {}  # job -> the client address that registered it

    @property
    def cfg(self) -> NodeConfig:
        return self.d.node.cfg

    def register(
        self, workers: int, sa_atp: dict[str, Any] | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        """A new job of ``workers``; ``sa_atp`` (ATP family only) turns on
        SA-ATP straggler help with these ``HelpConfig`` fields
        (``iteration_packets`` required). ``kind``: one of the scheme's job
        kinds (DLCP: ``dlcp``, or ``background`` traffic for its port)."""
        helping = None
        if sa_atp is not None:
            if self.cfg.scheme not in ("atp", "esa"):
                raise ConfigError("help", "SA-ATP help runs on the atp and esa policies")
            helping = HelpConfig(**sa_atp)
            if helping.iteration_packets < 1:
                raise ConfigError("iteration_packets", "SA-ATP needs packets per iteration")
            if helping.replicas >= workers:
                raise ConfigError("replicas", f"a shard's replicas live on the other workers "
                                  f"(< {workers}), got {helping.replicas}")  # fmt: skip
        base = self._free_range() if self.cfg.scheme == "switchml" else 0
        job = self._install(self._new_id(), secrets.token_bytes(TOKEN_BYTES), workers, base,
                            kind, helping)  # fmt: skip
        self.d.counters["jobs_registered"] += 1
        self.save()
        return self.ticket(job)

    def restore(self, req: dict[str, Any]) -> dict[str, Any]:
        """A job the restarted daemon lost, installed again from its ticket."""
        d, cfg = self.d, self.cfg
        job_id, token = int(req["job_id"]), bytes.fromhex(str(req["token"]))
        job = d.jobs.get(job_id)
        if job is not None:
            if not secrets.compare_digest(token, job.token):
                raise ConfigError("job_id", f"job {job_id} is another job's now")
            return self.ticket(job)  # restored already, by another rank or from the state dir
        # (a group need not match: the ranks probe the new incarnation's, if any)
        theirs = {k: req.get(k) for k in ("policy", "window", "values_per_packet")}
        ours = {"policy": cfg.scheme, "window": cfg.job_slots,
                "values_per_packet": cfg.values_per_packet}  # fmt: skip
        if theirs != ours:
            raise ConfigError("restore", f"the daemon now runs {ours}, the job had {theirs}")
        workers, base = int(req["workers"]), int(req.get("slot_base", 0))
        if not 1 <= job_id <= 0xFFFF or len(token) != TOKEN_BYTES:
            raise ConfigError("job_id", "not a ticket this daemon could have issued")
        if cfg.scheme == "switchml" and not self._range_free(base):
            raise ConfigError("slot_base", f"slots from {base} are another job's now")
        kind = req.get("kind")
        job = self._install(job_id, token, workers, base, None if kind is None else str(kind),
                            None, resync=True)  # fmt: skip
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
                self.d.node.resync(job.job_id, False, job.floor)
                self.d.counters["jobs_resumed"] += 1
        if job.resync is None and job.floor is not None:
            return {"floor": job.floor, "epoch": self.d.epoch}
        return {"wait": True}

    def _install(
        self, job_id: int, token: bytes, workers: int, base: int, kind: str | None,
        helping: HelpConfig | None, resync: bool = False,
    ) -> DaemonJob:  # fmt: skip
        """The job at the node (its engines), then in the control plane's table."""
        if not 1 <= workers <= MAX_FAN_IN:
            raise ConfigError("workers", f"must be in 1..{MAX_FAN_IN}")
        d = self.d
        nj = d.node.add_job(job_id, token, workers, base, kind, helping, resyncing=resync)
        job = DaemonJob(job_id, token, workers, base, nj.kind, nj, helping,
                        resync={} if resync else None)  # fmt: skip
        if d.multicast:
            job.group = group_of(job_id, d.data_address()[1])
        d.jobs[job_id] = job
        d.addresses_changed(job)
        return job

    def ticket(self, job: DaemonJob) -> dict[str, Any]:
        """What a job's workers need to know (``runtime.client.Ticket``)."""
        d, cfg = self.d, self.cfg
        return {
            "switch": list(d.data_address()),
            "job_id": job.job_id,
            "token": job.token.hex(),
            "policy": cfg.scheme,
            "workers": job.workers,
            "pool_slots": cfg.slots,
            "slot_base": job.slot_base,
            "window": cfg.job_slots,
            "values_per_packet": cfg.values_per_packet,
            "rto_ns": cfg.rto_ns,
            "entry": job.node.entry,
            "kind": job.kind,
            "streams": cfg.omni_streams,
            "push_bound": cfg.push_bound,
            "pull_bound": d.pull_bound,
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
        cfg, base = self.cfg, 0
        for lo, hi in sorted(self._taken()):
            if base + cfg.job_slots <= lo:
                break
            base = max(base, hi)
        if base + cfg.job_slots > cfg.slots:
            raise ConfigError("slots", f"no free range of {cfg.job_slots} slots left")
        return base

    def _taken(self) -> list[tuple[int, int]]:
        w = self.cfg.job_slots
        return [(j.slot_base, j.slot_base + w) for j in self.d.jobs.values()]

    def _range_free(self, base: int) -> bool:
        w = self.cfg.job_slots
        inside = base >= 0 and base + w <= self.cfg.slots
        return inside and all(hi <= base or base + w <= lo for lo, hi in self._taken())

    # -- the state directory ------------------------------------------------
    def save(self) -> None:
        """Write every registration to the state directory (if any), atomically."""
        d = self.d
        if d.state_dir is None:
            return
        jobs = [
            {"job_id": j.job_id, "token": j.token.hex(), "workers": j.workers,
             "slot_base": j.slot_base, "kind": j.kind,
             "help": None if j.help is None else asdict(j.help),
             "addrs": {str(r): list(a) for r, a in j.addrs.items()}}
            for j in d.jobs.values()
        ]  # fmt: skip
        state = {"config": self._identity(), "next_job": self.next_job, "jobs": jobs}
        path = os.path.join(d.state_dir, STATE_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    def load(self) -> None:
        """Know the jobs the state directory holds, each waiting to resynchronise."""
        d = self.d
        if d.state_dir is None:
            return
        os.makedirs(d.state_dir, exist_ok=True)
        path = os.path.join(d.state_dir, STATE_FILE)
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
                                j["slot_base"], j["kind"], helping, resync=True)  # fmt: skip
            for r, (host, port) in j["addrs"].items():
                self._hello(job, int(r), (str(host), int(port)))
            d.counters["jobs_restored"] += 1
        self.next_job = int(state["next_job"])

    def _identity(self) -> dict[str, Any]:
        """What a job's workers depend on: a daemon must match it to take the jobs over."""
        cfg = self.cfg
        return {"policy": cfg.scheme, "slots": cfg.slots, "window": cfg.job_slots,
                "values_per_packet": cfg.values_per_packet}  # fmt: skip

    def _hello(self, job: DaemonJob, rank: int, addr: Address) -> None:
        if not 0 <= rank < job.workers:
            raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
        job.addrs[rank] = addr
        self.d.addresses_changed(job)

    def _delivered(self, job: DaemonJob, rank: int, ok: bool, why: str) -> None:
        """Rank ``rank`` got its probe through the group (or did not)."""
        if not 0 <= rank < job.workers:
            raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
        was = job.multicasting
        if ok:
            job.delivered.add(rank)
        elif job.unicast is None:
            job.unicast = f"rank {rank} got no probe through {job.group}: {why or 'none came'}"
            self.d.counters["multicast_refused"] += 1
            LOG.warning("job %d: results go to each worker: %s", job.job_id, job.unicast)
        if job.multicasting != was:
            if job.multicasting:
                LOG.info("job %d: results multicast to %s", job.job_id, job.group)
            self.d.addresses_changed(job)

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
        return self.d.node.missing(job.job_id)

    def _admit(self, req: dict[str, Any], peer: str) -> None:
        """Refuse (``ConfigError``, counted) a peer outside ``allow``, a
        registration or restore without the cluster secret, or one more job
        than a client may hold."""
        d, op = self.d, req.get("op")
        if d.networks and not any(ipaddress.ip_address(peer) in n for n in d.networks):
            d.counters["control_refused_network"] += 1
            raise ConfigError("allow", f"{peer} may not use this control port")
        if d.secret is not None and op in ("register", "restore") and not \
                secrets.compare_digest(str(req.get("secret", "")).encode(), d.secret.encode()):
            d.counters["control_refused_secret"] += 1
            raise ConfigError("secret", "the cluster secret is missing or wrong")
        held = sum(1 for j, who in self.owners.items() if who == peer and j in d.jobs)
        if op == "register" and held >= d.max_jobs_per_client:
            d.counters["register_refused_cap"] += 1
            raise ConfigError("jobs", f"{peer} holds {held} jobs, as many as a client may")

    def handle(self, req: dict[str, Any], peer: str) -> dict[str, Any]:
        d = self.d
        op = req.get("op")
        self._admit(req, peer)
        if op == "register":
            kind = req.get("kind")
            ticket = self.register(
                int(req.get("workers", 0)), req.get("help"), None if kind is None else str(kind)
            )
            self.owners[int(ticket["job_id"])] = peer
            return ticket
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
        if op == "probe":
            if job.group is None:
                raise ConfigError("multicast", f"job {job.job_id} has no group")
            nonce = bytes.fromhex(str(req["nonce"]))
            if not 1 <= len(nonce) <= 32:
                raise ConfigError("nonce", "1 to 32 bytes")
            return {"ok": d.probe(job, int(req["port"]), nonce)}
        if op == "multicast":
            self._delivered(job, int(req["rank"]), bool(req["ok"]), str(req.get("why", "")))
            return {"ok": True, "multicast": job.multicasting}
        if op == "unregister":
            d.node.remove_job(job.job_id)
            d.forget(job)
            del d.jobs[job.job_id]
            self.owners.pop(job.job_id, None)
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
