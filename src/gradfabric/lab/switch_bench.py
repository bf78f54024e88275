"""``gradfabric bench switch``: the software switch against gloo all-reduce.

For each worker count a switch daemon process starts and ``workers`` gloo
ranks (torchrun) each sum the same float32 tensor ``iters`` times through
the switch (``InaClient.allreduce``: the block-exponent round over gloo,
quantisation, the packets through the switch, decoding; what ``ina_hook``
pays, the sum decoded into one array kept for the run as the hook decodes
into its bucket) and ``iters`` times with ``torch.distributed.all_reduce``,
alternating, after ``warmup`` untimed sums of each (two: the first is a
one-off, connections and buffers touched for the first time; the second
was slow too, a quarter over the run's median, while every sum's result was
a new array, whose pages the kernel zeroed on first touch, and is within a
few percent of it now: docs/notebook/2026-11-27.md#switch-slow-second-sum).
Every switch result is checked against gloo's (equal up to the quantisation
bound) so a fast wrong answer cannot pass.

Where: on loopback, or (``link_gbps``, root) on the star that in-network
aggregation assumes (``net.netns.tor_star``): each worker in its own
namespace behind one tbf-shaped link (both directions), the switch daemon
in the namespace that bridges them, where the top-of-rack switch sits. gloo's
ring runs over the very same links. There each way has a physical floor, its
bytes over the link rate: aggregation moves the tensor once up and once down
every worker's link (``S / R`` per direction, both at once), the ring
``2 (n - 1) / n * S`` each way; a row reports each time against its floor.

Reported per row: medians of the slowest rank's time for each way, the
tensor's goodput (bits per second of wall time), each way's bytes floor and
its time over that floor, the switch process's CPU seconds per sum (and the
tensor bits per second of that CPU time: what one switch core sustains),
and the workers' CPU seconds per sum for each way (the slowest rank's
process time: its own and its client thread's); with ``--json`` also the
switch's counters and the workers' (``worker_counters``: how many results
came, how many datagrams were sent again on a timeout or a fast retransmit).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradfabric.core.errors import ConfigError
from gradfabric.net.datapath import COUNTERS
from gradfabric.net.netns import MTU, check_mtu
from gradfabric.net.udp import default_values, values_fitting
from gradfabric.runtime.client import SWITCH_ENV, InaClient
from gradfabric.runtime.switchd import default_window

# Values per datagram by default: 64 KB datagrams on loopback (it carries them
# whole); on shaped links what the daemon chooses from the links' MTU (the
# most one datagram carries unfragmented, at most 2048: 358 at 1500 bytes,
# 2048 in jumbo frames of 9000; gloo's TCP gets the same MTU).
LOOPBACK_VALUES = 16_000
MODULE = "gradfabric.lab.switch_bench"  # what torchrun runs on each rank
DATAPATHS = {"auto": None, "native": True, "python": False}  # InaClient's ``native``


@dataclass(frozen=True)
class SwitchBenchConfig:
    workers: int = 2
    tensor_mb: float = 4.0
    iters: int = 5
    warmup: int = 2  # untimed sums of each way before the ``iters`` timed ones
    policy: str = "switchml"
    job_slots: int = 0  # the workers' window (and SwitchML's slots per job); 0: the daemon's
    values_per_packet: int = 0  # 0: LOOPBACK_VALUES on loopback, the daemon's on links
    seed: int = 0
    rto_ms: float = 20.0  # the workers' retransmission timeout (the daemon's --rto-ms)
    link_gbps: float | None = None  # the ToR star of shaped links (root), else loopback
    mtu: int = MTU  # with link_gbps: every link's MTU (up to netns.MAX_MTU)
    kernel_loss: float = 0.0  # with link_gbps: nftables drops this share of UDP at the switch
    # the workers' and the switch's: native (C where it serves), python (the reference)
    datapath: str = "auto"
    multicast: bool = True  # the daemon's default: results once, to the job's group

    def __post_init__(self) -> None:
        if self.workers < 2 or self.iters < 1 or self.tensor_mb <= 0:
            raise ConfigError("workers", "need >= 2 workers, >= 1 iteration, tensor_mb > 0")
        if self.warmup < 0:
            raise ConfigError("warmup", f"must be >= 0, got {self.warmup}")
        if self.rto_ms <= 0:
            raise ConfigError("rto_ms", f"must be > 0, got {self.rto_ms}")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise ConfigError("link_gbps", f"must be > 0, got {self.link_gbps}")
        if self.kernel_loss and self.link_gbps is None:
            raise ConfigError("kernel_loss", "kernel loss needs shaped links (link_gbps)")
        check_mtu(self.mtu)
        if self.datapath not in DATAPATHS:
            raise ConfigError("datapath", f"one of {', '.join(DATAPATHS)}; got {self.datapath!r}")
        if not self.values_per_packet:  # resolved here, so the stored config says it
            auto = LOOPBACK_VALUES if self.link_gbps is None else default_values(self.mtu)
            object.__setattr__(self, "values_per_packet", auto)
        if not self.job_slots:  # as the daemon chooses it
            object.__setattr__(self, "job_slots", default_window(self.values_per_packet))
        if self.link_gbps is not None and self.values_per_packet > values_fitting(self.mtu):
            raise ConfigError(
                "values_per_packet", f"at most {values_fitting(self.mtu)} on shaped links "
                f"(MTU {self.mtu}), got {self.values_per_packet}",
            )  # fmt: skip


def run_switch_bench(cfg: SwitchBenchConfig) -> dict[str, Any]:
    from contextlib import ExitStack

    from gradfabric.lab.daemon import switch_daemon
    from gradfabric.net.launch import run_on_hosts, run_ranks

    options = ("--policy", cfg.policy, "--job-slots", str(cfg.job_slots), "--rto-ms",
               str(cfg.rto_ms), "--values-per-packet", str(cfg.values_per_packet),
               "--datapath", "python" if cfg.datapath == "python" else "auto",
               "--multicast" if cfg.multicast else "--no-multicast")  # fmt: skip
    args = [json.dumps(asdict(cfg))]
    dropped = None
    with ExitStack() as stack:
        out = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "bench.json")
        if cfg.link_gbps is None:
            sw = stack.enter_context(switch_daemon(*options))
            env = {SWITCH_ENV: sw.control_text}
            run_ranks(cfg.workers, MODULE, [*args, out], timeout_s=600, extra_env=env)
        else:
            from gradfabric.net.netns import drop_udp, tor_star, udp_dropped

            hosts, tor = stack.enter_context(tor_star(cfg.workers, cfg.link_gbps, cfg.mtu))
            if cfg.kernel_loss:
                drop_udp(tor, cfg.kernel_loss)
            sw = stack.enter_context(switch_daemon(*options, host=tor))
            env = {SWITCH_ENV: sw.control_text}
            run_on_hosts(hosts, MODULE, [*args, out], timeout_s=600, extra_env=env)
            if cfg.kernel_loss:
                dropped = udp_dropped(tor)
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
    return _row(cfg, rec, sw.final.get("counters", {}), dropped)


def _row(
    cfg: SwitchBenchConfig, rec: dict[str, Any], counters: dict[str, Any], dropped: int | None
) -> dict[str, Any]:
    switch_s = statistics.median(rec["switch_s"])
    gloo_s = statistics.median(rec["gloo_s"])
    bits = cfg.tensor_mb * 8e6
    row: dict[str, Any] = {
        "workers": cfg.workers,
        "tensor_mb": cfg.tensor_mb,
        "policy": cfg.policy,
        # what the run got, not what it asked: every rank's probe came (none refused)
        "multicast": cfg.multicast and counters.get("multicast_probes", 0) > 0
        and not counters.get("multicast_refused", 0),
        "link_gbps": cfg.link_gbps,
        "mtu": cfg.mtu if cfg.link_gbps is not None else None,
        "kernel_loss": cfg.kernel_loss,
        "switch_ms": switch_s * 1e3,
        "gloo_ms": gloo_s * 1e3,
        "switch_ms_all": [t * 1e3 for t in rec["switch_s"]],
        "speedup": gloo_s / switch_s,
        "goodput_gbps": bits / switch_s / 1e9,
        "gloo_goodput_gbps": bits / gloo_s / 1e9,
        "switch_cpu_s": rec["switch_cpu_s"] / cfg.iters,
        "switch_cpu_gbps": cfg.iters * bits / rec["switch_cpu_s"] / 1e9,
        "worker_cpu_s": rec["worker_cpu_s"]["switch"],
        "gloo_worker_cpu_s": rec["worker_cpu_s"]["gloo"],
        "max_error": rec["max_error"],
        "datapath": rec["datapath"],
        "switch_counters": counters,
        "worker_counters": rec["worker_counters"],
    }
    if cfg.link_gbps is not None:
        rate = cfg.link_gbps * 1e9
        row["floor_ms"] = bits / rate * 1e3  # the tensor up (and down) each worker's link
        row["ring_floor_ms"] = 2 * (cfg.workers - 1) / cfg.workers * bits / rate * 1e3
        row["floor_ratio"] = row["switch_ms"] / row["floor_ms"]
        row["ring_floor_ratio"] = row["gloo_ms"] / row["ring_floor_ms"]
    if dropped is not None:
        row["kernel_dropped"] = dropped
    return row


def _rank_main(cfg: SwitchBenchConfig, out: str) -> None:
    rank = dist.get_rank()
    n = int(cfg.tensor_mb * 1e6 / 4)
    x = np.random.default_rng(cfg.seed + rank).standard_normal(n).astype(np.float32)
    # on shaped links the workers know their link's rate and pace to it
    client = InaClient.join(timeout_s=120, native=DATAPATHS[cfg.datapath],
                            pace_gbps=cfg.link_gbps or 0.0)  # fmt: skip
    times: dict[str, list[float]] = {"switch": [], "gloo": []}
    cpu_s: dict[str, list[float]] = {"switch": [], "gloo": []}
    got = np.empty_like(x)  # the sums' array, as a hook decodes into its bucket
    max_error = 0.0
    cpu = [0.0, 0.0]  # the switch process's CPU time after the warm-up and at the end
    for it in range(cfg.warmup + cfg.iters):  # the first ``warmup`` of each untimed
        if it == cfg.warmup and rank == 0:
            cpu[0], switch_path = _switch_cpu(client)
        for kind in ("switch", "gloo") if it % 2 == 0 else ("gloo", "switch"):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if kind == "switch":
                client.allreduce(x, out=got)
            else:
                ref = torch.from_numpy(x.copy())
                dist.all_reduce(ref)
            took = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
            if it >= cfg.warmup:
                times[kind].append(float(took[0]))
                cpu_s[kind].append(float(took[1]))
        diff = np.abs(got - ref.numpy())  # a NaN where gloo's sum is finite is an error too
        max_error = max(max_error, float("inf") if np.isnan(diff).any() else float(diff.max()))
    counters = _worker_counters(client)
    if rank == 0:
        cpu[1], switch_path = _switch_cpu(client)
        with open(out, "w") as f:
            json.dump({"switch_s": times["switch"], "gloo_s": times["gloo"],
                       "worker_counters": counters,
                       "worker_cpu_s": {k: statistics.median(v) for k, v in cpu_s.items()},
                       "max_error": max_error, "switch_cpu_s": cpu[1] - cpu[0],
                       "datapath": f"workers {client.path}, switch {switch_path}"},
                      f)  # fmt: skip
    client.close()


def _worker_counters(client: InaClient) -> dict[str, int]:
    """The workers' node counters (``net.datapath.COUNTERS``: results,
    timeouts' and fast retransmits, duplicate results, drops), summed over
    the workers and every sum of the run, the warm-up included."""
    counters = client.counters
    total = torch.tensor([counters[k] for k in COUNTERS], dtype=torch.int64)
    dist.all_reduce(total)
    return dict(zip(COUNTERS, total.tolist(), strict=True))


def _switch_cpu(client: InaClient) -> tuple[float, str]:
    """The switch process's CPU seconds so far, and its datapath."""
    import asyncio

    from gradfabric.runtime.switchd import control_call

    st = asyncio.run(control_call(client.ticket.control, {"op": "stats"}))
    return float(st["cpu_s"]), str(st["datapath"])


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, SwitchBenchConfig(**json.loads(sys.argv[1])), sys.argv[2])
