"""The command line: JSON output, exit codes, results next to the resolved config."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from gradfabric.cli import main
from gradfabric.sim.dlcp import RELIABLE, VARIANTS

SMALL = {
    "name": "tiny",
    "models": ["resnet50"],
    "schemes": ["switchml", "ring"],
    "workers": 4,
    "fabric": {"link": {"link_gbps": 100.0}},
    "ina": {"train_packets": 64},
}


def test_simulate_json_and_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "res"
    code = main(["simulate", str(cfg), "--json", "--out", str(out)])
    res = json.loads(capsys.readouterr().out)
    assert {r["scheme"] for r in res["rows"]} == {"switchml", "ring"}
    for key in ("iteration_ms", "goodput_gbps", "mem_util", "ps_fallback"):
        assert all(key in r for r in res["rows"])
    # the simulator meets its analytic bounds (ring: 2(n-1)/n S/B plus hop
    # latencies; SwitchML: min(line rate, W payload / RTT)), so the exit is 0
    assert res["checks"] and all(c["within_5pct"] for c in res["checks"])
    assert code == 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["workers"] == 4 and resolved["ina"]["switchml_slots"] == 128
    assert json.loads((out / "results.json").read_text()) == res


def test_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "schemes": ["carrier-pigeon"]}))
    assert main(["simulate", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "schemes" in capsys.readouterr().err


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gpt2"]["params"] == 124_439_808


def test_unknown_experiment_exits_2(tmp_path: Path) -> None:
    assert main(["reproduce", "--only", "nonsense", "--out", str(tmp_path)]) == 2


@pytest.mark.long  # (the default suite's 10 minutes; CI's second pass runs it)
def test_experiment_saatp_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "experiment",
            "saatp",
            "--quick",
            "--models",
            "mlp",
            "--slowdowns",
            "1,4",
            "--iterations",
            "2",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows, cmp = lines[:8], lines[8:]
    assert len(rows) == 2 * 4  # two slowdowns x four schemes
    # one comparison per slowdown, SA-ATP against ATP from the runs above
    assert [c["slowdown"] for c in cmp] == sorted({r["slowdown"] for r in rows})
    for c in cmp:
        ms = {r["scheme"]: r["iter_time_ms"] for r in rows if r["slowdown"] == c["slowdown"]}
        assert c["atp_ms"] == ms["atp"] and c["saatp_ms"] == ms["saatp"]
        assert c["reduction"] == pytest.approx(1 - ms["saatp"] / ms["atp"])
    for r in rows:
        assert {"model", "workers", "stragglers", "slowdown", "scheme", "iter_time_ms"} <= set(r)
    assert {r["scheme"] for r in rows} == {"saatp", "atp", "switchml", "ring"}
    # results.json carries the claims as reproduce states them, oriented and judged
    claims = json.loads((tmp_path / "results.json").read_text())["claims"]
    fastest = max(c["speedup"] for c in cmp if c["slowdown"] > 1)
    head = next(c for c in claims if c["headline"])
    assert (head["setting"], head["speedup"]) == ("sim", fastest)
    assert head["met"] == (fastest >= 1.8)


@pytest.mark.long
def test_experiment_esa_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "experiment",
            "esa",
            "--pools",
            "512",
            "--loads",
            "0.7",
            "--jobs",
            "2",
            "--jitters-us",
            "0,200",
            "--train-packets",
            "64",
            "--schemes",
            "switchml,atp,esa",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in lines if "scheme" in r]
    cmp = lines[len(rows) :]
    assert all("scheme" not in c for c in cmp)
    assert {r["scheme"] for r in rows} == {"esa", "atp", "switchml"}
    # one comparison per jitter: ATP's average JCT over ESA's, per seed, averaged
    assert sorted(c["jitter_us"] for c in cmp) == [0.0, 200.0]
    for c in cmp:
        jct = {(r["scheme"], r["seed"]): r["avg_jct_s"] for r in rows
               if r["jitter_us"] == c["jitter_us"]}  # fmt: skip
        seeds = sorted({s for _, s in jct})
        assert c["seeds"] == len(seeds)
        gains = [jct["atp", s] / jct["esa", s] for s in seeds]
        assert c["improvement"] == pytest.approx(sum(gains) / len(gains))
    assert {r["jitter_us"] for r in rows} == {0.0, 200.0}
    for r in rows:
        assert {
            "scheme",
            "pool_slots",
            "load",
            "jobs",
            "avg_jct_s",
            "p99_jct_s",
            "mem_util",
        } <= set(r)
        assert r["jobs"] == 2 and r["avg_jct_s"] > 0
    claims = json.loads((tmp_path / "results.json").read_text())["claims"]
    assert [c["speedup"] for c in claims] == [max(c["improvement"] for c in cmp),
                                             min(c["improvement"] for c in cmp)]  # fmt: skip


def test_bench_omnireduce_json_checks_results(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", "omnireduce", "--size-mb", "1", "--iters", "1", "--densities", "0.05,1", "--json"]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0  # exit 1 would mean sparse and dense results differed
    assert [r["density"] for r in rows] == [0.05, 1.0]
    for r in rows:
        assert {
            "density",
            "ranks",
            "link_gbps",
            "gradfabric_ms",
            "dense_ms",
            "speedup",
            "floor_ratio",
        } <= set(r)
    assert rows[0]["sparse_path"] and rows[0]["bytes_ratio"] < 0.2
    assert rows[0]["path_ratio"] == 1.0  # 2 ranks: the gather path moves the floor's bytes
    assert not rows[1]["sparse_path"]  # dense input: the dense all-reduce is used


def test_plan_json_for_a_yaml_cluster_and_an_online_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from gradfabric.planner.cost import Device, Group, Plan, Stage, Workload, evaluate
    from gradfabric.planner.spec import load_cluster
    from gradfabric.workloads.catalog import model_spec

    yaml_file = Path(__file__).parents[2] / "src/gradfabric/configs/cluster-example.yaml"
    args = [str(yaml_file), "--model", "resnet50", "--batch", "256", "--slots", "4", "--json"]
    assert main(["plan", *args, "--out", str(tmp_path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {"batch_time_s", "cost_per_hour", "plan_time_s", "baselines"} <= set(got)
    assert {b["name"] for b in got["baselines"]} == {
        "even-dp", "proportional-dp", "even-pipeline", "hetpipe",
    }  # fmt: skip
    # the plan printed is the plan timed: its groups, re-read from the JSON and
    # costed by the model, give the reported time; no baseline beats it
    cluster = load_cluster(yaml_file)
    devs = [Device(i, t) for i, t in enumerate(cluster.expand())]
    printed = Plan(tuple(
        Group(tuple(Stage(*s) for s in g["stages"]), g["batch"]) for g in got["groups"]
    ))  # fmt: skip
    w = Workload.of(model_spec("resnet50"), 256)
    est = evaluate(w, devs, printed, cluster.link_latency_us * 1e-6)
    assert got["batch_time_s"] == pytest.approx(est.batch_time_s, rel=1e-12)
    assert sum(g["batch"] for g in got["groups"]) == 256
    assert all(got["batch_time_s"] <= b["batch_time_s"] for b in got["baselines"])
    assert got["online"]["slots"] == 4 and (tmp_path / "plan_batch_time.png").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_file.read_text().replace("type: v100", "type: p100"))
    assert main(["plan", str(bad)]) == 2  # a config error names the field and exits 2
    assert "devices[2].type" in capsys.readouterr().err


@pytest.mark.long
def test_experiment_dlcp_json_rows_and_bad_collective(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["experiment", "dlcp", "--quick", "--json", "--loads", "0.8", "--seeds", "2",
            "--out", str(tmp_path)]  # fmt: skip
    code = main([*args, "--collectives", "allreduce", "--no-convergence"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    transport = [r for r in rows if "scheme" in r]
    assert code == 0 and {r["baseline"] for r in transport} == {"allreduce"}
    assert {r["scheme"] for r in transport} == set(VARIANTS)
    for r in transport:
        assert {"scheme", "baseline", "load", "iter_time_ms", "p99_comm_ms"} <= r.keys()
        assert r["iter_time_ms"] > 0 and (r["lost"] == 0) == (r["scheme"] in RELIABLE)
    # the headline's baseline is the fastest reliable transport under the same routing
    for g in (r for r in rows if "routing" in r):
        spray = g["routing"] == "spray"
        same = [s for s in RELIABLE if VARIANTS[s].get("spray", True) == spray]
        mean = {s: sum(r["iter_time_ms"] for r in transport if r["scheme"] == s) for s in same}
        assert g["best"] == min(mean, key=mean.__getitem__)
    assert {r["routing"] for r in rows if "routing" in r} == {"spray", "ECMP"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == transport and (tmp_path / "config.yaml").exists()
    # the claim, from the gain at the highest load: only the ring ran, no accuracy study
    (claim,) = saved["claims"]
    gain = next(g["gain"] for g in rows if g.get("routing") == "spray")
    assert claim["speedup"] == pytest.approx(1 / (1 - gain)) and claim["setting"] == "sim"
    assert main([*args, "--collectives", "tree"]) == 2


@pytest.mark.long
def test_bench_ddp_json_rows_per_model_and_hook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two models, every hook (``ina`` through a local switch), 3 steps: one
    JSON row per model and hook with the documented keys; the replicas end
    where DDP's own did (bit for bit for the exact hooks at 2 ranks; the
    switch's block quantisation, ~5e-10 of a block's peak, for ``ina`` and
    for ``auto``, which may take the switch's path)."""
    from gradfabric.lab.daemon import switch_daemon

    with switch_daemon("--policy", "atp") as sw:
        code = main(["bench", "ddp", "--models", "mlp,neumf", "--steps", "3", "--warmup", "1",
                     "--switch", sw.control_text, "--json", "--out", str(tmp_path)])  # fmt: skip
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [(r["model"], r["hook"]) for r in rows] == [
        (m, h) for m in ("mlp", "neumf") for h in ("default", "omnireduce", "auto", "ina")
    ]
    for r in rows:
        keys = {"model", "ranks", "link_gbps", "hook", "iter_ms", "speedup_vs_default", "density"}
        assert keys <= set(r) and r["iter_ms"] > 0
        # the host's cores while rank 0 stepped: its own compute at least, never above all
        assert 0 < r["host_busy"] <= 1
        # (auto_hook has the switch too here, and may take its path)
        quantised = r["hook"] in ("ina", "auto")
        assert r["max_param_diff_vs_default"] <= (1e-6 if quantised else 0.0)
    # the switch's buckets on ina_hook's thread, in DDP's order, drawn as each step's timeline
    for r in rows:
        spans = r["bucket_spans_ms"]
        if r["hook"] == "ina":
            assert spans and all(0 <= a <= w <= b for a, w, b in spans)
            assert all(p[2] <= q[0] for p, q in itertools.pairwise(spans))
        elif r["hook"] == "default":
            assert spans is None  # (gloo's own threads)
    assert (tmp_path / "timeline.png").stat().st_size > 0
    # auto_hook takes NeuMF's tables by the rows looked up (bench ddp tracks them)
    neumf_auto = next(r for r in rows if (r["model"], r["hook"]) == ("neumf", "auto"))
    assert neumf_auto["paths"].get("rows", 0) > 0 and neumf_auto["density"] < 0.2


