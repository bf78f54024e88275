"""gradfabric: distributed DNN training that communicates less and waits less.

One set of sans-I/O protocol engines (``gradfabric.proto``) is driven by a
discrete-event simulator (``gradfabric.sim``), by real UDP sockets
(``gradfabric.net``) and, in later layers, by PyTorch hooks.
"""

__version__ = "0.1.0"

import os as _os
import warnings as _warnings
from pathlib import Path as _Path

from gradfabric import _build

if _os.environ.get("GRADFABRIC_PURE"):
    _build.use_sources()
elif _stale := _build.stale_modules(_Path(__file__).parent):
    _build.use_sources()
    _warnings.warn(
        f"gradfabric: the compiled modules are older than their sources ({', '.join(_stale)}); "
        "running the pure-Python sources. Rebuild with: pip install -e . (or scripts/bootstrap.sh)",
        stacklevel=1,
    )
