"""Compile the simulator's hot path with mypyc, and the DDP hooks' C++ fast path.

The modules in ``gradfabric._build.HOT`` (the protocol engines, the
dispatcher, the wire packet and the simulator core) are the same typed Python
that runs everywhere; mypyc turns them into C extensions that Python imports
in preference to the ``.py`` files. Where there is no C compiler, or the
build fails, nothing is left behind and the pure-Python modules run.

A manifest (``src/gradfabric/_compiled.json``) records each compiled
source's hash; ``gradfabric`` refuses extensions whose sources have changed
since (it warns and runs the sources), and this script rebuilds only then.

The switch clients' block-exponent quantiser (``wire/_fastquant.c``, see
``gradfabric.wire.fastquant``) and the workers' datapath (``net/_datapath.c``,
see ``gradfabric.net.datapath``) are small C libraries loaded with ctypes,
built with the C compiler alone; ``NAME.json`` records each source's digest,
and they serve only while that still matches (``gradfabric.core.native``).

The DDP hooks' dense calls run in a small C++ extension
(``collectives/_fast_hook.cpp``, see ``gradfabric.collectives.fast``), built
against the installed torch; ``_fast_hook.json`` records its source's digest
and the torch version, and the hooks use it only while both still match.

    python scripts/compile.py            # build if missing or stale
    python scripts/compile.py --clean    # remove the extensions
    python scripts/compile.py --force    # rebuild
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# Only this module, by path: importing the package would judge (and warn
# about) the very build this script is about to replace.
_spec = importlib.util.spec_from_file_location("_build", SRC / "gradfabric" / "_build.py")
assert _spec is not None and _spec.loader is not None
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)


def compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(os.environ.get("CC", cc)) or shutil.which("cc") or shutil.which("gcc")


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    sources = [str(SRC / "gradfabric" / m.replace(".", "/")) + ".py" for m in _build.HOT]
    os.chdir(SRC)  # mypyc names modules from paths relative to the working directory
    rel = [os.path.relpath(s, SRC) for s in sources]
    setup(
        name="gradfabric-hot",
        packages=[],
        ext_modules=mypycify(
            rel, opt_level="3", group_name=_build.GROUP, target_dir=str(ROOT / "build" / "mypyc")
        ),
        script_args=["build_ext", "--inplace", "--build-temp", str(ROOT / "build" / "mypyc"), "-q"],
    )


HOOK = SRC / "gradfabric" / "collectives" / "_fast_hook.cpp"
HOOK_MANIFEST = HOOK.with_suffix(".json")
HOOK_FLAGS = ["-O3"]  # (at -O2 GCC leaves ``sum_rows``'s sums and division scalar)


def hook_wanted() -> dict[str, str]:
    """What a current build of the C++ hook records (``collectives.fast`` reads
    its source and torch; the flags make a build with other flags stale)."""
    import hashlib

    import torch

    source = hashlib.sha256(HOOK.read_bytes()).hexdigest()[:16]
    return {"source": source, "torch": torch.__version__, "flags": " ".join(HOOK_FLAGS)}


def hook_fresh() -> bool:
    try:
        built = json.loads(HOOK_MANIFEST.read_text())
    except (OSError, ValueError):
        return False
    return built == hook_wanted() and any(HOOK.parent.glob("_fast_hook*" + _build.EXT_SUFFIX))


def build_hook() -> None:
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    os.chdir(SRC)
    source = hook_wanted()["source"]
    setup(
        name="gradfabric-hook",
        ext_modules=[CppExtension(
            "gradfabric.collectives._fast_hook", [os.path.relpath(HOOK, SRC)],
            extra_compile_args=[*HOOK_FLAGS, f'-DGRADFABRIC_SOURCE="{source}"'],
        )],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
        # (--force: setuptools would otherwise copy an older build of the same
        # source from its build directory, whatever flags it was built with)
        script_args=["build_ext", "--inplace", "--force", "--build-temp",
                     str(ROOT / "build" / "hook"), "-q"],
    )  # fmt: skip


def _child(step: str, log: Path) -> bool:
    """Run ``step`` of this script in a child process (setuptools keeps global
    state, and a failed build must leave nothing half-written); its output to ``log``."""
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        r = subprocess.run([sys.executable, __file__, step], stdout=out, stderr=out, check=False)
    return r.returncode == 0


def _remove_hook() -> None:
    for old in HOOK.parent.glob("_fast_hook*" + _build.EXT_SUFFIX):
        old.unlink()
    HOOK_MANIFEST.unlink(missing_ok=True)


def compile_hook() -> None:
    if hook_fresh():
        print("compile: the C++ hook is up to date")
        return
    _remove_hook()
    t0 = time.perf_counter()
    log = ROOT / "build" / "hook.log"
    if not _child("--_build_hook", log):
        _remove_hook()
        print(f"compile: the C++ hook did not build (see {log}); the hooks' Python path will run",
              file=sys.stderr)  # fmt: skip
        return
    HOOK_MANIFEST.write_text(json.dumps(hook_wanted()) + "\n")
    print(f"compile: the C++ hook built in {time.perf_counter() - t0:.0f} s")


# The small C libraries loaded with ctypes (``gradfabric.core.native``).
LIBRARIES = (
    SRC / "gradfabric" / "wire" / "_fastquant.c",  # the clients' quantiser
    SRC / "gradfabric" / "net" / "_datapath.c",  # the workers' datapath
    SRC / "gradfabric" / "net" / "_switchpath.c",  # the switch daemon's datapath
)


def compile_library(cc: str, source: Path) -> None:
    """One C library beside its source, with the source's digest in its
    manifest; no fused or reassociated floating point, so the quantiser's
    results stay the numpy reference's bit for bit."""
    import hashlib

    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    library, manifest = source.with_suffix(".so"), source.with_suffix(".json")
    try:
        if json.loads(manifest.read_text()) == {"source": digest} and library.exists():
            print(f"compile: {source.name} is up to date")
            return
    except (OSError, ValueError):
        pass
    manifest.unlink(missing_ok=True)
    tmp = library.with_suffix(".so.tmp")
    cmd = [cc, "-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared",
           f'-DGRADFABRIC_SOURCE="{digest}"', "-o", str(tmp), str(source), "-lm"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        print(f"compile: {source.name} did not build; its Python reference will run\n{r.stderr}",
              file=sys.stderr)  # fmt: skip
        return
    tmp.replace(library)
    manifest.write_text(json.dumps({"source": digest}) + "\n")
    print(f"compile: {source.name} built")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the compiled extensions")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args()
    if args.clean or args.force:
        _build.clean(SRC / "gradfabric")  # the hook's extension too
        HOOK_MANIFEST.unlink(missing_ok=True)
        for source in LIBRARIES:
            source.with_suffix(".json").unlink(missing_ok=True)
            source.with_suffix(".so").unlink(missing_ok=True)
        if args.clean:
            print("compile: removed the compiled extensions")
            return 0
    if os.environ.get("GRADFABRIC_PURE"):
        print("compile: GRADFABRIC_PURE is set; the pure-Python modules will run")
        return 0
    cc = compiler()
    if cc is None:
        print("compile: no C compiler found; the pure-Python modules will run", file=sys.stderr)
        return 0
    for source in LIBRARIES:
        compile_library(cc, source)
    compile_hot()
    compile_hook()  # after: a mypyc build removes every extension first
    return 0


def compile_hot() -> None:
    pkg = SRC / "gradfabric"
    if _build.fresh(pkg):
        print("compile: the compiled hot path is up to date")
        return
    _build.clean(pkg)
    t0 = time.perf_counter()
    log = ROOT / "build" / "mypyc.log"
    if not _child("--_build", log):
        _build.clean(pkg)
        print(f"compile: mypyc build failed (see {log}); the pure-Python modules will run",
              file=sys.stderr)  # fmt: skip
        return
    _build.write_manifest(pkg)
    print(f"compile: {len(_build.HOT)} modules compiled with mypyc "
          f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] in (["--_build"], ["--_build_hook"]):
        (build if sys.argv[1] == "--_build" else build_hook)()
        sys.exit(0)
    sys.exit(main())
