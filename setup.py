"""gradfabric's native code, built by pip like any package's (``pip install .``
or ``pip install -e .``); everything else is declared in ``pyproject.toml``.

Two kinds of native code, each the same behaviour as Python that also ships:

* **The native engines and the quantiser**: C libraries beside their Python
  reference (``NATIVE``), loaded with ctypes (``gradfabric.core.native``).
  Built with ``-Wall -Wextra -Werror`` and hidden symbols (only what a
  source marks ``GF_API`` is exported); each carries its source's digest,
  so a library older than its source is never loaded.
* **The simulator's hot path**: the typed Python modules of
  ``gradfabric._build.HOT``, compiled with mypyc where it is importable (it is
  a build requirement), a manifest of their sources beside them.

A build that fails fails the install: nothing falls back silently. Two cases
build nothing, on purpose, and say so: ``GRADFABRIC_PURE=1`` (the reference
everywhere) and a machine with no C compiler (the same code runs as Python).
The DDP hooks' C++ extension is tied to the exact torch it runs with, so it
is built against the installed torch afterwards (``scripts/compile.py``).

Working on the C: ``GRADFABRIC_MYPYC=0 python setup.py build_ext --inplace``
rebuilds the C libraries alone, in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PKG = ROOT / "src" / "gradfabric"
# The C libraries: (module, sources, headers). The digest of all of them, in
# this order, names the build (``core.native`` computes the same).
NATIVE = (
    ("gradfabric.wire._fastquant", ["wire/_fastquant.c"], []),
    ("gradfabric.net._worker", ["net/native/worker.c"],
     ["net/native/worker.h", "net/native/wire.h"]),
    ("gradfabric.net._switch",
     ["net/native/switch_node.c", "net/native/switch_pool.c", "net/native/switch_ps.c",
      "net/native/switch_help.c", "net/native/switch_dlcp.c",
      "net/native/switch_dlcp_classes.c"],
     ["net/native/switch.h", "net/native/dlcp.h", "net/native/wire.h"]),
    ("gradfabric.net._udp", ["net/native/udp.c"], ["net/native/wire.h"]),
    ("gradfabric.net._host", ["net/native/host.c"], ["net/native/wire.h"]),
    ("gradfabric.net._dlcp", ["net/native/dlcp_client.c", "net/native/switch_dlcp_classes.c"],
     ["net/native/dlcp.h", "net/native/wire.h"]),
)  # fmt: skip
C_FLAGS = [
    "-O3", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
    # no fused or reassociated floating point: the quantiser's results stay
    # the numpy reference's bit for bit
    "-fno-math-errno", "-ffp-contract=off", "-std=gnu11",
]  # fmt: skip


def _load_build_module():  # type: ignore[no-untyped-def]
    """``gradfabric._build`` by path: the package itself is not importable yet."""
    spec = importlib.util.spec_from_file_location("_gf_build", PKG / "_build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BUILD = _load_build_module()
HOT_GROUP = BUILD.GROUP


def source_digest(paths: list[Path]) -> str:
    """What ``core.native.digest`` computes from the shipped sources."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def native_extensions() -> list[Extension]:
    out = []
    for name, rel, headers in NATIVE:
        sources, depends = [PKG / r for r in rel], [PKG / h for h in headers]
        digest = source_digest(sources + depends)
        out.append(Extension(
            name, [str(s.relative_to(ROOT)) for s in sources],
            depends=[str(h.relative_to(ROOT)) for h in depends],
            extra_compile_args=[*C_FLAGS, f'-DGRADFABRIC_SOURCE="{digest}"'],
            extra_link_args=["-lm"],
        ))  # fmt: skip
    return out


class BuildNative(build_ext):
    """``build_ext`` that adds mypyc's extensions when the build is set up
    (not when setup.py is read: metadata steps then need no type check of
    the package) and writes the hot path's manifest after the build."""

    def finalize_options(self) -> None:
        exts = self.distribution.ext_modules
        mypyc = os.environ.get("GRADFABRIC_MYPYC", "1") != "0"  # 0: the C libraries alone
        if exts and mypyc and not any(e.name.startswith(HOT_GROUP) for e in exts):
            try:
                from mypyc.build import mypycify
            except ImportError:
                print("gradfabric: mypyc is not installed; the simulator runs as Python",
                      file=sys.stderr)  # fmt: skip
            else:
                hot = [f"src/gradfabric/{m.replace('.', '/')}.py" for m in BUILD.HOT]
                # mypy's defaults, not the project's strict config: the build
                # environment may lack torch and numpy, whose types then read
                # as Any (the type check is CI's, not the build's)
                options = ["--config-file", os.devnull, "--ignore-missing-imports"]
                self.digests = BUILD.digests(PKG)  # as mypyc reads them, just below
                exts += mypycify([*options, *hot], opt_level="3", group_name=HOT_GROUP,
                                 target_dir="build/mypyc")  # fmt: skip
        super().finalize_options()

    def run(self) -> None:
        super().run()
        if any(e.name.startswith(HOT_GROUP) for e in self.extensions):
            pkg = PKG if self.inplace else Path(self.build_lib) / "gradfabric"
            BUILD.write_manifest(pkg, getattr(self, "digests", None) or BUILD.digests(pkg))

    def get_export_symbols(self, ext: Extension) -> list[str]:
        # the C libraries are loaded with ctypes and define no PyInit_*
        return [] if ext.name in {n for n, *_ in NATIVE} else super().get_export_symbols(ext)


def extensions() -> list[Extension]:
    if os.environ.get("GRADFABRIC_PURE"):
        print("gradfabric: GRADFABRIC_PURE is set; building no native code", file=sys.stderr)
        return []
    if compiler() is None:
        print("gradfabric: no C compiler found; the reference engines run as Python",
              file=sys.stderr)  # fmt: skip
        return []
    return native_extensions()


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})
