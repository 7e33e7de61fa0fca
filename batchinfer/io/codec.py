"""JSON-ready data from typed records and back, generated from their dataclass fields.

A record's ``to_dict`` is its fields in declaration order (so a record declares its keys in the
order its file has them), nested records as their own ``to_dict``, tuples as lists; its
``from_dict`` builds each field from its type hint (records, tuples, dicts, ``X | None``, numbers
coerced as the hint says) and leaves a missing key to the field's default. What is read back
was validated first (:mod:`batchinfer.io.readback`): here, data is trusted. Pure: no I/O.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, Mapping, TypeVar, Union

R = TypeVar("R", bound="Record")


class Record:
    """Base of a dataclass record that (de)serialises by its fields (see the module)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]   # a dataclass, for mypy

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        hints = _hints(cls)
        return cls(**{f.name: _build(hints[f.name], data[f.name])
                      for f in dataclasses.fields(cls) if f.name in data})


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s fields' type hints, resolved once per class (they are strings until then)."""
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = typing.get_type_hints(cls)
    return found


def _build(hint: Any, value: Any) -> Any:
    """``value`` (JSON data) as the type ``hint`` says."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        return {_build(args[0], k): _build(args[1], v) for k, v in value.items()}
    if hint in (int, float):
        return hint(value)
    return value   # str, bool, a Literal, Any, a plain dict: as read
