"""Config files: errors name the field and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradfabric.core.config import dump, load, load_yaml
from gradfabric.core.errors import ConfigError
from gradfabric.experiments.baselines import builtin_config
from gradfabric.experiments.simulate import SimulateConfig


def test_builtin_config_round_trips() -> None:
    cfg = builtin_config()
    assert cfg.models == ("resnet50", "vgg16") and cfg.workers == 8
    assert cfg.fabric.link.link_gbps == 100.0
    assert load(SimulateConfig, dump(cfg)) == cfg


@pytest.mark.parametrize(
    "data, field, allowed",
    [
        ({"schemes": ["switchml", "tcp"]}, "schemes", "ring"),
        ({"models": ["alexnet"]}, "models", "resnet50"),
        ({"fabric": {"topology": "torus"}}, "fabric.topology", "leaf_spine"),
        ({"fabric": {"link": {"loss": 2.0}}}, "fabric.link.loss", "[0, 1)"),
        ({"fabric": {"link": {"bandwidth": 1}}}, "fabric.link.bandwidth", "link_gbps"),
        ({"ina": {"switchml_slots": 0}}, "ina.switchml_slots", ">= 1"),
        ({"workers": "eight"}, "workers", "int"),
    ],
)
def test_errors_name_the_field(data: dict, field: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(SimulateConfig, data)
    assert e.value.field == field
    assert allowed in str(e.value)


def test_optional_nested_configs_load_as_their_class() -> None:
    """``fabric_link`` and ``uplink`` (``LinkSpec | None``) load as links, not
    dicts, in the compiled simulator too (mypyc keeps only ``type`` for a
    union in a class's annotations) and in the pure one; a round trip holds."""
    from gradfabric.sim.collective import FabricConfig
    from gradfabric.sim.network import LinkSpec

    data = {"topology": "leaf_spine", "fabric_link": {"link_gbps": 400.0}, "uplink": None}
    f = load(FabricConfig, data)
    assert f.fabric_link == LinkSpec(link_gbps=400.0) and f.uplink is None
    assert load(FabricConfig, dump(f)) == f
    with pytest.raises(ConfigError, match=r"fabric_link\.link_gbp"):
        load(FabricConfig, {"fabric_link": {"link_gbp": 1.0}})


def test_bad_yaml_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("models: [resnet50\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_yaml(SimulateConfig, p)


def test_a_native_switch_datapath_it_cannot_serve_is_a_config_error() -> None:
    """``switch serve --datapath native`` names why it cannot serve: a policy
    other than SwitchML, ATP, ESA, PS and DLCP, DLCP's shaped port or
    impairments (they run in the reference), or no build; ATP's PS behind
    modelled links and DLCP's server behind an unshaped port it serves."""
    from gradfabric.net import switchpath
    from gradfabric.runtime.impair import Impairment
    from gradfabric.runtime.switchd import SwitchConfig

    for kw in (
        {"policy": "dlcp", "port_mbps": 50.0}, {"policy": "omni"},
        {"policy": "switchml", "impair": Impairment(loss=0.1)},
    ):  # fmt: skip
        with pytest.raises(ConfigError, match="datapath: native cannot serve"):
            SwitchConfig(datapath="native", **kw)  # type: ignore[arg-type]
        assert SwitchConfig(**kw).native_unsuitable() is not None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="datapath: one of auto, native, python"):
        SwitchConfig(datapath="fast")
    for policy in ("switchml", "atp", "esa", "ps", "dlcp"):
        serves = SwitchConfig(policy=policy).native_unsuitable() is None
        assert serves == (switchpath.PATH == "compiled")
    for policy in ("atp", "esa"):
        serves = SwitchConfig(policy=policy, ps_link_mbps=100.0).native_unsuitable() is None
        assert serves == (switchpath.PATH == "compiled")
    assert SwitchConfig(policy="switchml", datapath="python").native_unsuitable() is not None


@pytest.mark.parametrize(
    ("hooks", "ok"),
    [
        (("default", "ina@16"), True),
        (("default", "default@32", "omnireduce@0.5"), True),
        (("default", "ina@4/16"), True),
        (("default", "ina@4/0"), False),
        (("default", "ina@0"), False),
        (("default", "ina@x"), False),
        (("default", "nope@4"), False),
        (("default", "default"), False),
    ],
)
def test_bench_ddp_hooks_with_their_own_bucket_caps(hooks: tuple[str, ...], ok: bool) -> None:
    """``bench ddp --hooks default,ina@16``: a replica's own bucket cap (or
    caps, ``@4/16``: DDP's ``bucket_cap_mb_list``); a
    cap that is not a positive number, an unknown hook or a hook twice is a
    ValueError naming the hooks."""
    from gradfabric.lab.ddp_bench import DdpBenchConfig, bucket_caps, hook_name

    if not ok:
        with pytest.raises(ValueError, match="hook"):
            DdpBenchConfig(hooks=hooks, switch_policy="switchml")
        return
    DdpBenchConfig(hooks=hooks, switch_policy="switchml")
    caps = {hook_name(h): bucket_caps(h, 4.0) for h in hooks[1:]}
    assert caps in ({"ina": [16.0]}, {"ina": [4.0, 16.0]}, {"default": [32.0], "omnireduce": [0.5]})


@pytest.mark.parametrize(("hooks", "steps", "block"), [(3, 7, 1), (3, 7, 2), (2, 9, 4), (4, 5, 8)])
def test_bench_ddp_runs_every_replica_through_every_step_in_order(
    hooks: int, steps: int, block: int
) -> None:
    """``bench ddp --block N``: each replica takes every step once, in order,
    ``N`` in a row; every round starts with another replica; with ``N`` 1 a
    step's replicas run back to back, as before the option existed."""
    from gradfabric.lab.ddp_bench import DdpBenchConfig, _schedule

    names = [f"h{k}" for k in range(hooks)]
    order = _schedule(names, steps, block)
    assert len(order) == hooks * steps
    for h in names:
        assert [s for s, g in order if g == h] == list(range(steps))
    at = 0
    for k, start in enumerate(range(0, steps, block)):
        span = list(range(start, min(start + block, steps)))
        this = order[at : at + hooks * len(span)]  # round k: each replica's run in turn
        at += len(this)
        assert this[0][1] == names[k % hooks]
        assert all([s for s, g in this if g == h] == span for h in names)
        assert all(len({g for _, g in this[j : j + len(span)]}) == 1
                   for j in range(0, len(this), len(span)))  # fmt: skip
    with pytest.raises(ValueError, match="block"):
        DdpBenchConfig(block=0)


def test_bench_ddp_timeline_takes_medians_over_the_steps_with_the_usual_bucket_count() -> None:
    """``bench ddp``'s ``bucket_spans_ms``: per bucket, the median start and
    end (seconds in, ms out) over the steps that served the most common number
    of buckets; a step with another count (a rebuilt bucket layout, the first
    steps' larger buckets) is left out; no job at all gives ``None``."""
    from gradfabric.lab.ddp_bench import timeline

    steps = [
        [(0.010, 0.011, 0.020), (0.020, 0.020, 0.050)],
        [(0.012, 0.019, 0.030), (0.031, 0.035, 0.040)],
        [(0.001, 0.001, 0.090)],  # another count: not in the medians
        [(0.014, 0.015, 0.025), (0.026, 0.027, 0.060)],
    ]
    assert timeline(steps) == [(12.0, 15.0, 25.0), (26.0, 27.0, 50.0)]
    assert timeline([[], []]) is None and timeline([]) is None



def test_reproduce_s_ddp_note_says_how_busy_the_host_was() -> None:
    """``reproduce``'s DDP claim states the host's busy share beside the
    default hook's where both rows read it, and nothing where one did not."""
    from gradfabric.experiments.emulator import _busy

    ina = {"cores": 2, "host_busy": 0.8049}
    default = {"cores": 2, "host_busy": 0.3361}
    assert _busy(ina, default).startswith("; the host's 2 cores busy 80% of the step against 34%")
    assert _busy(ina, {**default, "host_busy": None}) == ""
    assert _busy({"cores": 2}, default) == ""
