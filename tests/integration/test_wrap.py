"""Sequences that never run out: a job numbers its packets without bound and
the wire carries their low 32 bits (``wire.packet.unwrap``). Jobs that start
a few thousand short of 2**32 sum exactly across it, on the native node and
the reference, and a DDP job trains across it to the same weights as the
same job started at 0."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from gradfabric.lab.daemon import switch_daemon
from gradfabric.net import datapath
from gradfabric.runtime.client import InaClient, Ticket, parse_address, together
from tests.native import require

LIMIT = 2**32


@pytest.mark.parametrize("policy", ["switchml", "atp"])
@pytest.mark.parametrize("native", [True, False])
def test_sums_stay_exact_across_the_wires_sequence_limit(policy: str, native: bool) -> None:
    if native:
        require("the worker node", datapath.PATH, datapath.WHY_NOT)
    with switch_daemon("--policy", policy, "--values-per-packet", "64", "--job-slots", "8") as sw:
        ticket = Ticket.register(sw.control, 3)
        clients = [InaClient(ticket, r, timeout_s=30, native=native, first_seq=LIMIT - 50)
                   for r in range(3)]  # fmt: skip
        try:
            rng = np.random.default_rng(0)
            for n in (1000, 64 * 40 + 7, 5000):  # the second crosses the limit mid-window
                xs = [rng.integers(-(2**28), 2**28, n, dtype=np.int32) for _ in clients]
                outs = together([lambda c=c, x=x: c.allreduce_ints(x)
                                 for c, x in zip(clients, xs, strict=True)])  # fmt: skip
                ref = np.sum([x.astype(np.int64) for x in xs], axis=0)
                for out in outs:
                    np.testing.assert_array_equal(out, ref)
            assert all(c.node.next_seq > LIMIT for c in clients)
        finally:
            for c in clients:
                c.close()


def _train(rank: int, world: int, control: str, out: str, native: bool) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradfabric.runtime.hook import ina_hook
    from gradfabric.workloads.digits import digits_data, digits_mlp

    x, y, _, _ = digits_data()
    weights, seqs = [], []
    for first in (0, LIMIT - 600):  # the same job, then started short of the limit
        client = InaClient.join(control=parse_address(control), native=native, first_seq=first)
        torch.manual_seed(0)
        model = DDP(digits_mlp())
        model.register_comm_hook(client, ina_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            rows = slice(64 * (2 * step + rank), 64 * (2 * step + rank + 1))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        seqs.append(client.node.next_seq)
        client.close()
    torch.save({"weights": weights, "seqs": seqs}, os.path.join(out, f"{rank}.pt"))


@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.long)])
def test_a_ddp_job_trains_across_the_wires_sequence_limit(native: bool) -> None:
    """Two ranks, DDP with ``ina_hook`` through the switch, five steps of the
    digits MLP in 64-value datagrams (about 270 a step): started 600 short
    of 2**32 it crosses it, and its weights equal, bit for bit, those of the
    same job started at 0 (the same quantisation, the same integer sums)."""
    import torch

    from gradfabric.net.launch import spawn

    if native:
        require("the worker node", datapath.PATH, datapath.WHY_NOT)
    with switch_daemon("--policy", "switchml", "--values-per-packet", "64") as sw, \
            tempfile.TemporaryDirectory() as tmp:  # fmt: skip
        spawn(_train, 2, (sw.control_text, tmp, native), deadline_s=240)
        for r in range(2):
            got = torch.load(os.path.join(tmp, f"{r}.pt"))
            at_zero, wrapped = got["weights"]
            assert got["seqs"][0] < LIMIT < got["seqs"][1]
            assert torch.equal(at_zero, wrapped)
