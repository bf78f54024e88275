"""A ``Plan`` executed in real PyTorch: pipelines inside groups, data parallelism across them.

Theory of operation. A plan (``planner.cost.Plan``) has groups; a group is a
chain of stages, stage ``j`` holding layers ``[first, end)`` of the model on
one device, and takes a share of the global batch. Here one process runs one
device (rank ``r`` is the plan's device ``r``), and a model is an
``nn.Sequential`` whose children are the plan's layers.

- Inside a group, the stages run as a ``torch.distributed.pipelining``
  pipeline (``PipelineStage`` per rank on the group's own process group, a
  ``ScheduleGPipe`` or ``Schedule1F1B`` over ``Group.micro_batches``
  micro-batches). Stage shapes must be static, so a group's sample count is a
  whole number of equal micro-batches (``whole_batches``). A one-stage group
  runs its layers directly.
- The schedule scales gradients by the micro-batch count, so each rank holds
  the gradient of its group's mean loss. The gradient of the mean loss over
  the global batch ``B`` is ``sum_g (b_g / B) grad_g``: each rank weights its
  gradients by ``b_g / B`` and the ranks that hold the same layer in
  different groups sum them (``all_reduce``) on a process group of exactly
  those owners. Layers with the same owners share one group and one
  all-reduce; every rank walks the owner sets in one sorted order, so no two
  ranks wait on each other in opposite orders.

Process groups are made by every rank in the same order (``new_group`` is
collective over the default group), then only their members use them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradfabric.planner.cost import Group, Plan

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def whole_batches(plan: Plan, total: int) -> list[int]:
    """Samples per group: the plan's shares of ``total`` rounded down to whole
    multiples of each group's micro-batch count, then the rest handed out a
    micro-batch round at a time to the group furthest below its share.
    Raises ``ValueError`` when ``total`` cannot be split so."""
    shares = [g.batch / sum(g.batch for g in plan.groups) * total for g in plan.groups]
    units = [g.micro_batches for g in plan.groups]
    out = [int(s) // u * u for s, u in zip(shares, units, strict=True)]
    while (left := total - sum(out)) > 0:
        fits = [i for i, u in enumerate(units) if u <= left]
        if not fits:
            raise ValueError(f"{total} samples do not split into whole micro-batches of {units}")
        i = max(fits, key=lambda i: shares[i] - out[i])
        out[i] += units[i]
    return out


def as_run(plan: Plan, total: int) -> Plan:
    """``plan`` with the group batches it runs with (``whole_batches``): what
    the cost model must price to predict a run."""
    got = whole_batches(plan, total)
    return Plan(tuple(replace(g, batch=float(b)) for g, b in zip(plan.groups, got, strict=True)))


def splits_whole(plan: Plan, total: int) -> bool:
    """Whether ``whole_batches`` can split ``total`` samples for ``plan``
    (what a runner needs to execute it)."""
    try:
        whole_batches(plan, total)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Role:
    """This rank's place in the plan."""

    group: int
    stage: int
    first: int
    end: int


def roles(plan: Plan) -> dict[int, Role]:
    """Role by rank (= the plan's device index)."""
    return {
        st.device: Role(gi, si, st.first, st.end)
        for gi, g in enumerate(plan.groups)
        for si, st in enumerate(g.stages)
    }


def owner_sets(plan: Plan, layers: int) -> dict[tuple[int, ...], list[int]]:
    """For each set of ranks that hold the same layers, those layers."""
    owners: dict[tuple[int, ...], list[int]] = {}
    for layer, ranks in enumerate(plan.owners(layers)):
        owners.setdefault(tuple(sorted(ranks)), []).append(layer)
    return owners


class Clock:
    """Sleeps a throttled stage to its deadlines and keeps score of how well it
    held them: ``calls``; ``overruns``, the calls whose real compute took
    longer than the emulated device's (the deadline had passed before the
    sleep; the emulation is then slower than the model's device) and their
    ``overrun_s``; ``late_s``, the sleeps' overshoot past the deadline (the
    timer's error). On Linux the process's timer slack is set to 1 us, so a
    sleep ends within microseconds of its deadline instead of the default
    50 us."""

    KEYS = ("calls", "overruns", "overrun_s", "late_s")  # the score, as ``stats`` gives it

    def __init__(self) -> None:
        self.calls = self.overruns = 0
        self.overrun_s = self.late_s = 0.0
        self.backward_from = 0.0  # when the backward of the current call began
        _tight_timer()

    def wait(self, since: float, budget_s: float) -> None:
        deadline = since + budget_s
        self.calls += 1
        left = deadline - time.perf_counter()
        if left <= 0:
            self.overruns += 1
            self.overrun_s -= left
            return
        time.sleep(left)
        self.late_s += time.perf_counter() - deadline

    def stats(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.KEYS}


