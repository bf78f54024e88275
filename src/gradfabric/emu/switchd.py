"""The switch daemon: gradfabric's engines on a real UDP socket.

One asyncio process hosts, for any number of jobs, the engines the scheme
registry (``proto.schemes``) builds for its scheme (``policy``): the switch
engine (SwitchML, ATP, ESA) and each job's server (ATP's fallback PS, the
sharded PS, OmniReduce's aggregator, DLCP's server). Traffic between hosted
engines is a function call, not a datagram. This module is the socket and
timer loop and the data path; the control plane is ``emu.control``, the
impairments ``emu.impair``, the Prometheus metrics ``emu.metrics``.

The data port (UDP) takes ``wire.envelope`` datagrams. A datagram is checked
before any engine sees it: the job it names must be registered and its token
must be that job's (else ``drop_unknown_job`` / ``drop_bad_token``), its
packet must decode (else ``drop_malformed``); the engines then check worker
index, bitmap, fan-in and slot range against the job (their own ``drop_*``
counters). So a stranger's datagram is a counted drop, never a crash and
never another job's data.

Every hosted engine's actions go through the shared dispatcher
(``proto.dispatch.Port``): to another hosted engine by call, to a worker by
datagram. An engine's ``Fail`` (it gave up on a worker) is counted
(``gave_up``) and that worker is reported by the ``missing`` control call,
so the job's clients name it in their ``PeerTimeoutError``.

SIGTERM or SIGINT stops the daemon cleanly (sockets closed, final counters
printed by the CLI). A daemon that dies (SIGKILL, a crash) and is started
again on the same ports resumes its jobs: each incarnation has an epoch, the
workers notice the new one and restore their job from their tickets (or the
daemon already knows it from ``state_dir``), agree on a floor and replay
(``emu.control``, ``proto.worker``).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Final, cast

from gradfabric.core.errors import ConfigError, ProtocolError
from gradfabric.core.trace import Counters
from gradfabric.emu.control import BACKGROUND, ControlPlane, DaemonJob
from gradfabric.emu.control import control_call as control_call
from gradfabric.emu.control import server_name as server_name
from gradfabric.emu.control import worker_name as worker_name
from gradfabric.emu.impair import Impairer, Impairment
from gradfabric.emu.links import DOWN, UP, ShardLinks
from gradfabric.emu.metrics import registry, serve_metrics
from gradfabric.net import switchpath
from gradfabric.net.switchpath import POLICIES, NativePolicy
from gradfabric.net.udp import IP_MULTICAST_ALL, Address, size_buffers, sockaddr
from gradfabric.proto.actions import Fail
from gradfabric.proto.dispatch import Port
from gradfabric.proto.interface import Engine
from gradfabric.proto.ps import ParameterServer
from gradfabric.proto.qos import PortQueues
from gradfabric.proto.schemes import SCHEMES
from gradfabric.proto.switch import SwitchEngine
from gradfabric.proto.switch.atp import FREE
from gradfabric.wire.envelope import drop_reason, job_of, seal, unseal
from gradfabric.wire.packet import MAX_WIRE_VALUES, Packet

SWITCH: Final = "sw"  # the hosted switch engine's name
DRAIN_BATCH: Final = 256  # datagrams read per wake-up
MAX_BACKLOG: Final = 65_536  # datagrams waiting for a small send buffer (``sndbuf_kb``)
BURST_S: Final = 0.001  # the DLCP port's credit after idling: one timer tick
DAEMON_SCHEMES: Final = ("switchml", "atp", "esa", "dlcp", "ps", "omni")  # schemes a daemon hosts


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with the help (and choices) its command-line flag shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class SwitchConfig:
    """The daemon's settings; ``gradfabric switch serve`` derives its flags
    from these fields (``rto_ns`` is given in ms there)."""

    policy: str = _opt(
        "atp",
        "the switch's aggregation (switchml, atp, esa), a DLCP server behind a priority "
        "port (dlcp), a parameter server (ps) or an OmniReduce aggregator (omni)",
        DAEMON_SCHEMES,
    )
    slots: int = _opt(4096, "aggregators in the pool")
    job_slots: int = _opt(32, "SwitchML: slots per job; ATP/ESA: the window")
    values_per_packet: int = _opt(1024, "values per datagram")
    rto_ns: int = _opt(20_000_000, "workers' retransmission timeout")
    host: str = _opt("127.0.0.1", "address to serve on")
    port: int = _opt(0, "data (UDP) port; 0 picks one")
    control_port: int = _opt(0, "control (TCP) port; 0 picks one")
    metrics_port: int | None = _opt(None, "serve Prometheus text here")
    impair: Impairment = field(default_factory=Impairment)
    port_mbps: float = _opt(0.0, "dlcp: the rate of the port into the job servers (0: unshaped)")
    port_buffer_kb: int = _opt(256, "dlcp: that port's buffer")
    ps_link_mbps: float = _opt(
        0.0, "atp/esa: each job's fallback PS sharded per worker, each shard behind a "
        "modelled link of this rate both ways, as ATP deploys it (0: the PS at the switch)",
    )  # fmt: skip
    sndbuf_kb: int = _opt(
        0,
        "the data socket's send buffer (0: 4 MB); a small one paces what the daemon sends "
        "to its links' rate: what the kernel will not take yet waits, in order, in a backlog",
    )
    push_bound: float = _opt(0.1, "dlcp: loss bound, push")
    pull_bound: float = _opt(0.02, "dlcp: loss bound, pull")
    omni_streams: int = _opt(16, "omni: streams per job's aggregator")
    state_dir: str | None = _opt(
        None, "keep job registrations here: restarted on it, the daemon knows its jobs"
    )
    multicast: bool = _opt(
        False, "send a result once, to its job's multicast group (239.77.x.y on the data "
        "port), not once per worker: the network replicates it, as a switch's packet "
        "replication does (loopback and a Linux bridge carry it; needs --host)",
    )  # fmt: skip
    datapath: str = _opt(
        "auto", "native: the switch's datapath in C (net.switchpath: switchml, atp, esa, ps); "
        "python: the reference engines; auto: native where it is built and can serve "
        "(those policies, no impairments, the PS at the switch)",
        ("auto", "native", "python"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.policy not in DAEMON_SCHEMES:
            raise ConfigError("policy", f"one of {', '.join(DAEMON_SCHEMES)}; got {self.policy!r}")
        if not 1 <= self.job_slots <= self.slots:
            raise ConfigError("job_slots", f"must be in 1..slots ({self.slots})")
        if not 1 <= self.values_per_packet <= MAX_WIRE_VALUES:
            raise ConfigError("values_per_packet", f"must be in 1..{MAX_WIRE_VALUES}")
        if self.rto_ns <= 0:
            raise ConfigError("rto_ns", "must be > 0")
        if self.sndbuf_kb < 0:
            raise ConfigError("sndbuf_kb", f"must be >= 0, got {self.sndbuf_kb}")
        if self.ps_link_mbps < 0:
            raise ConfigError("ps_link_mbps", f"must be >= 0, got {self.ps_link_mbps}")
        if self.port_mbps < 0 or self.port_buffer_kb < 1:
            raise ConfigError("port_mbps", "must be >= 0, with a buffer of >= 1 KB")
        for name in ("push_bound", "pull_bound"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.multicast and self.host in ("", "0.0.0.0"):
            raise ConfigError("multicast", "needs --host: the address that sends the groups")
        if self.datapath not in ("auto", "native", "python"):
            raise ConfigError("datapath", f"one of auto, native, python; got {self.datapath!r}")
        why = self.native_unsuitable()
        if self.datapath == "native" and why is not None:
            raise ConfigError("datapath", f"native cannot serve: {why}")

    def native_unsuitable(self) -> str | None:
        """Why the native switch datapath cannot serve this daemon (None: it can)."""
        if self.datapath == "python":
            return "python was asked for"
        if self.policy not in POLICIES:
            return f"it runs {', '.join(POLICIES)}, not {self.policy}"
        if self.impair != Impairment():
            return "impairments run in the reference"
        if self.ps_link_mbps:
            return "the PS behind modelled links runs in the reference"
        return None if switchpath.PATH == "compiled" else str(switchpath.WHY_NOT)


def accept(
    data: bytes, jobs: dict[int, DaemonJob], counters: Counters
) -> tuple[DaemonJob, Packet] | None:
    """The daemon's checks of a datagram before any engine sees it (see the
    module doc): its job and packet, or None and a counted drop (the
    daemon's ``counters`` where no job is known, else the job's)."""
    job = None
    try:
        job = jobs.get(job_of(data))
        if job is None:
            counters["drop_unknown_job"] += 1
            return None
        pkt = unseal(data, job.token)
    except ProtocolError as e:
        (counters if job is None else job.counters)[drop_reason(e)] += 1
        return None
    job.counters["rx_datagrams"] += 1
    if job.resync is not None:  # restored after a restart: replays start from the floor
        job.counters["drop_resyncing"] += 1
        return None
    return job, pkt


class _Hosted(Port):
    """A hosted engine's port: packets to hosted engines are queued for the
    daemon to hand over (no recursion), others leave as datagrams; through
    its modelled links where it has them (``ShardLinks``)."""

    __slots__ = ("daemon", "links", "name")

    def __init__(self, daemon: SwitchDaemon, name: str, engine: Engine) -> None:
        super().__init__(engine)
        self.daemon, self.name = daemon, name
        self.links: ShardLinks | None = None

    def send(self, dst: str, pkt: Packet) -> None:
        if self.links is not None:
            self.links.cross(pkt, UP, self.daemon.forward, dst, pkt, None)
        else:
            self.daemon.forward(dst, pkt, None)

    def multicast(self, dsts: tuple[str, ...], pkt: Packet) -> None:
        raw: list[bytes] = []  # sealed once, for the datagrams among them
        if self.links is None and self.daemon.cfg.multicast and self.daemon.to_group(dsts, pkt):
            return
        for d in dsts:
            if self.links is not None:
                self.links.cross(pkt, UP, self.daemon.forward, d, pkt, raw)
            else:
                self.daemon.forward(d, pkt, raw)

    def schedule(self, deadline_ns: int) -> None:
        asyncio.get_running_loop().call_at(deadline_ns / 1e9, self.fire, deadline_ns)

    def now(self) -> int:
        return time.monotonic_ns()

    def on_fail(self, fail: Fail) -> None:
        d = self.daemon
        d.counters["gave_up"] += 1
        for job in d.jobs.values():
            if fail.peer in job.placement.workers:
                d.gave_up.setdefault(job.job_id, set()).add(fail.peer)


class SwitchDaemon:
    SWITCH: Final = SWITCH

    def __init__(self, cfg: SwitchConfig) -> None:
        self.cfg = cfg
        self.scheme = SCHEMES.get(cfg.policy)
        # Where the scheme keeps no switch state (PS, OmniReduce, DLCP) the
        # switch engine idles with an empty ATP pool.
        self.native: NativePolicy | None = None
        # where the C counters fold after each drain: the jobs', their PS's (``sync_native``)
        self.folded: tuple[dict[int, Counters], dict[int, Counters]] = ({}, {})
        if cfg.native_unsuitable() is None:  # the pool (and ATP's PS) in C (net.switchpath)
            counters = Counters()
            self.native = NativePolicy(cfg.policy, cfg.slots, counters)
            self.switch = SwitchEngine(self.SWITCH, self.native, counters)
        else:
            self.switch = SwitchEngine.build(self.SWITCH, self.scheme.policy or "atp", cfg.slots)
        self.local: dict[str, _Hosted] = {}
        self.host(self.SWITCH, self.switch)
        self.work: deque[tuple[str, Packet]] = deque()  # packets between hosted engines
        self.counters = Counters()
        self.impair = Impairer(cfg.impair, self.counters)
        self.metrics = registry(self)
        self.port: PortQueues[tuple[DaemonJob, Packet]] = PortQueues(
            cfg.port_buffer_kb * 1024, self.counters
        )
        self.port_clock = 0.0  # loop time at which the port is free
        self.port_wake = False
        self.jobs: dict[int, DaemonJob] = {}
        self.book: dict[str, tuple[DaemonJob, Address]] = {}
        self.gave_up: dict[int, set[str]] = {}  # job -> workers a hosted engine gave up on
        self.control = ControlPlane(self)
        self.sock: socket.socket | None = None
        self.backlog: deque[tuple[bytes, Address]] = deque()
        self.servers: list[asyncio.Server] = []
        self.stopped = asyncio.Event()
        self.started_ns = time.monotonic_ns()
        self.epoch = secrets.token_hex(8)  # this incarnation: workers notice a restart by it

    # -- hosted engines ---------------------------------------------------
    def host(self, name: str, engine: Engine) -> None:
        self.local[name] = _Hosted(self, name, engine)

    def unhost(self, name: str) -> None:
        self.local.pop(name, None)

    def engines(self) -> Iterator[Engine]:
        for port in self.local.values():
            assert port.engine is not None
            yield port.engine

    def register(
        self, workers: int, sa_atp: dict[str, Any] | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        out = self.control.register(workers, sa_atp, kind)
        self.sync_native()
        return out

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
        if cfg.sndbuf_kb:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.sndbuf_kb * 1024)
        sock.bind((cfg.host, cfg.port))
        if cfg.multicast:  # out of the interface the workers reach us by; ours stay ours
            here = socket.inet_aton(sock.getsockname()[0])
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, here)
            sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
        loop.add_reader(sock.fileno(), self._drain)
        self.control.load()
        self.sync_native()
        control = await asyncio.start_server(self.control.serve, cfg.host, cfg.control_port)
        self.servers.append(control)
        out = {
            "data": cast(Address, sock.getsockname()[:2]),
            "control": cast(Address, control.sockets[0].getsockname()[:2]),
        }
        if cfg.metrics_port is not None:

            async def metrics(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                await serve_metrics(self.metrics, r, w)

            server = await asyncio.start_server(metrics, cfg.host, cfg.metrics_port)
            self.servers.append(server)
            out["metrics"] = cast(Address, server.sockets[0].getsockname()[:2])
        return out

    def stop(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            if self.backlog:
                asyncio.get_running_loop().remove_writer(self.sock.fileno())
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
        if self.native is not None and sock is not None:
            self.native.native.drain(sock.fileno())
            self.native.native.fold(self.counters, self.switch.counters, *self.folded)
            return
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
        for _ in range(self.impair.copies()):
            self._received(data)

    def _received(self, data: bytes) -> None:
        got = accept(data, self.jobs, self.counters)
        if got is None:
            return
        job, pkt = got
        if job.shaped:
            self._port_offer(job, pkt, len(data))
        else:
            self._arrive(job, pkt)

    def _arrive(self, job: DaemonJob, pkt: Packet) -> None:
        if job.kind == BACKGROUND:
            self.counters["bg_delivered"] += 1
        else:
            self.deliver(job.entry, pkt)

    # The DLCP port: strict-priority queues with WRED (``proto.qos``), served at
    # ``port_mbps`` in front of the jobs' servers. The event loop's timers are
    # no finer than a millisecond, so the port keeps a virtual clock (when it
    # is free again) and on each wake-up sends everything that clock allows,
    # most urgent queue first; idle time gives at most BURST_S of credit.
    def _port_offer(self, job: DaemonJob, pkt: Packet, size: int) -> None:
        self.port.offer((job, pkt), size, pkt.priority, self.impair.rng.random())
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

    def deliver(self, name: str, pkt: Packet) -> None:
        """Feed ``pkt`` to the hosted engine ``name``, then every packet that
        hands on to other hosted engines, in order."""
        self.work.append((name, pkt))
        if len(self.work) > 1:
            return  # an outer call is draining
        now = time.monotonic_ns()
        while self.work:
            name, pkt = self.work[0]
            port = self.local.get(name)
            if port is None or port.engine is None:
                self.counters["drop_no_engine"] += 1
            else:
                port.execute(port.engine.on_packet(pkt, now))
            self.work.popleft()

    def forward(self, dst: str, pkt: Packet, raw: list[bytes] | None) -> None:
        """A hosted engine's packet: to another hosted engine, or out as a
        datagram to a worker (``raw`` caches one sealing for a multicast)."""
        to = self.local.get(dst)
        if to is not None:
            if to.links is not None:
                to.links.cross(pkt, DOWN, self.deliver, dst, pkt)
            else:
                self.deliver(dst, pkt)
            return
        hit = self.book.get(dst)
        if hit is None:
            self.counters["drop_no_address"] += 1
            return
        self._out(hit[0], pkt, raw, hit[1])

    def to_group(self, dsts: tuple[str, ...], pkt: Packet) -> bool:
        """A packet for every worker of a job that has a multicast group:
        sent once, to the group (the C datapath does the same)."""
        hit = self.book.get(dsts[0]) if dsts else None
        if hit is None or hit[0].group is None or dsts != hit[0].placement.workers:
            return False
        self._out(hit[0], pkt, None, hit[0].group)
        return True

    def _out(self, job: DaemonJob, pkt: Packet, raw: list[bytes] | None, addr: Address) -> None:
        """``pkt`` sealed with ``job``'s token (``raw`` caches one sealing)
        and sent to ``addr``, through the impairments."""
        try:
            if raw is None:
                data = seal(job.token, pkt)
            else:
                if not raw:
                    raw.append(seal(job.token, pkt))
                data = raw[0]
        except ValueError:  # an engine built a packet the wire cannot carry
            self.counters["drop_unencodable"] += 1
            return
        for delay in self.impair.delays_s():
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, self._sendto, data, addr)
            else:
                self._sendto(data, addr)

    def _sendto(self, raw: bytes, addr: Address) -> None:
        if self.sock is None:
            return
        if self.backlog:  # behind what waits for the kernel: in order, or not at all
            self._wait_for_kernel(raw, addr)
            return
        try:
            self.sock.sendto(raw, addr)
            self.counters["tx_datagrams"] += 1
        except BlockingIOError:  # the send buffer is full: wait until it drains
            self._wait_for_kernel(raw, addr)
        except OSError:
            self.counters["socket_error"] += 1

    def _wait_for_kernel(self, raw: bytes, addr: Address) -> None:
        if len(self.backlog) >= MAX_BACKLOG:
            # a link that does not drain: a loss the workers recover
            self.counters["drop_tx_full"] += 1
            return
        if not self.backlog and self.sock is not None:
            asyncio.get_running_loop().add_writer(self.sock.fileno(), self._flush)
        self.backlog.append((raw, addr))

    def _flush(self) -> None:
        """Send what waits, until the kernel refuses again or nothing is left."""
        sock = self.sock
        while self.backlog and sock is not None:
            raw, addr = self.backlog[0]
            try:
                sock.sendto(raw, addr)
            except BlockingIOError:
                return
            except OSError:
                self.counters["socket_error"] += 1
            else:
                self.counters["tx_datagrams"] += 1
            self.backlog.popleft()
        if sock is not None:
            asyncio.get_running_loop().remove_writer(sock.fileno())

    def sync_native(self) -> None:
        """Tell the native datapath what the control plane decided: every job's
        token, slot range, worker addresses and whether it resynchronises;
        jobs that left are forgotten."""
        if self.native is None or self.sock is None:
            return
        nat, sock, cfg = self.native.native, self.sock, self.cfg
        for job_id in set(nat.known) - set(self.jobs):
            nat.forget(job_id)
        servers: dict[int, Counters] = {}  # each job's hosted PS's: its C PS counts there
        for j in self.jobs.values():
            addrs = {r: sockaddr(sock, a) for r, a in j.addrs.items()}
            if j.group is not None:
                addrs[-1] = sockaddr(sock, j.group)
            if cfg.policy == "switchml":
                nat.job(j.job_id, j.token, j.workers, j.slot_base, cfg.job_slots,
                        j.resync is not None, addrs)  # fmt: skip
                continue
            ps = self.local[server_name(j.job_id)].engine
            assert isinstance(ps, ParameterServer)  # ATP's and ESA's fallback, or the PS
            pj = ps.jobs[j.job_id]
            nat.job(j.job_id, j.token, j.workers, 0, 0, j.resync is not None, addrs,
                    cfg.job_slots, (pj.window, pj.scale))  # fmt: skip
            servers[j.job_id] = ps.counters
        self.folded = ({i: j.counters for i, j in self.jobs.items()}, servers)

    # -- state ------------------------------------------------------------
    def occupancy(self) -> int:
        """Aggregators now held by some job (ATP/ESA pool; SwitchML's ranges)."""
        if self.native is not None and self.native.name != "switchml":
            return self.native.occupied()
        pool = getattr(self.switch.policy, "pool", None)
        if pool is not None:
            return sum(1 for a in pool if a.state != FREE)
        return len(self.jobs) * self.cfg.job_slots

    def stats(self) -> dict[str, Any]:
        merged = Counters()
        for e in self.engines():
            for k, v in e.counters.items():
                merged[k] += v
        for c in (self.counters, *(j.counters for j in self.jobs.values())):
            for k, v in c.items():
                merged[k] += v
        merged["rx_datagrams"] -= sum(j.counters["rx_datagrams"] for j in self.jobs.values())
        if self.native is not None:
            self.native.refresh_stats()
        return {
            "policy": self.cfg.policy,
            "datapath": "native" if self.native is not None else "python",
            "epoch": self.epoch,
            "uptime_s": (time.monotonic_ns() - self.started_ns) / 1e9,
            "cpu_s": time.process_time(),  # this process's CPU time (one core at most)
            "jobs": {
                str(j.job_id): {
                    "workers": j.workers,
                    "hellos": len(j.addrs),
                    "resyncing": j.resync is not None,
                }
                for j in self.jobs.values()
            },
            "slots": self.cfg.slots,
            "occupied": self.occupancy(),
            "counters": dict(sorted(merged.items())),
            "impair": asdict(self.cfg.impair),
        }