@pytest.mark.long
def test_bench_sim_runs_each_path_and_the_same_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench sim --json``: events/s per path that this checkout can run, each
    measured in its own child process on the same simulated work."""
    from gradfabric.experiments.simspeed import available_paths

    args = ["bench", "sim", "--workers", "2", "--train-packets", "16", "--repeats", "1"]
    assert main([*args, "--json", "--out", str(tmp_path / "b")]) == 0
    res = json.loads(capsys.readouterr().out)
    paths = available_paths()
    assert set(res["events_per_s"]) == set(paths) and res["granularity"] == "16-packet trains"
    assert all(v > 0 for v in res["events_per_s"].values())
    assert ("compiled_vs_python" in res) == ("mypyc" in paths)
    # asking for a path that was not built is a usage error, not a silent fallback
    # (``available_paths``: built and current, whatever path this process runs)
    if "mypyc" not in paths:
        assert main([*args, "--paths", "mypyc", "--out", str(tmp_path / "c")]) == 2
    assert main([*args, "--paths", "pypy", "--out", str(tmp_path / "d")]) == 2


@pytest.mark.long
def test_library_warnings_are_quiet_unless_verbose(tmp_path: Path) -> None:
    """In a network namespace every rank's c10d warns that it cannot name its
    client socket's host, which no user can act on: the CLI's ranks keep
    quiet (nothing on stderr), and ``--verbose`` lets the warnings through
    (so this test would see them if the quieting broke)."""
    import os
    import subprocess
    import sys

    from gradfabric.net import netns

    if not netns.usable():
        pytest.skip("needs root and network namespaces")
    args = ["bench", "ddp", "--models", "mlp", "--ranks", "2", "--steps", "2", "--warmup", "1",
            "--hooks", "default", "--link-gbps", "1", "--json", "--out", str(tmp_path)]  # fmt: skip
    cli = [sys.executable, "-m", "gradfabric.cli"]
    # as from a shell: not what an in-process main() of another test set here
    quieting = ("TORCH_CPP_LOG_LEVEL", "LOGLEVEL", "GRADFABRIC_QUIET")
    env = {k: v for k, v in os.environ.items() if k not in quieting}
    quiet = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=300, env=env)
    loud = subprocess.run([*cli, "--verbose", *args], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert quiet.returncode == loud.returncode == 0, quiet.stderr[-2000:] + loud.stderr[-2000:]
    assert quiet.stderr.strip() == ""
    assert "c10d" in loud.stderr


@pytest.mark.parametrize(
    ("change", "field"),
    [({"link_gbps": 0}, "link_gbps"), ({"gpus": 4}, "gpus"), ({"speeds": [1, 2]}, "speeds"),
     ({"devices": "tpu"}, "devices")],
)  # fmt: skip
def test_a_bad_cluster_file_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], field: str
) -> None:
    example = Path(__file__).parents[2] / "src/gradfabric/configs/emulated-cluster.yaml"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(example.read_text()), **change}))
    assert main(["bench", "plan", "--cluster", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert field in capsys.readouterr().err


def test_a_cluster_too_small_for_the_model_exits_2_naming_the_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).parents[2] / "src/gradfabric/configs/cluster-example.yaml"
    spec = yaml.safe_load(example.read_text())
    for t in spec["device_types"]:
        t["mem_gb"] = 0.001
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    assert main(["plan", str(cfg), "--model", "resnet50", "--out", str(tmp_path / "r")]) == 2
    assert "mem_gb" in capsys.readouterr().err


def test_a_cluster_whose_devices_cannot_hold_a_plan_exits_2_naming_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any process starts: the slow devices hold 1 MB, and the
    calibration's first plan puts the whole model on the slowest."""
    example = Path(__file__).parents[2] / "src/gradfabric/configs/emulated-cluster.yaml"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(example.read_text()),
                                   "memory_mb": [8192, 8192, 1, 1]}))  # fmt: skip
    assert main(["bench", "plan", "--cluster", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "memory_mb" in err and "device 3" in err


@pytest.mark.long
def test_experiment_sparse_train_tables_points_whose_options_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGD and Adam points run different options (with Adam also ``auto``
    on dense gradients): the printed table leaves a cell an option did not
    run as "-", and every point is stored."""
    import json

    args = ["experiment", "sparse-train", "--loopback", "--models", "neumf", "--ranks", "2",
            "--optimizers", "sgd,adam", "--steps", "3", "--warmup", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    points = {p["optimizer"]: p for p in res["points"]}
    assert set(points) == {"sgd", "adam"}
    assert "auto" in points["adam"]["ms"] and "auto" not in points["sgd"]["ms"]
    sgd_row = next(line for line in capsys.readouterr().out.splitlines() if " sgd " in line)
    assert " - " in sgd_row, sgd_row