@functools.cache  # the slack is the process's: once is enough
def _tight_timer() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1)  # PR_SET_TIMERSLACK, 1 ns (the kernel's floor)
    except (OSError, AttributeError):  # not Linux: the default slack, a little more late_s
        pass


class _BackwardEnds(torch.autograd.Function):
    """Identity at a stage's input. Its backward runs when the stage's own
    backward is done (the gradient has reached the input): it sleeps to the
    backward's deadline. ``anchor`` needs a gradient, so this runs on the first
    stage too, whose input needs none (there the backward then also computes
    the input's gradient, a matmul a real first stage skips: real work inside
    the budget, which only an overrun would show)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, clock: Clock,
                budget_s: float) -> torch.Tensor:  # fmt: skip
        ctx.clock, ctx.budget_s = clock, budget_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock.wait(ctx.clock.backward_from, ctx.budget_s)
        return grad, None, None, None


class _BackwardBegins(torch.autograd.Function):
    """Identity at a stage's output; its backward notes when the stage's
    backward begins."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: Clock) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.backward_from = time.perf_counter()
        return grad, None


class Throttled(nn.Module):
    """A stage run as on an emulated device at ``speed`` of a reference one.

    With ``sample_s`` (the reference device's forward and backward seconds
    per sample for this stage: its forward FLOPs x 3 / the device's FLOP/s,
    the cost model's own figure), a *deadline* throttle: a forward of ``n``
    samples ends ``n * sample_s / 3 / speed`` after it began, its backward
    ``2 n * sample_s / 3 / speed`` after the gradient reached the stage's
    output (the real compute runs first, then the process sleeps to the
    deadline; autograd identities at the input and output time the backward,
    whichever schedule drives it). The emulated compute is then the model's,
    whatever the host's contention, as long as the real compute fits in the
    budget: ``clock`` counts the calls where it did not. The per-call host
    work outside the stage (the schedule's Python, the transfers) is not
    stretched, as a slower GPU behind the same host would have it.

    Without ``sample_s``, a wall-time throttle: each forward sleeps ``(1/speed
    - 1)`` times three times its own wall time (no-op at speed 1), which
    stretches whatever the host's contention does too.

    Either way the sleep frees the core, so slow devices do not steal
    compute from fast ones."""

    def __init__(self, inner: nn.Module, speed: float, sample_s: float | None = None) -> None:
        super().__init__()
        if not 0 < speed <= 1:
            raise ValueError(f"speed must be in (0, 1], got {speed}")
        self.inner, self.speed, self.sample_s = inner, speed, sample_s
        self.clock = Clock()
        # a leaf needing a gradient (its own stays None: ``_BackwardEnds`` returns none)
        self.anchor = torch.zeros((), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.sample_s is None:
            out: torch.Tensor = self.inner(x)
            if self.speed < 1:
                time.sleep(3 * (time.perf_counter() - t0) * (1 / self.speed - 1))
            return out
        budget = len(x) * self.sample_s / 3 / self.speed
        out = self.inner(_BackwardEnds.apply(x, self.anchor, self.clock, 2 * budget))  # type: ignore[no-untyped-call]
        self.clock.wait(t0, budget)
        return cast(torch.Tensor, _BackwardBegins.apply(out, self.clock))  # type: ignore[no-untyped-call]


class PlanRunner:
    """Run training steps of ``model`` (an ``nn.Sequential`` of the plan's
    layers, built alike on every rank) under ``plan``; this rank keeps only
    its stage's layers and their optimizer. A rank the plan leaves out makes
    the process groups with the others and then sits each step out.
    ``speed``: this rank's emulated device speed (``Throttled``);
    ``layer_sample_s``: each layer's forward and backward seconds per sample
    on the reference device (the deadline throttle), or None (the wall-time
    one)."""

    def __init__(
        self,
        plan: Plan,
        model: nn.Sequential,
        loss_fn: Loss,
        total_batch: int,
        make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        sample: torch.Tensor,
        schedule: str = "gpipe",
        speed: float = 1.0,
        layer_sample_s: list[float] | None = None,
        groups: dict[tuple[int, ...], Any] | None = None,
    ) -> None:
        """``sample``: one input sample (batch dimension 1): the stages' shapes
        are derived from it, so no shape inference runs between stages.
        ``groups``: process groups made before, by their ranks, to reuse
        (``replan`` passes its own on, so a job re-planned every slot does
        not open a new set of gloo connections each time)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
        self.args: tuple[
            nn.Sequential,
            Loss,
            int,
            Callable[[list[nn.Parameter]], torch.optim.Optimizer],
            torch.Tensor,
            str,
            float,
            list[float] | None,
        ]
        self.args = (model, loss_fn, total_batch, make_opt, sample, schedule, speed,
                     layer_sample_s)  # fmt: skip
        rank, world = dist.get_rank(), dist.get_world_size()
        by_rank = roles(plan)
        if not set(by_rank) <= set(range(world)):
            raise ValueError(f"plan devices {sorted(by_rank)} must be among ranks 0..{world - 1}")
        self.plan, self.total = plan, total_batch
        self.moved_bytes = 0  # received by the replan that made this runner,
        self.moved_s = 0.0  # in this many seconds of transfers
        self.batches = whole_batches(plan, total_batch)
        # every rank makes every group, in one order: new_group is collective
        # (and every rank holds the same cache, so all of them skip alike)
        self.groups = {} if groups is None else groups
        pp = [self._group([st.device for st in g.stages]) for g in plan.groups]
        self.sync = {
            ranks: (self._group(list(ranks)), layers)
            for ranks, layers in sorted(owner_sets(plan, len(model)).items())
        }
        self.active = rank in by_rank
        self.role = by_rank.get(rank, Role(-1, -1, 0, 0))
        if not self.active:
            return
        self.offset = sum(self.batches[: self.role.group])
        group: Group = plan.groups[self.role.group]
        self.module = cast(nn.Sequential, model[self.role.first : self.role.end])
        self.params = [p for p in self.module.parameters()]
        self.opt = make_opt(self.params)
        self.loss_fn = loss_fn
        self.stages = len(group.stages)
        sample_s = None if layer_sample_s is None else sum(
            layer_sample_s[self.role.first : self.role.end])  # fmt: skip
        self.run = Throttled(self.module, speed, sample_s)
        self.schedule: Any = None
        if self.stages > 1:
            micro = self.batches[self.role.group] // group.micro_batches
            # this stage's input and output for one micro-batch: the stage's
            # static shapes; both marked as needing gradients (the schedule sizes
            # its gradient buffers from that)
            with torch.no_grad():
                x_in = model[: self.role.first](sample.expand(micro, *sample.shape[1:]))
                x_out = self.module(x_in)
            x_in, x_out = x_in.clone().requires_grad_(), x_out.clone().requires_grad_()
            stage = PipelineStage(self.run, self.role.stage, self.stages,
                                  x_in.device,
                                  input_args=x_in, output_args=x_out,
                                  group=pp[self.role.group])  # fmt: skip
            # new_group orders its ranks by number, a plan its stages by speed:
            # tell the stage which group rank holds each stage
            members = sorted(st.device for st in group.stages)
            stage.stage_index_to_group_rank = {
                j: members.index(st.device) for j, st in enumerate(group.stages)
            }
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            # (every stage passes the loss: a schedule without one runs no backward)
            self.schedule = kind(stage, group.micro_batches, loss_fn=loss_fn)

    def _group(self, ranks: list[int]) -> Any:
        key = tuple(sorted(ranks))
        if key not in self.groups:
            self.groups[key] = dist.new_group(list(key))
        return self.groups[key]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One step on the global batch ``(x, y)`` (the same on every rank).
        Returns the group's mean loss on the rank that computes it (the last
        stage of its group), else None."""
        if not self.active:
            return None
        lo, b = self.offset, self.batches[self.role.group]
        xs, ys = x[lo : lo + b], y[lo : lo + b]
        self.opt.zero_grad()
        loss: float | None = None
        if self.schedule is None:
            out = self.loss_fn(self.run(xs), ys)
            out.backward()  # type: ignore[no-untyped-call]
            loss = float(out.detach())
        elif self.role.stage == 0:
            self.schedule.step(xs)
        elif self.role.stage == self.stages - 1:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=ys, losses=losses)
            loss = float(torch.stack(losses).detach().mean())
        else:
            self.schedule.step()
        self._sync(b / self.total)
        self.opt.step()
        return loss

    def throttle_stats(self) -> dict[str, float]:
        """This rank's ``Clock`` score (zeros on a rank the plan leaves out)."""
        return self.run.clock.stats() if self.active else dict.fromkeys(Clock.KEYS, 0.0)

    def _sync(self, weight: float) -> None:
        """Weight this group's gradients by its batch share and sum each
        layer's over its owners."""
        for p in self.params:
            if p.grad is None:  # a layer this step left unused: it adds zero, but it adds
                p.grad = torch.zeros_like(p)
            p.grad.mul_(weight)
        for ranks, (pg, layers) in self.sync.items():
            if dist.get_rank() not in ranks or len(ranks) == 1:
                continue
            grads = [p.grad for i in layers for p in self.module[i - self.role.first].parameters()
                     if p.grad is not None]  # fmt: skip
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=pg)
            at = 0
            for g in grads:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()

    def replan(self, plan: Plan, speed: float | None = None) -> tuple[PlanRunner, float]:
        """Move the job to ``plan`` (all ranks call this together; ``speed``:
        this rank's device speed from now on, else the same). A rank that will
        hold a layer it does not hold now receives the layer's parameters and
        its optimizer state from the lowest rank that holds it now (after a
        step every holder has the same values); layers a rank keeps stay where
        they are. Per (sender, receiver) pair, one small pickled header (the
        optimizer state's structure) and one flat buffer (the parameters and
        every state tensor shaped like its parameter: momentum, Adam's
        moments); pairs in one global order, so the lowest unfinished transfer
        always has both ends ready: no deadlock. Then a runner for ``plan``
        takes over. Returns it and this rank's wall seconds; the new runner's
        ``moved_bytes`` and ``moved_s`` are what this rank received and the
        transfers' seconds."""
        model = self.args[0]
        t0 = time.perf_counter()
        me = dist.get_rank()
        was, will = self.plan.owners(len(model)), plan.owners(len(model))
        states: dict[int, Any] = (
            {id(p): self.opt.state.get(p, {}) for p in self.params} if self.active else {}
        )
        pairs: dict[tuple[int, int], list[nn.Parameter]] = {}
        for layer in range(len(model)):
            for dst in sorted(will[layer] - was[layer]):
                pairs.setdefault((min(was[layer]), dst), []).extend(model[layer].parameters())
        if len({p.dtype for p in model.parameters()}) > 1:
            raise ValueError("replan moves models of one dtype (each move is one flat buffer)")
        moved = 0
        for (src, dst), params in sorted(pairs.items(), key=lambda kv: kv[0]):
            if me == src:
                _send_layers(params, [self.opt.state.get(p, {}) for p in params], dst)
            elif me == dst:
                got, moved_here = _recv_layers(params, src)
                states.update({id(p): st for p, st in zip(params, got, strict=True)})
                moved += moved_here
        moved_s = time.perf_counter() - t0
        args = self.args if speed is None else (*self.args[:6], speed, self.args[7])
        new = PlanRunner(plan, *args, groups=self.groups)
        if new.active:
            for p in new.params:
                if states.get(id(p)):
                    new.opt.state[p] = states[id(p)]
        new.moved_bytes, new.moved_s = moved, moved_s
        return new, time.perf_counter() - t0


