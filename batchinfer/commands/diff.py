"""``batchinfer diff``: compare two committed outputs of the same partition, or a partition's
champion with one of its challengers (``--challenger NAME``) (contract §2, §6 "Challengers").

Both sides are read through their manifests only (files a manifest does not list are not part
of a partition). Rows are matched by ``(_source_shard, _source_row)``, one shard at a time, so
memory is bounded by the largest shard, not the partition — except for the rank correlation,
which needs every matched value of a score column: two float64 arrays per column (16 bytes a
row; 128 MiB for 8M rows). Compared: the triple, the inputs (each shard's sha256), which rows
were scored or quarantined on each side, ``_input_hash``, and every other column the two
prediction tables share — bit for bit, with the largest absolute difference for numbers — and,
as models are compared (:mod:`batchinfer.rows.compare`): per float column Spearman's rank
correlation, |A − B| quantiles and the top movers; per integer, boolean or string column the
agreement. ``_inference_id`` and ``_compute_ms`` describe an execution and are not compared
(contract §5.4); the triple columns are compared once, from the manifests.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NotRequired, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SpecError
from ..io.outputs import PREDICTIONS, QUARANTINE, challenger_folder
from ..io.partitions import open_partition
from ..io.records import FileRecord, ShardRecord, Totals
from ..rows.arrow_types import plain_array, plain_type
from ..rows.columns import EXPLANATION, INPUT_HASH, NOT_COMPARED, SOURCE_ROW
from ..rows.compare import (
    ExplanationAgreement,
    ScoreSummary,
    TopMovers,
    agreement,
    explanation_agreement,
    score_summary,
)

# The columns not compared bit for bit: the row's key, what describes an execution, and the
# triple (compared once, from the manifests) — as rows/columns.py declares them.
EXEMPT = NOT_COMPARED


TOP_MOVERS = 10


class Pair(TypedDict):
    a: Any
    b: Any


class Side(TypedDict):
    output: str
    job: str
    ds: str | None
    attempt: str
    totals: dict[str, Any]          # Totals.to_dict()
    challenger: NotRequired[str]    # B is this challenger of A's partition


class Shards(TypedDict):
    both: int
    only_a: list[str]
    only_b: list[str]
    input_changed: list[str]


class Rows(TypedDict):
    scored_both: int
    scored_only_a: int
    scored_only_b: int
    quarantined_both: int
    input_hash_differs: int


class Column(TypedDict):
    differ: int
    max_abs_diff: float | None
    types: NotRequired[Pair]   # the Arrow types, where they differ


class Label(TypedDict):
    rows: int
    agreement: float | None


class Models(TypedDict):
    scores: dict[str, ScoreSummary]
    labels: dict[str, Label]
    # a mover's values: a, b, abs_diff, _source_shard, _source_row, and the label and id columns
    top_movers: dict[str, list[dict[str, Any]]]
    explanations: NotRequired[ExplanationAgreement]   # only where both sides hold explanations


class DiffReport(Models):
    """What ``diff`` reports (``--json`` prints it as it is; keys in this order)."""

    a: Side
    b: Side
    same_partition: bool
    triple_differs: dict[str, Pair]
    shards: Shards
    rows: Rows
    columns: dict[str, Column]
    identical: bool


def diff_outputs(url_a: str, url_b: str | None = None, *, challenger: str | None = None,
                 top: int = TOP_MOVERS) -> DiffReport:
    """A report (plain data, JSON-ready) of how output B differs from output A; with
    ``challenger``, B is that challenger of output A (and A its champion).

    Args:
        top: how many top movers to list per score column.

    Raises:
        SpecError: either side holds no committed partition, or no challenger of that name.
        StorageError: a listed file cannot be read.
    """
    if (url_b is None) == (challenger is None):
        raise SpecError("diff compares OUTPUT_A OUTPUT_B, or OUTPUT --challenger NAME")
    a = _Side(url_a)
    b = _Side(url_a, challenger) if challenger is not None else _Side(str(url_b))
    triple: dict[str, Pair] = {part: {"a": a.triple.get(part), "b": b.triple.get(part)}
              for part in sorted(set(a.triple) | set(b.triple))
              if a.triple.get(part) != b.triple.get(part)}
    shards_a, shards_b = a.shards(), b.shards()
    rows: Rows = {"scored_both": 0, "scored_only_a": 0, "scored_only_b": 0, "quarantined_both": 0,
                  "input_hash_differs": 0}
    columns: dict[str, Column] = {}
    models = _Models(top)
    for name in sorted(set(shards_a) & set(shards_b)):
        _compare_shard(a, b, shards_a[name], shards_b[name], rows, columns, models)
    changed = sorted(n for n in set(shards_a) & set(shards_b)
                     if shards_a[n].sha256 != shards_b[n].sha256)
    identical = (not triple and not changed and shards_a.keys() == shards_b.keys()
                 and rows["scored_only_a"] == rows["scored_only_b"] == 0
                 and rows["input_hash_differs"] == 0
                 and all(c["differ"] == 0 and "types" not in c for c in columns.values()))
    return {
        "a": a.about(), "b": b.about(),
        "same_partition": (a.manifest.job, a.manifest.ds) == (b.manifest.job, b.manifest.ds),
        "triple_differs": triple,
        "shards": {"both": len(set(shards_a) & set(shards_b)),
                   "only_a": sorted(set(shards_a) - set(shards_b)),
                   "only_b": sorted(set(shards_b) - set(shards_a)),
                   "input_changed": changed},
        "rows": rows,
        "columns": columns,
        **models.report(),
        "identical": identical,
    }


class _Side:
    """One side of a diff: a partition's champion, or one of its challengers."""

    def __init__(self, url: str, challenger: str | None = None):
        self.url = url
        partition = open_partition(url)
        if partition is None:
            raise SpecError(f"{url} holds no committed partition (no _manifest.json)")
        self.partition = partition
        manifest = self.manifest = partition.manifest
        self.shown = url
        self.challenger = challenger
        self.triple = manifest.triple
        self.predictions = PREDICTIONS
        self._shards = {s.path: s for s in manifest.shards}
        if challenger is not None:
            found = manifest.challenger(challenger)
            if found is None:
                known = ", ".join(c.name for c in manifest.challengers) or "none"
                raise SpecError(f"{url} has no challenger {challenger!r} (its challengers: {known})")
            self.shown = f"{url} challenger {challenger}"
            self.triple = found.triple
            self.predictions = challenger_folder(challenger)
            # The challenger's rows, per shard, as shard records: what it rejected stands where
            # the champion's quarantine would (it has no quarantine files).
            self._shards = {s.path: replace(self._shards[s.path], rows_scored=s.rows_scored,
                                            rows_quarantined=s.rows_rejected, reason=s.reason,
                                            files=s.files)
                            for s in found.shards}

    def about(self) -> Side:
        manifest = self.manifest
        about: Side = {"output": self.shown, "job": manifest.job, "ds": manifest.ds,
                       "attempt": manifest.attempt, "totals": manifest.totals.to_dict()}
        if self.challenger is not None:  # its rows_quarantined are the rows it rejected
            about["totals"] = Totals.of(list(self._shards.values())).to_dict()
            about["challenger"] = self.challenger
        return about

    def shards(self) -> dict[str, ShardRecord]:
        return self._shards

    def read(self, files: tuple[FileRecord, ...], kind: str,
             columns: list[str] | None) -> pa.Table | None:
        """The shard's files of one kind (predictions | quarantine), concatenated."""
        return self.partition.read(files, self.predictions if kind == PREDICTIONS else kind, columns)


