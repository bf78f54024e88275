"""What every client of a switch daemon shares: a rank's session at its job.

A session holds the job's ticket and its rank, runs the control plane's
calls on an asyncio loop in a background thread (hello, watch, restore,
missing), and turns an integer all-reduce (``allreduce_ints``, each
client's own) into a float one.

Floats reach the integer domain as SwitchML does it: per block of
``values_per_packet`` values every worker quantises with the block exponent
agreed over the job (the maximum over workers of the exponents, which every
rank sends every other over the training process group in one exchange:
``block_maxima``), so the integer sum cannot overflow and is exact; the only
error is the rounding at encode time (``wire.quant.BlockExponent``).
Integers cannot carry a NaN or an infinity: a block holding one at any rank
says so in the exponent round, goes through the switch as zeros, and is
summed as floats instead in a second round over the same group (every rank
knows the same blocks after the first), so its values come back as a dense
all-reduce's would: NaN and inf where DDP's default hook puts them, the
block's finite values summed, and AMP's gradient scaler sees what it would
see without the switch.

A client made with ``exponents="carried"`` skips the round: each tensor
(``key``; a DDP bucket's index in ``ina_hook``) takes its exponents from its
own last sum, which every rank holds (``wire.carried``: values beyond a
block's range clip, counted in ``clipped``; a NaN or an infinity is an
error, as no round can tell the other ranks). No rank waits for another
before the switch does, which is what a straggler's helpers need (SA-ATP).

A collective that does not finish within ``timeout_s`` raises
``PeerTimeoutError`` naming the ranks the switch still waits on (asked over
the control port), or the switch itself if it is gone or cannot take the
job back.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future as CFuture
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from gradfabric.core.errors import ConfigError, PeerTimeoutError
from gradfabric.net.overlap import Overlapped
from gradfabric.net.udp import Address
from gradfabric.runtime.control import control_call
from gradfabric.runtime.ticket import Ticket, switch_from_env
from gradfabric.wire import fastquant
from gradfabric.wire.carried import CarriedExponents
from gradfabric.wire.quant import block_exponents, block_scales

# How a float all-reduce's ranks agree on each block's exponent: in a round
# over the process group before each sum (``agreed``), or carried from the
# tensor's last sum without a message (``carried``: ``wire.carried``)
Exponents = Literal["agreed", "carried"]

ANY_HOST = "0.0.0.0"


def bind_host_for(ticket: Ticket) -> str:
    """Where a client's data socket binds: loopback for a local switch, else
    every interface."""
    return "127.0.0.1" if ticket.switch[0].startswith("127.") else ANY_HOST


async def say_hello(ticket: Ticket, rank: int, port: int, bind_host: str) -> dict[str, Any]:
    """Tell the daemon where rank ``rank``'s data socket is (its reply)."""
    t = ticket
    hello = {"op": "hello", "job_id": t.job_id, "token": t.token, "rank": rank, "port": port}
    if bind_host != ANY_HOST:  # else the switch answers where the hello came from
        hello["host"] = bind_host
    return await control_call(t.control, hello)

# An exponent no finite float32 has: the block holds a NaN or an infinity at
# some rank, and is summed as floats, outside the switch.
NON_FINITE = 1 << 20

S = TypeVar("S", bound="Session")