def _flat_keys(p: torch.Tensor, state: dict[str, Any]) -> list[str]:
    """The state entries that travel in the flat buffer: tensors shaped like ``p``."""
    like = (k for k, v in state.items() if isinstance(v, torch.Tensor))
    return [k for k in like if state[k].shape == p.shape and state[k].dtype == p.dtype]


def _send_layers(params: list[nn.Parameter], states: list[dict[str, Any]], dst: int) -> None:
    keys = [_flat_keys(p, st) for p, st in zip(params, states, strict=True)]
    rest = [{k: v for k, v in st.items() if k not in ks}
            for st, ks in zip(states, keys, strict=True)]  # fmt: skip
    dist.send_object_list([(keys, rest)], dst)
    parts = [t for p, st, ks in zip(params, states, keys, strict=True)
             for t in (p.data, *(st[k] for k in ks))]  # fmt: skip
    dist.send(torch.cat([t.reshape(-1) for t in parts]), dst)


def _recv_layers(params: list[nn.Parameter], src: int) -> tuple[list[dict[str, Any]], int]:
    """Fill ``params`` from ``src``; their optimizer states and the bytes received."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src)
    keys, rest = box[0]
    flat = torch.empty(sum(p.numel() * (1 + len(ks)) for p, ks in zip(params, keys, strict=True)),
                       dtype=params[0].dtype)  # fmt: skip
    dist.recv(flat, src)
    at, states = 0, []
    for p, ks, st in zip(params, keys, rest, strict=True):
        n = p.numel()
        p.data.copy_(flat[at : at + n].view_as(p))
        at += n
        for k in ks:
            st[k] = flat[at : at + n].view_as(p).clone()
            at += n
        states.append(st)
    return states, flat.numel() * flat.element_size()
