"""The switch daemon: gradfabric's switch engine on a real UDP socket.

One asyncio process runs one ``SwitchEngine`` (policy ``switchml``, ``atp``
or ``esa``) for any number of jobs and, for ATP and ESA, the parameter server
those policies fall back to (in the same process: its traffic to and from
the switch is a function call, not a datagram). It has two ports:

* data (UDP): ``wire.envelope`` datagrams. A datagram is checked before any
  engine sees it: the job it names must be registered and its token must be
  that job's (else ``drop_unknown_job`` / ``drop_bad_token``), its packet must
  decode (else ``drop_malformed``); the switch engine then checks worker
  index, bitmap, fan-in and slot range against the job (its own ``drop_*``
  counters). So a stranger's datagram is a counted drop, never a crash and
  never another job's data.
* control (TCP, one JSON object per line): ``register`` (a job of N workers;
  answers its id, secret token and the protocol parameters its workers
  need), ``hello`` (a worker's UDP port), ``missing`` (which workers the
  job's partly filled aggregators wait on), ``stats`` (all counters and the
  aggregator pool's occupancy), ``unregister``.

Impairments (this kernel has no netem): every datagram in and out is
independently lost with ``loss``, duplicated with ``dup`` and held for
``delay_us`` plus a uniform ``jitter_us`` (which reorders), from one seeded
generator.

Counters are also served on ``metrics_port`` (any path) in Prometheus's
exposition format, through ``prometheus_client`` (see ``_Metrics``).
SIGTERM or SIGINT stops the daemon cleanly (sockets closed, final counters
printed by the CLI).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gradfabric.core.errors import ConfigError, ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.net.udp import Address, size_buffers
from gradfabric.proto.actions import Action, Engine, Multicast, Send
from gradfabric.proto.dlcp import DlcpServer
from gradfabric.proto.omni import OmniAggregator
from gradfabric.proto.ps import ParameterServer, PsJob
from gradfabric.proto.qos import PortQueues
from gradfabric.proto.switch import SwitchEngine, SwitchJob
from gradfabric.proto.switch.atp import FREE
from gradfabric.proto.switch.straggler import HelpConfig
from gradfabric.wire.envelope import TOKEN_BYTES, drop_reason, job_of, seal, unseal
from gradfabric.wire.packet import MAX_FAN_IN, MAX_WIRE_VALUES, Packet

SWITCH, PS = "sw", "ps"
DRAIN_BATCH = 256  # datagrams read per wake-up
BURST_S = 0.001  # the DLCP port's credit after idling: one timer tick
POLICIES = ("switchml", "atp", "esa", "dlcp", "ps", "omni")
SWITCH_POLICIES = ("switchml", "atp", "esa")  # the ones the switch engine runs


@dataclass(frozen=True)
class Impairment:
    loss: float = 0.0
    dup: float = 0.0
    delay_us: float = 0.0
    jitter_us: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("loss", "dup"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.delay_us < 0 or self.jitter_us < 0:
            raise ConfigError("delay_us", "delays must be >= 0")


@dataclass(frozen=True)
class SwitchConfig:
    policy: str = "atp"
    slots: int = 4096  # aggregators (SwitchML: cut into per-job ranges of job_slots)
    job_slots: int = 32  # SwitchML: each job's slot range; ATP/ESA: the workers' window
    values_per_packet: int = 1024
    rto_ms: float = 20.0
    host: str = "127.0.0.1"
    port: int = 0
    control_port: int = 0
    metrics_port: int | None = None
    impair: Impairment = field(default_factory=Impairment)
    # DLCP: the port into the job's server (0: unshaped) and the loss bounds
    port_mbps: float = 0.0
    port_buffer_kb: int = 256
    push_bound: float = 0.1
    pull_bound: float = 0.02
    omni_streams: int = 16  # omni: streams per job's aggregator

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"one of {', '.join(POLICIES)}; got {self.policy!r}")
        if not 1 <= self.job_slots <= self.slots:
            raise ConfigError("job_slots", f"must be in 1..slots ({self.slots})")
        if not 1 <= self.values_per_packet <= MAX_WIRE_VALUES:
            raise ConfigError("values_per_packet", f"must be in 1..{MAX_WIRE_VALUES}")
        if self.rto_ms <= 0:
            raise ConfigError("rto_ms", "must be > 0")
        if self.port_mbps < 0 or self.port_buffer_kb < 1:
            raise ConfigError("port_mbps", "must be >= 0, with a buffer of >= 1 KB")
        for name in ("push_bound", "pull_bound"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")


@dataclass
class _Job:
    job_id: int
    token: bytes
    workers: int
    slot_base: int
    kind: str = "ina"  # or "dlcp" (a DLCP job), "background" (traffic for the port)
    addrs: dict[int, Address] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)  # datagrams that named this job


def worker_name(job_id: int, rank: int) -> str:
    return f"j{job_id}w{rank}"


def server_name(job_id: int) -> str:
    return f"j{job_id}ps"


class SwitchDaemon:
    def __init__(self, cfg: SwitchConfig) -> None:
        self.cfg = cfg
        # DLCP jobs bypass the aggregation engine (an idle ATP pool there)
        self.switch = SwitchEngine.build(
            SWITCH, cfg.policy if cfg.policy in SWITCH_POLICIES else "atp", cfg.slots
        )
        self.ps = ParameterServer(PS) if cfg.policy in ("atp", "esa", "ps") else None
        self.local: dict[str, Engine] = {SWITCH: self.switch}  # engines hosted here
        if self.ps is not None:
            self.local[PS] = self.ps
        self.timers: dict[str, tuple[int, asyncio.TimerHandle]] = {}
        self.counters = Counters()
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(_Metrics(self))
        self.port: PortQueues[tuple[_Job, Packet]] = PortQueues(
            cfg.port_buffer_kb * 1024, self.counters
        )
        self.port_clock = 0.0  # loop time at which the port is free
        self.port_wake = False
        self.jobs: dict[int, _Job] = {}
        self.book: dict[str, tuple[_Job, Address]] = {}
        self.next_job = 1
        self.rng = random.Random(cfg.impair.seed)
        self.sock: socket.socket | None = None
        self.servers: list[asyncio.Server] = []
        self.stopped = asyncio.Event()
        self.started_ns = time.monotonic_ns()

    # -- lifecycle ------------------------------------------------------
    async def start(self) -> dict[str, Address]:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        # A plain non-blocking socket drained in a loop on each wake-up: asyncio's
        # datagram transport costs an event-loop turn per datagram, about as much
        # as the switch engine's work on it.
        self.sock = sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        size_buffers(sock)
        sock.bind((cfg.host, cfg.port))
        loop.add_reader(sock.fileno(), self._drain)
        control = await asyncio.start_server(self._control, cfg.host, cfg.control_port)
        self.servers.append(control)
        out = {
            "data": cast(Address, sock.getsockname()[:2]),
            "control": cast(Address, control.sockets[0].getsockname()[:2]),
        }
        if cfg.metrics_port is not None:
            metrics = await asyncio.start_server(self._metrics, cfg.host, cfg.metrics_port)
            self.servers.append(metrics)
            out["metrics"] = cast(Address, metrics.sockets[0].getsockname()[:2])
        return out

    def stop(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        for s in self.servers:
            s.close()
        self.stopped.set()

    async def serve(self, on_ready: Callable[[dict[str, Address]], None]) -> None:
        """Start, report the addresses, run until SIGTERM/SIGINT or ``stop()``."""
        addrs = await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        on_ready(addrs)
        await self.stopped.wait()

    # -- data path ------------------------------------------------------
    def _drain(self) -> None:
        sock = self.sock
        for _ in range(DRAIN_BATCH):  # then let the control plane and timers run
            if sock is None:
                return
            try:
                data, addr = sock.recvfrom(65_536)
            except BlockingIOError:
                return
            except OSError:
                self.counters["socket_error"] += 1
                return
            self.datagram_received(data, addr)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.counters["rx_datagrams"] += 1
        imp = self.cfg.impair
        if imp.loss and self.rng.random() < imp.loss:
            self.counters["impair_loss"] += 1
            return
        job = None
        try:
            job = self.jobs.get(job_of(data))
            if job is None:
                self.counters["drop_unknown_job"] += 1
                return
            pkt = unseal(data, job.token)
        except ProtocolError as e:
            (self.counters if job is None else job.counters)[drop_reason(e)] += 1
            return
        job.counters["rx_datagrams"] += 1
        if job.kind != "ina" and self.cfg.port_mbps > 0:
            self._port_offer(job, pkt, len(data))
        else:
            self._arrive(job, pkt)

    def _arrive(self, job: _Job, pkt: Packet) -> None:
        if job.kind == "background":
            self.counters["bg_delivered"] += 1
        else:
            self._run(self._entry(job.job_id, job.kind), pkt)

    def _entry(self, job_id: int, kind: str) -> str:
        """The local engine a job's packets go to."""
        if kind == "dlcp" or self.cfg.policy == "omni":
            return server_name(job_id)
        return PS if self.cfg.policy == "ps" else SWITCH

    # The DLCP port: strict-priority queues with WRED (``proto.qos``), served at
    # ``port_mbps`` in front of the jobs' servers. The event loop's timers are
    # no finer than a millisecond, so the port keeps a virtual clock (when it
    # is free again) and on each wake-up sends everything that clock allows,
    # most urgent queue first; idle time gives at most BURST_S of credit.
    def _port_offer(self, job: _Job, pkt: Packet, size: int) -> None:
        self.port.offer((job, pkt), size, pkt.priority, self.rng.random())
        self._port_kick()

    def _port_kick(self) -> None:
        if not self.port_wake:
            self.port_wake = True
            loop = asyncio.get_running_loop()
            loop.call_at(max(loop.time(), self.port_clock), self._port_tick)

    def _port_tick(self) -> None:
        self.port_wake = False
        now = asyncio.get_running_loop().time()
        self.port_clock = max(self.port_clock, now - BURST_S)
        rate = self.cfg.port_mbps * 1e6 / 8
        while self.port_clock <= now:
            nxt = self.port.take()
            if nxt is None:
                break
            (job, pkt), size = nxt
            self.port_clock += size / rate
            self.counters["port_served"] += 1
            if job.job_id in self.jobs:
                self._arrive(job, pkt)
        if self.port.backlog > 0:
            self._port_kick()

    def _run(self, name: str, pkt: Packet) -> None:
        """Feed ``pkt`` to a local engine and follow its actions."""
        engine = self.local.get(name)
        if engine is None:
            self.counters["drop_no_engine"] += 1
            return
        self._follow(name, engine.on_packet(pkt, time.monotonic_ns()))

    def _follow(self, name: str, actions: list[Action]) -> None:
        """Carry out ``name``'s actions: to other local engines by call, to
        workers by datagram; then re-arm the timers of the engines involved."""
        now = time.monotonic_ns()
        work: deque[tuple[str, Packet]] = deque()
        touched = {name}
        while True:
            for a in actions:
                if isinstance(a, Send):
                    targets: tuple[str, ...] = (a.dst,)
                elif isinstance(a, Multicast):
                    targets = a.dsts
                else:
                    continue
                raw: bytes | None = None
                for dst in targets:
                    if dst in self.local:
                        work.append((dst, a.pkt))
                        continue
                    hit = self.book.get(dst)
                    if hit is None:
                        self.counters["drop_no_address"] += 1
                        continue
                    try:
                        raw = raw or seal(hit[0].token, a.pkt)
                    except ValueError:  # an engine built a packet the wire cannot carry
                        self.counters["drop_unencodable"] += 1
                        break
                    self._emit(raw, hit[1])
            if not work:
                break
            name, pkt = work.popleft()
            touched.add(name)
            actions = self.local[name].on_packet(pkt, now)
        for n in touched:
            self._arm(n)

    def _arm(self, name: str) -> None:
        engine = self.local.get(name)
        d = None if engine is None else engine.next_deadline()
        held = self.timers.get(name)
        if held is not None and (d is None or held[0] > d):
            held[1].cancel()
            del self.timers[name]
            held = None
        if d is not None and held is None:
            handle = asyncio.get_running_loop().call_at(d / 1e9, self._fire, name, d)
            self.timers[name] = (d, handle)

    def _fire(self, name: str, when: int) -> None:
        if self.timers.get(name, (None,))[0] == when:
            del self.timers[name]
        engine = self.local.get(name)
        if engine is not None:
            self._follow(name, engine.on_timer(time.monotonic_ns()))

    def _emit(self, raw: bytes, addr: Address) -> None:
        imp, rng = self.cfg.impair, self.rng
        if imp.loss and rng.random() < imp.loss:
            self.counters["impair_loss"] += 1
            return
        copies = 2 if imp.dup and rng.random() < imp.dup else 1
        self.counters["impair_dup"] += copies - 1
        for _ in range(copies):
            delay = (imp.delay_us + rng.random() * imp.jitter_us) / 1e6
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, self._sendto, raw, addr)
            else:
                self._sendto(raw, addr)

    def _sendto(self, raw: bytes, addr: Address) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendto(raw, addr)
            self.counters["tx_datagrams"] += 1
        except BlockingIOError:  # our socket buffer is full: a loss the workers recover
            self.counters["drop_tx_full"] += 1
        except OSError:
            self.counters["socket_error"] += 1

    # -- control plane --------------------------------------------------
    def register(
        self, workers: int, sa_atp: dict[str, Any] | None = None, kind: str = "ina"
    ) -> dict[str, Any]:
        """A new job of ``workers``; ``sa_atp`` (ATP/ESA only) turns on SA-ATP
        straggler help with these ``HelpConfig`` fields (``iteration_packets``
        required). Under the ``dlcp`` policy ``kind`` is ``dlcp`` (a job whose
        server lives here) or ``background`` (traffic that only loads the port)."""
        cfg = self.cfg
        if not 1 <= workers <= MAX_FAN_IN:
            raise ConfigError("workers", f"must be in 1..{MAX_FAN_IN}")
        kinds = ("dlcp", "background") if cfg.policy == "dlcp" else ("ina",)
        if kind not in kinds:
            raise ConfigError("kind", f"the {cfg.policy} switch takes {', '.join(kinds)} jobs")
        helping = None
        if sa_atp is not None:
            if cfg.policy == "switchml":
                raise ConfigError("help", "SA-ATP help runs on the atp and esa policies")
            helping = HelpConfig(**sa_atp)
            if helping.iteration_packets < 1:
                raise ConfigError("iteration_packets", "SA-ATP needs packets per iteration")
        if len(self.jobs) >= 0xFFFF:
            raise ConfigError("jobs", "the switch is full")
        job_id = self.next_job
        self.next_job = self.next_job % 0xFFFF + 1
        while job_id in self.jobs:
            job_id = self.next_job
            self.next_job = self.next_job % 0xFFFF + 1
        base = 0
        if cfg.policy == "switchml":  # a free range of job_slots (first fit)
            taken = sorted((j.slot_base, j.slot_base + cfg.job_slots) for j in self.jobs.values())
            for lo, hi in taken:
                if base + cfg.job_slots <= lo:
                    break
                base = max(base, hi)
            if base + cfg.job_slots > cfg.slots:
                raise ConfigError("slots", f"no free range of {cfg.job_slots} slots left")
        job = _Job(job_id, secrets.token_bytes(TOKEN_BYTES), workers, base, kind)
        names = tuple(worker_name(job_id, r) for r in range(workers))
        window = cfg.job_slots
        rto_ns = int(cfg.rto_ms * 1e6)
        if kind == "dlcp":
            self.local[server_name(job_id)] = DlcpServer(
                server_name(job_id), job_id, list(names), cfg.push_bound,
                cfg.values_per_packet, rto_ns,
            )  # fmt: skip
        elif kind == "background":
            pass
        elif cfg.policy == "omni":
            self.local[server_name(job_id)] = OmniAggregator(
                server_name(job_id), job_id, 0, list(names), cfg.omni_streams
            )
        elif cfg.policy == "ps":  # workers send here directly; results go straight back
            assert self.ps is not None
            self.ps.add_job(PsJob(job_id, names, window=4 * window))
        elif cfg.policy == "switchml":
            self.switch.add_job(SwitchJob(job_id, names, slot_base=base, slot_count=window))
        else:
            assert self.ps is not None
            self.switch.add_job(SwitchJob(job_id, names, parent=PS, window=window))
            self.ps.add_job(PsJob(job_id, names, via=SWITCH, window=4 * window))
        if helping is not None:
            self.switch.watch(job_id, helping)
        self.jobs[job_id] = job
        self.counters["jobs_registered"] += 1
        assert self.sock is not None
        return {
            "switch": list(self.sock.getsockname()[:2]),
            "job_id": job_id,
            "token": job.token.hex(),
            "policy": cfg.policy,
            "workers": workers,
            "pool_slots": cfg.slots,
            "slot_base": base,
            "window": window,
            "values_per_packet": cfg.values_per_packet,
            "rto_ns": rto_ns,
            "entry": self._entry(job_id, kind),
            "kind": kind,
            "streams": cfg.omni_streams,
        } | ({"push_bound": cfg.push_bound, "pull_bound": cfg.pull_bound}
             if cfg.policy == "dlcp" else {})  # fmt: skip

    def _job(self, req: dict[str, Any]) -> _Job:
        job = self.jobs.get(int(req.get("job_id", -1)))
        if job is None or not secrets.compare_digest(
            bytes.fromhex(str(req.get("token", ""))), job.token
        ):
            raise ConfigError("job_id", "unknown job or wrong token")
        return job

    def _handle(self, req: dict[str, Any], peer: str) -> dict[str, Any]:
        op = req.get("op")
        if op == "register":
            kind = str(req.get("kind", "dlcp" if self.cfg.policy == "dlcp" else "ina"))
            return self.register(int(req.get("workers", 0)), req.get("help"), kind)
        if op == "stats":
            return self.stats()
        job = self._job(req)
        if op == "hello":
            rank = int(req["rank"])
            if not 0 <= rank < job.workers:
                raise ConfigError("rank", f"must be in 0..{job.workers - 1}")
            addr = (str(req.get("host") or peer), int(req["port"]))
            job.addrs[rank] = addr
            self.book[worker_name(job.job_id, rank)] = (job, addr)
            return {"ok": True, "ready": len(job.addrs) == job.workers}
        if op == "missing":
            server = self.local.get(server_name(job.job_id))
            if isinstance(server, DlcpServer):
                ranks = sorted({w for (w, _), t in server.rx.tensors.items() if not t.done})
                return {"missing": ranks}
            names = set()
            if isinstance(server, OmniAggregator):
                names |= set(server.missing_workers())
            if self.cfg.policy in SWITCH_POLICIES:
                names |= set(self.switch.missing_children(job.job_id))
            if self.ps is not None:
                names |= set(self.ps.missing_workers(job.job_id))
            ranks = sorted(r for r in range(job.workers) if worker_name(job.job_id, r) in names)
            return {"missing": ranks}
        if op == "unregister":
            if job.kind == "ina" and self.cfg.policy in SWITCH_POLICIES:
                self.switch.remove_job(job.job_id)
            self.local.pop(server_name(job.job_id), None)
            for r in range(job.workers):
                self.book.pop(worker_name(job.job_id, r), None)
            del self.jobs[job.job_id]
            return {"ok": True}
        raise ConfigError("op", f"unknown operation {op!r}")

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        try:
            while line := await reader.readline():
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ConfigError("request", "must be a JSON object")
                    reply = self._handle(req, peer)
                except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
                    self.counters["control_errors"] += 1
                    reply = {"error": str(e)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def occupancy(self) -> int:
        """Aggregators now held by some job (ATP/ESA pool; SwitchML's ranges)."""
        pool = getattr(self.switch.policy, "pool", None)
        if pool is not None:
            return sum(1 for a in pool if a.state != FREE)
        return len(self.jobs) * self.cfg.job_slots

    def stats(self) -> dict[str, Any]:
        merged = Counters()
        for e in self.local.values():
            for k, v in e.counters.items():
                merged[k] += v
        for c in (self.counters, *(j.counters for j in self.jobs.values())):
            for k, v in c.items():
                merged[k] += v
        merged["rx_datagrams"] -= sum(j.counters["rx_datagrams"] for j in self.jobs.values())
        return {
            "policy": self.cfg.policy,
            "uptime_s": (time.monotonic_ns() - self.started_ns) / 1e9,
            "cpu_s": time.process_time(),  # this process's CPU time (one core at most)
            "jobs": {
                str(j.job_id): {"workers": j.workers, "hellos": len(j.addrs)}
                for j in self.jobs.values()
            },
            "slots": self.cfg.slots,
            "occupied": self.occupancy(),
            "counters": dict(sorted(merged.items())),
            "impair": asdict(self.cfg.impair),
        }

    async def _metrics(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readline()
            body = generate_latest(self.metrics)
            writer.write(
                f"HTTP/1.0 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n".encode()
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


class _Metrics:
    """The daemon's counters in Prometheus's exposition format, read when
    scraped (``prometheus_client``'s custom-collector protocol). Counters get
    the ``_total`` suffix; drops carry their reason and, where the datagram
    named a registered job, the job; the engines' own counters (per reason,
    not per job) are ``events``."""

    def __init__(self, daemon: SwitchDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        rx = CounterMetricFamily(
            "gradfabric_switch_datagrams_received", "Datagrams accepted for a job", labels=["job"]
        )
        drops = CounterMetricFamily(
            "gradfabric_switch_dropped_datagrams",
            "Datagrams dropped, by reason; job is the registered job the datagram named, "
            "empty where it named none",
            labels=["job", "reason"],
        )
        events = CounterMetricFamily(
            "gradfabric_switch_events",
            "Events counted by the daemon and its engines (drops inside an engine included)",
            labels=["event"],
        )
        workers = GaugeMetricFamily(
            "gradfabric_switch_job_workers", "Workers of each registered job", labels=["job"]
        )
        for job in d.jobs.values():
            name = str(job.job_id)
            rx.add_metric([name], job.counters.get("rx_datagrams", 0))
            workers.add_metric([name], job.workers)
            for k, v in job.counters.items():
                if k.startswith("drop_"):
                    drops.add_metric([name, k.removeprefix("drop_")], v)
        for k, v in d.counters.items():
            if k.startswith("drop_"):
                drops.add_metric(["", k.removeprefix("drop_")], v)
        for eng in d.local.values():
            for k, v in eng.counters.items():
                events.add_metric([k], v)
        yield rx
        yield drops
        yield events
        yield workers
        yield GaugeMetricFamily("gradfabric_switch_jobs", "Registered jobs", value=len(d.jobs))
        yield GaugeMetricFamily("gradfabric_switch_slots", "Aggregator slots", value=d.cfg.slots)
        yield GaugeMetricFamily(
            "gradfabric_switch_slots_occupied", "Aggregator slots held by jobs",
            value=d.occupancy(),
        )  # fmt: skip
        yield CounterMetricFamily(
            "gradfabric_switch_datagrams_sent", "Datagrams sent", value=d.counters["tx_datagrams"]
        )


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
