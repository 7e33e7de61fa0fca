"""Quarantine rows: the dead-letter output for input rows that cannot be scored (contract §4).

Every rejected input row becomes exactly one quarantine row::

    _source_shard  string            the shard's URL
    _source_row    int64             0-based row index within that shard
    _reason        string            message of the first failure
    _column        string (nullable) column of the first failure (null: row/frame-level)
    _check         string            check of the first failure
    _reasons       list<struct<column, check, message>>   every failure of that row, in order
    _values        string            the original row as a strict JSON object

``_values`` keeps the row readable whatever the shard's shape, so quarantine files of shards
with different columns can be read together. The encoding (see ``docs/validation.md``) is
deterministic and strict JSON (no ``NaN``/``Infinity`` literals):

- keys are the batch's column names, in the batch's column order;
- null → ``null``; booleans → ``true``/``false``; integers → numbers;
- floats → the shortest decimal that round-trips at the column's width (float32 ``0.1`` is
  ``0.1``), always with a ``.`` or exponent (``2.0``); NaN, +inf, -inf → the strings
  ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
- strings → JSON strings (UTF-8, not ASCII-escaped); binary → base64 strings (RFC 4648, padded);
- decimals → strings (exact); dates → ``"YYYY-MM-DD"``; timestamps → ISO 8601 with as many
  fraction digits as the unit has (0/3/6/9), suffixed ``Z`` (UTC) when the type has a time
  zone; times → ``"HH:MM:SS[.fff…]"``; durations → integer count of the column's unit;
- lists → arrays; structs → objects (field order); maps → arrays of ``[key, value]`` pairs;
  dictionary columns → their decoded values.

Building a quarantine table is per-bad-row Python at most; numbers, booleans and plain strings
are encoded with Arrow compute kernels.
"""
from __future__ import annotations

import base64
import datetime as _dt
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "QUARANTINE_SCHEMA",
    "REASON_TYPE",
    "Failure",
    "build_quarantine",
    "empty_quarantine",
    "values_json",
]

REASON_TYPE = pa.struct(
    [
        pa.field("column", pa.string(), nullable=True),
        pa.field("check", pa.string(), nullable=False),
        pa.field("message", pa.string(), nullable=False),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("_source_shard", pa.string(), nullable=False),
        pa.field("_source_row", pa.int64(), nullable=False),
        pa.field("_reason", pa.string(), nullable=False),
        pa.field("_column", pa.string(), nullable=True),
        pa.field("_check", pa.string(), nullable=False),
        pa.field("_reasons", pa.list_(REASON_TYPE), nullable=False),
        pa.field("_values", pa.string(), nullable=False),
    ]
)


@dataclass(frozen=True)
class Failure:
    """One reason a row was rejected.

    Attributes:
        column: the column the failure is about; None for row/frame-level failures.
        check: the check that failed, e.g. ``"not_nullable"``, ``"in_range(0, 10)"``,
            ``"dtype('Float64')"``, ``"column_in_dataframe"``, ``"model"``.
        message: human readable, one line.
    """

    column: str | None
    check: str
    message: str


_EMPTY = QUARANTINE_SCHEMA.empty_table()


def empty_quarantine() -> pa.Table:
    """A quarantine table with no rows (QUARANTINE_SCHEMA)."""
    return _EMPTY


def build_quarantine(
    source_shard: str,
    source_rows: np.ndarray,
    failures: Sequence[Sequence[Failure]],
    original: pa.RecordBatch | pa.Table,
) -> pa.Table:
    """Build one quarantine row per rejected input row.

    Args:
        source_shard: the shard's URL, copied to ``_source_shard``.
        source_rows: int64 row indices within the shard, one per quarantined row.
        failures: for each row, its failures (at least one); the first one fills
            ``_reason``/``_column``/``_check``, all of them fill ``_reasons``.
        original: exactly those rows' original values, same length and order.

    Returns:
        A table with QUARANTINE_SCHEMA and ``len(source_rows)`` rows.

    Raises:
        ValueError: lengths disagree, or a row has no failure.
    """
    rows = np.asarray(source_rows, dtype=np.int64).reshape(-1)
    n = len(rows)
    if len(failures) != n or original.num_rows != n:
        raise ValueError(
            f"build_quarantine: {n} source rows, {len(failures)} failure lists and "
            f"{original.num_rows} original rows must all be equal"
        )
    if n == 0:
        return _EMPTY

    # Each distinct Failure is stored once and gathered with `take`; the same failure list
    # object repeated (a column-level failure on every row) is flattened once.
    ids: dict[Failure, int] = {}
    by_list: dict[int, list[int]] = {}
    flat: list[int] = []
    first: list[int] = []
    offsets = np.empty(n + 1, dtype=np.int32)
    offsets[0] = 0
    for i, row_failures in enumerate(failures):
        idx = by_list.get(id(row_failures))
        if idx is None:
            idx = [ids.setdefault(f, len(ids)) for f in row_failures]
            if not idx:
                raise ValueError(f"build_quarantine: row {i} (source row {rows[i]}) has no failure")
            by_list[id(row_failures)] = idx
        flat.extend(idx)
        first.append(idx[0])
        offsets[i + 1] = len(flat)

    unique = list(ids)
    column = pa.array([f.column for f in unique], pa.string())
    check = pa.array([str(f.check) for f in unique], pa.string())
    message = pa.array([str(f.message) for f in unique], pa.string())
    flat_idx = pa.array(flat, pa.int32())
    first_idx = pa.array(first, pa.int32())
    reasons = pa.ListArray.from_arrays(
        pa.array(offsets),
        pa.StructArray.from_arrays(
            [column.take(flat_idx), check.take(flat_idx), message.take(flat_idx)],
            fields=list(REASON_TYPE),
        ),
        type=pa.list_(REASON_TYPE),
    )
    shard = pa.array([source_shard], pa.string()).take(pa.array(np.zeros(n, dtype=np.int32)))
    return pa.Table.from_arrays(
        [
            shard,
            pa.array(rows, pa.int64()),
            message.take(first_idx),
            column.take(first_idx),
            check.take(first_idx),
            reasons,
            _values_array(original),
        ],
        schema=QUARANTINE_SCHEMA,
    )


