"""Real DDP training through the software switch, against DDP's default hook.

``run_emu_training`` starts a switch daemon (``gradfabric switch serve``,
its own process, with the chosen policy and impairments) and ``ranks`` gloo
processes with torchrun. Each rank trains two replicas of the digits MLP
side by side from the same weights on the same batches: one with DDP's
default all-reduce, one with ``ina_hook`` (every gradient bucket summed
through the switch; with policy ``dlcp``: ``dlcp_hook``, the bucket pushed
to the job's DLCP server behind the switch's port within the loss bounds).
Reported: both loss curves (the global mean per step), per-step times, both
test accuracies, the largest weight difference between the replicas, whether
the switch-trained replicas are identical across ranks, and the switch's
final counters.

Ranks that rejoin: with ``checkpoint_every`` rank 0 saves both replicas,
their optimisers, the batch generator and the curves so far; with
``max_restarts`` torchrun restarts the whole group when a rank dies, and the
new group revokes the old job at the switch (its ticket is kept next to the
checkpoint), registers a new one and resumes from the checkpoint.
``kill_rank``/``kill_step`` inject that fault: the rank SIGKILLs itself as
it reaches the step, in the first attempt only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.core.errors import ConfigError
from gradfabric.core.records import compare_sides
from gradfabric.runtime.client import CLIENTS, SWITCH_ENV
from gradfabric.runtime.dlcp import DlcpClient
from gradfabric.runtime.hook import dlcp_hook, ina_hook
from gradfabric.workloads.digits import digits_data, digits_mlp


@dataclass(frozen=True)
class EmuTrainConfig:
    policy: str = "atp"
    ranks: int = 4
    steps: int = 40
    batch: int = 32  # per rank
    lr: float = 0.05
    seed: int = 0
    loss: float = 0.0  # switch impairment: drop probability per datagram, each way
    timeout_s: float = 60.0
    port_mbps: float = 0.0  # dlcp: the port into the server (0: unshaped)
    link_gbps: float | None = None  # namespaces on tbf-shaped links (root), else loopback
    kernel_loss: float = 0.0  # with link_gbps: nftables drops this share of UDP at the switch
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    max_restarts: int = 0  # torchrun's restarts of the group after a rank fails
    kill_rank: int = -1  # fault: this rank SIGKILLs itself at kill_step, first attempt only
    kill_step: int = -1
    exponents: str = "agreed"  # ina_hook's: agreed in a round each bucket, or carried

    def __post_init__(self) -> None:
        CLIENTS.get(self.policy)
        if self.exponents != "agreed" and self.policy not in ("switchml", "atp", "esa"):
            raise ConfigError("exponents", "carried exponents are ina_hook's (switchml, atp, esa)")
        if self.ranks < 2 or self.steps < 1 or self.batch < 1:
            raise ConfigError("ranks", "need >= 2 ranks, >= 1 step, batch >= 1")
        if self.checkpoint_every < 0 or self.max_restarts < 0:
            raise ConfigError("checkpoint_every", "checkpoint_every and max_restarts are >= 0")
        if self.max_restarts and self.link_gbps is not None:
            raise ConfigError("max_restarts", "restarts run on loopback (one torchrun)")


MODULE = "gradfabric.lab.switch_train"


def run_emu_training(cfg: EmuTrainConfig) -> dict[str, Any]:
    """On loopback, or with ``link_gbps`` each rank in its own network
    namespace behind a tbf-shaped link and the switch in the namespace that
    bridges them, where the top-of-rack switch sits (root only)."""
    from contextlib import ExitStack

    from gradfabric.lab.daemon import switch_daemon
    from gradfabric.net.launch import run_on_hosts, run_ranks

    options = [
        *("--policy", cfg.policy, "--loss", str(cfg.loss), "--seed", str(cfg.seed)),
        *("--port-mbps", str(cfg.port_mbps), *CLIENTS.get(cfg.policy).DAEMON_OPTIONS),
    ]
    args = [json.dumps(asdict(cfg))]
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        out = os.path.join(tmp, "train.json")
        if cfg.link_gbps is None:
            sw = stack.enter_context(switch_daemon(*options))
            env = {SWITCH_ENV: sw.control_text}
            run_ranks(
                cfg.ranks, MODULE, [*args, out], timeout_s=cfg.timeout_s * 4, extra_env=env,
                max_restarts=cfg.max_restarts,
            )  # fmt: skip
        else:
            from gradfabric.net.netns import drop_udp, tor_star, udp_dropped

            hosts, at = stack.enter_context(tor_star(cfg.ranks, cfg.link_gbps))
            if cfg.kernel_loss:
                drop_udp(at, cfg.kernel_loss)
            sw = stack.enter_context(switch_daemon(*options, host=at))
            env = {SWITCH_ENV: sw.control_text}
            run_on_hosts(hosts, MODULE, [*args, out], timeout_s=cfg.timeout_s * 4, extra_env=env)
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
        if cfg.link_gbps is not None and cfg.kernel_loss:
            rec["kernel_dropped"] = udp_dropped(at)
    rec["config"] = asdict(cfg)
    rec["switch"] = sw.final
    compare_sides(rec, "default", "switch")
    return rec


def timed_step(
    net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """One synchronous DDP step after a barrier: the slowest rank's time for
    it and the loss averaged over the ranks."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    rec = torch.tensor([time.perf_counter() - t0, loss.item()], dtype=torch.float64)
    worst = rec[:1].clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's step
    dist.all_reduce(rec[1:])
    return float(worst), float(rec[1]) / dist.get_world_size()


