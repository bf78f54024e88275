"""The switch daemon: a switch node (``proto.node``) on a real UDP socket.

One asyncio process serves, for any number of jobs, the switch node of its
scheme (``policy``): the reference ``SwitchNode`` or, where it can serve,
its native twin (``net.switchpath``), both behind one datagram interface.
This module is the driver: the socket and the clock, the node's one timer,
where each worker is (its hello), the multicast groups, and the
impairments of the network itself (``runtime.impair``: this kernel has no
netem). The control plane is ``runtime.control``, the metrics ``runtime.metrics``.

With the reference node, each datagram read goes to
``node.receive_datagram`` (through the impairments: lost, or twice) and
what the node answers goes out after each batch, to its job's rank (or the
job's multicast group, or every worker with an address; a rank that never
said hello is ``drop_no_address``). With the native node, the native UDP
driver does the same in C (``UdpBook.drain``), batches of datagrams per
system call, with no Python per datagram.

SIGTERM or SIGINT stops the daemon cleanly (sockets closed, final counters
printed by the CLI). A daemon that dies (SIGKILL, a crash) and is started
again on the same ports resumes its jobs: each incarnation has an epoch, the
workers notice the new one and restore their job from their tickets (or the
daemon already knows it from ``state_dir``), agree on a floor and replay
(``runtime.control``, ``proto.worker``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, cast

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net import switchpath
from gradfabric.net.datapath import offload
from gradfabric.net.switchpath import NativeSwitchNode, UdpBook
from gradfabric.net.udp import (
    AUTO_MAX_VALUES,
    IP_MULTICAST_ALL,
    PROBE,
    Address,
    default_values,
    interface_mtu,
    size_buffers,
    sockaddr,
)
from gradfabric.proto.node import ALL, NODE_SCHEMES, SWITCH, NodeConfig, SwitchNode
from gradfabric.runtime.control import ControlPlane, DaemonJob
from gradfabric.runtime.control import control_call as control_call
from gradfabric.runtime.control import server_name as server_name
from gradfabric.runtime.control import worker_name as worker_name
from gradfabric.runtime.impair import Impairer, Impairment
from gradfabric.runtime.metrics import registry, serve_metrics
from gradfabric.runtime.wakeup import WakeUp
from gradfabric.wire.packet import MAX_WIRE_VALUES, VALUE_BYTES

DRAIN_BATCH: Final = 256  # datagrams read per wake-up
MAX_BACKLOG: Final = 65_536  # datagrams waiting for a small send buffer (``sndbuf_kb``)
DAEMON_SCHEMES: Final = NODE_SCHEMES  # schemes a daemon hosts


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with the help (and choices) its command-line flag shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


WINDOW_BYTES: Final = 32 * AUTO_MAX_VALUES * VALUE_BYTES  # a job's window by default: 256 KB


def default_window(values_per_packet: int, slots: int = 4096) -> int:
    """A job's window by default: WINDOW_BYTES of values, whatever the
    datagram's size (what is in flight is what covers the round trip)."""
    return max(1, min(slots, round(WINDOW_BYTES / (VALUE_BYTES * values_per_packet))))


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
    job_slots: int = _opt(
        0, "SwitchML: slots per job; ATP/ESA: the window (0: a window of 256 KB of values: "
        "32 datagrams of 2048 values, 183 of 358)",
    )  # fmt: skip
    values_per_packet: int = _opt(
        0, "values per datagram (0: the most one datagram carries unfragmented on the MTU "
        "of the interface --host is on, at most 2048: 358 at 1500, 2048 at 9000)",
    )  # fmt: skip
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
    secret: str | None = _opt(
        None, "a cluster secret every registration (and a restart's restore) must carry "
        "(clients read it from $GRADFABRIC_SECRET); none: any client may register",
    )  # fmt: skip
    allow: str = _opt(
        "", "comma-separated networks (CIDR) the control port answers; empty: any",
    )  # fmt: skip
    max_jobs_per_client: int = _opt(
        64, "jobs one client address may hold at once (its share of the pool): past it, "
        "a registration is refused and counted",
    )  # fmt: skip
    state_dir: str | None = _opt(
        None, "keep job registrations here: restarted on it, the daemon knows its jobs"
    )
    multicast: bool = _opt(
        True, "offer each job a multicast group (239.77.x.y on the data port): once every "
        "worker got a probe through it, a result leaves once and the network replicates it, "
        "as a switch's packet replication does; else each worker gets its copy (loopback "
        "and a Linux bridge carry it; not with the wildcard --host, which names no interface)",
    )  # fmt: skip
    datapath: str = _opt(
        "auto", "native: the switch's datapath in C (net.switchpath: switchml, atp, esa, ps, "
        "dlcp); python: the reference engines; auto: native where it is built and can serve "
        "(those policies, no impairments, DLCP's port unshaped)",
        ("auto", "native", "python"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.policy not in DAEMON_SCHEMES:
            raise ConfigError("policy", f"one of {', '.join(DAEMON_SCHEMES)}; got {self.policy!r}")
        if not 0 <= self.values_per_packet <= MAX_WIRE_VALUES:
            raise ConfigError("values_per_packet", f"must be in 0..{MAX_WIRE_VALUES}")
        # 0s are resolved here, where the daemon runs (its config says what it chose):
        # datagrams as large as the network carries whole, a window of as many bytes
        # whatever their size (what is in flight is what covers the round trip)
        if not self.values_per_packet:
            object.__setattr__(self, "values_per_packet", default_values(interface_mtu(self.host)))
        if not self.job_slots:
            window = default_window(self.values_per_packet, self.slots)
            object.__setattr__(self, "job_slots", window)
        if not 1 <= self.job_slots <= self.slots:
            raise ConfigError("job_slots", f"must be in 1..slots ({self.slots})")
        if self.rto_ns <= 0:
            raise ConfigError("rto_ns", "must be > 0")
        if self.sndbuf_kb < 0:
            raise ConfigError("sndbuf_kb", f"must be >= 0, got {self.sndbuf_kb}")
        if not (self.ps_link_mbps == 0 or 1 <= self.ps_link_mbps < float("inf")):
            raise ConfigError("ps_link_mbps", f"0 (none) or >= 1, got {self.ps_link_mbps}")
        if self.port_mbps < 0 or self.port_buffer_kb < 1:
            raise ConfigError("port_mbps", "must be >= 0, with a buffer of >= 1 KB")
        for name in ("push_bound", "pull_bound"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.max_jobs_per_client < 1:
            raise ConfigError("max_jobs_per_client", "must be >= 1")
        try:
            self.networks()
        except ValueError as e:
            raise ConfigError("allow", f"comma-separated networks such as 10.0.0.0/8: {e}") from e
        if self.datapath not in ("auto", "native", "python"):
            raise ConfigError("datapath", f"one of auto, native, python; got {self.datapath!r}")
        why = self.native_unsuitable()
        if self.datapath == "native" and why is not None:
            raise ConfigError("datapath", f"native cannot serve: {why}")

    def networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The networks ``allow`` names (none: any)."""
        return [ipaddress.ip_network(n.strip(), strict=False)
                for n in self.allow.split(",") if n.strip()]  # fmt: skip

    def node(self) -> NodeConfig:
        """What the switch node runs (``proto.node``)."""
        return NodeConfig(
            scheme=self.policy, slots=self.slots, job_slots=self.job_slots,
            values_per_packet=self.values_per_packet, rto_ns=self.rto_ns,
            omni_streams=self.omni_streams, push_bound=self.push_bound, port_mbps=self.port_mbps,
            port_buffer_kb=self.port_buffer_kb, ps_link_mbps=self.ps_link_mbps,
            seed=self.impair.seed,
        )  # fmt: skip

    def native_unsuitable(self) -> str | None:
        """Why the native switch node cannot serve this daemon (None: it can)."""
        if self.datapath == "python":
            return "python was asked for"
        if self.impair != Impairment():
            return "impairments run in the reference"
        return switchpath.unsuitable(self.node())


class SwitchDaemon:
    SWITCH: Final = SWITCH

    def __init__(self, cfg: SwitchConfig) -> None:
        self.cfg = cfg
        self.node: SwitchNode | NativeSwitchNode = (
            NativeSwitchNode(cfg.node()) if cfg.native_unsuitable() is None
            else SwitchNode(cfg.node())
        )  # fmt: skip
        self.udp: UdpBook | None = None  # the native driver's half (``start``)
        self.counters = Counters()
        self.impair = Impairer(cfg.impair, self.counters)
        self.metrics = registry(self)
        self.jobs: dict[int, DaemonJob] = {}
        self.control = ControlPlane(self)
        self.sock: socket.socket | None = None
        self.offload = {"gro": False, "gso": False}  # Linux's UDP offloads (net.datapath.offload)
        self.backlog: deque[tuple[bytes, Address]] = deque()
        self.servers: list[asyncio.Server] = []
        self.stopped = asyncio.Event()
        self.started_ns = time.monotonic_ns()
        self.epoch = secrets.token_hex(8)  # this incarnation: workers notice a restart by it
        self.timer_at: int | None = None  # the node's pending wake-up
        self.wakeup: WakeUp | None = None
        # the wildcard address names no interface to send the groups from
        self.multicast = cfg.multicast and cfg.host not in ("", "0.0.0.0")
        self.state_dir = cfg.state_dir
        self.pull_bound = cfg.pull_bound
        self.secret, self.networks = cfg.secret, cfg.networks()
        self.max_jobs_per_client = cfg.max_jobs_per_client

    @property
    def native(self) -> bool:
        return isinstance(self.node, NativeSwitchNode)

    def register(
        self, workers: int, sa_atp: dict[str, Any] | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        return self.control.register(workers, sa_atp, kind)

    # -- what the control plane tells the driver ----------------------------
    def data_address(self) -> Address:
        assert self.sock is not None
        return cast(Address, self.sock.getsockname()[:2])

    def addresses_changed(self, job: DaemonJob) -> None:
        """``job``'s workers or group moved: the native driver learns it."""
        if self.udp is not None and self.sock is not None:
            addrs = {r: sockaddr(self.sock, a) for r, a in job.addrs.items()}
            if job.multicasting:
                assert job.group is not None
                addrs[-1] = sockaddr(self.sock, job.group)
            self.udp.job(job.job_id, job.workers, addrs)

    def probe(self, job: DaemonJob, port: int, nonce: bytes) -> bool:
        """One probe datagram to ``job``'s group on ``port`` (a worker's,
        apart from the data port), from the data socket: the way results go.
        False if the kernel would not take it (the worker asks again)."""
        assert self.sock is not None and job.group is not None
        try:
            self.sock.sendto(PROBE + nonce, (job.group[0], port))
        except OSError:
            self.counters["multicast_probe_errors"] += 1
            return False
        self.counters["multicast_probes"] += 1
        return True

    def forget(self, job: DaemonJob) -> None:
        if self.udp is not None:
            self.udp.forget(job.job_id)

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
        if self.multicast:  # out of the interface the workers reach us by; ours stay ours
            here = socket.inet_aton(sock.getsockname()[0])
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, here)
            sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
        if isinstance(self.node, NativeSwitchNode):
            self.udp = UdpBook(self.node.ops, self.node.s)
            self.offload = offload(sock)  # the native driver alone reads this socket
        loop.add_reader(sock.fileno(), self._drain)
        self.control.load()
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
        if self.wakeup is not None:
            self.wakeup.close()
            self.wakeup = None
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
        if sock is None:
            return
        if self.udp is not None:  # the native driver: timers, reads, the engine and sends in C
            self.udp.drain(sock.fileno())
            self.udp.fold(self.counters)
            self._arm()
            return
        for _ in range(DRAIN_BATCH):  # then let the control plane and timers run
            try:
                data, _addr = sock.recvfrom(65_536)
            except BlockingIOError:
                break
            except OSError:
                self.counters["socket_error"] += 1
                break
            self.datagram_received(data)
        self._flush()

    def datagram_received(self, data: bytes) -> None:
        """One datagram, through the impairments (lost, or taken twice)."""
        now = time.monotonic_ns()
        for _ in range(self.impair.copies()):
            self.node.receive_datagram(data, now)

    def _flush(self) -> None:
        """What the node has to send, each to where its job's workers are; then
        its timer armed."""
        for job_id, rank, data in self.node.datagrams_to_send(time.monotonic_ns()):
            job = self.jobs.get(job_id)
            if job is None:
                self.counters["drop_no_address"] += 1
            elif rank == ALL and job.multicasting:
                assert job.group is not None
                self._out(data, job.group)
            else:
                for r in range(job.workers) if rank == ALL else (rank,):
                    addr = job.addrs.get(r)
                    if addr is None:
                        self.counters["drop_no_address"] += 1
                    else:
                        self._out(data, addr)
        self._arm()

    def _arm(self) -> None:
        """A wake-up at the node's timer, unless an earlier one is set (to
        the microsecond: ``runtime.wakeup``)."""
        d = self.node.get_timer()
        if d is not None and (self.timer_at is None or d < self.timer_at):
            self.timer_at = d
            if self.wakeup is None:
                self.wakeup = WakeUp(asyncio.get_running_loop(), self._fire)
            self.wakeup.at(d)

    def _fire(self) -> None:
        self.timer_at = None
        if self.udp is not None:
            self._drain()  # the native driver handles the timer and sends
            return
        self.node.handle_timer(time.monotonic_ns())
        self._flush()

    def _out(self, data: bytes, addr: Address) -> None:
        """``data`` to ``addr``, through the impairments."""
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
            asyncio.get_running_loop().add_writer(self.sock.fileno(), self._flush_backlog)
        self.backlog.append((raw, addr))

    def _flush_backlog(self) -> None:
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

    # -- state ------------------------------------------------------------
    def occupancy(self) -> int:
        """Aggregators now held by some job (ATP/ESA pool; SwitchML's ranges)."""
        return self.node.occupancy()

    def own_counters(self) -> list[Counters]:
        """What no job is charged with: the daemon's (and its native driver's)
        and the node's own."""
        return [self.counters, cast(Counters, self.node.counter_groups()["node"])]

    def engine_counters(self) -> list[Counters]:
        """The hosted engines' counters: the switch engine's and every server's."""
        groups = self.node.counter_groups()
        servers = cast(dict[int, Counters], groups["servers"])
        return [cast(Counters, groups["switch"]), *servers.values()]

    def stats(self) -> dict[str, Any]:
        groups = self.node.counter_groups()
        merged = Counters()
        for c in (self.counters, cast(Counters, groups["node"]), *self.engine_counters(),
                  *(j.counters for j in self.jobs.values())):  # fmt: skip
            for k, v in c.items():
                merged[k] += v
        merged["rx_datagrams"] -= sum(j.counters["rx_datagrams"] for j in self.jobs.values())
        return {
            "policy": self.cfg.policy,
            "datapath": "native" if self.native else "python",
            "offload": self.offload,
            "values_per_packet": self.cfg.values_per_packet,
            "window": self.cfg.job_slots,
            "epoch": self.epoch,
            "uptime_s": (time.monotonic_ns() - self.started_ns) / 1e9,
            "cpu_s": time.process_time(),  # this process's CPU time (one core at most)
            "jobs": {
                str(j.job_id): {
                    "workers": j.workers,
                    "hellos": len(j.addrs),
                    "resyncing": j.resync is not None,
                    "multicast": j.multicasting if j.unicast is None else j.unicast,
                }
                for j in self.jobs.values()
            },
            "slots": self.cfg.slots,
            "occupied": self.occupancy(),
            "counters": dict(sorted(merged.items())),
            "impair": asdict(self.cfg.impair),
        }
