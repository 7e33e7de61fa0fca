"""The rows an export is checked on (batchinfer/convert/samples.py): drawn from every readable
shard of the partition in proportion to its rows, seeded, validated and preprocessed as a run
does; the shard reads they need (io/shards.py ``footer_rows``, ``ShardReader.take``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.convert.samples import SampleSize, _draw, _job_sample, allocate
from batchinfer.errors import SpecError
from batchinfer.io import shards as shards_module
from batchinfer.io.shards import ShardReader, Unreadable, footer_rows
from batchinfer.spec import load_job
from factories import DS, make_mlp_onnx, write_job, write_schema

SHARD = 1_000_000   # a row's id is shard * SHARD + its row in the shard: where each sampled row came from
# The sample's ids by the preprocessing's second output: what the default one (features only) drops.
PREP = ("import numpy as np\n\n"
        "def transform(batch):\n"
        "    x = np.stack([batch.column(f'f{i}').to_numpy() for i in range(4)], axis=1)\n"
        "    return {'x': x.astype(np.float32), 'id': batch.column('id').to_numpy()}\n")


def partition(folder: Path, rows: list[int], *, bad: dict[int, list[int]] | None = None,
              row_group: int | None = None) -> Path:
    """A job whose partition has a shard of each size in ``rows`` (ids encode shard and row);
    ``bad``: rows of a shard with f0 out of the schema's range (quarantined by a run)."""
    write_schema(folder / "schemas")
    make_mlp_onnx(folder / "models" / "model.onnx")
    (folder / "prep.py").write_text(PREP)
    data = folder / "data" / f"dt={DS}"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for s, n in enumerate(rows):
        x = rng.uniform(-1, 1, (n, 4)).astype(np.float32)
        x[(bad or {}).get(s, []), 0] = 50.0
        table = pa.table({"id": s * SHARD + np.arange(n, dtype=np.int64), **{f"f{i}": x[:, i] for i in range(4)}})
        pq.write_table(table, data / f"part-{s:05d}.parquet", row_group_size=row_group)
    return write_job(folder, preprocess="prep:transform")


def sampled_ids(job: Path, size: SampleSize, **sets: str) -> np.ndarray:
    loaded = load_job(job, ds=DS, overrides=[f"{k}={v}" for k, v in sets.items()])
    sample = _job_sample(loaded, ["x", "id"], size)
    x, ids = sample.arrays
    assert len(x) == len(ids) == sample.rows
    return ids


# -- which rows ----------------------------------------------------------------------------------

