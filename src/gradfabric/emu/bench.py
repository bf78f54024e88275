"""``gradfabric bench switch``: the software switch against gloo all-reduce.

For each worker count a switch daemon process starts and ``workers`` gloo
ranks (torchrun, loopback) each sum the same float32 tensor ``iters`` times
through the switch (``InaClient.allreduce``: the block-exponent round over
gloo, quantisation, the packets through the switch, decoding; what
``ina_hook`` pays) and ``iters`` times with ``torch.distributed.all_reduce``,
alternating, after one warm-up of each. Reported: medians of the slowest
rank's time, and the switch's gradient goodput (tensor bits per second of
switch time), and the same per second of the switch process's CPU time
(the rate one switch core sustains when it is busy). Every switch result
is checked against gloo's (equal up to the quantisation bound) so a fast
wrong answer cannot pass.
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
from gradfabric.emu.client import SWITCH_ENV, InaClient


@dataclass(frozen=True)
class SwitchBenchConfig:
    workers: int = 2
    tensor_mb: float = 4.0
    iters: int = 5
    policy: str = "switchml"
    job_slots: int = 8  # the workers' window (and SwitchML's slots per job)
    values_per_packet: int = 16_000  # 64 KB datagrams: loopback carries them whole
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 2 or self.iters < 1 or self.tensor_mb <= 0:
            raise ConfigError("workers", "need >= 2 workers, >= 1 iteration, tensor_mb > 0")


def run_switch_bench(cfg: SwitchBenchConfig) -> dict[str, Any]:
    from gradfabric.emu.harness import switch_daemon
    from gradfabric.net.launch import run_ranks

    options = ("--policy", cfg.policy, "--job-slots", str(cfg.job_slots),
               "--values-per-packet", str(cfg.values_per_packet))  # fmt: skip
    with switch_daemon(*options) as sw, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        run_ranks(
            cfg.workers, "gradfabric.emu.bench", [json.dumps(asdict(cfg)), out],
            timeout_s=600, extra_env={SWITCH_ENV: sw.control_text},
        )  # fmt: skip
        with open(out) as f:
            rec: dict[str, Any] = json.load(f)
    switch_s = statistics.median(rec["switch_s"])
    return {
        "workers": cfg.workers,
        "tensor_mb": cfg.tensor_mb,
        "switch_ms": switch_s * 1e3,
        "gloo_ms": statistics.median(rec["gloo_s"]) * 1e3,
        "goodput_gbps": cfg.tensor_mb * 8e6 / switch_s / 1e9,
        "switch_cpu_gbps": cfg.iters * cfg.tensor_mb * 8e6 / rec["switch_cpu_s"] / 1e9,
        "policy": cfg.policy,
        "max_error": rec["max_error"],
        "switch_counters": sw.final.get("counters", {}),
    }


def _rank_main(cfg: SwitchBenchConfig, out: str) -> None:
    rank = dist.get_rank()
    n = int(cfg.tensor_mb * 1e6 / 4)
    x = np.random.default_rng(cfg.seed + rank).standard_normal(n).astype(np.float32)
    client = InaClient.join(timeout_s=120)
    times: dict[str, list[float]] = {"switch": [], "gloo": []}
    max_error = 0.0
    cpu = [0.0, 0.0]  # the switch process's CPU time after the warm-up and at the end
    for it in range(cfg.iters + 1):  # the first of each is a warm-up
        if it == 1 and rank == 0:
            cpu[0] = _switch_cpu(client)
        for kind in ("switch", "gloo") if it % 2 == 0 else ("gloo", "switch"):
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "switch":
                got = client.allreduce(x)
            else:
                ref = torch.from_numpy(x.copy())
                dist.all_reduce(ref)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if it:
                times[kind].append(float(took))
        max_error = max(max_error, float(np.abs(got - ref.numpy()).max()))
    if rank == 0:
        cpu[1] = _switch_cpu(client)
        with open(out, "w") as f:
            json.dump({"switch_s": times["switch"], "gloo_s": times["gloo"],
                       "max_error": max_error, "switch_cpu_s": cpu[1] - cpu[0]}, f)  # fmt: skip
    client.close()


def _switch_cpu(client: InaClient) -> float:
    import asyncio

    from gradfabric.emu.switchd import control_call

    return float(asyncio.run(control_call(client.ticket.control, {"op": "stats"}))["cpu_s"])


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    run_rank(_rank_main, SwitchBenchConfig(**json.loads(sys.argv[1])), sys.argv[2])
