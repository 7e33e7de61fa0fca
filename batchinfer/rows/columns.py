"""The columns batchinfer writes, described once, and the rule that a name the user chooses never
takes one of them.

A partition's prediction files hold the job's id columns, the prediction columns and the audit
columns (contract §4); its quarantine files hold the quarantine columns. Each is declared here
once — its name, its Arrow type, how prediction files encode it and whether ``diff`` compares it —
and the writer (``pipeline/writer/``: ``audit.py`` computes the audit columns, one entry per
declared column), the Parquet encoding of prediction files, ``diff``'s
exemptions and the collision check below all derive from these declarations.

Two columns with one name cannot both be written: the later one silently replaces the earlier
(ids overwritten by scores, a prediction column dropped in favour of ``_source_row``). So every
collision is refused before any work, naming both sides (pure; no I/O). A table output's names
also take its partition column, and are compared regardless of case, as the tables take them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from ..errors import SpecError

# How a prediction file stores a column: dictionary-encoded (one value repeated per batch), with
# min/max statistics (readers prune by it), or neither (a dictionary tried on hashes or scores
# only to be given up costs more than writing them; measured: 36 → 13 ms CPU per 65,536-row file),
# and "uncompressed" besides: random hex digits, which Snappy shrinks by 16 % (1.31 → 1.10 MB a
# 65,536-row file) for 6 of the file's 19 ms of encoding (bench/README.md, issue 35).
Encoding = Literal["dictionary", "statistics", "plain", "uncompressed"]


@dataclass(frozen=True, kw_only=True)
class Column:
    """A column batchinfer writes.

    Attributes:
        name: its name (``_``-prefixed: a user's columns cannot take it, see below).
        type: its Arrow type as pyarrow spells it (``str(pa.DataType)``), as it is written.
            Spelled, not imported: the job spec's check imports this module, and loading pyarrow
            would cost every command that only reads a spec (tests hold the files to it).
        encoding: how prediction files store it (quarantine files keep Parquet's defaults).
        compared: whether ``diff`` compares it between two outputs; the others describe an
            execution, key the rows, or are compared once from the manifests (the triple).
    """

    name: str
    type: str
    encoding: Encoding = "plain"
    compared: bool = False


STRING, INT64, FLOAT64 = "string", "int64", "double"
CONSTANT = "dictionary<values=string, indices=int32, ordered=0>"   # one value per batch

# -- prediction files: the audit columns, in the order they follow the id and prediction columns
SOURCE_SHARD = Column(name="_source_shard", type=STRING, encoding="dictionary")
SOURCE_ROW = Column(name="_source_row", type=INT64, encoding="statistics")
INPUT_HASH = Column(name="_input_hash", type=STRING, encoding="uncompressed", compared=True)
# The triple's parts (triple/contract.py's Triple, field by field), one column each.
TRIPLE = {part: Column(name=f"_{part}", type=CONSTANT, encoding="dictionary")
          for part in ("model_version", "model_digest", "schema_version", "preprocess_hash")}
INFERENCE_ID = Column(name="_inference_id", type=STRING, encoding="dictionary")
COMPUTE_MS = Column(name="_compute_ms", type=FLOAT64)
AUDIT = (SOURCE_SHARD, SOURCE_ROW, INPUT_HASH, *TRIPLE.values(), INFERENCE_ID, COMPUTE_MS)

# -- prediction files of a job with `explain` (contract §6 "Explanations"): after the prediction
# columns, before the audit columns; absent otherwise. A row not explained (explain.fraction)
# has nulls in both.
EXPLANATION = Column(name="_explanation",
                     type="list<item: struct<feature: string not null, attribution: double not null>>")
EXPLANATION_BASELINE = Column(name="_explanation_baseline", type=FLOAT64)
EXPLAINED = (EXPLANATION, EXPLANATION_BASELINE)


def attribution_column(feature: str) -> str:
    """The profile column (``_profile.json``, baselines, drift) of one feature's attribution: a
    statistic, never a column of a file."""
    return f"{EXPLANATION.name}.{feature}"

# -- quarantine files (rows/quarantine.py's QUARANTINE_SCHEMA, which tests hold to these)
REASON = Column(name="_reason", type=STRING)
FAILED_COLUMN = Column(name="_column", type=STRING)
CHECK = Column(name="_check", type=STRING)
REASONS = Column(name="_reasons",
                 type="list<item: struct<column: string, check: string not null, message: string not null>>")
VALUES = Column(name="_values", type=STRING)
QUARANTINE = (SOURCE_SHARD, SOURCE_ROW, REASON, FAILED_COLUMN, CHECK, REASONS, VALUES)

AUDIT_COLUMNS = tuple(c.name for c in AUDIT)
QUARANTINE_COLUMNS = tuple(c.name for c in QUARANTINE)
EXPLAINED_COLUMNS = tuple(c.name for c in EXPLAINED)
RESERVED = frozenset(AUDIT_COLUMNS + QUARANTINE_COLUMNS + EXPLAINED_COLUMNS)
NOT_COMPARED = frozenset(c.name for c in AUDIT if not c.compared)


def prediction_encoding(id_columns: Sequence[str]) -> dict[str, list[str]]:
    """The Parquet encoding of a prediction file (``io.outputs.parquet_bytes``' arguments): the
    audit columns as declared, and statistics on the id columns too (readers look rows up by
    them)."""
    return {"dictionary": [c.name for c in AUDIT if c.encoding == "dictionary"],
            "statistics": [*id_columns, *(c.name for c in AUDIT if c.encoding == "statistics")],
            "uncompressed": [c.name for c in AUDIT if c.encoding == "uncompressed"]}


def check_output_columns(id_columns: Sequence[str], predictions: Mapping[str, str], *,
                         source: str = "output.predictions", partition: str | None = None) -> None:
    """Refuse id and prediction column names that collide with each other or with ours.

    Args:
        id_columns: ``output.id_columns``.
        predictions: model output name → prediction column name (``output.predictions``, or
            each model output under its own name when the job maps none).
        source: what ``predictions`` is, for the message (``output.predictions``, or the
            model's outputs).
        partition: a table output's partition column (``output.partition_column``), which
            the tables hold beside the columns of the files.

    Raises:
        SpecError: an empty name, an id column listed twice, two outputs mapped to one column, a
            prediction column that is also an id column, either named like an audit column, or
            the tables' partition column named like any column the job writes.
    """
    if partition is not None:
        check_partition_column(partition, id_columns, predictions)
    # A table's columns are one namespace regardless of case (Delta refuses `ID` beside `id` at
    # the commit, after all the scoring); a Parquet file's are not.
    def key(name: str) -> str:
        return _fold(name) if partition is not None else name

    reserved = {key(c): c for c in sorted(RESERVED)}
    seen: dict[str, str] = {}
    for column in id_columns:
        if not column:
            raise SpecError("output.id_columns: a column name cannot be empty")
        if key(column) in seen:
            raise SpecError(f"output.id_columns lists {column!r} twice"
                            f"{_case(column, seen[key(column)])}")
        if key(column) in reserved:
            raise SpecError(f"output.id_columns: {column!r} is the name of a column batchinfer "
                            f"writes itself ({_reserved_list()})"
                            f"{_case(column, reserved[key(column)])}; rename it in the schema")
        seen[key(column)] = column
    taken: dict[str, tuple[str, str]] = {}
    for output, column in predictions.items():
        if not column:
            raise SpecError(f"{source}: output {output!r} is mapped to an empty column name")
        if key(column) in reserved:
            raise SpecError(f"{source}: output {output!r} would be written as {column!r}, the "
                            f"name of a column batchinfer writes itself ({_reserved_list()})"
                            f"{_case(column, reserved[key(column)])}; map it to another name in "
                            f"output.predictions")
        if key(column) in seen:
            raise SpecError(f"{source}: output {output!r} would be written as {column!r}, which is "
                            f"also in output.id_columns{_case(column, seen[key(column)])}; map it "
                            f"to another name in output.predictions")
        if key(column) in taken:
            other, named = taken[key(column)]
            raise SpecError(f"{source}: outputs {other!r} and {output!r} would both be "
                            f"written as column {column!r}{_case(column, named)}; give each its "
                            f"own name")
        taken[key(column)] = (output, column)


def check_partition_column(partition: str, id_columns: Sequence[str],
                           predictions: Mapping[str, str]) -> None:
    """Refuse a table output's partition column named like a column the job writes.

    Each table holds the partition column beside the columns of its files (Iceberg's data files
    hold it too; Delta's log carries it): the id and prediction columns, and every column
    batchinfer writes itself into any of the tables — the audit columns (predictions and each
    challenger's table), the explanation columns, the quarantine table's columns. Those of the
    quarantine table or of ``explain`` are refused even when this run writes none: a later run
    (the first quarantined row, an ``explain`` added) would meet the collision at its commit,
    after all its scoring. Names are compared regardless of case: Delta refuses ``ID`` beside
    ``id``, and the engines that read the tables (Spark, Trino) take them for one column.

    Raises:
        SpecError: naming the partition column and the column it collides with.
    """
    taken = [*((f"batchinfer's own {c!r}", c) for c in sorted(RESERVED)),
             *((f"output.id_columns' {c!r}", c) for c in id_columns),
             *((f"the prediction column {c!r} (model output {o!r})", c)
               for o, c in predictions.items())]
    for what, column in taken:
        if _fold(column) == _fold(partition):
            case = "" if column == partition else " (a table's column names ignore case)"
            raise SpecError(f"output.partition_column {partition!r} is also a column the job "
                            f"writes: {what}{case}; the tables would hold two columns of that "
                            f"name; set output.partition_column to another name")


def _fold(name: str) -> str:
    return name.casefold()


def _case(name: str, other: str) -> str:
    """What a message adds when two names collide only regardless of case."""
    return "" if name == other else f" (as {other!r}: a table's column names ignore case)"


def _reserved_list() -> str:
    return ", ".join(sorted(RESERVED))
