"""DLCP carrying a real DDP training job over congested, shaped links.

The network: ``workers`` ranks, each in its own namespace behind a
``link_mbps`` link (both directions), and the switch namespace that bridges
them (``net.netns.tor_star``). Every link's egress is a strict-priority port
(``classes=True``: three classes, a FIFO of ``queue_kb`` each, tail drop).
Each host link also carries ``load`` x ``link_mbps`` of background UDP
each way (``net.background``: another tenant's bulk traffic, which does
not back off) in the middle class, where everything unmarked rides.

The job: the catalog's digits MLP under DDP (``lab.job``: the same model,
data shards and seeded micro-batches as the other real-training studies),
SGD with momentum, and one of four ways to sum its gradients:

* ``gloo``: DDP's default hook (gloo's ring over TCP), unmarked: it shares
  the middle class with the background, as on a network without QoS;
* ``gloo-prio``: the same, with the job's TCP marked into the top class (a
  practitioner's QoS rule for training traffic: the strongest reliable
  baseline here);
* ``reliable``: ``dlcp_hook`` with loss bounds 0 (DLCP's reliable mode);
* ``dlcp``: ``dlcp_hook`` within the bounds (push ``push_bound``, pull
  ``pull_bound``) to the job's server in the switch daemon, which sits where
  the top-of-rack switch does.

For both DLCP schemes the ports read DLCP's traffic class from each
datagram (``dlcp_rules``: the priority byte, as a switch reads DSCP): its
datagrams ride in the top class, and where the push bound covers the
smallest quarter of a tensor's packets (drop precedence 3, ``push_bound``
>= 1/4) that quarter rides in the bottom class, below the background, first
to wait and to be lost. Datagrams beyond the bound are never waited for
(a tensor completes at ``1 - p``), so loss above the bound is never put on
the network's side of the ledger. Workers and server pace by small send
buffers (``pace_kb``: the kernel takes a datagram when the port has room).

``fabric="leaf-spine"`` is the network where DLCP's load balancing
matters (``net.fabric``): two racks, each with half the ranks and
``bg_hosts`` background hosts, every leaf linked to ``spines`` spines at
``link_mbps``. Leaves hash TCP flows over the spines (ECMP), and spray
DLCP's datagrams over them one by one; the server sits in the second rack's
leaf (its switch). The background is bursty: on/off flows between the two
racks' background hosts at ``link_mbps`` when on (``burst_ms`` on average,
each a new flow to the hash), off long enough that the spines carry
``load`` of their capacity on average.

Recorded per run: each step's time (the slowest rank's), the global mean
loss, test accuracy every ``eval_every`` steps, the per-class packets sent
and dropped over all ports, the background's datagrams, and for DLCP the
values lost at the server (push) and at the workers (pull).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.core.errors import ConfigError
from gradfabric.lab.job import (
    accuracy,
    apply,
    check_shards,
    data,
    gradient,
    model,
    optimizer,
    shard_batch,
)
from gradfabric.net.netns import MTU
from gradfabric.net.udp import values_fitting
from gradfabric.proto.dlcp import MAG_CLASSES
from gradfabric.runtime.client import SWITCH_ENV
from gradfabric.wire.envelope import TOKEN_BYTES

if TYPE_CHECKING:
    from gradfabric.net.fabric import Fabric
    from gradfabric.net.netns import NsHost

SCHEMES = ("gloo", "gloo-prio", "reliable", "dlcp")
# the most float32 values one DLCP datagram carries whole on the namespaces' links
MAX_VALUES_PER_DATAGRAM = values_fitting(MTU)
FABRICS = ("star", "leaf-spine")
TOP, BOTTOM = "1:10", "1:12"  # netns.CLASSES' first and last
# the priority byte, in bits from the UDP header: its 8 bytes, the job token, then
# the packet header's magic (2 bytes) and version (1)
PRIORITY_BITS = (8 + TOKEN_BYTES + 3) * 8


@dataclass(frozen=True)
class DlcpTrainConfig:
    scheme: str = "dlcp"
    workers: int = 4
    steps: int = 40
    micro_batch: int = 32
    lr: float = 0.3
    seed: int = 0
    shards: str = "interleaved"  # how the data is cut among the ranks (``lab.job.SHARDS``)
    link_mbps: float = 50.0
    load: float = 0.8  # background on every host link, each way, as a share of it
    queue_kb: int = 256  # each class's FIFO at every port
    push_bound: float = 0.1  # DLCP's loss bounds (the paper's); reliable: 0
    pull_bound: float = 0.02
    rto_ms: float = 5.0
    pace_kb: int = 64  # DLCP's send buffers, worker and server: paced by the link (0: bursts)
    bucket_kb: int = 0  # DDP's gradient buckets (0: DDP's default, 25 MB)
    values_per_packet: int = 256  # DLCP's datagrams (256: 1 KB; 2,048: 8 KB, a jumbo frame's)
    eval_every: int = 2
    timeout_s: float = 60.0
    fabric: str = "star"  # or "leaf-spine" (module docstring)
    spines: int = 2  # leaf-spine: spines, background hosts per rack, mean on period
    bg_hosts: int = 2
    burst_ms: float = 50.0

    def __post_init__(self) -> None:
        check_shards(self.shards)
        if self.scheme not in SCHEMES:
            raise ConfigError("scheme", f"one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.workers < 2 or self.steps < 1 or self.eval_every < 1:
            raise ConfigError("workers", "need >= 2 workers, >= 1 step, eval_every >= 1")
        if not 0 <= self.load < 1 or self.link_mbps <= 0:
            raise ConfigError("load", "load in [0, 1) of a link rate > 0")
        if self.fabric not in FABRICS:
            raise ConfigError("fabric", f"one of {', '.join(FABRICS)}, got {self.fabric!r}")
        if self.pace_kb < 0:
            raise ConfigError("pace_kb", f"a send buffer in KB, >= 0 (0: the default), got "
                              f"{self.pace_kb}")  # fmt: skip
        if not (1 <= self.spines <= 8 and self.bg_hosts >= 1 and self.burst_ms > 0):
            raise ConfigError("spines", "need 1..8 spines, >= 1 background host, burst_ms > 0")
        if not 1 <= self.values_per_packet <= MAX_VALUES_PER_DATAGRAM:
            raise ConfigError("values_per_packet", f"1..{MAX_VALUES_PER_DATAGRAM} (one "
                              f"datagram within the links' MTU), got {self.values_per_packet}")
        if self.fabric == "leaf-spine" and not 0 <= self.duty <= 1:
            raise ConfigError("load", f"{self.bg_hosts} background hosts a rack at the link "
                              f"rate cannot load {self.spines} spines to {self.load}")  # fmt: skip

    @property
    def duty(self) -> float:
        """The share of time each background host of the leaf-spine is on
        (at ``link_mbps``): the spines then carry ``load`` on average."""
        return self.load * self.spines / self.bg_hosts

    @property
    def dlcp(self) -> bool:
        return self.scheme in ("reliable", "dlcp")


MODULE = "gradfabric.lab.dlcp_train"


def dlcp_rules(port: int, push_bound: float) -> list[str]:
    """nftables rules that place the daemon's DLCP datagrams (to or from
    ``port``) by their traffic class: the top class, and for a push whose
    bound covers the smallest quarter of a tensor's packets (``push_bound``
    >= 1/4), that quarter (drop precedence 3, the priority byte's low nibble)
    in the bottom class. Only what the bound lets go may wait behind the
    background: a tensor completes without it, and never waits for it."""
    rules = [f"udp {way} {port} meta priority set {TOP}" for way in ("dport", "sport")]
    if push_bound >= 1 / MAG_CLASSES:
        rules.append(
            f"udp dport {port} @th,{PRIORITY_BITS + 4},4 {MAG_CLASSES - 1} "
            f"meta priority set {BOTTOM}"
        )
    return rules


GLOO_PRIO_RULES = [f"meta l4proto tcp meta priority set {TOP}"]


def run_dlcp_training(cfg: DlcpTrainConfig) -> dict[str, Any]:
    """One run of ``cfg.scheme`` (root: namespaces, nftables)."""
    from gradfabric.lab.daemon import cpu_s, switch_daemon
    from gradfabric.net.fabric import spine_bytes, spray
    from gradfabric.net.launch import run_on_hosts
    from gradfabric.net.netns import class_totals, prioritise

    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        out = os.path.join(tmp, "train.json")
        hosts, server, nodes, fab = _network(cfg, stack)
        env: dict[str, str] = {}
        sw = None
        if cfg.dlcp:
            bounds = (0.0, 0.0) if cfg.scheme == "reliable" else (cfg.push_bound, cfg.pull_bound)
            sw = stack.enter_context(switch_daemon(
                "--policy", "dlcp", "--values-per-packet", str(cfg.values_per_packet),
                "--job-slots", "32",
                "--rto-ms", str(cfg.rto_ms),
                "--push-bound", str(bounds[0]), "--pull-bound", str(bounds[1]),
                "--sndbuf-kb", str(cfg.pace_kb), host=server,
            ))  # fmt: skip
            env[SWITCH_ENV] = sw.control_text
            rules = dlcp_rules(sw.data[1], bounds[0])
            if fab is not None:
                spray(fab, sw.data[1])
        else:
            rules = GLOO_PRIO_RULES if cfg.scheme == "gloo-prio" else []
        if rules:
            for h in nodes:
                prioritise(h, rules)
        sent = stack.enter_context(_load(cfg, hosts, server, fab))
        time.sleep(0.2)  # the background's queues fill before the job starts
        paths = spine_bytes(fab) if fab is not None else []
        t0 = time.perf_counter()
        daemon_cpu = cpu_s(sw.proc.pid) if sw else 0.0
        run_on_hosts(hosts, MODULE, [json.dumps(asdict(cfg)), out],
                     timeout_s=cfg.timeout_s * 4, extra_env=env)  # fmt: skip
        daemon_cpu = cpu_s(sw.proc.pid) - daemon_cpu if sw else 0.0
        classes = class_totals(nodes)
        if fab is not None:  # bytes each leaf sent up each spine while the job ran
            paths = [[b - a for a, b in zip(x, y, strict=True)]
                     for x, y in zip(paths, spine_bytes(fab), strict=True)]  # fmt: skip
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
    rec["paths"] = paths
    rec["config"] = asdict(cfg)
    rec["classes"] = classes
    rec["background"] = dict(sent)
    rec["wall_s"] = time.perf_counter() - t0
    if sw is not None:
        counters = sw.final.get("counters", {})
        values = cfg.steps * rec["params"] * cfg.workers
        rec["lost_push"] = counters.get("values_lost", 0) / values
        rec["incomplete"] = counters.get("values_incomplete", 0) / (cfg.steps * rec["params"])
        rec["late_push"] = [counters.get(f"late_values_p{d}", 0) / values for d in range(4)]
        rec["switch"] = counters
        rec["daemon_cpu_s"] = daemon_cpu  # while the ranks ran, torchrun's start included
    return rec


def _network(
    cfg: DlcpTrainConfig, stack: ExitStack
) -> tuple[list[NsHost], NsHost, list[NsHost], Fabric | None]:
    """The ranks' hosts (in rank order), where the server runs, every
    namespace (their ports are counted), and the leaf-spine if it is one."""
    from gradfabric.net.fabric import leaf_spine
    from gradfabric.net.netns import tor_star

    if cfg.fabric == "star":
        hosts, tor = stack.enter_context(
            tor_star(cfg.workers, cfg.link_mbps / 1000, classes=True, queue_kb=cfg.queue_kb)
        )
        return hosts, tor, [*hosts, tor], None
    half = cfg.workers // 2
    fab = stack.enter_context(leaf_spine(
        [half + cfg.bg_hosts, cfg.workers - half + cfg.bg_hosts], cfg.spines, cfg.link_mbps,
        cfg.link_mbps, cfg.queue_kb,
    ))  # fmt: skip
    ranks = fab.racks[0][:half] + fab.racks[1][: cfg.workers - half]
    return ranks, fab.leaves[1], fab.nodes, fab


def _load(
    cfg: DlcpTrainConfig, hosts: list[NsHost], server: NsHost, fab: Fabric | None
) -> AbstractContextManager[dict[str, float]]:
    """The background: constant on the star's links, on/off flows between
    the racks' background hosts on the leaf-spine."""
    from gradfabric.net.background import background, bursts

    if fab is None or cfg.load == 0:  # (no load: nothing started)
        return background(hosts, server, cfg.load * cfg.link_mbps, cfg.seed)
    bg = [rack[len(rack) - cfg.bg_hosts :] for rack in fab.racks]
    plan = [(h, [p.ip for p in bg[1 - r]]) for r in range(2) for h in bg[r]]
    off_ms = cfg.burst_ms * (1 - cfg.duty) / cfg.duty
    return bursts(plan, cfg.link_mbps, cfg.burst_ms, off_ms, cfg.seed)


def replay(cfg: DlcpTrainConfig) -> list[float]:
    """The reliable scheme's loss curve replayed in one process: every
    rank's gradient in turn, summed in float64 as DLCP's server does, cast
    to float32 and averaged as ``dlcp_hook`` does (on one thread, as each
    rank computes). Reliable mode must equal it: nothing lost, nothing
    reordered that could change a bit (four float32 values sum exactly in
    float64, in any order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = model(cfg)
        opt = optimizer(cfg, net)
        losses = []
        for step in range(cfg.steps):
            grads, step_losses = zip(
                *(gradient(net, shard_batch(cfg, step, r)) for r in range(cfg.workers)),
                strict=True,
            )
            total = np.sum([g.numpy().astype(np.float64) for g in grads], axis=0)
            apply(net, opt, torch.from_numpy(total.astype(np.float32) / np.float32(cfg.workers)))
            losses.append(sum(step_losses) / cfg.workers)
        return losses
    finally:
        torch.set_num_threads(threads)


def _rank_main(cfg: DlcpTrainConfig, out: str) -> None:
    from gradfabric.lab.switch_train import timed_step
    from gradfabric.runtime.dlcp import DlcpClient
    from gradfabric.runtime.hook import dlcp_hook

    rank = dist.get_rank()
    torch.set_num_threads(1)  # as ``replay`` computes: a reduction's order follows the threads
    xtr, ytr, _, _ = data()
    net = DDP(model(cfg), bucket_cap_mb=cfg.bucket_kb / 1024 if cfg.bucket_kb else None)
    client = None
    if cfg.dlcp:
        client = DlcpClient.join(timeout_s=cfg.timeout_s, pace_kb=cfg.pace_kb)
        net.register_comm_hook(client, dlcp_hook)
    opt = optimizer(cfg, net)
    times, losses, evals = [], [], []
    start = resource.getrusage(resource.RUSAGE_SELF)
    for step in range(cfg.steps):
        rows = torch.from_numpy(shard_batch(cfg, step, rank))
        took, mean_loss = timed_step(net, opt, xtr[rows], ytr[rows])
        times.append(took)
        losses.append(mean_loss)
        if rank == 0 and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            evals.append((step + 1, accuracy(net.module)))
    use = resource.getrusage(resource.RUSAGE_SELF)  # this rank, its DLCP client thread included
    lost_pull = torch.tensor([client.lost() if client else 0], dtype=torch.float64)
    dist.all_reduce(lost_pull, op=dist.ReduceOp.MAX)
    spent = use.ru_utime + use.ru_stime - start.ru_utime - start.ru_stime  # the steps (and evals)
    # and of it the kernel's: the sockets, and the namespaces' forwarding, which
    # a veth runs in the context of the process that sends
    cpu = torch.tensor([spent, use.ru_stime - start.ru_stime], dtype=torch.float64)
    dist.all_reduce(cpu)
    if client is not None:
        client.close()
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        with open(out, "w") as f:
            json.dump({"times_s": times, "loss": losses, "evals": evals, "params": params,
                       "lost_pull": float(lost_pull) / (cfg.steps * params),
                       "ranks_cpu_s": float(cpu[0]), "ranks_sys_s": float(cpu[1])},
                      f)  # fmt: skip


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, DlcpTrainConfig(**json.loads(sys.argv[1])), sys.argv[2])
