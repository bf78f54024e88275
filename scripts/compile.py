"""Build the DDP hooks' C++ extension against the torch this environment runs.

A torch extension is tied to the exact torch it was built with, so it is not
part of the package's own build (``setup.py`` builds the native engines, the
quantiser and the simulator's hot path): ``scripts/bootstrap.sh`` runs this
after installing. ``_fast_hook.json`` records the source's digest, the flags
and the torch version, and the hooks use the extension only while all three
still match (``gradfabric.collectives.fast``).

Where a C++ compiler is present and the build fails, this exits 1 (a build
error is an error); where there is none, or ``GRADFABRIC_PURE`` is set, it
builds nothing and says so.

    python scripts/compile.py            # build if missing or stale
    python scripts/compile.py --clean    # remove it
    python scripts/compile.py --force    # rebuild
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
HOOK = SRC / "gradfabric" / "collectives" / "_fast_hook.cpp"
MANIFEST = HOOK.with_suffix(".json")
FLAGS = ["-O3", "-Wall", "-Wextra", "-Werror"]  # (at -O2 GCC leaves ``sum_rows`` scalar)
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def wanted() -> dict[str, str]:
    """What a current build records (``collectives.fast`` reads the same)."""
    import torch

    source = hashlib.sha256(HOOK.read_bytes()).hexdigest()[:16]
    return {"source": source, "torch": torch.__version__, "flags": " ".join(FLAGS)}


def fresh() -> bool:
    try:
        built = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return False
    return built == wanted() and any(HOOK.parent.glob("_fast_hook*" + EXT_SUFFIX))


def remove() -> None:
    for old in HOOK.parent.glob("_fast_hook*" + EXT_SUFFIX):
        old.unlink()
    MANIFEST.unlink(missing_ok=True)


def build() -> None:
    """The build itself, in a child process (setuptools keeps global state)."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths

    # torch's headers as system headers: their warnings are not ours to fail on
    system = [f for d in include_paths() for f in ("-isystem", d)]
    os.chdir(SRC)
    setup(
        name="gradfabric-hook",
        ext_modules=[CppExtension(
            "gradfabric.collectives._fast_hook", [os.path.relpath(HOOK, SRC)],
            extra_compile_args=[*system, *FLAGS, f'-DGRADFABRIC_SOURCE="{wanted()["source"]}"'],
        )],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
        # (--force: setuptools would otherwise copy an older build of the same
        # source from its build directory, whatever flags it was built with)
        script_args=["build_ext", "--inplace", "--force", "--build-temp",
                     str(ROOT / "build" / "hook"), "-q"],
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the extension")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args()
    if args.clean or args.force:
        remove()
        if args.clean:
            print("compile: removed the C++ hook")
            return 0
    if os.environ.get("GRADFABRIC_PURE"):
        print("compile: GRADFABRIC_PURE is set; the hooks' Python path will run")
        return 0
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        print("compile: no C++ compiler found; the hooks' Python path will run", file=sys.stderr)
        return 0
    if fresh():
        print("compile: the C++ hook is up to date")
        return 0
    remove()
    t0 = time.perf_counter()
    log = ROOT / "build" / "hook.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        r = subprocess.run([sys.executable, __file__, "--_build"], stdout=out, stderr=out,
                           check=False)  # fmt: skip
    if r.returncode != 0:
        remove()
        sys.stderr.write(log.read_text())
        print("compile: the C++ hook did not build (above; also in build/hook.log)",
              file=sys.stderr)  # fmt: skip
        return 1
    MANIFEST.write_text(json.dumps(wanted()) + "\n")
    print(f"compile: the C++ hook built in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--_build"]:
        build()
        sys.exit(0)
    sys.exit(main())