def values_json(original: pa.RecordBatch | pa.Table) -> list[str]:
    """Each row of ``original`` as a strict JSON object string (encoding: module docstring).

    Example:
        >>> values_json(pa.table({"x": [float("nan")], "s": ["é"]}))
        ['{"x":"NaN","s":"é"}']
    """
    return _values_array(original).to_pylist()


# --- encoding -----------------------------------------------------------------------------


def _columns(original: pa.RecordBatch | pa.Table) -> list[tuple[str, pa.Array]]:
    out = []
    for field, col in zip(original.schema, original.columns):
        if isinstance(col, pa.ChunkedArray):
            col = pa.concat_arrays(col.chunks) if col.num_chunks else pa.array([], field.type)
        out.append((field.name, col))
    return out


def _values_array(original: pa.RecordBatch | pa.Table) -> pa.StringArray:
    n = original.num_rows
    cols = _columns(original)
    if not cols:
        return pa.array(["{}"] * n, pa.string())
    if n == 0:
        return pa.array([], pa.string())
    parts: list = []
    for i, (name, col) in enumerate(cols):
        key = json.dumps(name, ensure_ascii=False) + ":"
        parts.append(pa.scalar(("{" if i == 0 else ",") + key, pa.string()))
        parts.append(_encode(col))
    parts.append(pa.scalar("}", pa.string()))
    return pc.binary_join_element_wise(*parts, "").cast(pa.string())


def _encode(arr: pa.Array) -> pa.StringArray:
    """JSON text of every element of ``arr`` (never null: nulls become ``"null"``)."""
    t = arr.type
    if len(arr) == 0:
        return pa.array([], pa.string())
    if isinstance(t, pa.ExtensionType):
        return _encode(arr.storage)
    if pa.types.is_dictionary(t):
        return _encode(arr.dictionary_decode())
    if pa.types.is_null(t):
        return pa.array(["null"] * len(arr), pa.string())
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        text = arr.cast(pa.string())
    elif pa.types.is_floating(t):
        text = _encode_float(arr)
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or _is_string_view(t):
        text = _encode_string(arr)
    elif pa.types.is_map(t):
        entry = pa.struct([pa.field("key", t.key_type), pa.field("value", t.item_type)])
        entries = arr.cast(pa.list_(entry))
        return _join_lists(entries, _encode_pairs(entries.flatten()))
    elif (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ):
        return _join_lists(arr, _encode(arr.flatten()))
    elif pa.types.is_struct(t):
        return _encode_struct(arr)
    else:
        return pa.array(_encode_leaf_py(arr), pa.string())
    return pc.fill_null(text, "null").cast(pa.string())


def _is_string_view(t: pa.DataType) -> bool:
    check = getattr(pa.types, "is_string_view", None)
    return bool(check and check(t))


def _encode_float(arr: pa.Array) -> pa.Array:
    # Arrow prints the shortest round-trip decimal for the value's width ("0.1", "1e-7",
    # "2", "-0"); integral-looking results get ".0" so every float reads as a float.
    text = arr.cast(pa.string())
    integral = pc.ascii_is_decimal(pc.ascii_ltrim(text, "-"))
    if pc.any(integral).as_py():
        text = pc.if_else(integral, pc.binary_join_element_wise(text, ".0", ""), text)
    if not pc.all(pc.is_finite(arr)).as_py():  # nulls are skipped: all-null gives null
        text = pc.if_else(pc.is_nan(arr), '"NaN"', text)
        text = pc.if_else(pc.greater(arr, 0), pc.if_else(pc.is_inf(arr), '"Infinity"', text), text)
        text = pc.if_else(pc.less(arr, 0), pc.if_else(pc.is_inf(arr), '"-Infinity"', text), text)
    return text


