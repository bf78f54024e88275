"""A plan executed for real: pipelined, uneven groups against one full-batch step.

Four gloo ranks run a plan of two groups, each a two-stage pipeline cut at a
different layer (group 0: layers [0, 2) | [2, 5); group 1: [0, 3) | [3, 5)),
taking 8 and 16 of 24 samples (8 micro-batches each); group 1's first stage
is on rank 3 and its second on rank 2 (a plan orders stages by speed, not by
rank number). After SGD steps, every
rank's layers must equal those of the unsplit model stepped on all 24
samples at once. In float64 the two differ only by the order of additions
(micro-batch gradients summed then scaled, group gradients weighted and
summed): a few ulps of values of order 1 per step, so 1e-12 absolute leaves
three orders of magnitude of room and would still catch a wrong weight (an
even split instead of 8:16 moves gradients by ~1e-2).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from gradfabric.net.launch import spawn
from gradfabric.planner.cost import Group, Plan, Stage
from gradfabric.planner.pipeline import PlanRunner, as_run, owner_sets, whole_batches

PLAN = Plan(
    (
        Group((Stage(0, 0, 2), Stage(1, 2, 5)), batch=1.0),
        Group((Stage(3, 0, 3), Stage(2, 3, 5)), batch=2.0),  # stages not in rank order
    )
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4)).double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(24, 16, generator=g, dtype=torch.float64),
            torch.randn(24, 4, generator=g, dtype=torch.float64))  # fmt: skip


def _rank(rank: int, world: int, schedule: str, out: str) -> None:
    runner = PlanRunner(PLAN, _model(), nn.functional.mse_loss, 24,
                        lambda ps: torch.optim.SGD(ps, lr=0.1), _data(0)[0][:1],
                        schedule=schedule)  # fmt: skip
    losses = [runner.step(*_data(step)) for step in range(3)]
    state = runner.module.state_dict()  # (a slice of a Sequential keeps the layers' names)
    torch.save((state, losses, runner.role), f"{out}/{rank}.pt")


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.long)])
def test_a_pipelined_uneven_plan_steps_like_the_full_batch(schedule: str) -> None:
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for step in range(3):
        x, y = _data(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        ref_losses.append(float(loss.detach()))
    want = ref.state_dict()
    group_losses: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, 4, (schedule, tmp), deadline_s=240)
        for r in range(4):
            state, losses, role = torch.load(f"{tmp}/{r}.pt", weights_only=False)
            assert state, f"rank {r} holds no layers"
            for k, v in state.items():
                torch.testing.assert_close(v, want[k], atol=1e-12, rtol=0.0, msg=f"rank {r} {k}")
            last = role.stage == len(PLAN.groups[role.group].stages) - 1
            assert all((x is not None) == last for x in losses)
            if last:
                group_losses[role.group] = losses
    # the groups' mean losses, weighted by their samples, are the full batch's
    for step, want_loss in enumerate(ref_losses):
        got = (8 * group_losses[0][step] + 16 * group_losses[1][step]) / 24
        assert got == pytest.approx(want_loss, abs=1e-12, rel=0)


def test_batches_split_into_whole_micro_batches_and_owner_sets() -> None:
    assert whole_batches(PLAN, 24) == [8, 16]
    assert whole_batches(PLAN, 48) == [16, 32]
    with pytest.raises(ValueError):
        whole_batches(PLAN, 20)
    # the plan the cost model prices for a run: the shares as whole micro-batches
    assert [g.batch for g in as_run(PLAN, 48).groups] == [16.0, 32.0]
    # layer 2 is held by rank 1 (group 0) and rank 3 (group 1)
    assert owner_sets(PLAN, 5) == {(0, 3): [0, 1], (1, 3): [2], (1, 2): [3, 4]}


@pytest.mark.long
def test_bench_plan_runs_three_plans_beside_their_predictions(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command end to end (small): three plans executed on 3 throttled
    ranks, each row with a measured and a predicted time (no claim on which
    is faster: that is a measurement, reported by the command, not a test)."""
    import json

    from gradfabric.cli import main

    code = main(["bench", "plan", "--speeds", "1,0.5,0.5", "--layers", "3", "--width", "64",
                 "--batch", "48", "--steps", "3", "--random", "1", "--repeats", "2", "--json",
                 "--out", str(tmp_path)])  # fmt: skip
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    names = [r["plan"] for r in rows]
    assert names[:3] == ["planner", "even-dp", "even-pipeline"]
    assert {"planner-calibrated", "proportional-dp", "random-0"} <= set(names)
    for r in rows:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["calibrated_ms"] > 0
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
        assert len(r["runs_ms"]) == 2 and min(r["runs_ms"]) <= r["measured_ms"] <= max(r["runs_ms"])
        assert 0 <= r["overrun_share"] <= 1