def block_maxima(exps: Any, group: Any = None) -> Any:
    """Each block's largest exponent over the ranks of ``group``: every rank
    sends its exponents to every other at once (``all_to_all_single``) and
    takes the maximum itself, the same at every rank. The exponents are a few
    KB a bucket; a ring all-reduce would carry them through 2(n-1) hops in
    turn, each a wake-up of a gloo thread that, on a host busy with backward,
    waits for a core: with 4 ranks on 2 cores its 2 KB took 7-38 ms after the
    last rank arrived, the exchange 1-27 ms, and a step's first sum began
    14-20 ms sooner (two runs each;
    docs/notebook/2026-11-28.md#ddp-step-through-switch). Each rank
    sends n-1 copies: in an alpha-beta model the exchange beats the ring's
    hops while the exponents stay under about twice a hop's latency times
    the link's rate (some 100 KB at 10 Gbit/s and 50 us), at any rank count;
    a bucket's are 2-16 KB (4-32 MB buckets). ``exps``: a 1-D int32 tensor."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    every = torch.empty(world * len(exps), dtype=exps.dtype)
    dist.all_to_all_single(every, exps.repeat(world), group=group)
    return every.view(world, -1).amax(dim=0)


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
    carried: CarriedExponents | None = None  # the exponents came from it: the sum goes back


class Session(Overlapped):
    """A rank's session at its job (see the module doc). A subclass builds
    its engine and calls ``_start``."""

    ticket: Ticket
    rank: int
    timeout_s: float
    calls = 0  # float all-reduces so far (keys the check-in after a failure)
    _group: tuple[Any] | None = None  # the process group of the float all-reduces, once known
    _summing: int | None = None  # the float all-reduce the switch serves now (its ``calls``)
    refused: str | None = None  # why the job could not be taken back after a restart
    KIND: str | None = None  # what ``join`` registers (None: the daemon's default)
    exponents: Exponents = "agreed"  # how the ranks agree on a block's exponent (``agree``)
    _carried: dict[int, CarriedExponents]  # per tensor (its ``key``), where carried
    DAEMON_OPTIONS: tuple[str, ...] = ()  # switch-serve flags a job of this client wants

    def __init__(self, ticket: Ticket, rank: int, timeout_s: float = 30.0, **kw: Any) -> None:
        raise NotImplementedError  # each client builds its engine, then calls _start

    @classmethod
    def join(
        cls: type[S], control: Address | None = None, group: Any = None, timeout_s: float = 30.0,
        ticket_file: str | None = None, **kw: Any,
    ) -> S:  # fmt: skip
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

    def _start(self, ticket: Ticket, rank: int, timeout_s: float) -> None:
        """The session's fields and its control loop's thread."""
        if not 0 <= rank < ticket.workers:
            raise ConfigError("rank", f"must be in 0..{ticket.workers - 1}")
        self.ticket, self.rank, self.timeout_s = ticket, rank, timeout_s
        self._carried = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _wait(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the control loop and wait for its result."""
        fut: CFuture[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

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
            roll = Roll("ina", group, dist.get_world_size(group), self.rank, call)
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

    # -- the float all-reduce ------------------------------------------------
    def allreduce(
        self, x: npt.NDArray[np.float32], group: Any = None, *,
        out: npt.NDArray[np.float32] | None = None, key: int = 0,
    ) -> npt.NDArray[np.float32]:  # fmt: skip
        """Sum float32 ``x`` over the job (see the module doc for the
        quantisation), into ``out`` where given (a float32 array of ``len(x)``
        values; ``x`` itself may be it: a block's sum arrives only after the
        block was read), else into a new array. A caller that sums tensors of
        one size again and again (a hook, a benchmark) should pass one: a new
        array each call costs the kernel's zeroing of its pages. ``key``
        names the tensor where exponents are carried (each its own)."""
        return self.sum_agreed(self.agree(x, group, key), out)

    def agree(self, x: npt.NDArray[np.float32], group: Any = None, key: int = 0) -> Agreed:
        """The first half of ``allreduce``: the job's ranks agree on each
        block's exponent (an exchange of the maxima on ``group``), or, where
        exponents are carried, take those of tensor ``key``'s last sum
        without a message. It needs nothing of the switch, so a hook runs it
        for the next bucket while the switch sums this one
        (``runtime.hook.ina_hook``)."""
        if self.exponents == "carried":
            return self._carry(x, key)
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
                "ina", group, world, self.rank, self.calls, self.timeout_s, err
            ) from err
        scale = block_scales(np.where(lost, 0, e.numpy()), self.ticket.workers)
        return Agreed(x, scale, lost, self.calls, floats)

    def _carry(self, x: npt.NDArray[np.float32], key: int) -> Agreed:
        vpp = self.ticket.values_per_packet
        quant = self._carried.get(key)
        if quant is None:
            quant = self._carried[key] = CarriedExponents(self.ticket.workers, vpp)
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.calls += 1
        lost = np.zeros(-(-len(x) // vpp), dtype=bool)
        return Agreed(quant.clip(x), quant.scales(len(x)), lost, self.calls, carried=quant)

    @property
    def clipped(self) -> int:
        """Values this rank clipped to their block's carried range, so far."""
        return sum(q.clipped for q in self._carried.values())

    def sum_agreed(
        self, a: Agreed, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """The second half of ``allreduce``: the integer round through the switch."""
        self._summing = a.call  # (the stage thread may have counted the next one already)
        out = self._sum_floats(a.x, np.where(a.lost, 0.0, a.scale), a.scale, out)
        if a.floats is not None:  # (a lost block's values were encoded as 0 at every rank)
            out[np.repeat(a.lost, self.ticket.values_per_packet)[: len(a.x)]] = a.floats
        if a.carried is not None:
            a.carried.carry(out)
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
        """Stop the session's control loop (and what the subclass runs on it:
        ``_shut``) and release its file descriptors (idempotent)."""
        if self.loop.is_running():
            self._wait(self._shut(), 5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    async def _shut(self) -> None:
        """What a subclass stops on the control loop before it ends."""
