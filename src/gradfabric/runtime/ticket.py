"""A job at a switch daemon, as its workers hold it: the ticket the daemon
answered at registration, and how each worker's engine is built from it.

Every rank of a job needs the ticket (``Ticket.register`` on one rank, then
broadcast: ``Client.join``); each builds its engine for the ticket's scheme
from the scheme registry (``scheme_worker``), as every driver does.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from gradfabric.core.errors import ConfigError
from gradfabric.net.udp import Address
from gradfabric.proto.interface import Engine
from gradfabric.proto.schemes import SCHEMES, Placement
from gradfabric.runtime.control import control_call, worker_name

SWITCH_ENV = "GRADFABRIC_SWITCH"  # HOST:PORT of the switch daemon's control port
SECRET_ENV = "GRADFABRIC_SECRET"  # the cluster secret a daemon may ask registrations for


def with_secret(req: dict[str, Any]) -> dict[str, Any]:
    """``req`` carrying the cluster secret, where ``$GRADFABRIC_SECRET`` holds one."""
    secret = os.environ.get(SECRET_ENV)
    return req if secret is None else req | {"secret": secret}


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
    """What the switch answered at registration, and the launcher's own
    settings for its workers: every rank needs it."""

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
    # the launcher's fast retransmit for its workers (None: ``fast_retransmit``'s
    # rule; 0: off, a loss or a split sequence waits for the timeout)
    fast_retransmit: int | None = None

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
        reply = asyncio.run(control_call(control, with_secret(req), timeout_s))
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


def fast_retransmit(notices: bool, window: int, override: int | None = None) -> int:
    """Results past a loss before a worker resends it on its own (``override``
    where a launcher set one: ``Ticket.fast_retransmit``). Where the
    switch sends loss notices (SwitchML), the notice repairs the loss within
    about one loaded round trip, in which up to a window of results pass: a
    fast retransmit sooner mostly duplicates a repair on its way, and since
    every worker of the copy sends it, three in four are needless at 4
    workers. So it waits half a window there, a backstop for what no notice
    reveals (a lost resend, a tensor's last share, a lost result). Measured
    (docs/notebook/2026-11-27.md#loss-notices-switch-names): k = 3 and
    k = 16 took the same time under 5% loss at window 32, k = 16 with a sixth
    of the fast resends."""
    if override is not None:
        return override
    return max(FAST_RETRANSMIT, window // 2) if notices else FAST_RETRANSMIT


def scheme_worker(
    ticket: Ticket, rank: int, timeout_s: float, takes_help: bool = False, first_seq: int = 0
) -> Engine:
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
        fast_retransmit=fast_retransmit(scheme.sends_notices, t.window, t.fast_retransmit),
        nack=True, takes_help=takes_help, first_seq=first_seq,
    )  # fmt: skip
    return scheme.worker(p, rank)


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