def _rows(table: pa.Table | None) -> np.ndarray:
    if table is None:
        return np.zeros(0, np.int64)
    return table.column(SOURCE_ROW.name).to_numpy()


def _compare_shard(a: _Side, b: _Side, shard_a: ShardRecord, shard_b: ShardRecord, rows: Rows,
                   columns: dict[str, Column], models: "_Models") -> None:
    pred_a = a.read(shard_a.files, PREDICTIONS, None)
    pred_b = b.read(shard_b.files, PREDICTIONS, None)
    quar_a = _rows(a.read(shard_a.files, QUARANTINE, [SOURCE_ROW.name]))
    quar_b = _rows(b.read(shard_b.files, QUARANTINE, [SOURCE_ROW.name]))
    rows_a, rows_b = _rows(pred_a), _rows(pred_b)
    common, ia, ib = np.intersect1d(rows_a, rows_b, assume_unique=True, return_indices=True)
    rows["scored_both"] += int(common.size)
    rows["scored_only_a"] += int(rows_a.size - common.size)
    rows["scored_only_b"] += int(rows_b.size - common.size)
    rows["quarantined_both"] += int(np.intersect1d(quar_a, quar_b, assume_unique=True).size)
    if not common.size or pred_a is None or pred_b is None:
        return
    names = [n for n in pred_a.column_names if n in pred_b.column_names and n not in EXEMPT]
    matched_a = pred_a.take(pa.array(ia))
    matched_b = pred_b.take(pa.array(ib))
    models.add(shard_a.path, common, matched_a, matched_b,
               [n for n in names if not n.startswith("_")])
    if EXPLANATION.name in names:
        models.explained[0].extend(matched_a.column(EXPLANATION.name).to_pylist())
        models.explained[1].extend(matched_b.column(EXPLANATION.name).to_pylist())
    for name in names:
        col_a = matched_a.column(name)
        col_b = matched_b.column(name)
        differ, max_abs = _column_difference(col_a, col_b)
        if name == INPUT_HASH.name:
            rows["input_hash_differs"] += differ
            continue
        entry = columns.setdefault(name, {"differ": 0, "max_abs_diff": None})
        entry["differ"] += differ
        if plain_type(col_a.type) != plain_type(col_b.type):  # compared by value, if at all
            entry["types"] = {"a": str(col_a.type), "b": str(col_b.type)}
        if max_abs is not None:
            entry["max_abs_diff"] = max(entry["max_abs_diff"] or 0.0, max_abs)


