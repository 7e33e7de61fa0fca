"""Batch validation: split an Arrow batch into valid rows and quarantine rows with pandera.

The schema may be a pandera *polars* or *pandas* ``DataFrameSchema``, or a ``DataFrameModel``
subclass of either (``.to_schema()`` is called once per schema object and cached).

- **polars** schemas see ``pl.from_arrow(batch)``: zero-copy, Arrow types unchanged.
  pandera-polars treats NaN as null for ``nullable=False``; NaN also fails range checks.
- **pandas** schemas see one fixed conversion (``docs/validation.md``): integers and booleans
  become pandas nullable dtypes (``Int64``, ``Int32``, …, ``UInt64``, ``boolean``), so a null
  int stays an int column and only that row fails ``not_nullable``; floats stay numpy floats
  with null → NaN; strings become pandas' default string dtype (``str``); everything else is
  pyarrow's default ``to_pandas``. Declare integer columns with the nullable dtypes
  (``"Int64"``, ``"Int32"``) in pandas schemas.

Validation is always lazy (every failure is collected) and always checks data, whatever
pandera's global configuration says. pandera reports one record per failed check, plus
records with no row index for column- and frame-level failures (wrong dtype, missing column,
extra column under ``strict=True``, a check that raised, a check returning one ``False``).
They are folded into exactly one quarantine row per bad input row: a record without a row index
applies to every row of the batch and comes first, then the row's own failures in pandera's
order. If pandera itself raises (not a validation failure), or the batch cannot be converted,
every row is quarantined with that error as the reason; the job never crashes on bad data.

The passing case costs the conversion, the pandera call and O(1) Python; Python runs per
failure record and per bad row only. Batches that :mod:`batchinfer.rows.precheck` proves clean
with Arrow kernels (the common case for schemas of built-in checks) skip pandera entirely.
"""
from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchinfer.errors import UsageError
from batchinfer.imports import without
from batchinfer.rows.arrow_types import plain_type
from batchinfer.rows.precheck import Precheck
from batchinfer.rows.quarantine import Failure, build_quarantine, empty_quarantine


def import_pandera() -> None:
    """Import pandera without hypothesis. Schema modules import pandera, and pandera's data
    synthesis imports hypothesis (~0.2 s) whenever it is installed; a validator never needs
    it. Call before the first schema module runs (idempotent; hypothesis stays importable)."""
    if "pandera.strategies.base_strategies" not in sys.modules:
        with without("hypothesis"):
            import pandera.strategies.base_strategies  # noqa: F401

__all__ = [
    "ValidationResult",
    "quarantine_all",
    "schema_columns",
    "schema_kind",
    "to_pandas_frame",
    "validate_batch",
    "with_absent_columns",
]

#: Longest failing value quoted in a message, and longest message, in characters.
MAX_VALUE_CHARS = 200
MAX_MESSAGE_CHARS = 500


@dataclass
class ValidationResult:
    """The outcome of validating one batch.

    Attributes:
        valid: the original Arrow rows that passed, untouched (the batch itself when all pass),
            plus the optional schema columns the batch lacks, all null.
        valid_rows: int64 row indices (within the input batch) of the valid rows, ascending.
        quarantine: one row per rejected input row (QUARANTINE_SCHEMA), ``_source_row`` =
            ``first_row`` + row index in the batch, in ascending row order.
    """

    valid: pa.RecordBatch
    valid_rows: np.ndarray
    quarantine: pa.Table


# --- schema kinds -------------------------------------------------------------------------


class CompiledSchema:
    """A pandera schema made ready to validate Arrow batches: its kind, the ``DataFrameSchema``
    (a ``DataFrameModel`` is converted), its columns and the pre-check.

    Built once per schema version and process (:func:`batchinfer.triple.schemas.resolve_schema`
    does); it pickles as the ``DataFrameSchema`` alone and is built again where it is unpickled
    (a Beam worker), since the pre-check holds compiled evaluators and a lock.

    Raises:
        UsageError: not a pandera polars/pandas DataFrameSchema or DataFrameModel.
    """

    def __init__(self, schema: Any):
        self.kind = schema_kind(schema)
        # The public modules register pandera's validation backends for their kind.
        if self.kind == "polars":
            import pandera.polars  # noqa: F401
        else:
            import pandera.pandas  # noqa: F401
        # A DataFrameModel class becomes its DataFrameSchema.
        to_schema = getattr(schema, "to_schema", None) if isinstance(schema, type) else None
        self.schema: Any = to_schema() if to_schema is not None else schema
        self.columns: tuple[str, ...] = tuple(self.schema.columns)
        # Columns a shard may lack (``required=False``), with the Arrow type of the null column
        # that stands in for them in the valid rows (see validate_batch).
        self.optional: dict[str, pa.DataType] = {
            name: _arrow_type(self.kind, column) for name, column in self.schema.columns.items()
            if not getattr(column, "required", True) and not getattr(column, "regex", False)}
        self.precheck = Precheck(self.schema)   # proves clean batches clean without pandera

    def __reduce__(self):
        return (CompiledSchema, (self.schema,))


