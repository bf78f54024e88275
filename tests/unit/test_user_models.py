"""A user's own model (``package.module:callable``) and a recorded PyTorch
execution trace, as the simulator's workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ExecutionTraceObserver

from gradfabric.cli import main
from gradfabric.core.errors import ConfigError
from gradfabric.wire.packet import wire_bytes
from gradfabric.workloads.catalog import model_spec
from gradfabric.workloads.compute import device, timeline
from gradfabric.workloads.trace import trace_timeline

MODULE = '''
import torch
from torch import nn

def build():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1, groups=2),
        nn.ReLU(), nn.Flatten(), nn.Linear(64 * 16 * 16, 512), nn.ReLU(), nn.Linear(512, 10),
    )
    return model, (torch.empty(1, 3, 16, 16),)
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_net.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_net:build"


def record(name: str, batch: int, path: Path) -> None:
    from gradfabric.workloads.catalog import user_builder

    model, inputs = user_builder(name)()
    x = torch.randn(batch, *inputs[0].shape[1:])
    et = ExecutionTraceObserver().register_callback(str(path))
    et.start()
    model(x).sum().backward()
    et.stop()
    et.unregister_callback()


def test_a_user_module_is_profiled_like_the_catalog_s_models(user_module: str) -> None:
    spec = model_spec(user_module)
    assert spec.params == 3 * 32 * 9 + 32 + 32 // 2 * 64 * 9 + 64 + 64 * 256 * 512 + 512 + 5130
    conv2 = 2 * 16 * 9 * 64 * 16 * 16  # 2 Cin/groups kh kw per output element
    assert spec.layers[1].fwd_flops == conv2 + 64 * 16 * 16  # and its bias


def test_a_recorded_trace_gives_the_model_s_gradients_and_forward_flops(
    user_module: str, tmp_path: Path
) -> None:
    """Against the catalog's hook-based profile of the same module: every
    gradient once, in buckets, and the forward's FLOPs (the trace counts
    products and convolutions, the hooks also biases: within 1%)."""
    batch = 4
    record(user_module, batch, tmp_path / "step.json")
    dev = device("a100")
    got = trace_timeline(str(tmp_path / "step.json"), dev, bucket_mb=1.0)
    spec = model_spec(user_module)
    want = timeline(spec, batch, dev, bucket_mb=1.0)
    assert sum(b.values for b in got.buckets) == spec.params
    assert [b.values for b in got.buckets] == [b.values for b in want.buckets]
    assert got.forward_ns == pytest.approx(want.forward_ns, rel=0.01)
    # backward: no gradient for the input, so less than the 2x-forward rule
    assert want.forward_ns < got.backward_ns <= want.backward_ns
    assert [b.ready_ns for b in got.buckets] == sorted(b.ready_ns for b in got.buckets)


def test_simulate_runs_a_user_module_and_a_trace_at_1024_workers(
    user_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record(user_module, 8, tmp_path / "step.json")
    for model in ("--module", user_module), ("--trace", str(tmp_path / "step.json")):
        assert main(["simulate", *model, "--workers", "1024", "--schemes", "switchml,ring",
                     "--json", "--out", str(tmp_path / "r")]) == 0  # fmt: skip
        rows = {r["scheme"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
        assert set(rows) == {"switchml", "ring"}
        assert all(r["workers"] == 1024 and r["mode"] == "flow" for r in rows.values())
        # the whole model through one 100 Gbit/s NIC, and the ring's 2(n-1)/n of it
        floor_ms = wire_bytes(model_spec(user_module).params, 256) / 12.5 / 1e6
        assert floor_ms <= rows["switchml"]["comm_only_ms"] <= 1.02 * floor_ms
        assert rows["ring"]["comm_only_ms"] >= 2 * 1023 / 1024 * floor_ms


def test_a_module_that_is_not_there_or_not_a_model_is_a_config_error(user_module: str) -> None:
    with pytest.raises(ConfigError, match="model"):
        model_spec("no_such_module:build")
    with pytest.raises(ConfigError, match="model"):
        model_spec("my_net:nothing")
    with pytest.raises(ConfigError, match="model"):
        trace_timeline("missing.json", device("a100"))


def test_a_callable_that_builds_no_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="model"):
        model_spec("json:dumps")  # wants an argument
    with pytest.raises(ConfigError, match="model"):
        model_spec("builtins:list")  # returns no (module, inputs)
