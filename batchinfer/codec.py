"""Typed records and their JSON: one declaration of each on-disk record, validated where it is
read, and written from the same fields.

A record is a frozen dataclass deriving from :class:`Record`; its fields are declared in the order
its file has its keys, with the constraints a file read back must meet in their annotations
(:data:`Count`, :data:`Finite`, :data:`Name`, ``Literal``\\s, pydantic validators for checks that
span fields). Its ``to_dict`` is its fields in declaration order (nested records as their own
``to_dict``, tuples as lists); its :meth:`Record.read` (and :meth:`Record.from_dict`, from parsed
JSON) validates JSON text against the same declaration (pydantic validates the dataclass:
strict, so a count is an integer, not ``3.0``, ``true`` or ``"3"``; floats finite unless a field
says otherwise; unknown keys ignored: the file may come from a newer batchinfer; a missing key
takes the field's default). :func:`batchinfer.io.readback.check` turns what is wrong into the
one-line error of the file's kind. Pure: no I/O.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Mapping, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter

R = TypeVar("R", bound="Record")
T = TypeVar("T")

# What a record's fields may hold, as a file read back must have it.
Count = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Duration = NonNegative   # seconds or milliseconds
Name = Annotated[str, Field(min_length=1)]

# strict: a count is an integer (not 3.0, not true, not "3"); floats are finite unless a field
# says otherwise. Unknown keys are ignored: the file may come from a newer batchinfer.
CHECKED = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Record:
    """Base of a dataclass record that (de)serialises by its fields (see the module)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]   # a dataclass, for mypy
    __pydantic_config__: ClassVar[ConfigDict] = CHECKED

    def to_dict(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name in _field_names(type(self))}

    @classmethod
    def read(cls: type[R], data: bytes | str) -> R:
        """The record in ``data`` (JSON text), validated.

        Raises:
            pydantic.ValidationError: ``data`` is not such a record (io/readback.py ``check``
                makes it one line naming the file and the field).
        """
        return adapter(cls).validate_json(data)

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record in parsed JSON (as :meth:`to_dict` made it), validated as :meth:`read` does."""
        return cls.read(json.dumps(data))


def json_validated(kind: type[T], value: Any) -> T:
    """``value`` (data parsed from JSON) validated as ``kind`` as if read from the file: for a
    validator that runs before a field's own, which sees Python data (strict validation of
    Python data would refuse a JSON array for a tuple, or an object for a record)."""
    return adapter(kind).validate_json(json.dumps(value))


def check_range(count: int, low: float | None, high: float | None) -> None:
    """A column's statistics' range: present when it has values, and not upside down."""
    if count and (low is None or high is None):
        raise ValueError(f"count is {count} but min or max is missing")
    if low is not None and high is not None and low > high:
        raise ValueError(f"min {low} is above max {high}")


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def adapter(kind: type[T]) -> TypeAdapter[T]:
    """The validator of ``kind`` (a record, or a pydantic model), made once."""
    found = _ADAPTERS.get(kind)
    if found is None:
        found = _ADAPTERS[kind] = TypeAdapter(kind)
    return found


_NAMES: dict[type, tuple[str, ...]] = {}
# Values that are their own JSON: most of a record's fields (a fast path, not a different result).
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _field_names(kind: type) -> tuple[str, ...]:
    """A dataclass's field names in declaration order, looked up once per class (a shard's
    result holds hundreds of fields: ``dataclasses.fields`` each time was most of ``to_dict``)."""
    found = _NAMES.get(kind)
    if found is None:
        found = _NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return found


def _plain(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Record):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
