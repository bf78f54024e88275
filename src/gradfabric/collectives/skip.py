"""``DenseSkip``: which buckets of a scanning hook skip their scan, alike on every rank.

(Shared by ``omnireduce_hook``'s and ``auto_hook``'s states; the compiled
half, which runs the skipped calls without Python, is ``collectives.fast``.)
"""

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from gradfabric.net.overlap import Overlapped


class _SkipTable:
    """The table a compiled hook shares (``collectives.fast``): not a field of
    the dataclasses below, and never pickled."""

    table: torch.Tensor | None = None  # by key: skips left, calls and ring bytes run in C++
    _seen: torch.Tensor | None = None  # the table's counts already folded in


@dataclass
class DenseSkip(Overlapped, _SkipTable):
    """Which buckets skip their occupancy scan, alike on every rank.

    Once a call with a ``key`` (the hook's: the bucket index) went dense in
    every chunk, the next ``dense_skip`` calls with that key run the dense
    all-reduce at once, without the scan and bitmap round; then the key is
    scanned again. Each further scan in a row that goes dense doubles the
    skip, up to ``8 * dense_skip`` (a dense model's buckets are then scanned
    about once in 65 calls); a scan that goes sparse resets it. Every rank
    sees the same paths, so every rank skips alike. 0: always scan.

    Registered with ``collectives.fast.register_hook``, the skipped calls run
    in C++ without entering Python; their counts reach the statistics at the
    hook's next scanned call (on its thread), at ``summary()`` and pickling,
    or at ``fold()``."""

    dense_skip: int = 8
    skipped_scans: int = 0
    skips_left: dict[int, int] = field(default_factory=dict)  # by key
    dense_streak: dict[int, int] = field(default_factory=dict)  # by key

    def take_skip(self, key: int | None) -> bool:
        """Whether the call with ``key`` skips its scan and goes dense at once
        (counted as such)."""
        if key is None or self.skips_left.get(key, 0) <= 0:
            return False
        self.skips_left[key] -= 1
        self.skipped_scans += 1
        return True

    def scanned(self, key: int | None, dense: bool) -> None:
        """Record how a scan of ``key`` went."""
        if key is None:
            return
        streak = self.dense_streak[key] = self.dense_streak.get(key, 0) + 1 if dense else 0
        if dense:
            skips = self.dense_skip * 2 ** min(streak - 1, 3)
            if self.table is not None and key < len(self.table):
                self.table[key, 0] = skips  # the compiled hook takes them
            else:
                self.skips_left[key] = skips

    def attach_table(self, table: torch.Tensor) -> None:
        """Share ``table`` with a compiled hook: the skips of its keys go there."""
        for key in [k for k in self.skips_left if k < len(table)]:
            table[key, 0] = self.skips_left.pop(key)
        self.table, self._seen = table, torch.zeros(len(table), 2, dtype=torch.int64)

    def fold(self) -> None:
        """Count the calls the compiled hook ran since the last fold."""
        if self.table is None or self._seen is None:
            return
        with _FOLD_LOCK:
            now = self.table[:, 1:].clone()
            new, self._seen = now - self._seen, now
            for key in torch.nonzero(new[:, 0]).flatten().tolist():
                calls, ring = int(new[key, 0]), int(new[key, 1])
                self.skipped_scans += calls
                self.skipped(key, calls, ring)

    def skipped(self, key: int, calls: int, ring: int) -> None:
        """Count ``calls`` skipped calls of ``key`` that sent ``ring`` bytes in
        all (a subclass's statistics)."""

    def __getstate__(self) -> dict[str, Any]:
        self.fold()
        state = super().__getstate__()
        if self.table is not None:  # a copy runs without this process's compiled hook
            left = {k: int(n) for k, n in enumerate(self.table[:, 0].tolist()) if n > 0}
            state["skips_left"] = {**state["skips_left"], **left}
        state.pop("table", None)
        state.pop("_seen", None)
        return state


_FOLD_LOCK = threading.Lock()