def _numeric(arrow_type: pa.DataType) -> bool:
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)


def _column_difference(col_a: pa.ChunkedArray, col_b: pa.ChunkedArray) -> tuple[int, float | None]:
    """(rows that are not identical, largest |a - b| for numeric columns or None).

    Numbers are compared by value whatever their widths (a float32 score against a float64 one,
    int32 against int64: numpy compares them exactly, the gap is taken in float64); the physical
    kinds of one type (``string``, ``large_string``…) compare by value too. Columns of other
    types that differ have every row differ."""
    rows, width = len(col_a), 1
    values_a, values_b = plain_array(col_a.combine_chunks()), plain_array(col_b.combine_chunks())
    while (pa.types.is_fixed_size_list(values_a.type) and pa.types.is_fixed_size_list(values_b.type)
           and values_a.type.list_size == values_b.type.list_size):  # outputs of shape [N, K, ...]
        width *= values_a.type.list_size
        values_a, values_b = values_a.flatten(), values_b.flatten()
    if _numeric(values_a.type) and _numeric(values_b.type):
        x = values_a.to_numpy(zero_copy_only=False).reshape(rows, width)
        y = values_b.to_numpy(zero_copy_only=False).reshape(rows, width)
        same = x == y
        if "f" in (x.dtype.kind, y.dtype.kind):
            same |= np.isnan(x) & np.isnan(y)
        gap = np.abs(x.astype(np.float64) - y.astype(np.float64))
        return int((~same.all(axis=1)).sum()), float(np.nanmax(gap)) if gap.size else 0.0
    if values_a.type != values_b.type:
        return rows, None
    if pa.types.is_list(values_a.type):   # _explanation: Arrow's kernels do not compare lists
        return sum(x != y for x, y in zip(values_a.to_pylist(), values_b.to_pylist())), None
    equal = pc.fill_null(pc.equal(values_a, values_b), False)
    same = pc.or_(equal, pc.and_(pc.is_null(values_a), pc.is_null(values_b)))
    return int((~same.to_numpy(zero_copy_only=False).reshape(rows, width).all(axis=1)).sum()), None


class _Models:
    """The model comparison, fed shard by shard: every matched value of each score column
    (for the rank correlation), label agreement counts, and each score column's top movers.

    Columns batchinfer writes (``_…``) are not predictions. A float column is a score; an
    integer, boolean or string column a label (id columns are such columns too: their
    agreement says the rows line up). A top mover shows the label and id columns beside it."""

    def __init__(self, top: int):
        self.top = top
        self.scores: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.labels: dict[str, list[int]] = {}   # column -> [rows, agreeing]
        self.movers: dict[str, TopMovers] = {}
        # explain: both sides' _explanation of the matched rows (a row's list is k entries)
        self.explained: tuple[list, list] = ([], [])

    def add(self, shard: str, rows: np.ndarray, a: pa.Table, b: pa.Table, names: list[str]) -> None:
        kinds = {n: _kind(a.schema.field(n).type, b.schema.field(n).type) for n in names}
        keys = {n: _values(a.column(n)) for n, kind in kinds.items() if kind == "label"}
        for name, kind in kinds.items():
            if kind == "score":
                x = _values(a.column(name)).astype(np.float64)
                y = _values(b.column(name)).astype(np.float64)
                seen = self.scores.setdefault(name, ([], []))
                seen[0].append(x)
                seen[1].append(y)
                self.movers.setdefault(name, TopMovers(self.top)).add(shard, rows, x, y, keys)
            elif kind == "label":
                counts = self.labels.setdefault(name, [0, 0])
                counts[0] += a.num_rows
                counts[1] += agreement(_values(a.column(name)), _values(b.column(name)))

    def report(self) -> Models:
        scores = {}
        for name, (xs, ys) in self.scores.items():
            scores[name] = score_summary(np.concatenate(xs), np.concatenate(ys))
        labels: dict[str, Label] = {name: {"rows": n, "agreement": (same / n if n else None)}
                                    for name, (n, same) in self.labels.items()}
        report: Models = {"scores": scores, "labels": labels,
                  "top_movers": {name: movers.rows() for name, movers in self.movers.items()}}
        if self.explained[0]:   # only where both sides hold explanations: the key is absent otherwise
            report["explanations"] = explanation_agreement(*self.explained)
        return report


def _kind(type_a: pa.DataType, type_b: pa.DataType) -> str | None:
    """score (float; a float against an integer or a float of another width too), label
    (integer of any width, boolean, string) or None (lists, other mixed types)."""
    type_a, type_b = plain_type(type_a), plain_type(type_b)   # dictionaries decoded
    if _numeric(type_a) and _numeric(type_b):
        return "score" if pa.types.is_floating(type_a) or pa.types.is_floating(type_b) else "label"
    if type_a != type_b:
        return None
    if pa.types.is_boolean(type_a) or pa.types.is_string(type_a):
        return "label"
    return None


def _values(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    return array.to_numpy(zero_copy_only=False)