_NEEDS_ESCAPE = r'["\\\x00-\x1f]'


def _encode_string(arr: pa.Array) -> pa.Array:
    arr = arr.cast(pa.string())
    if pc.any(pc.match_substring_regex(arr, _NEEDS_ESCAPE)).as_py():
        return pa.array(
            [None if v is None else json.dumps(v, ensure_ascii=False) for v in arr.to_pylist()],
            pa.string(),
        )
    return pc.binary_join_element_wise('"', arr, '"', "")


def _join_lists(lists: pa.Array, child: pa.StringArray) -> pa.StringArray:
    lengths = pc.list_value_length(lists).to_pylist()
    parts = child.to_pylist()
    out: list[str] = []
    pos = 0
    for length in lengths:
        if length is None:
            out.append("null")
        else:
            out.append("[" + ",".join(parts[pos : pos + length]) + "]")
            pos += length
    return pa.array(out, pa.string())


def _encode_pairs(entries: pa.StructArray) -> pa.StringArray:
    keys, values = entries.flatten()
    return pc.binary_join_element_wise("[", _encode(keys), ",", _encode(values), "]", "")


def _encode_struct(arr: pa.StructArray) -> pa.StringArray:
    fields = list(arr.type)
    if not fields:
        text = pa.array(["{}"] * len(arr), pa.string())
    else:
        parts: list = []
        for i, (field, child) in enumerate(zip(fields, arr.flatten())):
            key = json.dumps(field.name, ensure_ascii=False) + ":"
            parts.append(("{" if i == 0 else ",") + key)
            parts.append(_encode(child))
        parts.append("}")
        text = pc.binary_join_element_wise(*parts, "")
    if arr.null_count:
        text = pc.if_else(arr.is_null(), "null", text)
    return text.cast(pa.string())


# Leaf types without a vectorised encoder: per-value Python (only bad rows reach here).

_EPOCH = _dt.datetime(1970, 1, 1)
_EPOCH_DATE = _dt.date(1970, 1, 1)
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_DIGITS = {"s": 0, "ms": 3, "us": 6, "ns": 9}


def _encode_leaf_py(arr: pa.Array) -> list[str]:
    t = arr.type
    if pa.types.is_timestamp(t):
        per, digits, zone = _PER_SECOND[t.unit], _DIGITS[t.unit], "Z" if t.tz else ""
        return [
            "null" if v is None else _quote_or_int(_timestamp_text(v, per, digits, zone), v)
            for v in arr.cast(pa.int64()).to_pylist()
        ]
    if pa.types.is_date32(t) or pa.types.is_date64(t):
        days = arr.cast(pa.date32()).cast(pa.int32()).to_pylist()
        return ["null" if v is None else _quote_or_int(_date_text(v), v) for v in days]
    if pa.types.is_time(t):
        per, digits = _PER_SECOND[t.unit], _DIGITS[t.unit]
        return [
            "null" if v is None else '"' + _time_text(v, per, digits) + '"'
            for v in arr.cast(pa.int64()).to_pylist()
        ]
    if pa.types.is_duration(t):
        return ["null" if v is None else str(v) for v in arr.cast(pa.int64()).to_pylist()]
    return [_py_json(v) for v in arr.to_pylist()]


def _quote_or_int(text: str | None, raw: int) -> str:
    return str(raw) if text is None else '"' + text + '"'


def _timestamp_text(v: int, per: int, digits: int, zone: str) -> str | None:
    seconds, frac = divmod(v, per)
    try:
        text = (_EPOCH + _dt.timedelta(seconds=seconds)).isoformat()
    except OverflowError:  # outside years 1..9999: the raw count of units instead
        return None
    if digits:
        text += "." + str(frac).zfill(digits)
    return text + zone


def _date_text(days: int) -> str | None:
    try:
        return (_EPOCH_DATE + _dt.timedelta(days=days)).isoformat()
    except OverflowError:
        return None


def _time_text(v: int, per: int, digits: int) -> str:
    seconds, frac = divmod(v, per)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return text + "." + str(frac).zfill(digits) if digits else text


def _py_json(v: object) -> str:
    """Generic strict-JSON text of a Python value from ``to_pylist`` (rare Arrow types)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return '"NaN"'
        if math.isinf(v):
            return '"Infinity"' if v > 0 else '"-Infinity"'
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return '"' + base64.b64encode(bytes(v)).decode("ascii") + '"'
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return '"' + v.isoformat() + '"'
    if isinstance(v, dict):
        items = (json.dumps(str(k), ensure_ascii=False) + ":" + _py_json(x) for k, x in v.items())
        return "{" + ",".join(items) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_py_json(x) for x in v) + "]"
    return json.dumps(str(v), ensure_ascii=False)  # Decimal, timedelta, MonthDayNano, …