def _arrow_type(kind: str, column: Any) -> pa.DataType:
    """The plain Arrow type (:mod:`batchinfer.rows.arrow_types`) of a schema column's declared
    dtype: what the frame library converts to Arrow; ``null`` when it declares none or the
    library cannot say."""
    dtype = getattr(getattr(column, "dtype", None), "type", None)
    if dtype is None:
        return pa.null()
    try:
        if kind == "polars":
            import polars as pl

            return plain_type(pl.Series("", [], dtype=dtype).to_arrow().type)
        import pandas as pd

        return plain_type(pa.array(pd.Series([], dtype=dtype), from_pandas=True).type)
    except Exception:  # a dtype the library cannot make an empty series of
        return pa.null()


def with_absent_columns(batch: pa.RecordBatch, schema: CompiledSchema) -> pa.RecordBatch:
    """``batch`` plus each optional schema column it lacks, as an all-null column of the
    schema's type (appended, in schema order): so that hashing (which covers every schema
    column) and the preprocessing see the column, and a row hashes the same whether the shard
    lacked the column or held it null (docs/hashing.md)."""
    names = set(batch.schema.names)
    for name, arrow_type in schema.optional.items():
        if name not in names:
            batch = batch.append_column(name, pa.nulls(batch.num_rows, arrow_type))
    return batch


def compile_schema(schema: object) -> CompiledSchema:
    """``schema`` ready to validate with (a CompiledSchema is returned as it is)."""
    return schema if isinstance(schema, CompiledSchema) else CompiledSchema(schema)


def _kind_of(schema: object) -> str | None:
    # A schema object's class is only defined once its pandera module is imported, so looking
    # in sys.modules avoids importing pandera (or polars) just to say "no".
    for kind, container, model in (
        ("polars", "pandera.api.polars.container", "pandera.api.polars.model"),
        ("pandas", "pandera.api.pandas.container", "pandera.api.pandas.model"),
    ):
        container_mod = sys.modules.get(container)
        if container_mod is not None and isinstance(schema, container_mod.DataFrameSchema):
            return kind
        model_mod = sys.modules.get(model)
        if (
            model_mod is not None
            and isinstance(schema, type)
            and issubclass(schema, model_mod.DataFrameModel)
        ):
            return kind
    return None


def schema_kind(schema: object) -> str:
    """``"polars"`` or ``"pandas"``: the pandera backend ``schema`` is written for.

    Raises:
        UsageError: ``schema`` is not a pandera polars/pandas DataFrameSchema or DataFrameModel.
    """
    kind = _kind_of(schema)
    if kind is None:
        shown = schema.__name__ if isinstance(schema, type) else type(schema).__name__
        raise UsageError(
            f"unsupported schema object {shown!r}: define SCHEMA as a pandera DataFrameSchema "
            "or DataFrameModel from pandera.polars or pandera.pandas"
        )
    return kind


def schema_columns(schema: object) -> list[str]:
    """The column names ``schema`` declares, in declaration order.

    Raises:
        UsageError: ``schema`` is not a supported pandera schema (see ``schema_kind``).
    """
    return list(compile_schema(schema).columns)


# --- validation ---------------------------------------------------------------------------


