"""``gradfabric bench ddp``: DDP training iterations per hook, side by side in one run.

Each model is trained by ``ranks`` gloo processes under torchrun (on
loopback, or each rank in a network namespace behind a tbf-shaped link), one
replica per hook, all from the same initial weights, fed the same batches.
Every step runs each replica once (forward, backward, optimizer step), rotating
which goes first, so that machine noise falls on all alike; a step's time is
its slowest rank's. Reported per model and hook: the median iteration time
after ``warmup`` steps, the speedup against DDP without a hook (its built-in
all-reduce: the ratio of medians, and the ratio of mean step times with its
paired 95% interval, ``paired_vs_default``), the gradients' measured block
density, and how far the replica's weights ended from the default replica's
(a check that the hook averages what DDP would: with 2 ranks, to the bit),
and where each hook's dense calls ran (``dense_calls_in``: ``compiled``, the
C++ path of ``collectives.fast``, or ``python``; the ``-python`` hooks force
the latter, for a side-by-side of the two). ``sparse`` is no hook: the same
model with ``sparse=True`` tables under plain DDP (what PyTorch offers for
embeddings), with SGD, or under ``optimizer="adam"`` the usual hybrid of
SparseAdam on the tables and Adam on the rest; ``sparse+auto`` is that same
replica with ``auto_hook``, which exchanges each table's sparse gradient by
the path its model predicts fastest (``collectives.coo``); ``rows`` is
``rows_hook``; ``torchrec`` (the ``mixed``, ``dlrm`` and ``neumf`` models, SGD) is
TorchRec's ``DistributedModelParallel`` with the sharding its planner picks,
and ``torchrec-cw`` the same with every table column-wise over every rank,
from the same weights (``lab.trec``; an optional install); ``local``
is the ``sparse=True`` replica without DDP, exchanging nothing: the step's
compute alone, the floor under every exchange (its weights drift).
Where a hook works on a thread of its own (``net.overlap``),
``bucket_spans_ms`` is its step as rank 0's thread served it: when each
bucket took the thread, began its sum (after the ranks agreed on it: the
wait for the last rank to reach it) and ended, against the step's start
(``timeline``): what a sum waited for and how long it took beside the
backward pass.

Models: ``workloads.trained.MODELS``.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradfabric.collectives.fast import PYTHON, register_hook
from gradfabric.collectives.rows import tables
from gradfabric.core import hostcpu
from gradfabric.lab import trec
from gradfabric.net.netns import MTU
from gradfabric.proto.switch import ALLOCATORS
from gradfabric.workloads.trained import MODELS

HOOKS = ("default", "omnireduce", "auto")
# ``-python``: the same hook with its dense calls in Python (``ddp.register_comm_hook``)
ALL_HOOKS = (
    *HOOKS, "allreduce", "builtin", "ina", "rows", "sparse", "omnireduce-python", "auto-python",
    *trec.SHARDINGS, "sparse+auto", "local",
)  # fmt: skip
# what a user has without gradfabric: DDP's own hooks, sparse=True, TorchRec
STOCK = ("default", "builtin", "allreduce", "sparse", *trec.SHARDINGS)
SPARSE_TABLES = ("sparse", "sparse+auto", "local")  # replicas whose tables are ``sparse=True``
TORCHREC_MODELS = ("mixed", "dlrm", "neumf")  # those ``lab.trec`` has a form of
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class DdpBenchConfig:
    models: tuple[str, ...] = ("mlp", "neumf", "mixed")
    ranks: int = 2
    link_gbps: float | None = None
    steps: int = 20
    warmup: int = 3
    bucket_cap_mb: float = 4.0
    gradient_as_bucket_view: bool = False
    hooks: tuple[str, ...] = HOOKS
    switch: str | None = None  # a switch daemon's control address: adds ina_hook
    switch_policy: str | None = None  # start a daemon with this policy for the run instead
    mtu: int = MTU  # with link_gbps: every link's MTU (net.netns.tor_star)
    switch_window: int = 0  # with switch_policy: the workers' window (0: the daemon's default)
    switch_multicast: bool = True  # with switch_policy: the daemon's --multicast (its default)
    optimizer: str = "sgd"  # sgd (lr 0.01) or adam (lr 1e-3); see ``_optimizers``
    block: int = 1  # steps each replica takes in a row before the next (``_schedule``)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"unknown models {unknown}; valid: {sorted(MODELS)}")
        if self.switch is not None and self.switch_policy is not None:
            raise ValueError("give a running switch (switch) or a policy to start one, not both")
        if self.switch_policy is not None:
            ALLOCATORS.get(self.switch_policy)  # a pool policy the daemon serves, or a ValueError
        bad = [h for h in self.hooks if not _valid_hook(h)]
        names = [hook_name(h) for h in self.hooks]
        has_switch = self.switch is not None or self.switch_policy is not None
        if bad or not self.hooks or ("ina" in names and not has_switch):
            raise ValueError(
                f"hooks must be some of {ALL_HOOKS}, each with an optional @MB bucket cap "
                f"(ina with a switch), got {bad}"
            )
        if len(set(self.hooks)) != len(self.hooks):
            raise ValueError(f"a hook twice: {list(self.hooks)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        bagged = set(self.models) & set(TORCHREC_MODELS)
        if set(names) & set(trec.SHARDINGS) and (self.optimizer != "sgd" or not bagged):
            raise ValueError(f"torchrec runs the {TORCHREC_MODELS} models with sgd (its CPU "
                             "fused optimizers are the EXACT_* family)")  # fmt: skip
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        if self.switch_window < 0:
            raise ValueError(f"switch_window must be >= 0, got {self.switch_window}")
        if self.ranks < 2 or self.steps <= self.warmup or self.warmup < 0:
            raise ValueError("need ranks >= 2 and steps > warmup >= 0")


def held_to_default(row: dict[str, Any], optimizer: str) -> bool:
    """Whether a row's weights must end where the default hook's do (within
    float32 rounding: ``max_param_diff_vs_default`` <= 1e-4). Not the
    SparseAdam hybrid (another optimizer), and not Adam beyond 2 ranks: a sum
    of more than two terms in another order differs in its last bits, and
    where the ranks' rows cancel, Adam scales that difference up to a whole
    step of its learning rate."""
    if hook_name(row["hook"]) == "local":
        return False
    if optimizer != "adam":
        return True
    return hook_name(row["hook"]) not in SPARSE_TABLES and row["ranks"] <= 2


def hook_name(hook: str) -> str:
    """``ina@16`` -> ``ina``: a replica's hook, less its own bucket cap."""
    return hook.partition("@")[0]


