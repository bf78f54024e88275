"""A worker's side of a job at a switch daemon, for use from training code.

Every client owns one sans-I/O engine (the same the simulator runs) on a UDP
socket, driven by an asyncio loop in a background thread, so a training step
can call a collective synchronously. Everything crossing the socket carries
the job's token (``wire.envelope``).

* ``InaClient``: a ``ResumableWorker`` aggregating through the switch (SwitchML,
  ATP, ESA) or a parameter server daemon (``ps``).
* ``OmniClient``: an ``OmniWorker`` streaming its non-zero blocks to an
  OmniReduce aggregator daemon (``omni``).
* ``emu.dlcp.DlcpClient``: DLCP's bounded-loss transport.

Floats reach the integer domain as SwitchML does it: per block of
``values_per_packet`` values every worker quantises with the block exponent
agreed over the job (the maximum over workers of the exponents, which every
rank sends every other over the training process group in one exchange:
``block_maxima``), so
the integer sum cannot overflow and is exact; the only error is the rounding
at encode time (``wire.quant.BlockExponent``). Integers cannot carry a NaN or
an infinity: a block holding one at any rank says so in the exponent round,
goes through the switch as zeros, and is summed as floats instead in a second
round over the same group (every rank knows the same blocks after the
first), so its values come back as a dense all-reduce's would: NaN and inf
where DDP's default hook puts them, the block's finite values summed, and
AMP's gradient scaler sees what it would see without the switch.

A collective that does not finish within ``timeout_s`` raises
``PeerTimeoutError`` naming the ranks the switch still waits on (asked over
the control port), or the switch itself if it is gone or cannot take the
job back.

A switch that dies and is started again on the same ports does not end an
``InaClient``'s job: each client keeps a control connection open
(``watch``); when it closes, the client reconnects until the daemon answers,
and if the daemon's epoch changed it restores the job from its ticket, says
hello again, reports the oldest sequence it has no result for and, once the
daemon has heard every rank, replays from the floor it answers (see
``proto.worker``): the collective in flight completes with exact sums.
OmniReduce and DLCP clients do not resume (their engines keep no replay
state); their jobs end with the switch, naming it.

A daemon serving with ``--multicast`` sends each result once, to the job's
multicast group (``Ticket.group``), and the network replicates it: each
client then reads a second socket, joined to the group, into the same engine
(and the C datapath polls both); everything else stays unicast.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as CFuture
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError, PeerTimeoutError, ProtocolError
from gradfabric.core.registry import Registry
from gradfabric.emu.switchd import control_call, worker_name
from gradfabric.net import datapath
from gradfabric.net.overlap import Overlapped
from gradfabric.net.udp import Address, EngineProtocol, join_group, open_engine, sockaddr
from gradfabric.proto.actions import Action, Deliver
from gradfabric.proto.interface import Engine
from gradfabric.proto.omni import OmniWorker
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.proto.worker import ResumableWorker
from gradfabric.wire import fastquant
from gradfabric.wire.packet import Flag, Packet
from gradfabric.wire.quant import block_exponents, block_scales

SWITCH_ENV = "GRADFABRIC_SWITCH"  # HOST:PORT of the switch daemon's control port
ANY_HOST = "0.0.0.0"
RECONNECT_S = 0.05  # between tries to reach a daemon that went away
RESUME_POLL_S = 0.01  # between asking whether every rank has reported
# An exponent no finite float32 has: the block holds a NaN or an infinity at
# some rank, and is summed as floats, outside the switch.
NON_FINITE = 1 << 20


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("address", f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def switch_from_env() -> Address:
    env = os.environ.get(SWITCH_ENV)
    if env is None:
        raise ConfigError(SWITCH_ENV, "set it to the switch's HOST:CONTROL_PORT")
    return parse_address(env)


@dataclass(frozen=True)
class Ticket:
    """What the switch answered at registration: every rank needs it."""

    switch: Address  # data (UDP)
    control: Address
    job_id: int
    token: str  # hex
    policy: str
    workers: int
    pool_slots: int
    slot_base: int
    window: int
    values_per_packet: int
    rto_ns: int
    entry: str  # the engine at the daemon that this job's packets go to
    kind: str = "ina"
    streams: int = 16  # omni
    push_bound: float = 0.0  # dlcp
    pull_bound: float = 0.0
    epoch: str = ""  # the daemon's incarnation that issued it
    group: Address | None = None  # where results arrive multicast (``SwitchConfig.multicast``)

    def save(self, path: str) -> None:
        """Write the ticket to ``path`` (atomically), for a restarted launch to revoke."""
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path: str) -> Ticket:
        with open(path) as f:
            d = json.load(f)
        return cls(**d | {"switch": tuple(d["switch"]), "control": tuple(d["control"]),
                          "group": _address(d.get("group"))})  # fmt: skip

    def revoke(self, timeout_s: float = 5.0) -> bool:
        """Unregister the job: its stray datagrams become counted drops at the
        switch. False if the switch no longer knew it."""
        req = {"op": "unregister", "job_id": self.job_id, "token": self.token}
        try:
            asyncio.run(control_call(self.control, req, timeout_s))
        except ConfigError:
            return False
        return True

    @classmethod
    def register(
        cls, control: Address, workers: int, kind: str | None = None, timeout_s: float = 5.0,
        **extra: Any,
    ) -> Ticket:  # fmt: skip
        """Register a job of ``workers`` at the daemon whose control port is ``control``."""
        req = {"op": "register", "workers": workers} | ({"kind": kind} if kind else {}) | extra
        reply = asyncio.run(control_call(control, req, timeout_s))
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in reply.items() if k in known}
        return cls(control=control, **args | {"switch": tuple(reply["switch"]),
                                              "group": _address(reply.get("group"))})  # fmt: skip


def _address(v: list[Any] | None) -> Address | None:
    """A (host, port) from JSON's list."""
    return None if v is None else (str(v[0]), int(v[1]))


