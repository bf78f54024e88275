"""Which modules are compiled (mypyc), and whether their extensions are current.

pip (``setup.py``) builds the modules in ``HOT`` into C extensions beside
their sources and writes ``_compiled.json`` (each source's hash). At import,
``gradfabric`` runs the extensions only if every source still has its
recorded hash; otherwise (an edited source, a checkout of another commit) it
warns and imports the ``.py`` files, so a stale build can never run code
that is not in the tree. ``GRADFABRIC_PURE=1`` chooses the sources too.

Only the standard library here: the build script imports this module before
anything is compiled.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# The simulator's hot path, compiled together: an attribute read across the
# compiled/interpreted boundary costs more than it saves, so the engines, the
# dispatcher, the packet and the simulator core go in one group.
HOT: tuple[str, ...] = (
    "wire.packet",
    "core.trace",
    "proto.actions",
    "proto.dispatch",
    "proto.routes",
    "proto.host",
    "proto.worker",
    "proto.ps",
    "proto.qos",
    "proto.switch.engine",
    "proto.switch.job",
    "proto.switch.switchml",
    "proto.switch.atp",
    "proto.switch.esa",
    "proto.switch.straggler",
    "proto.ring",
    "proto.rto",
    "proto.omni",
    "proto.dlcp",
    "proto.dctcp",
    "proto.priority",
    "sim.loop",
    "sim.network",
    "sim.collective",
    "sim.multijob",
    "sim.training",
    "sim.stragglers",
    "sim.dlcp",
)
GROUP = "gradfabric._hot"  # the shared library: gradfabric/_hot__mypyc.*.so
MANIFEST = "_compiled.json"
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _source(pkg: Path, module: str) -> Path:
    return pkg.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extensions(pkg: Path) -> list[Path]:
    """The compiled files in the package tree (shims and the shared library)."""
    return [p for p in pkg.rglob("*" + EXT_SUFFIX)]


def clean(pkg: Path) -> None:
    for p in extensions(pkg):
        p.unlink()
    (pkg / MANIFEST).unlink(missing_ok=True)


def digests(pkg: Path) -> dict[str, str]:
    """Each compiled module's source hash, taken when the compiler reads the
    sources: a source edited during the build then reads as stale after it."""
    return {m: _digest(_source(pkg, m)) for m in HOT}


def write_manifest(pkg: Path, manifest: dict[str, str]) -> None:
    (pkg / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def fresh(pkg: Path) -> bool:
    """A build exists and every compiled module's source is unchanged."""
    return not stale_modules(pkg) and (pkg / MANIFEST).exists()


def stale_modules(pkg: Path) -> list[str]:
    """Compiled modules whose source changed since the build (none if no build)."""
    path = pkg / MANIFEST
    if not path.exists():
        return []
    try:
        manifest: dict[str, str] = json.loads(path.read_text())
    except (OSError, ValueError):
        return list(HOT)
    return [
        m for m in HOT
        if manifest.get(m) is None or not _source(pkg, m).exists()
        or manifest[m] != _digest(_source(pkg, m))
    ]  # fmt: skip


class SourceOnly(importlib.abc.MetaPathFinder):
    """Import ``gradfabric``'s modules from their ``.py`` files even where a
    compiled extension sits beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("gradfabric.") or path is None:
            return None
        loaders = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, loaders).find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


def use_sources() -> None:
    if not any(isinstance(f, SourceOnly) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceOnly())


def compiled_path() -> str:
    """``"mypyc"`` if the hot path runs compiled in this process, else ``"python"``
    (where the import system finds the simulator's event loop)."""
    spec = importlib.util.find_spec("gradfabric.sim.loop")
    return "mypyc" if spec is not None and (spec.origin or "").endswith(EXT_SUFFIX) else "python"
