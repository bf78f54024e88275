"""Loading the project's small C libraries (ctypes), and only while current.

A library here is one C source beside its Python wrapper (the clients'
quantiser ``wire/_fastquant.c``, the workers' datapath ``net/_datapath.c``),
built by ``scripts/compile.py`` with the C compiler alone into ``NAME.so``,
with the source's digest in ``NAME.json`` and compiled into the library
(``gf_source()``). A wrapper uses the library only while both still match the
source on disk and ``GRADFABRIC_PURE`` is unset; otherwise its Python
reference serves, with the reason kept for ``gradfabric --version``.

Only the standard library: the switch daemon, which never imports torch or
numpy-heavy code paths, may load these too.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path

COMPILED, PYTHON = "compiled", "python"


def digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


Signature = tuple[str, list[type], type | None]  # a function's name, argtypes, restype


def load(
    source: Path, signatures: tuple[Signature, ...] = ()
) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built from ``source`` (``X.c`` -> ``X.so``, ``X.json``)
    with its functions' ``signatures`` set, or None and why it cannot serve."""
    if os.environ.get("GRADFABRIC_PURE"):
        return None, "GRADFABRIC_PURE is set"
    try:
        built = json.loads(source.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None, "not built (scripts/compile.py builds it)"
    want = digest(source)
    if built.get("source") != want:
        return None, "its source changed since it was built (run scripts/compile.py)"
    try:
        lib = ctypes.CDLL(str(source.with_suffix(".so")))
    except OSError as e:
        return None, f"does not load: {e}"
    lib.gf_source.restype = ctypes.c_char_p
    if lib.gf_source().decode() != want:
        return None, "the library on disk is from another source"
    for name, args, res in signatures:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib, None