def test_every_shard_gives_rows_in_proportion_to_its_rows(tmp_path):
    """Eight shards of 100 to 800 rows, 360 sample rows: each shard gives 10 per 100 rows."""
    job = partition(tmp_path, [100 * (s + 1) for s in range(8)])
    ids = sampled_ids(job, SampleSize(360))
    assert len(ids) == len(set(ids)) == 360
    per_shard = np.bincount(ids // SHARD, minlength=8)
    assert per_shard.tolist() == [10 * (s + 1) for s in range(8)]
    # inside a shard the rows are spread over it, not its head
    last = ids[ids // SHARD == 7] % SHARD
    assert last.max() > 400 and last.min() < 400


def test_the_same_seed_draws_the_same_rows_and_another_seed_others(tmp_path):
    job = partition(tmp_path, [300, 500, 200])
    first, again = sampled_ids(job, SampleSize(100, seed=0)), sampled_ids(job, SampleSize(100, seed=0))
    other = sampled_ids(job, SampleSize(100, seed=1))
    assert first.tolist() == again.tolist()       # the same rows in the same order: the same digest
    assert sorted(first) != sorted(other)
    assert np.bincount(other // SHARD).tolist() == np.bincount(first // SHARD).tolist() == [30, 50, 20]


def test_the_sample_is_shuffled_across_shards(tmp_path):
    """The first rows (what calibrates a static quantization) are from every shard, not the first."""
    job = partition(tmp_path, [1000] * 4)
    ids = sampled_ids(job, SampleSize(400))
    assert set(ids[:40] // SHARD) == {0, 1, 2, 3}


def test_a_partition_smaller_than_the_sample_gives_every_valid_row(tmp_path):
    job = partition(tmp_path, [30, 0, 20], bad={0: [3, 4]})
    ids = sampled_ids(job, SampleSize(4096))
    assert sorted(ids) == sorted([i for i in range(30) if i not in (3, 4)] + [2 * SHARD + i for i in range(20)])


def test_rows_that_fail_validation_are_replaced_from_their_shard(tmp_path):
    """Shard 1 holds one valid row among 2,000: it still gives it (every shard with valid rows
    gives one); shard 0's invalid rows are replaced by valid ones of shard 0, so it keeps its share."""
    job = partition(tmp_path, [1000, 2000, 1000], bad={0: list(range(0, 1000, 2)), 1: list(range(1, 2000))})
    ids = sampled_ids(job, SampleSize(40))
    per_shard = np.bincount(ids // SHARD, minlength=3).tolist()
    assert per_shard == [10, 1, 10], per_shard     # shard 1 short of its 20: the sample is 21 rows
    assert 1 * SHARD + 0 in ids                       # shard 1's only valid row
    assert all(i % 2 == 1 for i in ids[ids // SHARD == 0])   # shard 0's valid rows are its odd ones


def test_fewer_rows_than_shards_take_one_row_each_from_as_many_shards(tmp_path):
    job = partition(tmp_path, [50] * 8)
    ids = sampled_ids(job, SampleSize(3))
    assert len(ids) == 3 and len(set(ids // SHARD)) == 3


def test_unreadable_shards_are_skipped_and_counted_in_the_partition(tmp_path):
    job = partition(tmp_path, [100, 100])
    data = tmp_path / "data" / f"dt={DS}"
    (data / "part-00002.parquet").write_bytes(b"not parquet")
    (data / "part-00003.parquet").write_bytes(b"")
    loaded = load_job(job, ds=DS)
    sample = _job_sample(loaded, ["x", "id"], SampleSize(50, seed=4))
    assert (sample.rows, sample.shards, sample.partition_shards, sample.partition_rows) == (50, 2, 4, 200)
    facts = sample.facts()
    assert facts["sample_method"] == "stratified" and facts["sample_seed"] == 4
    assert facts["sample_rows"] == 50 and facts["sample_shards"] == 2
    assert facts["sample_partition_shards"] == 4 and facts["sample_partition_rows"] == 200
    assert sample.where() == "50 rows of testjob's input, from 2 of 4 shards"


def test_no_valid_row_anywhere_is_a_usage_error(tmp_path):
    job = partition(tmp_path, [10, 10], bad={0: list(range(10)), 1: list(range(10))})
    with pytest.raises(SpecError, match="no valid rows in .* to sample"):
        _job_sample(load_job(job, ds=DS), ["x", "id"], SampleSize(5))


def test_a_large_shard_is_sampled_streamed_one_row_group_at_a_time(tmp_path, monkeypatch):
    """Past MAX_IN_MEMORY_BYTES a shard is read through HashingFile, not fetched whole: the sample
    takes its rows from the row groups that hold them, and gives the rows a whole read gives."""
    job = partition(tmp_path, [5000, 3000], row_group=250)
    whole = sampled_ids(job, SampleSize(200, seed=9))
    monkeypatch.setattr(shards_module, "MAX_IN_MEMORY_BYTES", 0)
    streamed = sampled_ids(job, SampleSize(200, seed=9))
    assert streamed.tolist() == whole.tolist()
    assert np.bincount(whole // SHARD).tolist() == [125, 75]


# -- the allocation ------------------------------------------------------------------------------

@pytest.mark.parametrize("counts, rows, want", [
    ([100, 300, 0, 1], 8, [2, 5, 0, 1]),          # the one-row shard gets one, from the largest
    ([100, 300], 4, [1, 3]),
    ([100, 300], 10_000, [100, 300]),             # more than there are: every row
    ([7, 7, 7], 10, [4, 3, 3]),                   # largest remainder, first of the equal ones
    ([0, 0], 5, [0, 0]),
])
def test_allocate(counts, rows, want):
    quotas = allocate(counts, rows, np.random.default_rng(0))
    assert quotas.tolist() == want
    assert quotas.sum() == min(rows, sum(counts)) and all(q <= c for q, c in zip(quotas, counts))


def test_allocate_fewer_rows_than_shards_draws_shards_by_their_rows():
    counts = [1, 1, 1, 10_000]
    picks = [allocate(counts, 1, np.random.default_rng(seed)) for seed in range(50)]
    assert all(p.sum() == 1 and p.max() == 1 for p in picks)
    assert sum(p[3] for p in picks) >= 48   # the shard that holds nearly every row, nearly always
    assert allocate(counts, 1, np.random.default_rng(3)).tolist() == allocate(
        counts, 1, np.random.default_rng(3)).tolist()


@pytest.mark.parametrize("population", [50, 10_000_000])   # listed, and drawn by rejection
def test_draw_gives_distinct_rows_not_taken_yet(population):
    rng = np.random.default_rng(0)
    taken = np.arange(0, 40, dtype=np.int64)
    drawn = _draw(rng, population, taken, 8)
    assert len(drawn) == len(set(drawn.tolist())) == 8 and not set(drawn.tolist()) & set(range(40))
    assert _draw(rng, 50, taken, 100).size == 10    # all that are left


# -- the reads -----------------------------------------------------------------------------------

def test_take_reads_rows_by_index_across_row_groups(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"v": np.arange(1000, dtype=np.int64)}), path, row_group_size=64)
    reader = ShardReader(str(path))
    rows = [0, 63, 64, 500, 999]
    assert reader.take(np.array(rows)).column("v").to_pylist() == rows
    assert reader.take(np.array([], dtype=np.int64)).num_rows == 0
    reader.close()


def test_footer_rows_reads_the_count_and_refuses_what_is_not_parquet(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"v": np.arange(77)}), path)
    assert footer_rows(str(path)) == 77
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "junk.parquet").write_bytes(b"junk" * 10)
    with pytest.raises(Unreadable, match="zero-byte"):
        footer_rows(str(tmp_path / "empty.parquet"))
    with pytest.raises(Unreadable, match="not a readable Parquet file"):
        footer_rows(str(tmp_path / "junk.parquet"))
