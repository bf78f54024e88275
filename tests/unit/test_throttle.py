"""The deadline throttle that turns host processes into slower devices.

A throttled stage must compute exactly what the bare stage computes (its
autograd hooks are identities), and its forward and backward must each last
at least the emulated device's time for the samples (``n * sample_s / 3 /
speed`` forward, twice that backward, the cost model's 1:2 split), the
backward counted from when its gradient arrives, not from the forward. These
are lower bounds: the sleep ends at or after its deadline, so no host noise can
make them fail. Calls whose real compute already passed the deadline are
counted as overruns.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from gradfabric.planner.pipeline import Throttled


def _stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("needs_grad", [False, True])  # a first stage, a later one
def test_a_throttled_stage_computes_the_same_and_takes_the_devices_time(needs_grad: bool) -> None:
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=needs_grad)
    bare, slow = _stage(), _stage()
    ref_out = bare(x)
    ref_out.sum().backward()  # type: ignore[no-untyped-call]
    ref_in = None if x.grad is None else x.grad.clone()
    x.grad = None

    sample_s, speed = 0.003, 0.5  # 12 samples: 24 ms forward, 48 ms backward
    throttled = Throttled(slow, speed, sample_s)
    t0 = time.perf_counter()
    out = throttled(x)
    forward_s = time.perf_counter() - t0
    time.sleep(0.03)  # between forward and backward: not the stage's time
    t1 = time.perf_counter()
    out.sum().backward()  # type: ignore[no-untyped-call]
    backward_s = time.perf_counter() - t1

    assert torch.equal(out, ref_out)
    for a, b in zip(slow.parameters(), bare.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert (x.grad is None) == (ref_in is None)
    if ref_in is not None:
        assert x.grad is not None and torch.equal(x.grad, ref_in)
    budget = 12 * sample_s / 3 / speed
    assert forward_s >= budget and backward_s >= 2 * budget
    assert throttled.clock.calls == 2  # the forward's deadline and the backward's


def test_calls_past_their_deadline_are_counted_as_overruns() -> None:
    throttled = Throttled(_stage(), 1.0, sample_s=1e-12)  # a device far faster than the host
    throttled(torch.randn(4, 8, dtype=torch.float64)).sum().backward()  # type: ignore[no-untyped-call]
    s = throttled.clock.stats()
    assert s["calls"] == s["overruns"] == 2 and s["overrun_s"] > 0 and s["late_s"] == 0
