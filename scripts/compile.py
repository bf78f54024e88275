"""Compile the simulator's hot path with mypyc, in place beside its sources.

The modules in ``gradfabric._build.HOT`` (the protocol engines, the
dispatcher, the wire packet and the simulator core) are the same typed Python
that runs everywhere; mypyc turns them into C extensions that Python imports
in preference to the ``.py`` files. Where there is no C compiler, or the
build fails, nothing is left behind and the pure-Python modules run.

A manifest (``src/gradfabric/_compiled.json``) records each compiled
source's hash; ``gradfabric`` refuses extensions whose sources have changed
since (it warns and runs the sources), and this script rebuilds only then.

    python scripts/compile.py            # build if missing or stale
    python scripts/compile.py --clean    # remove the extensions
    python scripts/compile.py --force    # rebuild
"""

from __future__ import annotations

import argparse
import importlib.util
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the compiled extensions")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args()
    if args.clean or args.force:
        _build.clean(SRC / "gradfabric")
        if args.clean:
            print("compile: removed the compiled extensions")
            return 0
    pkg = SRC / "gradfabric"
    if _build.fresh(pkg):
        print("compile: the compiled hot path is up to date")
        return 0
    if os.environ.get("GRADFABRIC_PURE"):
        print("compile: GRADFABRIC_PURE is set; the pure-Python modules will run")
        return 0
    if compiler() is None:
        print("compile: no C compiler found; the pure-Python modules will run", file=sys.stderr)
        return 0
    _build.clean(pkg)
    t0 = time.perf_counter()
    # In a child process: setuptools and mypyc keep global state, and a failed
    # build must leave nothing half-written behind.
    log = ROOT / "build" / "mypyc.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        r = subprocess.run(
            [sys.executable, __file__, "--_build"], stdout=out, stderr=out, check=False
        )
    if r.returncode != 0:
        _build.clean(pkg)
        print(f"compile: mypyc build failed (see {log}); the pure-Python modules will run",
              file=sys.stderr)  # fmt: skip
        return 0
    _build.write_manifest(pkg)
    print(f"compile: {len(_build.HOT)} modules compiled with mypyc "
          f"in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--_build"]:
        build()
        sys.exit(0)
    sys.exit(main())