def bucket_caps(hook: str, default: float) -> list[float]:
    """A replica's bucket caps in MB: its ``@MB`` suffix, else ``default``
    (each hook at its best bucket size, side by side in one run); ``@4/16``:
    DDP's ``bucket_cap_mb_list``, the first bucket (the last layers, whose
    gradients are ready first) 4 MB, the others 16."""
    _, at, caps = hook.partition("@")
    return [float(c) for c in caps.split("/")] if at else [default]


def _valid_hook(hook: str) -> bool:
    try:
        return hook_name(hook) in ALL_HOOKS and min(bucket_caps(hook, 1.0)) > 0
    except ValueError:
        return False


def _ddp(module: nn.Module, caps: list[float], **kw: Any) -> DDP:
    if len(caps) == 1:
        return DDP(module, bucket_cap_mb=caps[0], **kw)
    return DDP(module, bucket_cap_mb_list=caps, **kw)  # type: ignore[arg-type]  # (MB * bytes, int())


def run_ddp_bench(cfg: DdpBenchConfig) -> list[dict[str, Any]]:
    """Run every model's replicas on ``cfg.ranks`` torchrun ranks; the rows.

    With ``switch_policy`` a switch daemon serves the run: on loopback, or
    with ``link_gbps`` in the namespace that bridges the ranks' shaped links,
    where the top-of-rack switch sits (``net.netns.tor_star``), so that
    ``ina_hook``'s packets and the default hook's ring cross the same links."""
    from contextlib import ExitStack

    from gradfabric.net.launch import run_on_hosts, run_ranks

    module = "gradfabric.lab.ddp_bench"
    if set(cfg.hooks) & set(trec.SHARDINGS) and (reason := trec.why_not()) is not None:
        raise ValueError(reason)
    with ExitStack() as stack:
        out = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "rows.json")
        if cfg.switch_policy is None:
            run_ranks(cfg.ranks, module, [json.dumps(asdict(cfg)), out], link_gbps=cfg.link_gbps,
                      mtu=cfg.mtu)  # fmt: skip
        else:
            from gradfabric.lab.daemon import switch_daemon
            from gradfabric.lab.switch_bench import LOOPBACK_VALUES
            from gradfabric.net.udp import default_values
            from gradfabric.runtime.switchd import default_window

            vpp = default_values(cfg.mtu) if cfg.link_gbps is not None else LOOPBACK_VALUES
            options = ("--policy", cfg.switch_policy, "--values-per-packet", str(vpp),
                       "--job-slots", str(cfg.switch_window or default_window(vpp)),
                       "--multicast" if cfg.switch_multicast else "--no-multicast")  # fmt: skip
            hosts, tor = None, None
            if cfg.link_gbps is not None:
                from gradfabric.net.netns import tor_star

                hosts, tor = stack.enter_context(tor_star(cfg.ranks, cfg.link_gbps, cfg.mtu))
            sw = stack.enter_context(switch_daemon(*options, host=tor))
            run = replace(cfg, switch=sw.control_text, switch_policy=None)
            args = [json.dumps(asdict(run)), out]
            if hosts is None:
                run_ranks(cfg.ranks, module, args)
            else:
                run_on_hosts(hosts, module, args)
        with open(out) as f:
            rows: list[dict[str, Any]] = json.load(f)
    for r in rows:
        r["switch_policy"] = cfg.switch_policy
    return rows


