"""``InaClient``: a rank of an in-network aggregation job (SwitchML, ATP, ESA,
or the PS baseline's daemon), for use from training code.

The client owns one worker node (``proto.worker_node.WorkerNode``, or its
native twin ``net.datapath.NativeWorkerNode`` where it is built and the job
suits it: the registry's choice, made once, at construction) and a UDP
socket, and a collective runs in the calling thread: the node is pushed the
tensor and the driver (``net.datapath.run``) serves it until its sum is in.
No thread hop per call and nothing handed between implementations.

Who drives the node is whoever holds ``lock``: the calling thread during a
collective; the background thread when a collective left work outstanding
(a replay's packets, see below) until it is quiet; the control loop while
it takes the job back after a restart. A driver that must let another in
raises a flag (``_yield``) the running loop checks at least every 10 ms.

A switch that dies and is started again on the same ports does not end the
job: the client keeps a control connection open (``watch``); when it
closes, the client reconnects until the daemon answers, and if the daemon's
epoch changed it restores the job from its ticket, takes a new socket
(a result still on its way from the old switch must not pass for the new
one's answer), reports the oldest sequence it has no result for and, once
the daemon has heard every rank, replays from the floor it answers
(``proto.worker``): the collective in flight completes with exact sums.

A daemon that offers the job a multicast group (``Ticket.group``; its
default) sends each result once, to the group, once every rank got a probe
through it (``_probe_group``): the client reads a second socket, joined
to the group, into the same node (the driver polls both).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError
from gradfabric.core.trace import Counters
from gradfabric.net import datapath
from gradfabric.net.datapath import ABORTED, DONE, NativeWorkerNode, offload, run
from gradfabric.net.udp import (
    await_probe,
    datagram_bytes,
    join_group,
    path_mtu,
    size_buffers,
    sockaddr,
    values_fitting,
)
from gradfabric.proto.worker import ResumableWorker
from gradfabric.proto.worker_node import Fused, WorkerNode
from gradfabric.runtime.control import control_call
from gradfabric.runtime.session import Exponents, Session, bind_host_for, say_hello
from gradfabric.runtime.ticket import Ticket, scheme_worker, with_secret
from gradfabric.wire import fastquant

RECONNECT_S: Final = 0.05  # between tries to reach a daemon that went away
RESUME_POLL_S: Final = 0.01  # between asking whether every rank has reported
PROBE_S, PROBE_TRIES = 0.3, 3  # waiting for a multicast probe, and how often to ask
LOG = logging.getLogger("gradfabric.client")
CALL, RESTART, CLOSING = 1, 2, 4  # who asks the node's driver to yield (``_yield``'s bits)


class InaClient(Session):
    """Rank ``rank`` of the job ``ticket`` describes, aggregating in the switch
    (or at a ``ps`` daemon)."""

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, priority: int = 0,
        bind_host: str | None = None, native: bool | None = None, pace_gbps: float = 0.0,
        first_seq: int = 0, exponents: Exponents = "agreed",
    ) -> None:  # fmt: skip
        """``native``: the native worker node (``net.datapath``); None uses
        it where it is built and suits the job, False keeps the reference.
        ``pace_gbps``: the rate of this worker's link, where known: the node
        paces its sends to it (resends first) instead of queueing a window in
        the link (0: unpaced). ``first_seq``: where the job's sequence
        numbers start (every rank alike; the wire carries their low 32 bits,
        so a job may start anywhere and run past 2**32). ``exponents``:
        agreed in a round before each sum, or carried from each tensor's
        last sum (``runtime.session``)."""
        if exponents not in ("agreed", "carried"):
            raise ConfigError("exponents", f"agreed or carried, got {exponents!r}")
        self.exponents = exponents
        engine = scheme_worker(ticket, rank, timeout_s, first_seq=first_seq)
        assert isinstance(engine, ResumableWorker)
        token = bytes.fromhex(ticket.token)
        why = datapath.unsuitable(engine)
        if native and why is not None:
            raise ConfigError("native", why)
        self.node: WorkerNode | NativeWorkerNode = (
            NativeWorkerNode(engine, token, priority, pace_gbps)
            if native is not False and why is None
            else WorkerNode(engine, token, priority, pace_gbps)
        )  # fmt: skip
        self.priority = priority
        self.driver = Counters()  # the driver's (datagrams, system calls, socket errors)
        self.lock = threading.Lock()  # whoever holds it drives the node
        self._yield = ctypes.c_int32(0)  # set: the driver holding ``lock`` lets go
        self._flags = threading.Lock()
        self.resynced = threading.Event()
        self.resynced.set()
        self.epoch = ""  # the daemon incarnation this client's job state lives in
        self.sock: socket.socket | None = None
        self.offload = {"gro": False, "gso": False}  # Linux's UDP offloads (net.datapath.offload)
        self.multicast = "not offered"  # whether results reach this rank multicast, or why not
        self.group: socket.socket | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._start(ticket, rank, timeout_s)
        self.bind_host = bind_host_for(ticket) if bind_host is None else bind_host
        self._wait(self._open(), timeout_s)

    @property
    def path(self) -> str:
        """Which implementation serves this client's node."""
        return datapath.PATH if isinstance(self.node, NativeWorkerNode) else "python"

    @property
    def counters(self) -> Counters:
        """The node's counters (the protocol's and the envelope's)."""
        if isinstance(self.node, NativeWorkerNode):
            return self.node.fold()
        return self.node.counters

    def set_priority(self, priority: int) -> None:
        """The header priority of this client's next calls (ESA's preemption
        compares it), on whichever implementation serves them."""
        if not 0 <= priority <= 255:
            raise ConfigError("priority", f"must be in 0..255, got {priority}")
        self.priority = priority
        with self.lock:
            self.node.set_priority(priority)

    # -- a collective --------------------------------------------------------
    def allreduce_ints(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.int64]:
        """Sum ``q`` over the job's workers into ``out`` (every rank calls with
        the same length, in the same order)."""
        q = np.ascontiguousarray(q, dtype=np.int32)
        if out is None:
            out = np.zeros(len(q), dtype=np.int64)
        elif out.dtype != np.int64 or len(out) != len(q):
            raise ValueError(f"out: an int64 array of {len(q)} values")
        if len(q):
            self._collective(lambda now: self.node.push(q, out, now))
        return out

    def _sum_floats(
        self, x: npt.NDArray[np.float32], enc_scale: npt.NDArray[np.float64],
        dec_scale: npt.NDArray[np.float64], out: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """With the native node and the C quantiser, the quantiser runs in the
        node (``Fused``): the first packet leaves without waiting for the
        whole tensor's encoding, the sum is decoded as its results arrive (a
        block is encoded when it first leaves, and its sum can only arrive
        after that: ``out`` may be ``x``)."""
        native = isinstance(self.node, NativeWorkerNode) and fastquant.functions() is not None
        if not len(x) or not native:
            return super()._sum_floats(x, enc_scale, dec_scale, out)
        if self._q is None or len(self._q) != len(x):
            self._q = np.empty(len(x), dtype=np.int32)  # kept: its pages are touched once
        into: npt.NDArray[np.float32] = fastquant.output(out, len(x), np.float32)
        fused = Fused(x, enc_scale, dec_scale, into)
        q, total = self._q, self._scratch(len(x))
        self._collective(lambda now: self.node.push(q, total, now, fused))
        return into

    _q: npt.NDArray[np.int32] | None = None

    def _collective(self, push: Callable[[int], None]) -> None:
        """Push a collective and drive the node until it is done (see the
        module doc for who else may drive it, and when)."""
        deadline = time.monotonic_ns() + int(self.timeout_s * 1e9)
        self._ask(CALL, True)
        with self.lock:
            self._ask(CALL, False)
            if self.refused is not None:
                raise self._blame()
            push(time.monotonic_ns())
            while True:
                rc = self._run(deadline)
                if rc != ABORTED or self.refused is not None:
                    break
                self.lock.release()  # a restart: the control loop takes the job back
                try:
                    self.resynced.wait(max(0.0, (deadline - time.monotonic_ns()) / 1e9))
                finally:
                    self.lock.acquire()
            quiet = self.node.quiet
        if rc != DONE or self.refused is not None:
            raise self._blame()
        error = self.node.error
        if error is not None:
            raise error
        if not quiet:  # a replay's packets outstanding: driven until answered or retired
            threading.Thread(target=self._background, daemon=True).start()

    def _run(self, deadline_ns: int, quiet: bool = False) -> int:
        assert self.sock is not None
        peer = sockaddr(self.sock, self.ticket.switch) if isinstance(
            self.node, NativeWorkerNode) else self.ticket.switch  # fmt: skip
        return run(self.node, self.sock, peer, deadline_ns, self._yield, self.group, quiet,
                   self.driver)  # fmt: skip

    def _background(self) -> None:
        """Drive the node until nothing is outstanding, yielding to a call."""
        with self.lock:
            if not self._yield.value and not self.node.quiet and self.sock is not None:
                self._run(time.monotonic_ns() + int(self.timeout_s * 1e9), quiet=True)

    def _ask(self, who: int, on: bool) -> None:
        """Raise (or lower) ``who``'s request that the driver let go."""
        with self._flags:
            self._yield.value = (self._yield.value | who) if on else (self._yield.value & ~who)

    # -- the socket, and surviving a daemon restart ----------------------------
    async def _open(self) -> None:
        self.epoch = (await self._new_socket())["epoch"]
        t = self.ticket
        if t.group is not None:
            try:
                self.group = join_group(t.group, t.switch)
            except ConfigError as e:  # results come one by one; the daemon hears why
                self.multicast = str(e)
            if self.group is not None and isinstance(self.node, NativeWorkerNode):
                offload(self.group)
            await self._probe_group()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        size, mtu = datagram_bytes(t.values_per_packet), path_mtu(t.switch)
        if size > mtu:  # still exact, but each datagram crosses as IP fragments
            LOG.warning("rank %d: datagrams of %d bytes fragment on a path of MTU %d; serve "
                        "with --values-per-packet %d or fewer", self.rank, size, mtu,
                        values_fitting(mtu))  # fmt: skip
        LOG.info("rank %d: %d values a datagram, a window of %d, results %s, offloads %s",
                 self.rank, t.values_per_packet, t.window, self.multicast, self.offload)

    async def _probe_group(self) -> None:
        """Whether the job's group reaches this rank: ask the daemon for a probe
        datagram there (on a port apart from the data's) and say whether it
        came. Results go to the group once every rank said yes."""
        t = self.ticket
        job = {"job_id": t.job_id, "token": t.token, "rank": self.rank}
        if self.group is not None:  # (else ``multicast`` says why it was not joined)
            why = await self._probe(job)
            self.multicast = "on" if why is None else why
        ok = self.multicast == "on"
        if not ok:
            LOG.warning("rank %d: results come one by one, not multicast: %s", self.rank,
                        self.multicast)  # fmt: skip
        await control_call(t.control, job | {"op": "multicast", "ok": ok, "why": self.multicast})

    async def _probe(self, job: dict[str, Any]) -> str | None:
        """Ask for a probe through the group, on a port of this rank's own,
        up to PROBE_TRIES times: None once one came, else why none did."""
        t = self.ticket
        assert t.group is not None
        nonce = secrets.token_bytes(8)
        try:
            with join_group((t.group[0], 0), t.switch) as sock:
                ask = job | {"op": "probe", "port": sock.getsockname()[1], "nonce": nonce.hex()}
                for _ in range(PROBE_TRIES):
                    await control_call(t.control, ask)
                    if await await_probe(sock, nonce, PROBE_S):
                        return None
        except ConfigError as e:  # not joined, or a restarted daemon that offers no group
            return str(e)
        return f"no probe through {t.group[0]} in {PROBE_TRIES} tries"

    async def _new_socket(self) -> dict[str, Any]:
        """Serve the node from a new UDP socket (the old one closed with
        whatever it still held) and tell the daemon its address."""
        if self.sock is not None:
            self.sock.close()
        t = self.ticket
        self.sock = sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        size_buffers(sock)
        if isinstance(self.node, NativeWorkerNode):  # the native driver alone reads it
            self.offload = offload(sock)
        sock.bind((self.bind_host, 0))
        return await say_hello(t, self.rank, sock.getsockname()[1], self.bind_host)

    async def _watch(self) -> None:
        t = self.ticket
        req = json.dumps({"op": "watch", "job_id": t.job_id, "token": t.token}).encode() + b"\n"
        while True:
            try:
                reader, writer = await asyncio.open_connection(*t.control)
                try:
                    writer.write(req)
                    await writer.drain()
                    line = await reader.readline()
                    if line and json.loads(line).get("epoch") == self.epoch:
                        await reader.read()  # returns when the daemon's end closes
                        continue
                finally:
                    writer.close()
                if line and not await self._resync():  # a new incarnation: take the job back
                    return  # it refused the job: nothing more to watch
            except (OSError, ValueError):  # not up (yet), or went away mid-answer
                pass
            await asyncio.sleep(RECONNECT_S)

    async def _resync(self) -> bool:
        """Take the job back from a new daemon incarnation; False if it refuses."""
        t = self.ticket
        job = {"job_id": t.job_id, "token": t.token}
        restore = job | {
            "op": "restore", "workers": t.workers, "kind": t.kind, "slot_base": t.slot_base,
            "window": t.window, "values_per_packet": t.values_per_packet, "policy": t.policy,
        }  # fmt: skip
        try:
            epoch = (await control_call(t.control, with_secret(restore)))["epoch"]
        except ConfigError as e:  # the daemon cannot take the job back: end it, saying why
            self.refused = str(e)
            self._ask(RESTART, True)  # a call in flight gives up and names the switch
            return False
        self.resynced.clear()
        self._ask(RESTART, True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.lock.acquire)
        try:
            # A new socket before reporting: a late result of the old switch could
            # otherwise pass for the new one's answer to a replay (proto.worker).
            await self._new_socket()
            resume = job | {"op": "resume", "rank": self.rank, "base": self.node.base}
            while "floor" not in (reply := await control_call(t.control, resume)):
                await asyncio.sleep(RESUME_POLL_S)
            self.node.replay(int(reply["floor"]), time.monotonic_ns())
            assert self.sock is not None
            for data in self.node.datagrams_to_send(time.monotonic_ns()):
                self.sock.sendto(data, t.switch)
        finally:
            self._ask(RESTART, False)
            self.lock.release()
            self.resynced.set()
        self.epoch = epoch
        if t.group is not None:  # the new incarnation knows nothing of the group yet
            await self._probe_group()
        threading.Thread(target=self._background, daemon=True).start()
        return True

    async def _shut(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def close(self) -> None:
        """Stop watching, close the sockets, free the node (idempotent)."""
        self._ask(CLOSING, True)
        super().close()
        with self.lock:
            for s in (self.sock, self.group):
                if s is not None:
                    s.close()
            self.sock = self.group = None
            if isinstance(self.node, NativeWorkerNode):
                self.node.close()