def validate_batch(
    batch: pa.RecordBatch, schema: object, *, source_shard: str, first_row: int = 0
) -> ValidationResult:
    """Validate ``batch`` against ``schema``; split it into valid rows and quarantine rows.

    Columns the schema does not declare are passed through in ``valid``; whether they fail
    is the schema's ``strict`` setting. A column the schema declares optional
    (``required=False``) that the batch lacks passes as pandera passes it (its checks do not
    apply) and is added to ``valid`` as an all-null column of the schema's type
    (:func:`with_absent_columns`); quarantine rows keep the row as it was read.

    Args:
        batch: the input rows, as read from the shard.
        schema: a :class:`CompiledSchema` (compiled once: what a job passes), or a pandera
            polars/pandas DataFrameSchema or DataFrameModel subclass (compiled for this call).
        source_shard: the shard's URL, written to ``_source_shard``.
        first_row: the shard row index of the batch's row 0.

    Returns:
        ValidationResult; every input row is in exactly one of ``valid`` and ``quarantine``.

    Raises:
        UsageError: ``schema`` is not a supported pandera schema.

    Example:
        >>> result = validate_batch(batch, SCHEMA, source_shard="s3://b/part-0.parquet",
        ...                         first_row=65536)
        >>> result.valid.num_rows + result.quarantine.num_rows == batch.num_rows
        True
    """
    resolved = compile_schema(schema)
    n = batch.num_rows
    complete = with_absent_columns(batch, resolved) if resolved.optional else batch
    if n == 0:
        return ValidationResult(complete, np.empty(0, dtype=np.int64), empty_quarantine())
    if resolved.precheck.clean(batch):
        return ValidationResult(complete, np.arange(n, dtype=np.int64), empty_quarantine())
    frame_failures, row_failures = _check(resolved, batch)
    if not frame_failures:
        resolved.precheck.structure_ok(batch)
    if not frame_failures and not row_failures:
        return ValidationResult(complete, np.arange(n, dtype=np.int64), empty_quarantine())

    if frame_failures:
        bad = np.arange(n, dtype=np.int64)
        # Rows without failures of their own share one list object (cheap to flatten).
        failures = [
            frame_failures + row_failures[i] if i in row_failures else frame_failures
            for i in range(n)
        ]
    else:
        bad = np.fromiter(sorted(row_failures), dtype=np.int64, count=len(row_failures))
        failures = [row_failures[i] for i in bad.tolist()]

    keep = np.ones(n, dtype=bool)
    keep[bad] = False
    valid_rows = np.flatnonzero(keep).astype(np.int64)
    valid = complete.filter(pa.array(keep)) if len(valid_rows) else complete.slice(0, 0)
    quarantine = build_quarantine(
        source_shard, bad + np.int64(first_row), failures, batch.take(pa.array(bad))
    )
    return ValidationResult(valid, valid_rows, quarantine)


def quarantine_all(
    batch: pa.RecordBatch | pa.Table,
    failures: Sequence[Failure],
    *,
    source_shard: str,
    first_row: int,
) -> pa.Table:
    """Quarantine every row of ``batch`` with the same failures.

    Used for shards whose columns or types do not fit the schema (contract §4, shard cases).

    Raises:
        ValueError: ``failures`` is empty.
    """
    shared = list(failures)
    if not shared:
        raise ValueError("quarantine_all needs at least one failure")
    n = batch.num_rows
    rows = np.arange(n, dtype=np.int64) + np.int64(first_row)
    return build_quarantine(source_shard, rows, [shared] * n, batch)


def _dedupe(failures: list[Failure]) -> list[Failure]:
    return list(dict.fromkeys(failures)) if len(failures) > 1 else failures


# --- running pandera and folding its failure records --------------------------------------

# pandas conversion: integers and booleans to pandas' nullable dtypes (see module docstring).
_PANDAS_NULLABLE: dict[pa.DataType, Any] | None = None


def _pandas_types_mapper() -> dict[pa.DataType, Any]:
    global _PANDAS_NULLABLE
    if _PANDAS_NULLABLE is None:
        import pandas as pd

        _PANDAS_NULLABLE = {
            pa.int8(): pd.Int8Dtype(),
            pa.int16(): pd.Int16Dtype(),
            pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(),
            pa.uint8(): pd.UInt8Dtype(),
            pa.uint16(): pd.UInt16Dtype(),
            pa.uint32(): pd.UInt32Dtype(),
            pa.uint64(): pd.UInt64Dtype(),
            pa.bool_(): pd.BooleanDtype(),
        }
    return _PANDAS_NULLABLE


def to_pandas_frame(batch: pa.RecordBatch):
    """The pandas DataFrame a pandas schema validates (the documented conversion).

    Integers/booleans → nullable ``Int*``/``UInt*``/``boolean``; floats → numpy floats with
    null → NaN; strings → pandas' default ``str`` dtype; other types → pyarrow's defaults.
    The index is a RangeIndex, so pandera's failure index is the row position.
    """
    return batch.to_pandas(types_mapper=_pandas_types_mapper().get, split_blocks=True)


