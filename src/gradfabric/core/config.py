"""Load frozen config dataclasses from YAML with errors that name the field.

``load(cls, data)`` walks the dataclass fields: unknown keys, wrong types and
values rejected by a ``__post_init__`` all raise ``ConfigError`` with the full
dotted path (``fabric.link.loss: must be in [0, 1)``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import yaml

from gradfabric.core.errors import ConfigError

T = TypeVar("T")


def load(cls: type[T], data: Any, path: str = "") -> T:
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, f"expected a mapping, got {type(data).__name__}")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            _join(path, unknown[0]), f"unknown field; valid: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _convert(hints[k], v, _join(path, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_join(path, e.field), str(e).split(": ", 1)[-1]) from None
    except TypeError as e:
        raise ConfigError(path or cls.__name__, str(e)) from None


def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``; for a class compiled with mypyc, whose
    annotations keep only a union's erasure (``LinkSpec | None`` reads as
    ``type``), those fields' annotations as its source declares them."""
    hints = typing.get_type_hints(cls)
    if any(h is type for h in hints.values()):
        hints |= {k: v for k, v in _declared(cls).items() if hints.get(k) is type}
    return hints


@functools.cache  # (a module's source read once, not at every load)
def _declared(cls: type) -> dict[str, Any]:
    """The annotations of ``cls``'s body in its module's ``.py`` file,
    evaluated in the module (names it imports for type checking only are
    left out)."""
    module = sys.modules[cls.__module__]
    source = Path(module.__file__ or "").with_name(cls.__module__.rsplit(".", 1)[-1] + ".py")
    if not source.exists():
        return {}
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            out = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    try:
                        out[stmt.target.id] = eval(ast.unparse(stmt.annotation), vars(module))
                    except NameError:
                        continue
            return out
    return {}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path)
    if dataclasses.is_dataclass(tp):
        return load(tp, value, path)  # type: ignore[arg-type]
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {value!r}")
        return tuple(_convert(get_args(tp)[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and (type(value) is not tp):
        raise ConfigError(path, f"expected {tp.__name__}, got {value!r}")
    return value


def load_yaml(cls: type[T], file: Path) -> T:
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(str(file), f"not valid YAML: {e}") from None
    return load(cls, data or {})


def dump(obj: Any) -> dict[str, Any]:
    """The resolved config as plain data (written next to every result)."""
    return typing.cast(dict[str, Any], _plain(dataclasses.asdict(obj)))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v
