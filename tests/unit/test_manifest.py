"""Tests for the output layout, the manifest commit, shard listing/reading, and the pure
manifest helpers of the pipeline (contract §4, §5.1, §5.2)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.errors import NoShardsError
from batchinfer.io import shards as shards_module
from batchinfer.io.manifest import (
    clean_after_commit,
    create_manifest,
    manifest_bytes,
    read_manifest,
    remove_attempt,
)
from batchinfer.io.outputs import (
    MANIFEST,
    Layout,
    parquet_bytes,
    read_json,
    write_file,
    write_json,
)
from batchinfer.io.records import FileRecord, Manifest, ModelStats, ShardRecord, Totals
from batchinfer.io.shards import Shard, ShardReader, Unreadable, list_shards
from batchinfer.pipeline.shard_reports import BatchRecord, ShardInfo, fold_shard
from batchinfer.pipeline.transforms import ReadShard, ScoringPlan
from batchinfer.pipeline.writer.predictions import prediction_array
from batchinfer.redaction import Deferred
from factories import make_shards


def _manifest(attempt: str, files=(), job: str = "j") -> Manifest:
    shard = ShardRecord(path="s0", sha256="abc", rows_in=len(files), rows_scored=len(files),
                        rows_quarantined=0, status="scored", reason=None,
                        files=tuple(FileRecord(p, 1, "x") for p in files))
    return Manifest(job=job, ds="2026-01-15", attempt=attempt, triple={"model_version": "m:1"},
                    job_spec_sha256="h", runner="direct", device="cpu", started_at="t0",
                    finished_at="t1", mlflow_run_id=None, totals=Totals.of([shard]),
                    shards=(shard,))


@pytest.fixture
def memory_root():
    root = f"memory://batchinfer-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    path = root[len("memory://"):]
    if fs.exists(path):
        fs.rm(path, recursive=True)


# -- layout and files ----------------------------------------------------------------------------

def test_layout_paths(tmp_path):
    layout = Layout.for_url(str(tmp_path / "out"), "att1")
    assert layout.manifest == f"{tmp_path}/out/{MANIFEST}"
    assert layout.part("predictions", 3, 12) == "predictions/att1/part-00003-00012.parquet"
    assert layout.part("quarantine", 0, 0) == "quarantine/att1/part-00000-00000.parquet"
    assert layout.shard_result(7) == f"{tmp_path}/out/_tmp/att1/shards/00007.json"
    assert layout.abs("predictions/x") == f"{tmp_path}/out/predictions/x"


def test_write_file_returns_sha_of_bytes_and_creates_parents(tmp_path):
    layout = Layout.for_url(str(tmp_path / "out"), "a")
    table = pa.table({"x": [1, 2, 3]})
    data = parquet_bytes(table)
    path = layout.abs(layout.part("predictions", 0, 0))
    digest = write_file(layout.fs, path, data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert Path(path).read_bytes() == data
    assert pq.read_table(path).equals(table)


def test_write_read_json(memory_root):
    layout = Layout.for_url(memory_root, "a")
    write_json(layout.fs, layout.shard_result(1), {"b": 1, "a": [1, 2]})
    assert read_json(layout.fs, layout.shard_result(1)) == {"a": [1, 2], "b": 1}


# -- commit --------------------------------------------------------------------------------------

def test_read_manifest_absent_is_none(tmp_path, memory_root):
    assert read_manifest(fsspec.filesystem("file"), str(tmp_path / "out")) is None
    layout = Layout.for_url(memory_root, "a")
    assert read_manifest(layout.fs, layout.root) is None


def test_commit_local_is_exclusive(tmp_path):
    first = Layout.for_url(str(tmp_path / "out"), "first")
    second = Layout.for_url(str(tmp_path / "out"), "second")
    m1, m2 = _manifest("first"), _manifest("second")
    assert create_manifest(first, m1) is True
    before = Path(first.manifest).read_bytes()
    assert before == manifest_bytes(m1)
    assert create_manifest(second, m2) is False
    assert Path(first.manifest).read_bytes() == before
    assert read_manifest(first.fs, first.root) == m1
    # even the same attempt cannot commit twice, and trying does not touch the manifest
    assert create_manifest(first, _manifest("first", job="again")) is False
    assert read_manifest(first.fs, first.root) == m1


def test_commit_local_replace_overwrites(tmp_path):
    first = Layout.for_url(str(tmp_path / "out"), "first")
    second = Layout.for_url(str(tmp_path / "out"), "second")
    assert create_manifest(first, _manifest("first"))
    assert create_manifest(second, _manifest("second"), replace=True) is True
    assert read_manifest(second.fs, second.root).attempt == "second"


def test_commit_local_replace_without_previous(tmp_path):
    layout = Layout.for_url(str(tmp_path / "out"), "a")
    assert create_manifest(layout, _manifest("a"), replace=True) is True
    assert read_manifest(layout.fs, layout.root) == _manifest("a")


def test_commit_memory_is_exclusive(memory_root):
    first = Layout.for_url(memory_root, "first")
    second = Layout.for_url(memory_root, "second")
    assert create_manifest(first, _manifest("first")) is True
    assert create_manifest(second, _manifest("second")) is False
    assert read_manifest(first.fs, first.root).attempt == "first"
    assert create_manifest(second, _manifest("second"), replace=True) is True
    assert read_manifest(first.fs, first.root).attempt == "second"


def test_manifest_bytes_is_json():
    m = _manifest("a")
    assert json.loads(manifest_bytes(m)) == m.to_dict()
    assert manifest_bytes(m).endswith(b"\n")


def test_corrupt_manifest_is_a_contract_error(tmp_path):
    """A committed manifest that is not one batchinfer wrote is exit 3, like a partition of
    another triple (--overwrite), not 5: a scheduler would retry that to no end."""
    from batchinfer.errors import ContractError

    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text("{half")
    with pytest.raises(ContractError, match=r"_manifest.json: not valid JSON .*edited or damaged") as bad:
        read_manifest(fsspec.filesystem("file"), str(out))
    from batchinfer.commands.remedies import error_line
    from batchinfer.errors import Action

    assert bad.value.path == str(out / MANIFEST) and bad.value.field is None
    assert [r.action for r in bad.value.remedies] == [Action.OVERWRITE]
    assert error_line(bad.value).endswith("(edited or damaged): pass --overwrite to score the partition again")
    (out / MANIFEST).write_text('{"manifest_version": "one"}')
    with pytest.raises(ContractError) as field:
        read_manifest(fsspec.filesystem("file"), str(out))
    assert field.value.field == "manifest_version"


# -- cleaning ------------------------------------------------------------------------------------

def _populate(layout: Layout, attempt: str, names=("part-00000-00000.parquet",
                                                  "part-00001-00000.parquet")) -> list[str]:
    written = []
    for kind in ("predictions", "quarantine"):
        for name in names:
            relative = f"{kind}/{attempt}/{name}"
            write_file(layout.fs, layout.abs(relative), b"data")
            written.append(relative)
    write_file(layout.fs, layout.abs(f"_tmp/{attempt}/shards/00000.json"), b"{}")
    return written


def _all_files(layout: Layout) -> set[str]:
    return {p[len(layout.root):].lstrip("/") for p in layout.fs.find(layout.root)}


WINNER, CRASHED, LOSER = ("20260115T010203Z-0000000a", "20260115T010203Z-0000000b",
                          "20260115T010204Z-0000000c")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_clean_after_commit(tmp_path, memory_root, where):
    url = str(tmp_path / "out") if where == "local" else memory_root
    layout = Layout.for_url(url, WINNER)
    kept = [f"predictions/{WINNER}/part-00000-00000.parquet",
            f"quarantine/{WINNER}/part-00001-00000.parquet"]
    _populate(layout, WINNER)
    _populate(layout, CRASHED)
    _populate(layout, LOSER)
    # output.path is the user's: a folder in predictions/ not named like an attempt stays
    write_file(layout.fs, layout.abs("predictions/notes/README"), b"mine")
    manifest = _manifest(WINNER, files=kept)
    assert create_manifest(layout, manifest)
    clean_after_commit(layout, manifest)
    assert _all_files(layout) == {MANIFEST, *kept, "predictions/notes/README"}
    assert read_manifest(layout.fs, layout.root) == manifest
    if where == "local":
        assert not (tmp_path / "out" / "_tmp").exists()


def test_cleanup_keeps_a_users_folder_named_like_an_attempt_but_for_a_final_newline(tmp_path):
    """Only attempts are ours in predictions/: ``ATTEMPT`` with ``$`` also took a name ending
    in a newline for one, and the commit's cleanup deleted the user's folder."""
    layout = Layout.for_url(str(tmp_path / "out"), WINNER)
    kept = [f"predictions/{WINNER}/part-00000-00000.parquet"]
    _populate(layout, WINNER, names=("part-00000-00000.parquet",))
    theirs = f"predictions/{LOSER}\n/README"
    write_file(layout.fs, layout.abs(theirs), b"mine")
    manifest = _manifest(WINNER, files=kept)
    assert create_manifest(layout, manifest)
    clean_after_commit(layout, manifest)
    assert (tmp_path / "out" / theirs).read_bytes() == b"mine"


def test_remove_attempt_of_the_last_run_out_leaves_no_empty_tmp(tmp_path):
    layout = Layout.for_url(str(tmp_path / "out"), "a")
    _populate(layout, "a")
    _populate(layout, "b")
    remove_attempt(layout, "a")
    assert (tmp_path / "out" / "_tmp" / "b").is_dir()       # another run's scratch: kept
    remove_attempt(layout, "b")
    assert not (tmp_path / "out" / "_tmp").exists()


def test_manifest_files_and_round_trip():
    m = _manifest("a", files=("predictions/a/p0", "quarantine/a/q0"))
    assert m.files() == {"predictions/a/p0", "quarantine/a/q0"}
    assert Manifest.from_dict(json.loads(manifest_bytes(m))) == m
    assert json.loads(manifest_bytes(m))["shards"][0]["files"][0] == {
        "path": "predictions/a/p0", "rows": 1, "sha256": "x"}


def test_remove_attempt_only_touches_that_attempt(tmp_path):
    layout = Layout.for_url(str(tmp_path / "out"), "a")
    mine = _populate(layout, "a")
    other = _populate(layout, "b")
    remove_attempt(layout, "a")
    files = _all_files(layout)
    assert not any(f in files for f in mine)
    assert set(other) <= files
    assert "_tmp/b/shards/00000.json" in files
    remove_attempt(layout, "never-existed")  # no error


# -- the commit object ----------------------------------------------------------------------------

def _shard_result(layout: Layout, index: int, attempt: str) -> None:
    from batchinfer.io.records import ShardResult

    record = ShardRecord(path=f"s{index}", sha256="abc", rows_in=1, rows_scored=1,
                         rows_quarantined=0, status="scored", reason=None,
                         files=(FileRecord(f"predictions/{attempt}/part-{index:05d}-00000.parquet", 1, "x"),))
    write_json(layout.fs, layout.shard_result(index), ShardResult(record=record).to_dict())


@pytest.mark.parametrize("where", ["local", "memory"])
def test_partition_commit_life_cycle(tmp_path, memory_root, where):
    """begin → results → commit; a second attempt loses the race (same triple) and removes its
    files; an attempt with another triple is a conflict; --overwrite replaces what it began on."""
    from batchinfer.io.commit import PartitionCommit

    url = str(tmp_path / "out") if where == "local" else memory_root
    partition = PartitionCommit(url)
    assert partition.committed() is None
    first, second = partition.begin(WINNER), partition.begin(LOSER)
    for attempt in (first, second):
        _populate(attempt.layout, attempt.attempt)
        _shard_result(attempt.layout, 0, attempt.attempt)
    [result] = first.results(1)
    assert result.record.path == "s0"
    with pytest.raises(Exception, match="shard 1 has no result"):
        first.results(2)
    mine = _manifest(WINNER, files=[f"predictions/{WINNER}/part-00000-00000.parquet"])
    assert first.commit(mine).status == "committed"
    assert partition.committed() == mine
    assert second.committed_meanwhile() == mine
    lost = second.commit(_manifest(LOSER))
    assert (lost.status, lost.manifest) == ("lost_race", mine)
    other = dataclasses.replace(_manifest(CRASHED), triple={"model_version": "m:2"})
    third = partition.begin(CRASHED)
    _populate(third.layout, CRASHED)
    conflict = third.commit(other)
    assert conflict.status == "conflict"
    layout = partition.layout(WINNER)
    assert _all_files(layout) == {MANIFEST, f"predictions/{WINNER}/part-00000-00000.parquet"}
    # --overwrite: replaces exactly the manifest it began on, then removes its files
    replacing = partition.begin(CRASHED, replacing=mine)
    _populate(replacing.layout, CRASHED)
    assert replacing.commit(other).status == "committed"
    assert partition.committed() == other
    assert not any(WINNER in f for f in _all_files(layout))


def test_partition_commit_abort_removes_only_its_attempt(tmp_path):
    from batchinfer.io.commit import PartitionCommit

    partition = PartitionCommit(str(tmp_path / "out"))
    a, b = partition.begin(WINNER), partition.begin(LOSER)
    mine, other = _populate(a.layout, WINNER), _populate(b.layout, LOSER)
    a.abort()
    files = _all_files(a.layout)
    assert not set(mine) & files and set(other) <= files


# -- listing shards ------------------------------------------------------------------------------

def test_list_shards_sorted_with_glob(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("c.parquet", "a.parquet", "b.parquet", "notes.txt"):
        (folder / name).write_bytes(b"x")
    shards = list_shards(str(folder / "*.parquet"))
    assert shards == [Shard(0, str(folder / "a.parquet")), Shard(1, str(folder / "b.parquet")),
                      Shard(2, str(folder / "c.parquet"))]


def test_list_shards_directory_recurses_and_skips_dirs(tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "z.parquet").write_bytes(b"x")
    (folder / "sub" / "a.parquet").write_bytes(b"x")
    shards = list_shards(str(folder))
    assert [s.url for s in shards] == [str(folder / "sub" / "a.parquet"), str(folder / "z.parquet")]
    assert [s.index for s in shards] == [0, 1]


def test_list_shards_single_file(tmp_path):
    path = tmp_path / "one.parquet"
    path.write_bytes(b"x")
    assert list_shards(str(path)) == [Shard(0, str(path))]


def test_list_shards_no_match(tmp_path):
    with pytest.raises(NoShardsError) as excinfo:
        list_shards(str(tmp_path / "nothing" / "*.parquet"))
    assert excinfo.value.exit_code == 2
    assert "nothing" in str(excinfo.value)
    with pytest.raises(NoShardsError):
        list_shards(str(tmp_path / "absent.parquet"))


def test_list_shards_memory_urls(memory_root):
    fs = fsspec.filesystem("memory")
    base = memory_root[len("memory://"):]
    for name in ("b.parquet", "a.parquet"):
        fs.pipe_file(f"{base}/data/{name}", b"x")
    shards = list_shards(f"{memory_root}/data/*.parquet")
    # URLs keep the protocol (fsspec writes memory paths as memory:///...), sorted by name
    assert [s.index for s in shards] == [0, 1]
    assert all(s.url.startswith("memory://") for s in shards)
    assert [fsspec.core.url_to_fs(s.url)[1] for s in shards] == [f"/{base}/data/a.parquet",
                                                                 f"/{base}/data/b.parquet"]


# -- reading shards ------------------------------------------------------------------------------

def test_shard_reader_valid_file(tmp_path):
    [path] = make_shards(tmp_path, shards=1, rows=1000, n_features=2)
    reader = ShardReader(str(path))
    assert reader.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert reader.num_rows == 1000
    assert reader.schema.names == ["id", "f0", "f1"]
    batches = list(reader.batches(300))
    assert [b.num_rows for b in batches] == [300, 300, 300, 100]
    ids = np.concatenate([b.column("id").to_numpy() for b in batches])
    np.testing.assert_array_equal(ids, np.arange(1000))


def test_shard_reader_hashes_a_small_shard_itself_and_a_larger_one_on_the_hasher(tmp_path, monkeypatch):
    # A thread costs more than hashing a small shard (bench/shards.py): the digest is the same.
    from concurrent.futures import ThreadPoolExecutor

    from batchinfer.io import shards

    [path] = make_shards(tmp_path, shards=1, rows=1000, n_features=2)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    submitted = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            submitted.append(fn)
            return super().submit(fn, *args, **kwargs)

    with Recording(1) as hasher:
        assert ShardReader(str(path), hasher=hasher).sha256 == digest
        assert submitted == []
        monkeypatch.setattr(shards, "INLINE_HASH_BYTES", 0)
        monkeypatch.setattr(shards, "THREADED_DECODE_BYTES", 0)   # and Arrow's threads decode
        reader = ShardReader(str(path), hasher=hasher)
        assert [b.num_rows for b in reader.batches(300)] == [300, 300, 300, 100]
        assert reader.sha256 == digest and len(submitted) == 1


def test_shard_reader_memory_url(memory_root):
    data = parquet_bytes(pa.table({"x": list(range(10))}))
    fsspec.filesystem("memory").pipe_file(f"{memory_root[len('memory://'):]}/s.parquet", data)
    reader = ShardReader(f"{memory_root}/s.parquet")
    assert reader.sha256 == hashlib.sha256(data).hexdigest()
    assert [b.num_rows for b in reader.batches(4)] == [4, 4, 2]


def test_shard_reader_zero_rows(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), path)
    reader = ShardReader(str(path))
    assert reader.num_rows == 0
    assert list(reader.batches(10)) == []


def test_shard_reader_zero_byte_file(tmp_path):
    path = tmp_path / "zero.parquet"
    path.write_bytes(b"")
    with pytest.raises(Unreadable) as excinfo:
        ShardReader(str(path))
    assert "zero-byte" in str(excinfo.value)


def test_shard_reader_truncated_file(tmp_path):
    [path] = make_shards(tmp_path, shards=1, rows=500)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(Unreadable) as excinfo:
        ShardReader(str(path))
    assert "\n" not in str(excinfo.value)


def test_shard_reader_not_parquet(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text("id,f0\n1,2.0\n" * 50)
    with pytest.raises(Unreadable) as excinfo:
        ShardReader(str(path))
    assert "not a readable Parquet file" in str(excinfo.value)


def test_shard_reader_missing_file_is_storage_error(tmp_path):
    from batchinfer.errors import StorageError

    with pytest.raises(StorageError):
        ShardReader(str(tmp_path / "absent.parquet"))


def test_shard_reader_corrupt_pages_unreadable_on_read(tmp_path):
    [path] = make_shards(tmp_path, shards=1, rows=2000)
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    footer_start = len(data) - 8 - footer_len
    data[4:footer_start] = b"\xab" * (footer_start - 4)  # pages garbled, footer intact
    path.write_bytes(bytes(data))
    reader = ShardReader(str(path))  # the footer still reads
    assert reader.num_rows == 2000
    with pytest.raises(Unreadable):
        list(reader.batches(100))


# -- fold_shard ----------------------------------------------------------------------------------

def _info(rows_in, sha="abc", unreadable=None):
    return ShardInfo(sha, rows_in, unreadable)


def _batch(number, rows_in, scored, quarantined, files=(), reason=None):
    return BatchRecord(batch=number, rows_in=rows_in, rows_scored=scored,
                       rows_quarantined=quarantined, files=tuple(files), first_reason=reason,
                       seconds={"infer": 0.5}, model=ModelStats(rows=rows_in, raised=0, error=None))


def test_fold_shard_scored_orders_batches_and_sums():
    f0 = FileRecord("predictions/a/part-00000-00000.parquet", 10, "h0")
    f1 = FileRecord("predictions/a/part-00000-00001.parquet", 3, "h1")
    q1 = FileRecord("quarantine/a/part-00000-00001.parquet", 2, "h2")
    result = fold_shard("s.parquet", [_batch(1, 5, 3, 2, [f1, q1], reason="range"),
                                      _info(15), _batch(0, 10, 10, 0, [f0])])
    entry = result.record
    assert entry.status == "scored"
    assert entry.reason is None
    assert entry.path == "s.parquet"
    assert entry.sha256 == "abc"
    assert (entry.rows_in, entry.rows_scored, entry.rows_quarantined) == (15, 13, 2)
    assert entry.files == (f0, f1, q1)
    assert result.seconds == {"infer": 1.0}
    assert result.model == ModelStats(rows=15, raised=0, error=None)


def test_fold_shard_all_quarantined():
    entry = fold_shard("s", [_info(7), _batch(0, 4, 0, 4, reason="schema: missing column f1"),
                             _batch(1, 3, 0, 3, reason="other")]).record
    assert entry.status == "quarantined"
    assert entry.reason == "schema: missing column f1"
    assert (entry.rows_in, entry.rows_scored, entry.rows_quarantined) == (7, 0, 7)


def test_fold_shard_empty():
    entry = fold_shard("s", [_info(0)]).record
    assert entry.status == "empty"
    assert (entry.rows_in, entry.rows_scored, entry.rows_quarantined) == (0, 0, 0)
    assert entry.files == ()
    assert entry.reason is None


def test_fold_shard_unreadable():
    entry = fold_shard("s", [_info(None, sha="def", unreadable="zero-byte file")]).record
    assert entry.status == "unreadable"
    assert entry.rows_in is None
    assert entry.reason == "zero-byte file"
    assert entry.sha256 == "def"
    assert (entry.rows_scored, entry.rows_quarantined, entry.files) == (0, 0, ())


def test_fold_shard_unreadable_mid_read_wins_over_batches():
    entry = fold_shard("s", [_info(10), _batch(0, 5, 5, 0, [FileRecord("p", 5, "x")]),
                             _info(None, sha=None, unreadable="corrupt Parquet data: x")]).record
    assert entry.status == "unreadable"
    assert entry.sha256 == "abc"
    assert entry.files == ()


@pytest.mark.parametrize("records", [
    [_info(10), _batch(0, 9, 9, 0)],        # rows missing
    [_info(10), _batch(0, 10, 9, 0)],       # scored + quarantined != rows_in
    [_info(10), _batch(0, 10, 10, 1)],      # a row counted twice
    [_info(0), _batch(0, 1, 1, 0)],         # rows beyond the footer
])
def test_fold_shard_accounting_error(records):
    with pytest.raises(RuntimeError, match="accounting failed for shard s"):
        fold_shard("s", records)


# -- prediction_array ----------------------------------------------------------------------------

def test_prediction_array_1d():
    values = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    arr = prediction_array(values)
    assert arr.type == pa.float32()
    assert len(arr) == 3
    np.testing.assert_array_equal(arr.to_numpy(), values)


def test_prediction_array_n_by_1_becomes_scalar():
    values = np.array([[1.5], [2.5]], dtype=np.float64)
    arr = prediction_array(values)
    assert arr.type == pa.float64()
    assert arr.to_pylist() == [1.5, 2.5]


def test_prediction_array_n_by_k_fixed_size_list():
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    arr = prediction_array(values)
    assert arr.type == pa.list_(pa.float32(), 3)
    assert len(arr) == 4
    assert arr.to_pylist() == values.tolist()


def test_prediction_array_n_by_k_by_m_nested():
    values = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    arr = prediction_array(values)
    assert arr.type == pa.list_(pa.list_(pa.int64(), 4), 3)
    assert len(arr) == 2
    assert arr.to_pylist() == values.tolist()


def test_prediction_array_non_contiguous_input():
    values = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert arr_equal(prediction_array(values), values)
    transposed = np.arange(6, dtype=np.float32).reshape(3, 2).T
    assert arr_equal(prediction_array(transposed), transposed)


def test_prediction_array_empty_batch():
    arr = prediction_array(np.zeros((0, 5), dtype=np.float32))
    assert len(arr) == 0
    assert arr.type == pa.list_(pa.float32(), 5)


def arr_equal(arr: pa.Array, values: np.ndarray) -> bool:
    return arr.to_pylist() == values.tolist()


def test_streamed_corrupt_shard_keeps_the_digest_of_its_bytes(tmp_path, monkeypatch):
    import batchinfer.io.shards as shards

    monkeypatch.setattr(shards, "MAX_IN_MEMORY_BYTES", 0)
    [path] = make_shards(tmp_path, shards=1, rows=2000)
    data = bytearray(path.read_bytes())
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[4:footer_start] = b"\xab" * (footer_start - 4)
    path.write_bytes(bytes(data))
    reader = ShardReader(str(path))
    with pytest.raises(Unreadable, match="corrupt"):
        list(reader.batches(100))
    assert reader.sha256 == hashlib.sha256(bytes(data)).hexdigest()


def test_hashing_file_digest_is_of_the_bytes_read_in_any_order(tmp_path):
    from batchinfer.io.shards import HashingFile

    data = np.random.default_rng(0).bytes(100_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as raw:
        f = HashingFile(raw, len(data))
        for start, n in ((99_000, 1_000), (0, 10), (50_000, 30_000), (10, 5), (40_000, 20_000)):
            f.seek(start)
            assert f.read(n) == data[start:start + n]
        assert f.finish() == hashlib.sha256(data).hexdigest()


def test_streamed_shard_whose_store_fails_mid_read_is_a_storage_error(tmp_path, monkeypatch):
    import batchinfer.io.shards as shards
    from batchinfer.errors import StorageError

    monkeypatch.setattr(shards, "MAX_IN_MEMORY_BYTES", 0)
    [path] = make_shards(tmp_path, shards=1, rows=2000)
    reader = ShardReader(str(path))

    def broken(n=-1):
        raise ConnectionResetError("connection reset by peer")

    reader._stream._raw.read = broken
    with pytest.raises(StorageError, match="connection reset"):
        list(reader.batches(100))


def test_a_large_shard_decodes_on_arrows_pool_unless_the_caller_decodes_ahead(tmp_path, monkeypatch):
    """The pipeline decodes one batch ahead on its own thread (``decoded_ahead``), so its reader
    (``ReadShard``) keeps Arrow's pool out (a third more decode CPU on busy cores,
    bench/README.md); other readers of a large shard keep it. All read the same rows."""
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({f"f{i}": np.random.default_rng(i).random(40_000) for i in range(16)}),
                   path, compression="none")
    assert path.stat().st_size > shards_module.THREADED_DECODE_BYTES
    asked: list[bool] = []
    iter_batches = pq.ParquetFile.iter_batches

    def recording(self, *args, use_threads=True, **kwargs):
        asked.append(use_threads)
        return iter_batches(self, *args, use_threads=use_threads, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    pooled = pa.Table.from_batches(list(ShardReader(str(path)).batches(10_000)))
    alone = pa.Table.from_batches(list(ShardReader(str(path), pooled_decode=False).batches(10_000)))
    plan = ScoringPlan(shard_urls=(Deferred(str(path)),), shard_names=("big.parquet",),
                       output_url=Deferred(str(tmp_path / "out")), attempt="A1", batch_rows=10_000,
                       schema=None, preprocessor=None,  # type: ignore[arg-type]
                       id_columns=())
    read = ReadShard(plan)
    read.setup()
    try:
        chunks = list(read.process((0, Deferred(str(path)))))
    finally:
        read.teardown()
    assert asked == [True, False, False]
    assert alone.equals(pooled)
    assert pa.Table.from_batches([c.batch for c in chunks]).equals(pooled)