def _to_frame(kind: str, batch: pa.RecordBatch):
    if kind == "polars":
        import polars as pl

        return pl.from_arrow(batch)
    return to_pandas_frame(batch)


_Folded = tuple[list[Failure], dict[int, list[Failure]]]


def _check(resolved: CompiledSchema, batch: pa.RecordBatch) -> _Folded:
    """Run pandera lazily; return (failures of every row, failures by row index)."""
    from pandera.config import ValidationDepth, config_context
    from pandera.errors import SchemaErrors

    try:
        frame = _to_frame(resolved.kind, batch)
    except MemoryError:
        raise
    except Exception as exc:  # an Arrow type the frame library cannot hold
        text = f"batch cannot be converted to a {resolved.kind} frame: {_error_text(exc)}"
        return [Failure(None, "conversion", _message(text))], {}
    try:
        with config_context(
            validation_enabled=True, validation_depth=ValidationDepth.SCHEMA_AND_DATA
        ):
            if resolved.kind == "pandas":  # the frame is ours: skip pandera's defensive copy
                resolved.schema.validate(frame, lazy=True, inplace=True)
            else:
                resolved.schema.validate(frame, lazy=True)
    except SchemaErrors as exc:
        return _fold(exc.failure_cases, resolved.kind, batch.num_rows)
    except MemoryError:
        raise
    except Exception as exc:  # pandera or a check crashed outside its own error reporting
        text = f"schema validation raised {_error_text(exc)}"
        return [Failure(None, "validation_error", _message(text))], {}
    return [], {}


def _fold(failure_cases, kind: str, n: int) -> _Folded:
    if kind == "polars":
        get = lambda name: failure_cases.get_column(name).to_list()  # noqa: E731
    else:
        get = lambda name: failure_cases[name].tolist()  # noqa: E731
    frame_failures: list[Failure] = []
    row_failures: dict[int, list[Failure]] = {}
    records = zip(get("column"), get("check"), get("failure_case"), get("index"))
    for column, check, case, index in records:
        row = _row_index(index, n)
        failure = _failure(_text_or_none(column), _text_or_none(check), case, row is None)
        if row is None:
            frame_failures.append(failure)
        else:
            row_failures.setdefault(row, []).append(failure)
    return _dedupe(frame_failures), {row: _dedupe(f) for row, f in row_failures.items()}


def _is_null(value: object) -> bool:
    if value is None:
        return True
    if isinstance(value, (float, np.floating)):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")


def _text_or_none(value: object) -> str | None:
    return None if _is_null(value) else str(value)


def _row_index(index: object, n: int) -> int | None:
    """The batch row a failure record names, or None when it names no single row."""
    if _is_null(index):
        return None
    if isinstance(index, (float, np.floating)) and float(index).is_integer():
        index = int(index)
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool) and 0 <= index < n:
        return int(index)
    return None  # a label that is not a row position (e.g. a groupby key): every row


def _failure(column: str | None, check: str | None, case: object, frame_level: bool) -> Failure:
    check = check or "unknown"
    value = _value_text(case)
    if check == "column_in_dataframe":
        column = column or value
        text = f"{column}: column declared by the schema is missing from the batch"
    elif check == "column_in_schema":
        column = column or value
        text = f"{column}: column is not declared by the strict schema"
    elif check.startswith("dtype("):
        text = f"{column}: {check} failed: found {value}"
    else:
        prefix = f"{column}: " if column else ""
        if frame_level:
            text = f"{prefix}{check} failed: {value}"
        else:
            text = f"{prefix}{check} failed for value {value}"
    return Failure(column, check, _message(text))


def _value_text(value: object) -> str:
    if _is_null(value):
        return "NaN" if isinstance(value, (float, np.floating)) else "null"
    if isinstance(value, (float, np.floating)) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return _one_line(str(value), MAX_VALUE_CHARS)


def _error_text(exc: BaseException) -> str:
    text = re.sub(r"\s*[\r\n]+\s*", " | ", f"{type(exc).__name__}: {exc}".strip())
    return _one_line(text, MAX_VALUE_CHARS)


def _one_line(text: str, limit: int) -> str:
    """``text`` on one line (line breaks shown as ``\\n``), cut to ``limit`` characters."""
    text = text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n")
    if len(text) > limit:
        text = text[:limit] + f"…({len(text)} chars)"
    return text


def _message(text: str) -> str:
    return _one_line(text, MAX_MESSAGE_CHARS)