def _state(hook: str, cfg: DdpBenchConfig, module: nn.Module) -> tuple[Any, Any]:
    """(state, hook function) for ``hook``; (None, None) for DDP's own."""
    hook = hook.removesuffix("-python")
    if hook == "rows":  # (a model without tables: every bucket all-reduced on its thread)
        from gradfabric.collectives.rows import RowState, rows_hook

        return RowState.track(module) if tables(module) else RowState(), rows_hook
    if hook == "omnireduce":
        from gradfabric.collectives.sparse import OmniState, omnireduce_hook

        return OmniState(), omnireduce_hook
    if hook in ("auto", "sparse+auto"):  # every path it has: the switch, tables by rows
        from gradfabric.collectives.auto import AutoState, auto_hook
        from gradfabric.collectives.rows import RowState

        rows = RowState.track(module) if tables(module) else None
        return AutoState(switch=_client(cfg), rows=rows), auto_hook
    if hook == "allreduce":  # PyTorch's own Python hook: what any Python hook costs
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return None, allreduce_hook
    if hook == "ina":
        from gradfabric.runtime.hook import ina_hook

        return _client(cfg), ina_hook
    return None, None


def _optimizers(module: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """``sgd``: SGD at lr 0.01 (sparse gradients too). ``adam``: Adam at lr
    1e-3; a replica with sparse embedding gradients, which Adam refuses, gets
    the usual hybrid instead: SparseAdam on the tables, Adam on the rest (a
    lazy Adam on the tables: its weights differ from the others' by design)."""
    if kind == "sgd":
        return [torch.optim.SGD(module.parameters(), lr=0.01)]
    sparse = [t.weight for _, t in tables(module, sparse=True)]
    rest = [p for p in module.parameters() if all(p is not q for q in sparse)]
    opts: list[torch.optim.Optimizer] = [torch.optim.Adam(rest, lr=1e-3)] if rest else []
    return opts + ([torch.optim.SparseAdam(sparse, lr=1e-3)] if sparse else [])


def _client(cfg: DdpBenchConfig) -> Any:
    if cfg.switch is None:
        return None
    from gradfabric.runtime.client import InaClient, parse_address

    # on shaped links the workers know their link's rate and pace to it
    return InaClient.join(control=parse_address(cfg.switch), pace_gbps=cfg.link_gbps or 0.0)


def _density(state: Any) -> float | None:
    seen = getattr(state, "density_seen", None)
    return statistics.median(seen) if seen else None


def _rank_main(cfg: DdpBenchConfig, out: str) -> None:
    rank = dist.get_rank()
    names = [hook_name(h) for h in cfg.hooks]
    all_hooks = [*cfg.hooks, *(["ina"] if cfg.switch and "ina" not in names else [])]
    # the reference: DDP's default hook (the first such replica)
    ref_hook = next((h for h in all_hooks if hook_name(h) == "default"), None)
    rows = []
    path: dict[str, str | None] = {}  # each hook's dense calls: compiled or Python
    for name in cfg.models:
        replicas: dict[str, tuple[nn.Module, list[torch.optim.Optimizer], Any]] = {}
        params: dict[str, Callable[[], list[torch.Tensor]]] = {}  # each replica's, as Mixed's
        sharding: dict[str, dict[str, str]] = {}  # TorchRec's plan, per table
        hooks = [h for h in all_hooks if h not in trec.SHARDINGS or name in TORCHREC_MODELS]
        for hook in hooks:
            torch.manual_seed(cfg.seed)
            module, batch, loss_fn = MODELS[name]()
            if hook in trec.SHARDINGS:  # the same weights, sharded by TorchRec
                dmp, opts = trec.shard(module, lr=0.01, sharding=trec.SHARDINGS[hook])
                sharding[hook] = trec.plan(dmp)
                dense = [p for m in module.dense() for p in m.parameters()]  # type: ignore[operator]
                params[hook] = _tables_and(trec.tables, dmp, dense)
                replicas[hook] = (dmp, opts, None)
                path[hook] = None
                continue
            if hook_name(hook) in SPARSE_TABLES:  # PyTorch's sparse embedding gradients
                for _, table in tables(module):
                    table.sparse = True
            if hook == "local":
                replicas[hook] = (module, _optimizers(module, cfg.optimizer), None)
                params[hook], path[hook] = _listed(module), None
                continue
            ddp = _ddp(module, bucket_caps(hook, cfg.bucket_cap_mb),
                       gradient_as_bucket_view=cfg.gradient_as_bucket_view)  # fmt: skip
            state, fn = _state(hook_name(hook), cfg, module)
            path[hook] = None
            if fn is not None and hook_name(hook).endswith("-python"):
                ddp.register_comm_hook(state, fn)
                path[hook] = PYTHON
            elif fn is not None:
                path[hook] = register_hook(ddp, state, fn)
            if hook_name(hook) == "builtin":  # PyTorch's C++ all-reduce hook: a hook without Python
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # type: ignore[no-untyped-call,attr-defined]
            replicas[hook] = (ddp, _optimizers(module, cfg.optimizer), state)
            params[hook] = _listed(module)
        times: dict[str, list[float]] = {h: [] for h in hooks}
        cpu: dict[str, list[float]] = {h: [] for h in hooks}  # all ranks' CPU seconds a step
        hook_cpu: dict[str, list[float]] = {h: [] for h in hooks}  # of which the hooks' threads
        host = {h: hostcpu.Busy() for h in hooks}  # every core of the host, rank 0's reading
        spans: dict[str, list[list[tuple[float, ...]]]] = {h: [] for h in hooks}  # rank's own
        # a round's steps drawn once for all its replicas (as one step's were before blocks)
        batched = functools.lru_cache(maxsize=cfg.block)(batch)
        for step, hook in _schedule(hooks, cfg.steps, cfg.block):
            inputs, target = batched(rank, step)
            replica, opt, state = replicas[hook]
            dist.barrier()
            t0, c0, h0 = time.perf_counter(), time.process_time(), _thread_cpu(state)
            b0 = hostcpu.snapshot() if rank == 0 else None
            loss = loss_fn(replica(*inputs), target)
            for o in opt:
                o.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            for o in opt:
                o.step()
            took = torch.tensor([time.perf_counter() - t0])
            b1 = hostcpu.snapshot() if rank == 0 else None
            # (every thread of the rank's; the hook's own threads' share)
            spent = torch.tensor([time.process_time() - c0, _thread_cpu(state) - h0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
            dist.all_reduce(spent)
            if step >= cfg.warmup:
                times[hook].append(float(took))
                cpu[hook].append(float(spent[0]))
                hook_cpu[hook].append(float(spent[1]))
                host[hook].add(b0, b1)
                if hasattr(state, "spans_since"):
                    spans[hook].append(state.spans_since(t0))
        base = statistics.median(times[ref_hook]) if ref_hook else None
        stock = [h for h in hooks if hook_name(h) in STOCK]
        best = min(stock, key=lambda h: statistics.median(times[h])) if stock else None
        ref = params[ref_hook]() if ref_hook else None
        omni = replicas.get("omnireduce", (None, None, None))[2]
        for hook in hooks:
            replica, _, state = replicas[hook]
            if hasattr(state, "fold"):  # the compiled path's calls, into the statistics
                state.fold()
            iter_s = statistics.median(times[hook])
            diff, mine = None, params[hook]()  # (every rank: the table's gather is a collective)
            if ref is not None:
                pairs = zip(ref, mine, strict=True)
                diff = max(float((p - q).detach().abs().max()) for p, q in pairs)
            rows.append({
                "model": name, "ranks": cfg.ranks, "link_gbps": cfg.link_gbps, "hook": hook,
                "iter_ms": iter_s * 1e3,
                "cpu_ms": statistics.median(cpu[hook]) * 1e3,  # summed over the ranks
                "cores": os.cpu_count(),  # what the ranks' CPU shares on this host
                # the host's cores busy in rank 0's steps (any process, the kernel too)
                "host_busy": host[hook].share,
                # the hook's threads' CPU (``Overlapped.thread_cpu_s``), summed over the ranks
                "hook_cpu_ms": statistics.median(hook_cpu[hook]) * 1e3
                if hasattr(state, "thread_cpu_s") else None,
                "speedup_vs_default": base / iter_s if base else None,
                "paired_vs_default": _paired(times[ref_hook] if ref_hook else None, times[hook]),
                "best_stock": best,
                "paired_vs_best_stock": _paired(times[best] if best else None, times[hook]),
                "bucket_cap_mb": bucket_caps(hook, cfg.bucket_cap_mb)[-1],
                "bucket_caps_mb": bucket_caps(hook, cfg.bucket_cap_mb),
                "density": _density(omni), "iter_ms_all": [t * 1e3 for t in times[hook]],
                "max_param_diff_vs_default": diff,
                "paths": _paths(state), "dense_calls_in": path[hook],
                "coo_bytes_per_step": _per_step(getattr(state, "coo_bytes", None), cfg.steps),
                "sharding": sharding.get(hook),
                "a2a_bytes_per_step": trec.link_bytes(replica) if hook in trec.SHARDINGS
                else None,
                "grad_mb": sum(p.numel() for p in mine) * 4 / 2**20,
                "bucket_spans_ms": timeline(spans[hook]),
            })  # fmt: skip
        for _, _, state in replicas.values():
            if hasattr(state, "close"):
                state.close()
        del replicas
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def timeline(steps: list[list[tuple[float, ...]]]) -> list[tuple[float, ...]] | None:
    """A step's communication jobs, each (start, work, end) seconds from the
    step's start (``Overlapped.spans_since``) as ms: per job in serving
    order, each point's median over the steps that served the most common
    number of jobs (``None`` where the hook's thread served none: the
    default hook's all-reduces run on gloo's own threads)."""
    counts = [len(s) for s in steps if s]
    if not counts:
        return None
    n = statistics.mode(counts)
    like = [s for s in steps if len(s) == n]

    def ms(k: int, point: int) -> float:
        return round(statistics.median(s[k][point] for s in like) * 1e3, 2)

    return [tuple(ms(k, i) for i in range(len(like[0][k]))) for k in range(n)]


def _thread_cpu(state: Any) -> float:
    return float(getattr(state, "thread_cpu_s", 0.0))


def _schedule(hooks: list[str], steps: int, block: int) -> list[tuple[int, str]]:
    """(step, hook) in the order they run: every replica takes ``block``
    steps in a row, then the next, the replicas' order rotated every round
    (``block`` 1: step by step), so each sees the host as the others do."""
    out = []
    for k, start in enumerate(range(0, steps, block)):
        for hook in hooks[k % len(hooks) :] + hooks[: k % len(hooks)]:
            out += [(step, hook) for step in range(start, min(start + block, steps))]
    return out


def _listed(module: nn.Module) -> Callable[[], list[torch.Tensor]]:
    return lambda: list(module.parameters())


def _tables_and(
    tables: Callable[[nn.Module], list[torch.Tensor]], dmp: nn.Module, rest: list[torch.Tensor]
) -> Callable[[], list[torch.Tensor]]:
    """The torchrec replica's parameters in the model's order: the tables,
    gathered, first."""
    return lambda: [*tables(dmp), *rest]


def paired(ref: list[float], other: list[float]) -> tuple[float, float]:
    """The ratio of mean step times ``ref / other`` and its paired 95%
    half-width (the two ran in the same steps, one after the other: machine
    noise hits both; ``core.stats.ratio_ci`` says why not a mean of ratios)."""
    from gradfabric.core.stats import ratio_ci

    est = ratio_ci(ref, other)
    return est.mean, est.half


def _paired(ref: list[float] | None, other: list[float]) -> tuple[float, float] | None:
    return None if ref is None else paired(ref, other)


def _per_step(total: dict[str, int] | None, steps: int) -> dict[str, float] | None:
    """``auto_hook``'s bytes per path over its sparse tables (each path's, as
    if it had taken every call: ``coo.link_bytes``), per step."""
    return {p: b / steps for p, b in total.items()} if total else None


def _paths(state: Any) -> dict[str, int] | None:
    """Calls per path over all buckets (``auto_hook``), or None."""
    summary = getattr(state, "summary", None)
    if summary is None:
        return None
    total: dict[str, int] = {}
    for b in summary().values():
        for p, n in b["paths"].items():
            total[p] = total.get(p, 0) + n
    return total


if __name__ == "__main__":  # one rank, started by torchrun
    from gradfabric.net.launch import run_rank

    raw = json.loads(sys.argv[1])
    raw["models"], raw["hooks"] = tuple(raw["models"]), tuple(raw["hooks"])
    run_rank(_rank_main, DdpBenchConfig(**raw), sys.argv[2])
