"""``DenseSkip``: which buckets of a scanning hook skip their scan, alike on
every rank; ``LayoutCheck``: the ranks agree on their buckets before the
paths' collectives pair them up.

(Shared by ``omnireduce_hook``'s and ``auto_hook``'s states, and
``LayoutCheck`` by ``rows_hook``'s; the compiled half, which runs the skipped
calls without Python, is ``collectives.fast``.)
"""

import math
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from gradfabric.net.overlap import Overlapped

# a tensor's dtype as an int the ranks can gather (its index; past the end: another)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.float64)


def dtype_name(code: int) -> str:
    return str(DTYPES[code]) if code < len(DTYPES) else "another dtype"


def unlike_ranks(layout: list[int], group: Any = None) -> tuple[list[int], list[tuple[int, ...]]]:
    """Every rank's ``layout`` (ints, as many on every rank), one all-gather:
    the ranks whose layout is not rank 0's, and every rank's by rank."""
    mine = torch.tensor(layout, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    seen = [tuple(t.tolist()) for t in every]
    return [r for r, s in enumerate(seen) if s != seen[0]], seen


@dataclass
class LayoutCheck:
    """Every rank's bucket ``key`` has the same layout, checked at its first
    ``layout_checks`` calls (2: DDP rebuilds its buckets after the first step).

    DDP checks that the ranks' parameters have the same shapes, not that their
    buckets do: an ``nn.Embedding(sparse=True)`` on some ranks only, or a
    model in another dtype, gives ranks unlike buckets. Then a hook's paths
    issue collectives of different sizes, and gloo aborts the process on the
    first (as it does under DDP's default hook). So before those calls each
    rank gathers every rank's (bucket, sparse or dense, values, dtype), one
    all-gather on the default group from the autograd thread, where the
    buckets come in the same order on every rank; unlike layouts raise an
    error naming the ranks on every rank at once."""

    layout_checks: int = 2
    layouts_checked: dict[int, int] = field(default_factory=dict)  # calls checked, by key

    def agree_layout(self, key: int, buf: torch.Tensor, hook: str) -> None:
        done = self.layouts_checked.get(key, 0)
        if done >= self.layout_checks:
            return
        self.layouts_checked[key] = done + 1
        code = DTYPES.index(buf.dtype) if buf.dtype in DTYPES else len(DTYPES)
        odd, seen = unlike_ranks([key, int(buf.is_sparse), math.prod(buf.shape), code])
        if odd:
            said = "; ".join(f"rank {r}: bucket {k}, {'sparse' if sp else 'dense'}, "
                             f"{n} values of {dtype_name(c)}"
                             for r, (k, sp, n, c) in enumerate(seen))  # fmt: skip
            raise ValueError(
                f"{hook}: ranks {odd} hold a bucket unlike rank 0's ({said}): every rank must "
                "build the same model (sparse=True or another dtype on some ranks only?)"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = cast(dict[str, Any], super().__getstate__())
        state["layouts_checked"] = {}  # a copy serves another DDP: its buckets are checked anew
        return state


class _SkipTable:
    """The table a compiled hook shares (``collectives.fast``): not a field of
    the dataclasses below, and never pickled."""

    table: torch.Tensor | None = None  # by key: skips left, calls and ring bytes run in C++
    _seen: torch.Tensor | None = None  # the table's counts already folded in


@dataclass
class DenseSkip(LayoutCheck, Overlapped, _SkipTable):
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
