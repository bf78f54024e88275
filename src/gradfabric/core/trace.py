"""Observability as data: engines emit records to an injected sink."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol


class TraceSink(Protocol):
    def emit(self, kind: str, now_ns: int, **fields: Any) -> None: ...


class NullSink:
    """Discards every record (the default: zero cost beyond the call)."""

    def emit(self, kind: str, now_ns: int, **fields: Any) -> None:
        return None


class ListSink:
    """Keeps every record in memory, for tests and small runs."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, kind: str, now_ns: int, **fields: Any) -> None:
        self.records.append({"kind": kind, "now_ns": now_ns, **fields})


class Counters(Counter[str]):
    """Named event counters (drops by reason, collisions, ...)."""

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.items()))
