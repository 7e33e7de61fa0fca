"""Bad input, every kind a nightly job meets (contract §4 shard cases and quarantine, §5.1, §5.5):
quarantined or recorded with a reason, one quarantine row per bad input row, the accounting
invariant everywhere, and the job goes on within the thresholds.

The jobs run in-process (``load_job`` + ``run_job`` on the DirectRunner): one partition holds
every bad shard at once, with ``max_bad_fraction: 1.0`` and ``max_bad_shards`` = the number of
unreadable shards. MLflow tracking is replaced by a stub (not under test here). Rerun with
``.venv/bin/pytest tests/unit/test_bad_input.py -q``.
"""
from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from factories import (
    DS,
    check_partition,
    kept_for_resume,
    make_mlp_onnx,
    mlp_reference,
    no_tracking,  # noqa: F401  (a fixture)
    write_job,
    write_schema,
)

FEATURES = ["f0", "f1", "f2", "f3"]
N = 40




pytestmark = pytest.mark.usefixtures("no_tracking")  # MLflow is not under test here


def frame(n: int = N, seed: int = 0, first_id: int = 0, **columns) -> pa.Table:
    """id int64 + f0..f3 float32 in [-3, 3]; keyword columns replace or add columns."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal((n, 4)), -3, 3).astype(np.float32)
    cols: dict = {"id": pa.array(np.arange(first_id, first_id + n, dtype=np.int64))}
    cols.update({f: pa.array(x[:, i]) for i, f in enumerate(FEATURES)})
    for name, value in columns.items():
        if value is None:
            cols.pop(name)
        else:
            cols[name] = value
    return pa.table(cols)


def with_values(table: pa.Table, column: str, rows: dict[int, object]) -> pa.Table:
    values = table[column].to_pylist()
    for row, value in rows.items():
        values[row] = value
    i = table.column_names.index(column)
    return table.set_column(i, column, pa.array(values, table.schema.field(column).type))


def stamp_job(folder: Path, job_name: str, model: str, **job_sections) -> Path:
    from batchinfer.commands.stamp import stamp
    from batchinfer.spec import load_job

    make_mlp_onnx(folder / model)
    written = write_job(folder, model=model, **job_sections)
    path = written.rename(folder / job_name)
    stamp(load_job(path, require_ds=False), None, "model:1")
    return path


def run(job: Path, *overrides: str):
    from batchinfer.commands.run import run_job
    from batchinfer.spec import load_job

    return run_job(load_job(job, ds=DS, overrides=list(overrides)))


# -- one partition with every kind of bad shard (strict schema) ----------------------------------

ROW_BAD = {  # row → (column, values to set) in the "rows" shard
    3: {"f0": None},                      # null
    5: {"f1": float("nan")},              # NaN
    7: {"f2": float("inf")},              # +inf
    9: {"f3": float("-inf")},             # -inf
    11: {"f0": 10.5},                     # out of range (schema: [-10, 10])
    13: {"f0": None, "f1": 99.0},         # two failures in one row
    15: {"id": None},                     # null id
}


def _bad_shards(data: Path) -> dict[str, Path]:
    data.mkdir(parents=True)
    shards: dict[str, Path] = {}

    def put(name: str, table: pa.Table | None = None, raw: bytes | None = None) -> None:
        path = data / f"{len(shards):02d}-{name}.parquet"
        if raw is not None:
            path.write_bytes(raw)
        else:
            pq.write_table(table, path)
        shards[name] = path

    put("good", frame(seed=1))
    rows = frame(seed=2)
    for row, change in ROW_BAD.items():
        for column, value in change.items():
            rows = with_values(rows, column, {row: value})
    put("rows", rows)
    put("dtype_float64", frame(seed=3, f0=pa.array(np.linspace(-1, 1, N), pa.float64())))
    put("dtype_string", frame(seed=4, f1=pa.array([str(i) for i in range(N)])))
    put("missing_column", frame(seed=5, f3=None))
    put("extra_column", frame(seed=6, extra=pa.array(np.ones(N, np.float32))))
    put("zero_rows", frame(n=0))
    put("zero_bytes", raw=b"")
    good_bytes = (data / "00-good.parquet").read_bytes()
    put("truncated", raw=good_bytes[: len(good_bytes) // 2])
    put("not_parquet", raw=b"id,f0,f1,f2,f3\n1,0.1,0.2,0.3,0.4\n")
    sibling = frame(seed=8)   # columns in another order and id as int32: differs from its siblings
    sibling = pa.table({"f3": sibling["f3"], "id": sibling["id"].cast(pa.int32()),
                        "f2": sibling["f2"], "f1": sibling["f1"], "f0": sibling["f0"]})
    put("sibling_schema", sibling)
    # footer fine, a later row group's page header destroyed: the first batches read (and are
    # scored and written) before the damage shows; the whole shard must count as unreadable
    pq.write_table(frame(n=400, seed=10), data / "tmp.parquet", row_group_size=100)
    chunk = pq.read_metadata(data / "tmp.parquet").row_group(2).column(1)
    raw = bytearray((data / "tmp.parquet").read_bytes())
    for i in range(chunk.data_page_offset + 1, chunk.data_page_offset + 40):
        raw[i] ^= 0xFF
    (data / "tmp.parquet").unlink()
    put("corrupt_middle", raw=bytes(raw))
    reordered = frame(seed=9)   # only the column order differs: fine
    put("reordered", reordered.select(["f2", "f0", "id", "f3", "f1"]))
    return shards


UNREADABLE = ("zero_bytes", "truncated", "not_parquet", "corrupt_middle")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_input")
    write_schema(folder / "schemas", strict=True)
    shards = _bad_shards(folder / "data" / "strict" / f"dt={DS}")
    job = stamp_job(folder, "strict.yaml", "models/strict.onnx",
                    input={"path": "data/strict/dt={ds}/*.parquet"}, batch={"rows": 100},
                    quarantine={"max_bad_fraction": 1.0, "max_bad_shards": len(UNREADABLE)})
    return folder, job, shards


@pytest.fixture(scope="module")
def strict_run(project):
    folder, job, shards = project
    outcome = run(job)
    assert outcome.status == "committed", outcome.message
    out = folder / "out" / f"dt={DS}"
    preds, quar, manifest = check_partition(out, list(shards.values()))
    by_name = {name: next(s for s in manifest["shards"] if s["path"] == str(path))
               for name, path in shards.items()}
    return preds, quar, manifest, by_name, shards


def _quarantine_of(quar: pa.Table, path: Path) -> list[dict]:
    rows = [r for r in quar.to_pylist() if r["_source_shard"] == str(path)]
    return sorted(rows, key=lambda r: r["_source_row"])


def test_good_shard_scored_with_correct_predictions(strict_run):
    preds, _, _, by_name, shards = strict_run
    assert by_name["good"]["status"] == "scored" and by_name["good"]["rows_scored"] == N
    mine = preds.filter(pc.equal(preds["_source_shard"], str(shards["good"])))
    x = np.stack([frame(seed=1)[f].to_numpy() for f in FEATURES], axis=1)
    want = mlp_reference(x)[mine["_source_row"].to_numpy()]
    np.testing.assert_allclose(mine["y"].to_numpy(), want, rtol=1e-5, atol=1e-6)
    assert mine["id"].to_pylist() == mine["_source_row"].to_pylist()


def test_nulls_nan_inf_out_of_range_quarantined_row_by_row(strict_run):
    preds, quar, _, by_name, shards = strict_run
    entry = by_name["rows"]
    assert entry["status"] == "scored"
    assert entry["rows_quarantined"] == len(ROW_BAD) and entry["rows_scored"] == N - len(ROW_BAD)
    rows = _quarantine_of(quar, shards["rows"])
    assert [r["_source_row"] for r in rows] == sorted(ROW_BAD)
    got = {r["_source_row"]: r for r in rows}
    for row, change in ROW_BAD.items():
        q = got[row]
        assert q["_column"] in change, (row, q)
        assert q["_reason"] and q["_check"]
        assert {c["column"] for c in q["_reasons"]} >= set(change), (row, q["_reasons"])
    assert got[3]["_check"] == "not_nullable"
    assert got[11]["_check"].startswith("in_range")
    assert len(got[13]["_reasons"]) >= 2                     # every failure of the row is kept
    values = {row: json.loads(got[row]["_values"]) for row in got}
    assert values[3]["f0"] is None
    assert values[5]["f1"] == "NaN"
    assert values[7]["f2"] == "Infinity" and values[9]["f3"] == "-Infinity"
    assert values[11]["f0"] == 10.5 and values[15]["id"] is None
    assert values[7]["id"] == 7                               # the original row, not a neighbour
    # none of these rows made it into the predictions
    scored = preds.filter(pc.equal(preds["_source_shard"], str(shards["rows"])))
    assert not set(scored["_source_row"].to_pylist()) & set(ROW_BAD)
    assert np.isfinite(preds["y"].to_numpy()).all()


@pytest.mark.parametrize("name,column,check", [
    ("dtype_float64", "f0", "dtype("),
    ("dtype_string", "f1", "dtype("),
    ("missing_column", "f3", "column_in_dataframe"),
    ("extra_column", "extra", "column_in_schema"),
    ("sibling_schema", "id", "dtype("),
])
def test_shard_that_does_not_fit_the_schema_has_every_row_quarantined(strict_run, name, column, check):
    _, quar, _, by_name, shards = strict_run
    entry = by_name[name]
    assert entry["status"] == "quarantined", entry
    assert entry["rows_in"] == N and entry["rows_quarantined"] == N and entry["rows_scored"] == 0
    assert entry["reason"] and column in entry["reason"]
    rows = _quarantine_of(quar, shards[name])
    assert [r["_source_row"] for r in rows] == list(range(N))
    for r in rows:
        assert r["_column"] == column and r["_check"].startswith(check), r
    original = pq.read_table(shards[name]).to_pylist()
    for r in rows[:3]:   # _values is the row as it was, with the shard's own columns
        values = json.loads(r["_values"])
        assert list(values) == pq.read_schema(shards[name]).names
        assert values["id"] == original[r["_source_row"]]["id"]


def test_zero_row_shard_is_empty(strict_run):
    entry = strict_run[3]["zero_rows"]
    assert entry["status"] == "empty" and entry["rows_in"] == 0 and entry["files"] == []


@pytest.mark.parametrize("name,words", [("zero_bytes", "zero-byte"),
                                        ("truncated", "parquet"),
                                        ("not_parquet", "parquet"),
                                        ("corrupt_middle", "corrupt")])
def test_unreadable_shards_recorded_and_counted(strict_run, name, words):
    _, quar, manifest, by_name, shards = strict_run
    entry = by_name[name]
    assert entry["status"] == "unreadable"
    assert entry["rows_in"] is None and entry["rows_scored"] == 0 and entry["rows_quarantined"] == 0
    assert words in entry["reason"].lower()
    # sha256 may be null for a shard that cannot be read (contract §4: str|null)
    assert entry["sha256"] in (None, hashlib.sha256(shards[name].read_bytes()).hexdigest())
    assert manifest["totals"]["shards_unreadable"] == len(UNREADABLE)
    assert not _quarantine_of(quar, shards[name])


def test_reordered_columns_scored_by_name(strict_run):
    preds, _, _, by_name, shards = strict_run
    assert by_name["reordered"]["status"] == "scored"
    mine = preds.filter(pc.equal(preds["_source_shard"], str(shards["reordered"])))
    x = np.stack([frame(seed=9)[f].to_numpy() for f in FEATURES], axis=1)
    np.testing.assert_allclose(mine["y"].to_numpy(), mlp_reference(x)[mine["_source_row"].to_numpy()],
                               rtol=1e-5, atol=1e-6)


def test_unreadable_shards_above_max_bad_shards_exit_4_nothing_committed(project, strict_run):
    from batchinfer.errors import DataQualityError

    folder, job, _ = project
    with pytest.raises(DataQualityError) as info:
        run(job, f"quarantine.max_bad_shards={len(UNREADABLE) - 1}", "output.path=out_strict_fail")
    assert info.value.exit_code == 4
    assert f"{len(UNREADABLE)} unreadable shards (max {len(UNREADABLE) - 1})" in info.value.message
    out = folder / "out_strict_fail"
    # Its finished shards kept for a rerun (a shard found unreadable part-way may leave files
    # no result lists: the next commit removes them).
    assert kept_for_resume(out, all_finished=False)


def test_bad_rows_above_max_bad_fraction_exit_4(project, strict_run):
    from batchinfer.errors import DataQualityError

    folder, job, _ = project
    manifest = strict_run[2]
    t = manifest["totals"]
    fraction = t["rows_quarantined"] / t["rows_in"]
    with pytest.raises(DataQualityError) as info:
        run(job, f"quarantine.max_bad_fraction={fraction - 0.001:.4f}", "output.path=out_frac_fail")
    assert info.value.exit_code == 4
    assert not (folder / "out_frac_fail" / "_manifest.json").exists()


# -- a non-strict schema: extra columns are fine ------------------------------------------------

def test_extra_column_with_non_strict_schema_is_scored(tmp_path):
    write_schema(tmp_path / "schemas", version=2, strict=False)
    data = tmp_path / "data" / f"dt={DS}"
    data.mkdir(parents=True)
    plain, extra = data / "a-plain.parquet", data / "b-extra.parquet"
    pq.write_table(frame(seed=21), plain)
    pq.write_table(frame(seed=21, comment=pa.array(["x"] * N), extra=pa.array(np.ones(N))), extra)
    job = stamp_job(tmp_path, "loose.yaml", "models/loose.onnx", schema="feats@2")
    outcome = run(job)
    assert outcome.status == "committed"
    preds, quar, manifest = check_partition(tmp_path / "out" / f"dt={DS}", [plain, extra])
    assert quar.num_rows == 0
    assert [s["status"] for s in manifest["shards"]] == ["scored", "scored"]
    by_shard = {p: preds.filter(pc.equal(preds["_source_shard"], str(p))).sort_by("_source_row")
                for p in (plain, extra)}
    # same features: same predictions and same _input_hash (only schema columns are hashed)
    assert by_shard[plain]["y"].equals(by_shard[extra]["y"])
    assert by_shard[plain]["_input_hash"].equals(by_shard[extra]["_input_hash"])
    assert "comment" not in preds.column_names


# -- long strings and unicode ---------------------------------------------------------------------

NOTES = [
    "x" * 100_000,                                   # very long
    "emoji 🚀🔥👩‍👩‍👧‍👦 and flags 🇯🇵",
    "עברית RTL שלום \u202e reversed \u202c",          # Hebrew, RTL override
    "العربية مرحبا",                                  # Arabic
    "quotes \" and \\ backslash\nnewline\ttab\x00nul",
    "e\u0301 combining, ß, İ, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
    None,
]


def test_long_strings_and_unicode_round_trip_in_values(tmp_path):
    notes_schema = tmp_path / "schemas" / "notes" / "v1.py"
    notes_schema.parent.mkdir(parents=True)
    notes_schema.write_text(textwrap.dedent('''\
        import pandera.polars as pa
        import polars as pl

        SCHEMA = pa.DataFrameSchema({
            "id": pa.Column(pl.Int64, nullable=False),
            "note": pa.Column(pl.Utf8, nullable=True),
            "f0": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)),
            "f1": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)),
            "f2": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)),
            "f3": pa.Column(pl.Float32, checks=pa.Check.in_range(-10, 10)),
        }, strict=True)
        FEATURES = ["f0", "f1", "f2", "f3"]
        '''))
    data = tmp_path / "data" / f"dt={DS}"
    data.mkdir(parents=True)
    n = 2 * len(NOTES)
    table = frame(n=n, seed=31, note=pa.array(NOTES + NOTES, pa.string()))
    bad = list(range(len(NOTES)))               # the first copy of each note: out of range
    table = with_values(table, "f2", {r: 42.0 for r in bad})
    path = data / "notes.parquet"
    pq.write_table(table, path)
    job = stamp_job(tmp_path, "notes.yaml", "models/notes.onnx", schema="notes@1",
                    quarantine={"max_bad_fraction": 0.5, "max_bad_shards": 0})
    outcome = run(job)
    assert outcome.status == "committed"
    preds, quar, manifest = check_partition(tmp_path / "out" / f"dt={DS}", [path])
    assert quar.num_rows == len(NOTES) and preds.num_rows == len(NOTES)
    original = table.to_pylist()
    for q in quar.to_pylist():
        values = json.loads(q["_values"])
        row = original[q["_source_row"]]
        assert values["note"] == row["note"]               # exact, 100k chars and all
        assert values["id"] == row["id"] and values["f2"] == 42.0
        assert q["_column"] == "f2" and len(q["_reason"]) <= 1000
    assert {q["_source_row"] for q in quar.to_pylist()} == set(bad)
    # the good copies of the same notes were scored; distinct notes hash differently
    hashes = preds.sort_by("_source_row")["_input_hash"].to_pylist()
    assert len(set(hashes)) == len(hashes)


def test_corrupt_middle_shard_really_fails_after_some_batches(strict_run):
    """The scenario above is real: batches of that shard were read (so scored and written)
    before the damage showed; none of them is in the partition (check_partition: no row of an
    unreadable shard, no unlisted file)."""
    from batchinfer.io.shards import ShardReader, Unreadable

    preds, _, _, _, shards = strict_run
    reader = ShardReader(str(shards["corrupt_middle"]))
    seen = 0
    with pytest.raises(Unreadable):
        for batch in reader.batches(100):
            seen += batch.num_rows
    assert seen >= 100
    assert str(shards["corrupt_middle"]) not in set(preds["_source_shard"].to_pylist())
