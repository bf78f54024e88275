"""SA-ATP's alternatives in real training, and one run in any mode.

The ranks of the gloo alternatives SA-ATP is judged against (DDP's default
all-reduce, speed-proportional batch shares re-balanced from measured
speeds, backup workers: a parameter server stepping on the first n-1
gradients), on the same data, model and straggler as the switch's ranks in
``lab.saatp_train``; ``run_mode`` runs any mode, the switch's included.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from gradfabric.core.errors import ConfigError
from gradfabric.lab.job import (
    accuracy,
    apply,
    data,
    fingerprint,
    gradient,
    model,
    optimizer,
    shard_batch,
)
from gradfabric.lab.saatp_train import SaatpTrainConfig, run_switch
from gradfabric.lab.saatp_udp import iteration_times
from gradfabric.net.launch import run_hosts

MODES = ("atp", "saatp", "default", "proportional", "backup")


# ------------------------------------------------------------ over gloo


def _gloo_main(cfg: SaatpTrainConfig, mode: str, store: str, rank: int, conn: Connection) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        data()
        n = cfg.workers
        world = n + 1 if mode == "backup" else n  # backup workers: rank n is the server
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        conn.send("ready")
        conn.recv()
        if rank == n:
            conn.send(_backup_server(cfg))
        else:
            conn.send(_GlooRank(cfg, mode, rank).run())
        dist.destroy_process_group()
    except Exception as e:
        conn.send(f"rank {rank}: {e!r}")


class _GlooRank:
    """A rank of a baseline over gloo: the default hook's all-reduce, speed-
    proportional shares, or a backup worker of a parameter server."""

    def __init__(self, cfg: SaatpTrainConfig, mode: str, rank: int) -> None:
        self.cfg, self.mode, self.rank = cfg, mode, rank
        self.net = model(cfg)
        self.opt = optimizer(cfg, self.net)
        self.rates = [1.0] * cfg.workers
        self.shares: list[list[int]] = []
        self.stale = 0

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        losses, accs, ends = [], [], []
        for step in range(self.cfg.steps):
            rows, weight = self.rows(step)
            began = time.monotonic()
            if len(rows):
                g, loss = gradient(self.net, rows, weight)
            else:
                g, loss = torch.zeros(sum(p.numel() for p in self.net.parameters())), 0.0
            deadline = began + self.cfg.device_s(self.rank, step, len(rows))
            if self.mode == "backup":
                mean, mean_loss = self.through_server(step, g, loss, deadline)
            else:
                mean, mean_loss = self.all_reduce(g, loss, len(rows), deadline, began)
            apply(self.net, self.opt, mean)
            losses.append(mean_loss)
            accs.append(accuracy(self.net))  # (every mode evaluates after each step)
            ends.append(time.monotonic())
        net = self.net
        return {"t0": t0, "ends": ends, "loss": losses, "accs": accs, "weights": fingerprint(net),
                "accuracy": accuracy(net), "shares": self.shares, "stale": self.stale}  # fmt: skip

    def rows(self, step: int) -> tuple[np.ndarray, float]:
        """This rank's rows of the step's global batch and its loss weight."""
        from gradfabric.planner.cost import split
        from gradfabric.planner.uneven import loss_weight

        n, m = self.cfg.workers, self.cfg.micro_batch
        if self.mode != "proportional":
            return shard_batch(self.cfg, step, self.rank), 1.0
        batch = np.concatenate([shard_batch(self.cfg, step, s) for s in range(n)])
        share = split(n * m, self.rates)  # by the speeds measured on the step before
        self.shares.append(share)
        lo = sum(share[: self.rank])
        return batch[lo : lo + share[self.rank]], loss_weight(share[self.rank], n * m, n)

    def all_reduce(
        self, g: torch.Tensor, loss: float, rows: int, deadline: float, began: float
    ) -> tuple[torch.Tensor, float]:
        import torch.distributed as dist

        n = self.cfg.workers
        time.sleep(max(0.0, deadline - time.monotonic()))
        # one all-reduce a step, as DDP's: the gradient, the step's mean loss
        # and (proportional) each rank's measured samples per second
        extra = torch.zeros(1 + n, dtype=g.dtype)
        extra[0] = loss * rows / (n * self.cfg.micro_batch)
        extra[1 + self.rank] = max(rows, 1) / (time.monotonic() - began)
        flat = torch.cat([g, extra])
        dist.all_reduce(flat)
        self.rates = flat[len(g) + 1 :].tolist()
        return flat[: len(g)] / n, float(flat[len(g)])

    def through_server(
        self, step: int, g: torch.Tensor, loss: float, deadline: float
    ) -> tuple[torch.Tensor, float]:
        """Send the gradient to the server, which steps on the first n - b; a
        rank whose step came back before its compute ended drops that compute
        (its late gradient, sent anyway, is counted stale there)."""
        import torch.distributed as dist

        server = self.cfg.workers
        result = torch.zeros(len(g) + 1)
        arrived = threading.Event()

        def fetch() -> None:
            dist.recv(result, src=server, tag=_RESULT + step)
            arrived.set()

        threading.Thread(target=fetch, daemon=True).start()
        if arrived.wait(max(0.0, deadline - time.monotonic())):
            self.stale += 1
        dist.send(torch.cat([g, torch.tensor([loss])]), dst=server, tag=step)
        if not arrived.wait(self.cfg.timeout_s):
            raise TimeoutError(f"the parameter server (rank {server}) sent no step {step}")
        return result[: len(g)], float(result[len(g)])


_RESULT = 1 << 20  # tags of the server's replies (a step's gradients carry the step)


def _backup_server(cfg: SaatpTrainConfig) -> dict[str, Any]:
    """Backup workers' parameter server (Chen et al. 2016): each step averages
    the first ``workers - backups`` gradients to arrive and sends the mean (and
    the mean loss of those micro-batches) to every rank; later ones are
    dropped, counted."""
    import torch.distributed as dist

    n = cfg.workers
    size = sum(p.numel() for p in model(cfg).parameters()) + 1
    arrivals: queue.Queue[tuple[int, int, torch.Tensor]] = queue.Queue()

    def reader(w: int) -> None:  # every rank sends once per step, late or not
        for step in range(cfg.steps):
            buf = torch.zeros(size)
            dist.recv(buf, src=w, tag=step)
            arrivals.put((step, w, buf))

    threads = [threading.Thread(target=reader, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    dropped, used = 0, []
    for step in range(cfg.steps):
        got: dict[int, torch.Tensor] = {}
        while len(got) < n - cfg.backups:
            s, w, buf = arrivals.get(timeout=cfg.timeout_s)
            if s == step:
                got[w] = buf
            else:
                dropped += 1
        mean = torch.stack([got[w] for w in sorted(got)]).mean(0)
        used.append(sorted(got))
        for w in dist.get_process_group_ranks(dist.group.WORLD)[:n]:
            dist.send(mean, dst=w, tag=_RESULT + step)
    for t in threads:
        t.join(cfg.timeout_s)
    return {"dropped": dropped + arrivals.qsize(), "used": used}


# ------------------------------------------------------------------ runs


def run_mode(cfg: SaatpTrainConfig, mode: str) -> dict[str, Any]:
    """One training run in ``mode``: its step times, loss curve, weights'
    fingerprint (one per rank: they must agree) and test accuracy."""
    if mode not in MODES:
        raise ConfigError("mode", f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    extra: dict[str, Any] = {}
    if mode in ("atp", "saatp"):
        through = run_switch(cfg, help=mode == "saatp")
        recs, loss = through.pop("recs"), through.pop("loss")
        extra = through
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the ranks meet in a file store
            store = f"file://{tmp}/store"
            world = cfg.workers + (mode == "backup")
            total_s = cfg.timeout_s + cfg.steps * cfg.device_s(
                0, 0, cfg.workers * cfg.micro_batch
            ) * cfg.slowdown  # fmt: skip
            recs = run_hosts(
                _gloo_main, [(cfg, mode, store, r) for r in range(world)], cfg.timeout_s, total_s
            )  # fmt: skip
        if mode == "backup":
            server, recs = recs[-1], recs[:-1]
            extra = {"dropped": server["dropped"], "used": server["used"],
                     "stale": sum(r["stale"] for r in recs)}  # fmt: skip
        else:
            extra = {"shares": recs[0]["shares"][-1] if recs[0]["shares"] else None}
        loss = recs[0]["loss"]
    its = iteration_times(recs)
    return {
        "mode": mode,
        "step_ms": [x * 1e3 for x in its],
        "loss": loss,
        "weights": recs[0]["weights"],
        "replicas_agree": len({r["weights"] for r in recs}) == 1,
        "accuracy": recs[0]["accuracy"],
        "accs": recs[0]["accs"],  # test accuracy after each step
    } | extra