def _rank_main(cfg: EmuTrainConfig, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    xtr, ytr, xte, yte = digits_data()
    here = os.path.dirname(out)
    ckpt = os.path.join(here, "checkpoint.pt")
    kw: dict[str, Any] = {} if cfg.exponents == "agreed" else {"exponents": cfg.exponents}
    client = CLIENTS.get(cfg.policy).join(
        timeout_s=cfg.timeout_s, ticket_file=os.path.join(here, "ticket.json"), **kw
    )
    replicas = {}
    for name in ("default", "switch"):
        torch.manual_seed(cfg.seed)
        model = DDP(digits_mlp())
        if name == "switch":
            if isinstance(client, DlcpClient):
                model.register_comm_hook(client, dlcp_hook)
            else:
                model.register_comm_hook(client, ina_hook)
        replicas[name] = (model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9))
    loss_log: dict[str, list[float]] = {k: [] for k in replicas}
    times: dict[str, list[float]] = {k: [] for k in replicas}
    gen = torch.Generator().manual_seed(cfg.seed)
    start = 0
    if cfg.checkpoint_every and os.path.exists(ckpt):
        state = torch.load(ckpt)
        for name, (model, opt) in replicas.items():
            model.module.load_state_dict(state["models"][name])
            opt.load_state_dict(state["optimisers"][name])
        gen.set_state(state["generator"])
        loss_log, times, start = state["loss"], state["times"], state["step"]
    for step in range(start, cfg.steps):
        if attempt == 0 and rank == cfg.kill_rank and step == cfg.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.randint(len(xtr), (cfg.batch * world,), generator=gen)
        mine = idx[rank * cfg.batch : (rank + 1) * cfg.batch]
        for name in replicas if step % 2 == 0 else reversed(replicas):
            model, opt = replicas[name]
            took, mean_loss = timed_step(model, opt, xtr[mine], ytr[mine])
            times[name].append(took)
            loss_log[name].append(mean_loss)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            if rank == 0:
                torch.save(
                    {"step": step + 1, "generator": gen.get_state(), "loss": loss_log,
                     "times": times,
                     "models": {k: m.module.state_dict() for k, (m, _) in replicas.items()},
                     "optimisers": {k: o.state_dict() for k, (_, o) in replicas.items()}},
                    ckpt + ".tmp",
                )  # fmt: skip
                os.replace(ckpt + ".tmp", ckpt)
            dist.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet
    a, b = (replicas[k][0].module for k in ("default", "switch"))
    gap = max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    spread = torch.zeros(1)
    for p in b.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        spread = torch.maximum(spread, (p.detach() - ref).abs().max().reshape(1))
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    clipped = torch.tensor([client.clipped])  # values clipped to a carried range, every rank
    dist.all_reduce(clipped)
    client.close()
    if rank == 0:
        with torch.no_grad():
            acc = {
                k: float((m.module(xte).argmax(1) == yte).float().mean())
                for k, (m, _) in replicas.items()
            }
        with open(out, "w") as f:
            json.dump(
                {"loss": loss_log, "times_s": times, "weights_max_diff": gap,
                 "replica_spread": float(spread), "accuracy": acc,
                 "attempts": attempt + 1, "resumed_from": start, "clipped": int(clipped)},
                f,
            )  # fmt: skip


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, EmuTrainConfig(**json.loads(sys.argv[1])), sys.argv[2])