# a different split of the same 4 ranks: single-stage groups on ranks 0 and 2,
# a two-stage pipeline on ranks 1 and 3 cut after layer 1; 8 samples each
REPLAN = Plan(
    (
        Group((Stage(0, 0, 5),), batch=1.0),
        Group((Stage(1, 0, 2), Stage(3, 2, 5)), batch=1.0),
        Group((Stage(2, 0, 5),), batch=1.0),
    )
)


# the layers each rank holds under REPLAN and did not under PLAN
GAINED = {0: [2, 3, 4], 1: [0, 1], 2: [0, 1, 2], 3: [3, 4]}


def _replan_rank(rank: int, world: int, out: str) -> None:
    def sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    runner = PlanRunner(PLAN, _model(), nn.functional.mse_loss, 24, sgd, _data(0)[0][:1])
    for step in range(2):
        runner.step(*_data(step))
    runner, took = runner.replan(REPLAN)
    for step in range(2, 4):
        runner.step(*_data(step))
    torch.save((runner.module.state_dict(), took, runner.moved_bytes), f"{out}/{rank}.pt")


@pytest.mark.long
def test_a_replan_mid_training_moves_layers_and_optimizer_state_exactly() -> None:
    """Two steps under ``PLAN``, a re-plan to ``REPLAN`` (every layer changes
    owner somewhere), two more steps: the weights equal four full-batch steps
    of the unsplit model with the same momentum SGD (the momentum buffers must
    move with the layers: without them the third step differs by ~1e-2).
    Tolerance as above."""
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    want = ref.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_replan_rank, 4, (tmp,), deadline_s=240)
        for r in range(4):
            state, took, moved = torch.load(f"{tmp}/{r}.pt", weights_only=False)
            assert state and took > 0
            # only the layers a rank did not hold came to it, with their momentum
            assert moved == sum(2 * 8 * sum(p.numel() for p in ref[i].parameters())
                                for i in GAINED[r])  # fmt: skip
            for k, v in state.items():
                torch.testing.assert_close(v, want[k], atol=1e-12, rtol=0.0, msg=f"rank {r} {k}")


@pytest.mark.long  # (11 s on a slow day: the default suite's budget)
def test_train_plan_follows_the_controller_through_a_trace_and_trains_exactly() -> None:
    """The online controller re-plans across the built-in trace (device 1
    slows, device 0 leaves and returns) and the ranks move for real: the loss
    of every step equals the unsplit model's full-batch loss (float64; same
    tolerance argument as above, relative), no plan uses a device while it is
    gone, and each move sends exactly the layers the controller's migration
    term counts (its fp32 parameter bytes, here float64 and with momentum:
    4x the bytes).
    The other schedules of the comparison run in the same processes, each
    from a fresh model through the same trace, and train exactly alike."""
    from gradfabric.lab.plan_bench import ExecConfig
    from gradfabric.lab.train_plan import DEFAULT_TRACE, SCHEDULES, TrainPlanConfig, train_plan

    cfg = TrainPlanConfig(ExecConfig(layers=4, width=32, batch=48), steps_per_slot=2,
                          dtype="float64", calibrate=False, schedules=tuple(SCHEDULES))  # fmt: skip
    res = train_plan(cfg)
    sm = res["summary"]
    assert len(res["rows"]) == len(SCHEDULES) * len(DEFAULT_TRACE)
    assert sm["steps"] == 2 * len(DEFAULT_TRACE)
    assert sm["max_loss_rel_diff"] < 1e-12
    assert sm["last_loss"] < sm["first_loss"]
    for r in res["rows"]:
        used = {d for g in r["groups"] for d, _, _ in g}
        assert all(DEFAULT_TRACE[r["slot"]][d] > 0 for d in used), (r["schedule"], r["slot"], used)
        assert r["moved_mb"] == pytest.approx(4 * r["predicted_param_mb"], rel=1e-9)
    assert sm["migrations"] >= 1
    by = sm["schedules"]
    assert set(by) == set(SCHEDULES)
    assert by["static"]["replans"] == 0 and by["static"]["moved_mb"] == 0
    assert all(r["step_ms"] > 0 and r["dollars_per_1k_batches"] > 0 for r in by.values())
