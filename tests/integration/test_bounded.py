"""Bounded state and counted refusals at the switch daemon: what a token
holder or a client may make the daemon hold is capped, and what exceeds a
cap is refused and counted by name, never grown and never another job's
loss. How much of a flood the kernel delivers is the host's business: the
tests count what reached the daemon, not what was sent."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import numpy as np
import pytest

from gradfabric.core.errors import ConfigError
from gradfabric.lab.daemon import RunningSwitch, switch_daemon
from gradfabric.proto.routes import atp_index
from gradfabric.runtime.client import InaClient, Ticket, together
from gradfabric.runtime.control import control_call
from gradfabric.wire.packet import Flag, Packet, encode

WINDOW = 16  # the daemon's --job-slots: its PS keeps 4 of them, and 4 times that in merges


def _stats(sw: RunningSwitch) -> dict[str, Any]:
    return asyncio.run(control_call(sw.control, {"op": "stats"}))


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _flood(sw: RunningSwitch, ticket: Ticket, first: int, n: int) -> None:
    """``n`` shares of worker 0 of ``ticket``'s job, each of another sequence
    and flagged a resend: each would open a merge at the job's PS."""
    token = bytes.fromhex(ticket.token)
    vals = np.arange(1024, dtype=np.int32)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in range(first, first + n):
            agg = atp_index(ticket.job_id, seq, ticket.pool_slots)
            pkt = Packet(ticket.job_id, 0, seq, agg, 1, 2, Flag.RESEND, 0, 0, 1024, vals)
            s.sendto(token + encode(pkt), sw.data)


def _flood_stays_flat(datapath: str, n: int) -> None:
    with switch_daemon("--policy", "atp", "--job-slots", str(WINDOW), "--datapath", datapath) as sw:
        ticket = Ticket.register(sw.control, 2)
        _flood(sw, ticket, 0, 20_000)  # the merges fill up to their cap
        before = _rss_kb(sw.proc.pid)
        _flood(sw, ticket, 20_000, n)
        after = _rss_kb(sw.proc.pid)
        c = _stats(sw)["counters"]
    # every share that reached the PS opened a merge (up to the cap) or was
    # refused and counted; none was dropped uncounted, none grew the daemon
    assert c["ps_resend"] == c.get("merged", 0) + c.get("drop_pending_full", 0), c
    assert c.get("merged", 0) <= 16 * WINDOW and c.get("drop_pending_full", 0) > 0, c
    # the cap: 256 merges of 1,024 values (int64) is 2 MB; the daemon's
    # memory stays within a few MB of where the first 20,000 left it
    assert after - before < 8 * 1024, (before, after)
    print(f"flood of {n}: rss {before} -> {after} KB; refused {c['drop_pending_full']}")


@pytest.mark.parametrize("datapath", ["auto", "python"])
def test_a_flood_of_partial_sequences_keeps_the_daemon_flat(datapath: str) -> None:
    _flood_stays_flat(datapath, 100_000)


@pytest.mark.long
@pytest.mark.parametrize("datapath", ["auto", "python"])
def test_a_million_partial_sequences_keep_the_daemon_flat(datapath: str) -> None:
    _flood_stays_flat(datapath, 1_000_000)


def _register_from(sw: RunningSwitch, source: str, **extra: Any) -> dict[str, Any]:
    """A registration from the address ``source`` (another client than this host's)."""
    with socket.create_connection(sw.control, timeout=5, source_address=(source, 0)) as c:
        c.sendall(json.dumps({"op": "register", "workers": 2} | extra).encode() + b"\n")
        reply: dict[str, Any] = json.loads(c.makefile().readline())
    return reply


def test_a_registration_flood_is_refused_at_its_cap_and_other_tenants_stay_exact() -> None:
    with switch_daemon("--policy", "switchml", "--max-jobs-per-client", "5") as sw:
        flood = [_register_from(sw, "127.0.0.1") for _ in range(40)]
        assert sum("job_id" in r for r in flood) == 5
        assert all("holds 5 jobs" in r["error"] for r in flood if "error" in r)
        reply = _register_from(sw, "127.0.0.2")  # another tenant
        assert "job_id" in reply, reply
        ticket = Ticket(**{k: v for k, v in reply.items() if k in Ticket.__dataclass_fields__}
                        | {"switch": tuple(reply["switch"]), "control": sw.control,
                           "group": None})  # fmt: skip
        clients = [InaClient(ticket, r, timeout_s=30) for r in range(2)]
        try:
            xs = [np.random.default_rng(r).integers(-(2**20), 2**20, 50_000, np.int32)
                  for r in range(2)]  # fmt: skip
            outs = together([lambda c=c, x=x: c.allreduce_ints(x)
                             for c, x in zip(clients, xs, strict=True)])  # fmt: skip
            ref = xs[0].astype(np.int64) + xs[1]
            assert all(np.array_equal(o, ref) for o in outs)
        finally:
            for c in clients:
                c.close()
        counters = _stats(sw)["counters"]
    assert counters["register_refused_cap"] == 35 and counters["jobs_registered"] == 6


def test_the_control_port_asks_for_the_secret_and_answers_only_its_networks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with switch_daemon("--policy", "atp", "--secret", "s3cret", "--allow", "127.0.0.1/32") as sw:
        with pytest.raises(ConfigError, match="secret is missing or wrong"):
            Ticket.register(sw.control, 2)
        monkeypatch.setenv("GRADFABRIC_SECRET", "s3cret")
        assert Ticket.register(sw.control, 2).job_id > 0
        refused = _register_from(sw, "127.0.0.2", secret="s3cret")
        assert "may not use this control port" in refused["error"]
        counters = _stats(sw)["counters"]
    assert counters["control_refused_secret"] == 1 and counters["control_refused_network"] == 1
