"""The layer rule: imports point down only, never in a circle.

Each package may import the packages listed for it here and nothing above.
The table is the team's design (core and wire at the bottom, the engines,
then the drivers (the simulator, and the UDP emulator over net), then torch
integration and the planner, then the lab that measures them (benches and
per-rank training programs), then experiments and the CLI), written where a
test can hold the code to it. Imports inside functions count too: a lazy
import upward is still upward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradfabric

ROOT = Path(gradfabric.__file__).parent
BELOW = {"_build": set(), "core": set(), "wire": {"core"}, "workloads": {"core"}}
BELOW["proto"] = {"core", "wire", "workloads"}
BELOW["sim"] = BELOW["proto"] | {"proto"}
BELOW["net"] = BELOW["proto"] | {"proto"}
BELOW["runtime"] = BELOW["net"] | {"net"}
BELOW["collectives"] = BELOW["runtime"] | {"runtime"}
BELOW["planner"] = BELOW["collectives"] | {"collectives", "sim"}
BELOW["lab"] = BELOW["planner"] | {"planner"}
BELOW["experiments"] = BELOW["lab"] | {"lab"}
BELOW["cli"] = BELOW["experiments"] | {"experiments"}


def _imports(path: Path) -> set[str]:
    """The gradfabric packages a module imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("gradfabric.") and n.count(".")}
    return out


def test_every_import_points_down() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0].removesuffix(".py")
        if package in ("__init__", "__main__"):
            continue
        assert package in BELOW, f"{rel}: a package the layer table does not place"
        # ``gradfabric._build`` (which path runs: compiled or sources) sits
        # beside the root ``__init__`` and any layer may ask it
        wrong += [f"{rel} imports gradfabric.{p}" for p in _imports(path) - BELOW[package]
                  if p not in (package, "_build")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_table_has_no_cycle() -> None:
    for pkg, below in BELOW.items():
        assert all(pkg not in BELOW[b] for b in below), pkg


def test_no_module_runs_past_600_lines() -> None:
    """A module past 600 lines (C included) is split where its parts are
    separate ideas."""
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*"))
            if p.suffix in (".py", ".c", ".h", ".cpp")
            and (n := len(p.read_text().splitlines())) > 600}  # fmt: skip
    assert not long, long


# What starts the rank and host processes of a run: from Python, or torchrun
# as a program. Only the launcher does; the grid executor (core/cells.py)
# runs an experiment's independent cells on a pool. (The services a run
# stands on, the switch daemon and background traffic, are programs their
# modules start with subprocess, as the namespaces' ``ip`` commands are.)
STARTS_PROCESSES = ("get_context(", ".Process(", "start_processes(", "mp.spawn(", ".Pool(",
                    "os.fork(", "torch.distributed.run")  # fmt: skip
LAUNCHERS = {"net/launch.py", "core/cells.py"}


def test_one_launcher_starts_every_run_s_processes() -> None:
    """Ranks and hosts start in ``net/launch.py`` alone, so every run gets
    the same rank life and the same naming of a dead or late peer."""
    elsewhere = sorted(f"{rel}: {what}" for p in ROOT.rglob("*.py")
                       if (rel := str(p.relative_to(ROOT))) not in LAUNCHERS
                       for what in STARTS_PROCESSES if what in p.read_text())  # fmt: skip
    assert not elsewhere, elsewhere


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(("gradfabric", *rel.parts)).removesuffix(".__init__")