# A loss costs a round trip, not a timeout (``proto.worker``): on real links a
# timeout must allow for queueing, which makes it many round trips long.
FAST_RETRANSMIT = 3


def block_maxima(exps: Any, group: Any = None) -> Any:
    """Each block's largest exponent over the ranks of ``group``: every rank
    sends its exponents to every other at once (``all_to_all_single``) and
    takes the maximum itself, the same at every rank. The exponents are a few
    KB a bucket; a ring all-reduce would carry them through 2(n-1) hops in
    turn, each a wake-up of a gloo thread that, on a host busy with backward,
    waits for a core: with 4 ranks on 2 cores its 2 KB took 7-38 ms after the
    last rank arrived, the exchange 1-27 ms, and a step's first sum began
    14-20 ms sooner (two runs each; NOTEBOOK, 2026-11-28). Each rank sends n-1 copies: in an
    alpha-beta model the exchange beats the ring's hops while the exponents
    stay under about twice a hop's latency times the link's rate (some 100
    KB at 10 Gbit/s and 50 us), at any rank count; a bucket's are 2-16 KB
    (4-32 MB buckets). ``exps``: a 1-D int32 tensor."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    every = torch.empty(world * len(exps), dtype=exps.dtype)
    dist.all_to_all_single(every, exps.repeat(world), group=group)
    return every.view(world, -1).amax(dim=0)


def fast_retransmit(notices: bool, window: int) -> int:
    """Results past a loss before a worker resends it on its own. Where the
    switch sends loss notices (SwitchML), the notice repairs the loss within
    about one loaded round trip, in which up to a window of results pass: a
    fast retransmit sooner mostly duplicates a repair on its way, and since
    every worker of the copy sends it, three in four are needless at 4
    workers. So it waits half a window there, a backstop for what no notice
    reveals (a lost resend, a tensor's last share, a lost result). Measured
    (NOTEBOOK, "Loss notices"): k = 3 and k = 16 took the same time under 5%
    loss at window 32, k = 16 with a sixth of the fast resends."""
    return max(FAST_RETRANSMIT, window // 2) if notices else FAST_RETRANSMIT


def scheme_worker(ticket: Ticket, rank: int, timeout_s: float, takes_help: bool = False) -> Engine:
    """Rank ``rank``'s engine for the ticket's job, from the scheme registry
    (retrying each packet for up to ``timeout_s``; a switch job's workers can
    replay after a restart; ``takes_help``: results for sequences it has not
    sent are taken, as SA-ATP's helped hosts do, else dropped)."""
    t = ticket
    names = tuple(worker_name(t.job_id, r) for r in range(t.workers))
    scheme = SCHEMES.get(t.policy)
    p = Placement(
        t.job_id, names, {t.entry: names}, servers=(t.entry,), window=t.window,
        pool_slots=t.pool_slots, slot_base=t.slot_base, rto_ns=t.rto_ns,
        values_per_packet=t.values_per_packet, streams=t.streams,
        max_retries=max(1, int(timeout_s * 1e9 / t.rto_ns)), resumable=True,
        fast_retransmit=fast_retransmit(scheme.sends_notices, t.window), nack=True,
        takes_help=takes_help,
    )  # fmt: skip
    return scheme.worker(p, rank)


C = TypeVar("C", bound="Attached")
R = TypeVar("R")


def together(fns: list[Callable[[], R]]) -> list[R]:
    """Run ``fns`` in threads at once (each worker blocks in its collective) and
    return their results in order; re-raise the first error."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


class Attached(Overlapped):
    """A worker engine on a UDP socket at a daemon, run by its own asyncio loop
    in a background thread."""

    ticket: Ticket
    rank: int
    timeout_s: float
    calls = 0  # float all-reduces so far (keys the check-in after a failure)
    _group: tuple[Any] | None = None  # the process group of the float all-reduces, once known
    _summing: int | None = None  # the float all-reduce the switch serves now (its ``calls``)
    replayer: ResumableWorker | None = None  # set: the job survives a daemon restart
    epoch = ""  # the daemon incarnation this client's job state lives in
    refused: str | None = None  # why the job could not be taken back after a restart
    _watcher: asyncio.Task[None] | None = None
    _call: Call | None = None  # the collective in flight
    _mcast: asyncio.DatagramTransport | None = None  # the job's multicast results (Ticket.group)
    proto: EngineProtocol

    def __init__(self, ticket: Ticket, rank: int, timeout_s: float = 30.0, **kw: Any) -> None:
        raise NotImplementedError  # each client builds its engine, then calls _attach

    @classmethod
    def join(
        cls: type[C], control: Address | None = None, group: Any = None, timeout_s: float = 30.0,
        ticket_file: str | None = None, **kw: Any,
    ) -> C:  # fmt: skip
        """Every rank of a torch.distributed group calls this: rank 0 registers
        the job (at ``control``, or ``$GRADFABRIC_SWITCH``), the ticket goes to
        every rank over the group, and each rank opens its socket and says hello.

        ``ticket_file``: where rank 0 keeps the job's ticket. A group that
        torchrun restarted finds its previous job's ticket there and revokes
        it first (the old job's stray datagrams become counted drops and its
        aggregators are freed), then registers a new job."""
        import torch.distributed as dist

        control = control or switch_from_env()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box: list[Ticket | None] = [None]
        if rank == 0:
            if ticket_file is not None and os.path.exists(ticket_file):
                Ticket.load(ticket_file).revoke()
            ticket = box[0] = Ticket.register(control, world, cls.KIND)
            if ticket_file is not None:
                ticket.save(ticket_file)
        dist.broadcast_object_list(box, src=0, group=group)
        assert box[0] is not None
        client = cls(box[0], rank, timeout_s, **kw)
        dist.barrier(group)
        return client

    KIND: str | None = None  # what ``join`` registers (None: the daemon's default)
    DAEMON_OPTIONS: tuple[str, ...] = ()  # switch-serve flags a job of this client wants

    def _attach(
        self, ticket: Ticket, rank: int, timeout_s: float, engine: Engine,
        on_deliver: Callable[[Deliver], None], bind_host: str | None = None,
        on_help: Callable[[Any], None] | None = None,
    ) -> None:  # fmt: skip
        if not 0 <= rank < ticket.workers:
            raise ConfigError("rank", f"must be in 0..{ticket.workers - 1}")
        self.ticket, self.rank, self.timeout_s = ticket, rank, timeout_s
        if bind_host is None:  # loopback for a local switch, else every interface
            bind_host = "127.0.0.1" if ticket.switch[0].startswith("127.") else ANY_HOST
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def open_() -> None:
            t = ticket
            hello = {"op": "hello", "job_id": t.job_id, "token": t.token, "rank": rank}
            if bind_host != ANY_HOST:  # else the switch answers where the hello came from
                hello["host"] = bind_host
            self._open_socket = functools.partial(
                open_engine, engine, {t.entry: t.switch}, (bind_host, 0), on_deliver,
                bytes.fromhex(t.token), on_help,
            )  # fmt: skip
            self._hello_base = hello
            self.epoch = (await self._new_socket())["epoch"]
            if t.group is not None:
                self._mcast, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                    lambda: _GroupFeed(self), sock=join_group(t.group, t.switch))
            if self.replayer is not None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())

        self._wait(open_(), timeout_s)

    async def _new_socket(self) -> dict[str, Any]:
        """Serve the engine from a new UDP socket (the old one, if any, closed
        with whatever it still held) and tell the daemon its address."""
        self._drop_socket()
        transport, self.proto = await self._open_socket()
        self._group_reading(True)
        port = transport.get_extra_info("sockname")[1]
        return await control_call(self.ticket.control, self._hello_base | {"port": port})

    # -- surviving a daemon restart (see the module doc) -------------------
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
        assert self.replayer is not None
        t = self.ticket
        job = {"job_id": t.job_id, "token": t.token}
        restore = job | {
            "op": "restore", "workers": t.workers, "kind": t.kind, "slot_base": t.slot_base,
            "window": t.window, "values_per_packet": t.values_per_packet, "policy": t.policy,
            "multicast": t.group is not None,
        }  # fmt: skip
        try:
            epoch = (await control_call(t.control, restore))["epoch"]
        except ConfigError as e:  # the daemon cannot take the job back: end it, saying why
            self.refused = str(e)
            if self._call is not None:
                self._call.failed = True
                self._call.done.set()
            return False
        # A new socket before reporting: a late result of the old switch could
        # otherwise pass for the new one's answer to a replay (proto.worker).
        await self._stop_native()
        await self._new_socket()
        resume = job | {"op": "resume", "rank": self.rank, "base": self.replayer.base}
        while "floor" not in (reply := await control_call(t.control, resume)):
            await asyncio.sleep(RESUME_POLL_S)
        self.proto.execute(self.replayer.replay(int(reply["floor"]), time.monotonic_ns()))
        self.epoch = epoch
        self._native_again()
        return True

    async def _stop_native(self) -> None:
        """A restart: a call in the native datapath hands its state to the engine."""

    def _native_again(self) -> None:
        """The restart is handled: calls may take the native datapath again."""

    def _wait(self, coro: Any, timeout_s: float | None = None) -> Any:
        fut: CFuture[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    # A call the native datapath completed leaves the engine idle, with no
    # timer armed and nothing to send; the calling thread then takes its
    # state back itself and leaves the socket's reader paused for the next
    # native call ("parked", ``InaClient._park``): the two hops to the loop
    # thread a call made otherwise cost 0.2-4 ms each on a loaded host, and
    # the switch waits for the last rank to start each call. Until the loop
    # resumes the reader (a call the engine runs, ``_run``), datagrams wait in
    # the socket; the next native call reads them and counts them as the
    # engine would have (duplicates, stale results). A restart replaces the
    # socket (``_new_socket``): a parked transport that is no longer the
    # engine's is never resumed or read.
    _parked: Any = None

    def _unpark(self) -> None:
        """In the loop thread: the reader resumed if a native call left it paused."""
        parked: Any = self._parked
        self._parked = None
        if parked is not None and parked is self.proto.transport:
            parked.resume_reading()  # type: ignore[union-attr]  # selector transports have it
            self._group_reading(True)

    def _group_reading(self, on: bool) -> None:
        """The multicast socket's reader follows the engine socket's: paused
        while the C datapath reads both."""
        g = self._mcast
        if g is not None and not g.is_closing():
            (g.resume_reading if on else g.pause_reading)()  # type: ignore[attr-defined]

    def _run(self, call: Call, start: Callable[[], list[Action]]) -> npt.NDArray[np.int64]:
        """Start a collective in the loop thread and wait for it."""

        def begin() -> None:
            if call.done.is_set():
                return
            self._unpark()  # the engine's datagrams come through the reader
            self.proto.execute(start())
            if self.proto.gave_up.done() or self.refused is not None:
                call.failed = True
                call.done.set()

        self.loop.call_soon_threadsafe(begin)
        if not call.done.wait(self.timeout_s) or call.failed:
            raise self._blame()
        if call.error is not None:
            raise call.error
        return call.result

    def _blame(self) -> PeerTimeoutError:
        """Whom the collective waits on, as the daemon sees it, less the ranks
        that checked in at the rendezvous store after their own part of this
        call failed (in gloo's exponent round, say: they never reached the
        switch, but they are alive)."""
        from gradfabric.net.peers import Roll

        roll = None
        if self._group is not None:
            import torch.distributed as dist

            group = self._group[0]
            call = self.calls if self._summing is None else self._summing
            roll = Roll("emu", group, dist.get_world_size(group), self.rank, call)
        t = self.ticket
        req = {"op": "missing", "job_id": t.job_id, "token": t.token}
        switch = f"switch {t.switch[0]}:{t.switch[1]}"
        if self.refused is not None:
            return PeerTimeoutError(f"{switch} ({self.refused})", self.timeout_s)
        try:
            missing = self._wait(control_call(t.control, req, 2.0), 5.0)["missing"]
        except ConfigError:  # the switch no longer knows the job
            return PeerTimeoutError(f"{switch} (job state lost)", self.timeout_s)
        except (OSError, TimeoutError):
            return PeerTimeoutError(switch, self.timeout_s)
        if roll is not None:
            missing = [r for r in missing if not roll.present(r)] or missing
        who = ", ".join(f"rank {r}" for r in missing) if missing else switch
        return PeerTimeoutError(who, self.timeout_s)

    def allreduce(
        self, x: npt.NDArray[np.float32], group: Any = None, *,
        out: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """Sum float32 ``x`` over the job (see the module doc for the
        quantisation), into ``out`` where given (a float32 array of ``len(x)``
        values; ``x`` itself may be it: a block's sum arrives only after the
        block was read), else into a new array. A caller that sums tensors of
        one size again and again (a hook, a benchmark) should pass one: a new
        array each call costs the kernel's zeroing of its pages."""
        return self.sum_agreed(self.agree(x, group), out)

    def agree(self, x: npt.NDArray[np.float32], group: Any = None) -> Agreed:
        """The first half of ``allreduce``: the job's ranks agree on each
        block's exponent (an all-reduce of the maxima on ``group``). It needs
        nothing of the switch, so a hook runs it for the next bucket while the
        switch sums this one (``emu.hook.ina_hook``)."""
        import torch
        import torch.distributed as dist

        from gradfabric.net.peers import keep_alive, name_the_missing

        vpp = self.ticket.values_per_packet
        x = given = np.ascontiguousarray(x, dtype=np.float32)
        exps = fastquant.exponents(x, vpp)
        if exps is None:  # integers cannot carry NaN or inf: their blocks say so in the exponent
            bad = ~np.isfinite(x)
            x = np.where(bad, np.float32(0), x)
            exps = block_exponents(x, vpp)
            exps[np.add.reduceat(bad, np.arange(0, len(x), vpp)) > 0] = NON_FINITE
        e = torch.from_numpy(exps)
        self.calls += 1
        self._group = (group,)
        keep_alive()
        try:  # the exponent round: a rank gone here breaks gloo, not the switch
            e = block_maxima(e, group)
            lost = e.numpy() == NON_FINITE
            floats = None
            if lost.any():  # the same blocks at every rank: their values summed as floats
                t = torch.from_numpy(given[np.repeat(lost, vpp)[: len(x)]])
                dist.all_reduce(t, group=group)
                floats = t.numpy()
        except RuntimeError as err:
            world = dist.get_world_size(group)
            raise name_the_missing(
                "emu", group, world, self.rank, self.calls, self.timeout_s, err
            ) from err
        scale = block_scales(np.where(lost, 0, e.numpy()), self.ticket.workers)
        return Agreed(x, scale, lost, self.calls, floats)

    def sum_agreed(
        self, a: Agreed, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """The second half of ``allreduce``: the integer round through the switch."""
        self._summing = a.call  # (the stage thread may have counted the next one already)
        out = self._sum_floats(a.x, np.where(a.lost, 0.0, a.scale), a.scale, out)
        if a.floats is not None:  # (a lost block's values were encoded as 0 at every rank)
            out[np.repeat(a.lost, self.ticket.values_per_packet)[: len(a.x)]] = a.floats
        return out

    def _sum_floats(
        self, x: npt.NDArray[np.float32], enc_scale: npt.NDArray[np.float64],
        dec_scale: npt.NDArray[np.float64], out: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """The integer round of ``allreduce``: encode, sum, decode (into ``out``)."""
        vpp = self.ticket.values_per_packet
        q = fastquant.encode(x, vpp, enc_scale)
        return fastquant.decode(self.allreduce_ints(q, self._scratch(len(x))), vpp, dec_scale, out)

    def allreduce_ints(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.int64]:
        """Sum ``q`` over the job's workers into ``out`` (a new array if None)."""
        raise NotImplementedError

    _sum: npt.NDArray[np.int64] | None = None

    def _scratch(self, n: int) -> npt.NDArray[np.int64]:
        """The float all-reduce's integer sum, reused from call to call: a
        fresh array each time costs the kernel's zeroing of its pages, as
        much CPU as the datagrams of a large tensor."""
        if self._sum is None or len(self._sum) != n:
            self._sum = np.empty(n, dtype=np.int64)
        return self._sum

    def close(self) -> None:
        """Stop watching, close the socket, stop the loop and release its
        file descriptors (idempotent)."""
        if self.loop.is_running():
            self._wait(self._shut(), 5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    async def _shut(self) -> None:
        if self._watcher is not None:
            await _cancelled(self._watcher)
        self._drop_socket()
        if self._mcast is not None:
            self._mcast.close()
        await asyncio.sleep(0)  # the transport's close callback runs

    def _drop_socket(self) -> None:
        """Close the engine's socket (with whatever it still holds); its
        pending timers find no engine."""
        proto = getattr(self, "proto", None)
        if proto is not None:
            proto.attach(None)
            if proto.transport is not None:
                proto.transport.close()


class _GroupFeed(asyncio.DatagramProtocol):
    """The job's multicast results, into the engine's protocol (which
    answers from the engine's own socket)."""

    def __init__(self, client: Attached) -> None:
        self.client = client

    def datagram_received(self, data: bytes, addr: Address) -> None:
        proto = getattr(self.client, "proto", None)
        if proto is not None and proto.transport is not None:
            proto.datagram_received(data, addr)


class InaClient(Attached):
    """Rank ``rank`` of the job ``ticket`` describes, aggregating in the switch
    (or at a ``ps`` daemon)."""

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, priority: int = 0,
        bind_host: str | None = None, native: bool | None = None, pace_gbps: float = 0.0,
    ) -> None:  # fmt: skip
        """``native``: serve calls through the C datapath (``net.datapath``);
        None uses it where it is built, False keeps the Python engine.
        ``pace_gbps``: the rate of this worker's link, where known: the native
        datapath paces its sends to it (resends first) instead of queueing a
        window in the link (0: unpaced)."""
        engine = scheme_worker(ticket, rank, timeout_s)
        assert isinstance(engine, ResumableWorker)
        self.priority = priority
        self.engine = self.replayer = engine
        self._call = None
        why = datapath.unsuitable(engine)
        if native and why is not None:
            raise ConfigError("native", why)
        self.fast = None if native is False or why else datapath.NativeWorker(
            engine, bytes.fromhex(ticket.token), priority, pace_gbps
        )  # fmt: skip
        # A restart takes a native call over: the watcher raises ``abort`` and
        # waits for the call to hand its state back (``_native``, ``_resync``).
        self.abort = ctypes.c_int32(0)
        self.native_lock = threading.Lock()
        self.native_busy = self.resyncing = False
        self._attach(ticket, rank, timeout_s, self.engine, self._deliver, bind_host)

    @property
    def path(self) -> str:
        """Which datapath serves this client's calls."""
        return datapath.PATH if self.fast is not None else "python"

    def set_priority(self, priority: int) -> None:
        """The header priority of this client's next calls (ESA's preemption
        compares it), on whichever datapath serves them."""
        if not 0 <= priority <= 255:
            raise ConfigError("priority", f"must be in 0..255, got {priority}")
        self.priority = priority
        if self.fast is not None:
            self.fast.priority = self.fast.w.priority = priority

    def allreduce_ints(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.int64]:
        """Sum ``q`` over the job's workers into ``out`` (every rank calls with
        the same length, in the same order)."""
        q = np.ascontiguousarray(q, dtype=np.int32)
        call = self._call = Call(len(q), self.ticket.values_per_packet, out)
        call.first = self.engine.next_seq
        if len(q) == 0:
            return call.result
        if self._claim_native():
            self._native(call, q)
            return call.result
        return self._run(call, lambda: self.engine.push(len(q), time.monotonic_ns(), q,
                                                        priority=self.priority))  # fmt: skip

    def _sum_floats(
        self, x: npt.NDArray[np.float32], enc_scale: npt.NDArray[np.float64],
        dec_scale: npt.NDArray[np.float64], out: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """With the native datapath and the C quantiser, the quantiser runs
        inside the datapath (``net.datapath.Fused``): the first packet leaves
        without waiting for the whole tensor's encoding, the sum is decoded
        as its results arrive (a block is encoded when it first leaves, and
        its sum can only arrive after that: ``out`` may be ``x``)."""
        if not len(x) or fastquant.functions() is None or not self._claim_native():
            return super()._sum_floats(x, enc_scale, dec_scale, out)
        vpp = self.ticket.values_per_packet
        call = self._call = Call(len(x), vpp, self._scratch(len(x)))
        call.first = self.engine.next_seq
        if self._q is None or len(self._q) != len(x):
            self._q = np.empty(len(x), dtype=np.int32)  # kept: its pages are touched once
        into = fastquant.output(out, len(x), np.float32)
        fused = datapath.Fused(x, enc_scale, dec_scale, into)
        if self._native(call, self._q, fused):
            return fused.out
        return fastquant.decode(call.result, vpp, dec_scale, into)  # the engine finished the call

    _q: npt.NDArray[np.int32] | None = None

    def _claim_native(self) -> bool:
        """Whether this call takes the native datapath (not while a restart is handled)."""
        if self.fast is None or datapath.unsuitable(self.engine) is not None:
            return False
        with self.native_lock:
            self.native_busy = not self.resyncing
        return self.native_busy

    def _native(
        self, call: Call, q: npt.NDArray[np.int32], fused: datapath.Fused | None = None
    ) -> bool:
        """One call through the C datapath on this client's socket (its asyncio
        reader paused meanwhile); the engine takes over whatever is left. The
        int64 sum is in ``call.result``; True if ``fused.out`` holds it decoded."""
        fast = self.fast
        assert fast is not None
        transport = self.proto.transport
        if transport is not None and transport is self._parked:
            sock = transport.get_extra_info("socket")  # still paused since the last call
        else:
            transport, sock = self._wait(self._pause())
        addr = sockaddr(sock, self.ticket.switch)
        outcome = datapath.ABORTED
        try:
            fast.start(q, call.result, time.monotonic_ns(), fused)
            group_fd = -1 if self._mcast is None else self._mcast.get_extra_info("socket").fileno()
            outcome = fast.run(sock.fileno(), addr, time.monotonic_ns() + int(self.timeout_s * 1e9),
                               self.abort, group_fd)  # fmt: skip
        finally:
            if outcome != datapath.DONE_RUN:
                self._wait(self._hand_back(fast, call, outcome))
            elif not self._park(fast, call, transport):
                self._wait(self._resume())
        if outcome == datapath.DONE_RUN:
            if call.error is not None:
                raise call.error
            return fused is not None
        if outcome == datapath.OUT_OF_MEMORY:
            raise MemoryError("the native datapath's buffers")
        if outcome == datapath.ABORTED:  # a restart: the engine goes on with the call
            if (not self.engine.idle and not call.done.wait(self.timeout_s)) or call.failed:
                raise self._blame()
            if call.error is not None:
                raise call.error
            return False
        raise self._blame()

    async def _stop_native(self) -> None:
        with self.native_lock:
            self.resyncing = True
            if self.native_busy:
                self.abort.value = 1
        while self.native_busy:  # the call's hand-back runs in this loop meanwhile
            await asyncio.sleep(0.001)

    def _native_again(self) -> None:
        with self.native_lock:
            self.resyncing = False

    async def _pause(self) -> tuple[Any, Any]:
        transport = self.proto.transport
        assert transport is not None
        transport.pause_reading()  # type: ignore[attr-defined]  # selector transports have it
        self._group_reading(False)
        return transport, transport.get_extra_info("socket")

    async def _hand_back(self, fast: datapath.NativeWorker, call: Call, outcome: int) -> None:
        """In the loop thread, which owns the engine: its state from the call,
        the reader resumed, its timer armed for what is still outstanding."""
        self._finish(fast, call)
        if outcome != datapath.ABORTED:
            await self._resume()

    def _finish(self, fast: datapath.NativeWorker, call: Call) -> None:
        fast.finish()
        call.error = fast.error()
        with self.native_lock:
            self.native_busy = False
            self.abort.value = 0

    def _park(self, fast: datapath.NativeWorker, call: Call, transport: Any) -> bool:
        """After ``DONE_RUN``, on the calling thread (the loop thread leaves
        the engine alone while ``native_busy``): whether the reader may stay paused."""
        self._finish(fast, call)
        if not self.engine.idle:
            return False
        self._parked = transport
        return True

    async def _resume(self) -> None:
        """The reader resumed, the engine's timer armed for what is outstanding."""
        self._parked = None
        if self.proto.transport is not None:
            self.proto.transport.resume_reading()  # type: ignore[attr-defined]
            self._group_reading(True)
            self.proto.execute([])

    def _deliver(self, d: Deliver) -> None:
        call = self._call
        if call is None:
            return
        call.take(d.seq, d.pkt)
        if self.engine.idle:
            call.done.set()


class OmniClient(Attached):
    """Rank ``rank`` of an OmniReduce job at an aggregator daemon (``omni``):
    only non-zero blocks of ``values_per_packet`` values travel."""

    def __init__(
        self, ticket: Ticket, rank: int, timeout_s: float = 30.0, bind_host: str | None = None
    ) -> None:
        engine = scheme_worker(ticket, rank, timeout_s)
        assert isinstance(engine, OmniWorker)
        self.engine = engine
        self.bucket = 0
        self._call = None
        self._attach(ticket, rank, timeout_s, self.engine, self._deliver, bind_host)

    def allreduce_ints(
        self, q: npt.NDArray[np.int32], out: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.int64]:
        q = np.ascontiguousarray(q, dtype=np.int32)
        call = self._call = Call(len(q), self.ticket.values_per_packet, out)
        b, self.bucket = self.bucket, (self.bucket + 1) % 0x10000  # the header's bucket id
        if len(q) == 0:
            return call.result
        return self._run(call, lambda: self.engine.start(b, len(q), time.monotonic_ns(), q))

    def _deliver(self, d: Deliver) -> None:
        call = self._call
        if call is not None and d.pkt.payload is not None:
            call.result[:] = d.pkt.payload
            call.done.set()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass(frozen=True)
class Agreed:
    """A float all-reduce between its two rounds: the values (non-finite ones
    zeroed), each block's agreed scale, the blocks some rank lost to NaN or
    inf, which call it is, and those blocks' values summed as floats."""

    x: npt.NDArray[np.float32]
    scale: npt.NDArray[np.float64]
    lost: npt.NDArray[np.bool_]
    call: int  # its number among the client's float all-reduces (keys the check-in of ``_blame``)
    floats: npt.NDArray[np.float32] | None = None  # the lost blocks' sums, in order


class Call:
    """One collective of a client: its int64 sum, filled as results arrive."""

    def __init__(self, n: int, vpp: int, out: npt.NDArray[np.int64] | None = None) -> None:
        self.vpp = vpp
        if out is not None and (out.dtype != np.int64 or len(out) != n):
            raise ValueError(f"out: an int64 array of {n} values")
        # every value is written before the call returns (a partial sum never does)
        self.result = np.zeros(n, dtype=np.int64) if out is None else out
        self.first = 0
        self.done = threading.Event()
        self.failed = False
        self.error: Exception | None = None

    def take(self, seq: int, pkt: Packet) -> None:
        """Sequence ``seq``'s result (the native datapath's delivery mirrors
        this rule: an integer result of the count that was sent, else the
        call's error)."""
        lo = (seq - self.first) * self.vpp
        sent = min(self.vpp, len(self.result) - lo)
        if pkt.flags & Flag.FLOAT or pkt.payload is None:
            self.error = self.error or ProtocolError(f"result {seq} left the integer domain")
        elif pkt.count != sent:
            self.error = self.error or ProtocolError(
                f"result {seq} carries another count than was sent"
            )
        else:
            self.result[lo : lo + sent] = pkt.payload


# The client class of each scheme a daemon hosts (``emu.dlcp`` adds DLCP's).
CLIENTS: Registry[type[Attached]] = Registry("client")
for _name in ("switchml", "atp", "esa", "saatp", "ps"):
    CLIENTS.add(_name, InaClient)
CLIENTS.add("omnireduce", OmniClient)
CLIENTS.alias("omni", "omnireduce")
