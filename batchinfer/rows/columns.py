"""The columns batchinfer writes, and the rule that a name the user chooses never takes one of them.

A partition's prediction files hold the job's id columns, the prediction columns and the audit
columns (contract §4); its quarantine files hold the quarantine columns. Two columns with one name
cannot both be written: the later one silently replaces the earlier (ids overwritten by scores,
a prediction column dropped in favour of ``_source_row``). So every collision is refused before
any work, naming both sides (pure; no I/O).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..errors import SpecError

AUDIT_COLUMNS = ("_source_shard", "_source_row", "_input_hash", "_model_version",
                 "_model_digest", "_schema_version", "_preprocess_hash", "_inference_id",
                 "_compute_ms")
QUARANTINE_COLUMNS = ("_source_shard", "_source_row", "_reason", "_column", "_check",
                      "_reasons", "_values")
RESERVED = frozenset(AUDIT_COLUMNS + QUARANTINE_COLUMNS)


def check_output_columns(id_columns: Sequence[str], predictions: Mapping[str, str], *,
                         source: str = "output.predictions") -> None:
    """Refuse id and prediction column names that collide with each other or with ours.

    Args:
        id_columns: ``output.id_columns``.
        predictions: model output name → prediction column name (``output.predictions``, or
            each model output under its own name when the job maps none).
        source: what ``predictions`` is, for the message (``output.predictions``, or the
            model's outputs).

    Raises:
        SpecError: an empty name, an id column listed twice, two outputs mapped to one column, a
            prediction column that is also an id column, or either named like an audit column.
    """
    seen: set[str] = set()
    for column in id_columns:
        if not column:
            raise SpecError("output.id_columns: a column name cannot be empty")
        if column in seen:
            raise SpecError(f"output.id_columns lists {column!r} twice")
        if column in RESERVED:
            raise SpecError(f"output.id_columns: {column!r} is the name of a column batchinfer "
                            f"writes itself ({_reserved_list()}); rename it in the schema")
        seen.add(column)
    taken: dict[str, str] = {}
    for output, column in predictions.items():
        if not column:
            raise SpecError(f"{source}: output {output!r} is mapped to an empty column name")
        if column in RESERVED:
            raise SpecError(f"{source}: output {output!r} would be written as {column!r}, the "
                            f"name of a column batchinfer writes itself ({_reserved_list()}); "
                            f"map it to another name in output.predictions")
        if column in seen:
            raise SpecError(f"{source}: output {output!r} would be written as {column!r}, which is "
                            f"also in output.id_columns; map it to another name in "
                            f"output.predictions")
        if column in taken:
            raise SpecError(f"{source}: outputs {taken[column]!r} and {output!r} would both be "
                            f"written as column {column!r}; give each its own name")
        taken[column] = output


def _reserved_list() -> str:
    return ", ".join(sorted(RESERVED))
