"""Plug-ins chosen by name (allocation policies, experiments, topologies...).

An unknown name is a ``ConfigError`` that lists the valid names, never a
silent default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from gradfabric.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table with helpful errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def alias(self, name: str, target: str) -> None:
        """``name`` is another name for ``target`` (not listed among the names)."""
        self._aliases[name] = target

    def get(self, name: str) -> T:
        name = self._aliases.get(name, name)
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                self.kind, f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
