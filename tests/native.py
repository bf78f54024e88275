"""Tests of native code skip only where no native code is expected: under
``GRADFABRIC_PURE`` or on a machine without a C compiler. Where a compiler
is present, a library that does not serve is a failure (a compile error must
not leave CI green)."""

from __future__ import annotations

import pytest

from gradfabric.core import native


def require(what: str, path: str, why: object, *, module: bool = False) -> None:
    """Go on if ``what`` serves compiled (``path``), skip where nothing native
    is expected here, fail otherwise (``why``: the loader's reason)."""
    if path in (native.COMPILED, "mypyc"):
        return
    if native.expected():
        pytest.fail(f"{what} is not compiled although a C compiler is here: {why}",
                    pytrace=False)  # fmt: skip
    pytest.skip(f"{what} is not compiled here: {why}", allow_module_level=module)
