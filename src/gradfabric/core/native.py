"""Loading the project's C libraries (ctypes), and only while current.

A library here is a C source (and its parts) beside the Python module that
wraps it: the clients' quantiser ``wire/_fastquant.c``, the native engines
under ``net/``. pip builds each (``setup.py``, ``-Wall -Wextra -Werror``)
into ``NAME{EXT_SUFFIX}`` beside its source, with the sources' digest
compiled in (``gf_source()``). A wrapper uses the library only while that
digest still matches the sources on disk and ``GRADFABRIC_PURE`` is unset;
otherwise its Python reference serves, with the reason kept for
``gradfabric --version``.

Only the standard library: the switch daemon, which never imports torch or
numpy-heavy code paths, may load these too.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import shutil
import sysconfig
from pathlib import Path

COMPILED, PYTHON = "compiled", "python"
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
REBUILD = "pip install -e . (or scripts/bootstrap.sh) rebuilds it"


def digest(sources: Path | list[Path]) -> str:
    """The digest a build of ``sources`` carries (``setup.py`` computes the same)."""
    h = hashlib.sha256()
    for p in [sources] if isinstance(sources, Path) else sources:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def library_path(library: Path) -> Path:
    """Where pip put ``library`` (a module's path without its suffix)."""
    return library.with_name(library.name + EXT_SUFFIX)


def compiler_present() -> bool:
    """Whether this machine has the C compiler a build would use."""
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return any(shutil.which(c) for c in (cc, "cc", "gcc"))


def expected() -> bool:
    """Whether the native libraries must serve here: a compiler is present and
    nobody asked for the reference (tests fail, not skip, where they do not)."""
    return compiler_present() and not os.environ.get("GRADFABRIC_PURE")


Signature = tuple[str, list[type], type | None]  # a function's name, argtypes, restype


def load(
    library: Path, sources: list[Path], signatures: tuple[Signature, ...] = ()
) -> tuple[ctypes.CDLL | None, str | None]:
    """The library ``library`` (``net/_switch``: its path without the
    extension's suffix) built from ``sources`` (its C files and headers, in
    ``setup.py``'s order), with its functions' ``signatures`` set, or None
    and why it cannot serve."""
    if os.environ.get("GRADFABRIC_PURE"):
        return None, "GRADFABRIC_PURE is set"
    path = library_path(library)
    if not path.exists():
        return None, f"not built ({REBUILD})"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"does not load: {e}"
    lib.gf_source.restype = ctypes.c_char_p
    if lib.gf_source().decode() != digest(sources):
        return None, f"its source changed since it was built ({REBUILD})"
    for name, args, res in signatures:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib, None
