"""A hook's dense calls without Python: the compiled half of ``DenseSkip``.

Any Python DDP communication hook costs each bucket a GIL round trip, a call
and a Python ``then`` callback. On a host-bound rank that is about 5% of a
dense model's iteration: on 2 gloo ranks of one core each (dense MLP, 4 MB
buckets, loopback), PyTorch's own ``allreduce_hook`` ran at 0.947x of DDP
without a hook and ``omnireduce_hook`` at 0.943x, while PyTorch's C++ built-in
all-reduce hook ran at 1.001x (``gradfabric bench ddp --models mlp --hooks
default,builtin,allreduce,omnireduce``, one run of 60 steps).

gradfabric's hooks make a host decision only when they scan a bucket; a
bucket whose scan went dense skips its next scans (``skip.DenseSkip``), and
those calls need no decision. ``register_hook`` installs a small C++ hook
(``_fast_hook.cpp``, built by ``scripts/compile.py``) that runs exactly those
calls itself (divide, then an asynchronous all-reduce on the default group,
as the Python side does) and passes every other call to the Python hook. The
two share a table, one row per bucket: skips left (written by the Python
side after a scan), and the calls and ring bytes the C++ side ran (folded
into the state's statistics by ``DenseSkip.fold``).

Where the extension is not built (no compiler, another torch, the sources
changed since, ``GRADFABRIC_PURE=1``), ``register_hook`` registers the Python
hook as ``ddp.register_comm_hook`` would, and says so.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradfabric.collectives.skip import DenseSkip

SOURCE = Path(__file__).with_name("_fast_hook.cpp")
MANIFEST = Path(__file__).with_name("_fast_hook.json")  # written by scripts/compile.py
COMPILED, PYTHON = "compiled", "python"


def source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def why_not() -> str | None:
    """Why the compiled hook cannot run here, or None if it can."""
    if os.environ.get("GRADFABRIC_PURE"):
        return "GRADFABRIC_PURE is set"
    try:
        built = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return "not built (scripts/compile.py builds it against this torch)"
    if built.get("source") != source_digest():
        return "its source changed since it was built (scripts/compile.py rebuilds it)"
    if built.get("torch") != torch.__version__:
        return f"built for torch {built.get('torch')}, this is {torch.__version__}"
    try:
        ext = extension()
    except ImportError as e:
        return f"does not load: {e}"
    if getattr(ext, "SOURCE", None) != source_digest():
        return "the loaded extension is from another source"
    return None


def extension() -> Any:
    """The compiled module (check ``why_not()`` first)."""
    return importlib.import_module("gradfabric.collectives._fast_hook")


def register_hook(ddp: Any, state: Any, hook: Any) -> str:
    """``ddp.register_comm_hook(state, hook)``, with ``state``'s skipped
    (dense) calls run in C++ where the extension is built and ``state`` is a
    ``DenseSkip`` (``omnireduce_hook``'s and ``auto_hook``'s states). Returns
    ``"compiled"`` or ``"python"``: which path the skipped calls take."""
    if not isinstance(state, DenseSkip) or why_not() is not None:
        ddp.register_comm_hook(state, hook)
        return PYTHON
    ddp._check_comm_hook(hook)  # what register_comm_hook checks and records
    if ddp.logger is not None:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
    ddp._comm_hooks.append((hook, state))
    # a bucket holds at least one parameter: no more buckets than parameters
    rows = sum(1 for p in ddp.module.parameters() if p.requires_grad)
    state.attach_table(torch.zeros(rows, 3, dtype=torch.int64))
    ext = extension()
    group = dist.distributed_c10d._get_default_group()
    ext.install(ddp.reducer, state, hook, group.group_name, state.table)
    return COMPILED