def test_no_module_imports_itself_in_a_circle() -> None:
    """Module by module, imports under ``TYPE_CHECKING`` and inside functions
    included: a circle means two modules that are one idea, or a missing
    interface between them (the daemon and its control plane were one)."""
    modules = {_module_of(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                         else node.module for a in node.names}  # fmt: skip
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        # a package's face (its __init__) re-exports: an edge to it is an edge to what it names
        graph[name] = {d for d in deps if d in modules and d != name}
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                raise AssertionError(" -> ".join([*path[path.index(d):], d]))
            if d not in seen:
                visit(d, [*path, d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen and not m.endswith(("gradfabric", ".collectives", ".proto.switch")):
            visit(m, [m])


def _engine_state() -> dict[str, set[str]]:
    """Each attribute an engine keeps (``self.x = ...`` in a class with
    ``on_packet`` or ``receive_datagram``), and the modules that define it."""
    state: dict[str, set[str]] = {}
    for path in ROOT.joinpath("proto").rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            if not {f.name for f in cls.body if isinstance(f, ast.FunctionDef)} & {
                "on_packet", "receive_datagram"}:  # fmt: skip
                continue
            for t in _targets(cls):
                if isinstance(t.value, ast.Name) and t.value.id == "self":
                    state.setdefault(t.attr, set()).add(_module_of(path))
    return state


def _targets(tree: ast.AST) -> list[ast.Attribute]:
    """Every attribute assigned to in ``tree``."""
    out = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                   else [])  # fmt: skip
        for t in targets:
            out += [e for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                    if isinstance(e, ast.Attribute)]  # fmt: skip
    return out


# Attributes of objects that are not engines but share a name with an
# engine's state: a client's ``Call`` (its ``failed``), a DLCP client's
# count of DDP buckets (``buckets``).
NOT_ENGINES = {("call", "failed"), ("state", "buckets"), ("loop", "seq")}  # (and the simulator's
# event loop's insertion counter)


def test_no_driver_writes_an_engines_state() -> None:
    """Drivers and everything above them (the simulator, the sockets, the
    daemons and clients, the hooks, the lab) move an engine only through its
    calls: none assigns an attribute an engine keeps. (A C core that mirrored
    an engine once had its driver write a dozen of the engine's fields after
    each call.)"""
    state = _engine_state()
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in ("proto", "core", "wire", "workloads"):
            continue
        for t in _targets(ast.parse(path.read_text())):
            receiver = ast.unparse(t.value)
            if receiver not in ("self", "cls") and t.attr in state \
                    and (receiver, t.attr) not in NOT_ENGINES:  # fmt: skip
                wrong.append(f"{path.relative_to(ROOT)}:{t.lineno}: {receiver}.{t.attr}")
    assert not wrong, "\n".join(wrong)


def test_no_engine_writes_another_engines_state() -> None:
    """Engines compose by calls too: an engine module writes no attribute an
    engine of another module keeps, unless a class of its own keeps one by
    that name (its records: an aggregator's ``state``, a copy's ``seq``). A
    host's shadow stream gets its cap at construction, not assigned after."""
    state = _engine_state()
    wrong = []
    for path in sorted(ROOT.joinpath("proto").rglob("*.py")):
        module, tree = _module_of(path), ast.parse(path.read_text())
        own = {t.attr for t in _targets(tree) if ast.unparse(t.value) == "self"}
        own |= {f.target.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                for f in c.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
        for t in _targets(tree):
            receiver = ast.unparse(t.value)
            if receiver not in ("self", "cls") and t.attr in state and t.attr not in own \
                    and module not in state[t.attr]:  # fmt: skip
                wrong.append(f"{path.relative_to(ROOT)}:{t.lineno}: {receiver}.{t.attr}")
    assert not wrong, "\n".join(wrong)


# What a hook must reach of torch (and two of the standard library's), by name.
THIRD_PARTY_PRIVATE = {
    "_nnz", "_values", "_indices", "_check_comm_hook", "_comm_hooks", "_set_comm_hook_name",
    "_register_builtin_comm_hook", "_get_default_group", "_get_process_group_name",
    "_get_default_store", "_exit", "_Pointer",
}  # fmt: skip


def test_nothing_reaches_into_anothers_private_state() -> None:
    """``x._name`` is read or written only on ``self`` (or by the module that
    defines ``_name`` on some class of its own); torch's internals, which a
    hook must reach, are the exception, named here."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = {t.attr for t in _targets(tree) if ast.unparse(t.value) == "self"}
        own |= {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__"):  # fmt: skip
                continue
            receiver = ast.unparse(node.value)
            if receiver in ("self", "cls", "super()") or node.attr in THIRD_PARTY_PRIVATE:
                continue
            if node.attr not in own:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {receiver}.{node.attr}")
    assert not wrong, "\n".join(wrong)
