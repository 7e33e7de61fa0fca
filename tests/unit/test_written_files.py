"""The writer's files, byte for byte: one writer (``WritePredictions``) writes synthetic batches
under the champion's and a challenger's policy — with ``explain`` (sampled, top k, grouped
features; every feature, positions), rows rejected before the model, rows the model raised on,
a non-finite output, a batch with no row scored, an empty batch, an Iceberg and a Delta sink —
and each file's sha256, and each batch's record, must be the ones recorded here.

The expected values were made by the writer of commit f694606, before it was split into its
parts (pipeline/writer/): the same columns, order, types, Parquet encoding and statistics
choices, file names and digests. Everything here is deterministic (fixed attempt, fixed model
time), so the files are too; a change that alters one byte of a file fails here, and must be a
change of the contract (docs/contract.md §4), never of the code's shape. Such a change makes the
values anew from :func:`write_case` (its record's files; ``_digest`` of the record).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchinfer.beam_compat import PredictionResult
from batchinfer.handlers.base import Inference, Prepared
from batchinfer.handlers.explain import Attributions, ExplainPlan
from batchinfer.io.records import PreprocessStats
from batchinfer.io.sinks import FILES, Sink
from batchinfer.pipeline.shard_reports import BatchRecord, ChallengerBatchRecord
from batchinfer.pipeline.transforms import ModelRun, ScoringPlan, WritePredictions
from batchinfer.pipeline.writer.policy import WritePolicy
from batchinfer.pipeline.writer.scored import Payload
from batchinfer.redaction import Deferred
from batchinfer.rows.hashing import row_hashes
from batchinfer.rows.quarantine import Failure, build_quarantine
from batchinfer.triple.contract import Triple

ROWS = 48
ATTEMPT = "20260131T000000Z-0123abcd"
TRIPLE = Triple("credit:7", "d" * 64, "feats:1", "p" * 64)
CHALLENGER = Triple("credit:8", "e" * 64, "feats:1", "p" * 64)
NAMES = {"y": "score", "z": "vec"}
HASHED = ("id", "tag", "f0", "f1", "f2", "f3")
CUTS = {"f0": (-1.0, 0.0, 1.0), "score": (-0.5, 0.5), "_explanation.b": (0.0,)}
SAMPLED = ExplainPlan(method="permutation", input="x", output="y", samples=4, seed=1, top_k=2,
                      fraction=0.5, tolerance=0.05, complete=True, features=("a", "b", "c"),
                      groups=(0, 1, 1, 2), declared='{"method": "permutation", "top_k": 2}')
EVERY = ExplainPlan(method="gradient_x_input", input="x", output="y", top_k=None,
                    declared='{"method": "gradient_x_input"}', width=4)


def _valid(n: int) -> pa.RecordBatch:
    rng = np.random.default_rng(7)
    return pa.record_batch({
        "id": pa.array(np.arange(100, 100 + n, dtype=np.int64)),
        "tag": pa.array([f"t{i % 5}" for i in range(n)], pa.string()),
        **{f"f{j}": pa.array(rng.standard_normal(n)) for j in range(4)}})


def _result(*, number: int = 0, raised: tuple[int, ...] = (3, 7), nan_at: int | None = 5,
            explain: ExplainPlan | None = None, rows: int = ROWS, early: int = 2) -> PredictionResult:
    """A batch of ``rows`` valid rows (``early`` rows quarantined before the model, between
    them in the shard); the model raised on ``raised`` and gave a NaN score at ``nan_at`` of
    the others; with ``explain``, its attributions of the rows left."""
    valid = _valid(rows)
    source_rows = np.arange(rows, dtype=np.int64) + (np.arange(rows) >= rows // 2) * early
    quarantined = []
    if early:
        at = np.arange(rows // 2, rows // 2 + early, dtype=np.int64)
        quarantined.append(build_quarantine(
            "part-0.parquet", at, [[Failure("f1", "range", "f1 out of range")]] * early,
            pa.record_batch({"id": pa.array(at + 100), "f1": pa.array([9.0] * early)})))
    payload = Payload(number * 1000, rows + early, valid, source_rows, quarantined,
                      {"read": 0.5, "validate": 0.25}, PreprocessStats(rows), last=number == 1)
    ok = np.array([i for i in range(rows) if i not in raised], dtype=np.int64)
    rng = np.random.default_rng(11 + number)
    y = rng.standard_normal(ok.size).astype(np.float32)
    kept = np.ones(ok.size, dtype=bool)
    if nan_at is not None and ok.size:
        y[nan_at] = np.nan
        kept[nan_at] = False
    inference = Inference(ok_rows=ok, outputs={"y": y, "z": rng.standard_normal((ok.size, 3))},
                          failed=[(r, f"boom at {r}") for r in raised], compute_ms=12.5,
                          oom_backoffs=1, chunk_rows=16, warmup_ms=3.0)
    if explain is not None and kept.any():
        scored = valid.take(pa.array(ok[kept]))
        hashes = row_hashes(scored, HASHED) if explain.fraction < 1.0 else None
        chosen = np.arange(int(kept.sum()), dtype=np.int64)[::2 if hashes is not None else 1]
        values = np.random.default_rng(5).standard_normal((chosen.size, 4))
        inference.explained = Attributions(rows=chosen, values=values, baseline_value=0.125,
                                           incomplete=1, max_gap=0.0625, hashes=hashes,
                                           seconds=0.5)
    prepared = Prepared(key=(0, number), rows=rows, features=None, payload=payload)
    return PredictionResult(prepared, inference)


def _run(challenger: str, explain: ExplainPlan | None) -> ModelRun:
    policy = WritePolicy.challenger(challenger) if challenger else WritePolicy.champion()
    return ModelRun(name=challenger, triple=CHALLENGER if challenger else TRIPLE, handler=None,  # type: ignore[arg-type]
                    device="cpu", backend="onnxruntime", model_options={},
                    prediction_names=NAMES, policy=policy, explain=explain)


def _plan(out: Path, sink: Sink) -> ScoringPlan:
    return ScoringPlan(shard_urls=(Deferred("part-0.parquet"),), shard_names=("part-0.parquet",),
                       output_url=Deferred(str(out)), attempt=ATTEMPT, batch_rows=ROWS,
                       schema=None, preprocessor=None,  # type: ignore[arg-type]
                       id_columns=("id", "tag"), hash_columns=HASHED,
                       profile_features=("f0", "f1", "tag"), profile_cuts=CUTS, sink=sink)


def _summary(record) -> dict:
    """A batch's record without its timings (``seconds``: measured, never the same twice)."""
    files = [[f.path, f.rows, f.sha256] for f in record.files]
    if isinstance(record, ChallengerBatchRecord):
        return {"kind": "challenger", "name": record.name, "batch": record.batch,
                "rows_in": record.rows_in, "rows_scored": record.rows_scored,
                "rows_rejected": record.rows_rejected, "files": files,
                "first_reason": record.first_reason, "compute_ms": record.compute_ms}
    assert isinstance(record, BatchRecord)
    m = record.model
    return {"kind": "champion", "batch": record.batch, "rows_in": record.rows_in,
            "rows_scored": record.rows_scored, "rows_quarantined": record.rows_quarantined,
            "files": files, "first_reason": record.first_reason,
            "seconds": sorted(record.seconds),
            "model": [m.rows, m.raised, m.error, m.oom_backoffs, m.chunk_rows, m.warmup_ms,
                      m.tokens, m.padded_tokens, m.explained, m.incomplete,
                      sorted(m.abs_attribution.items()), m.max_gap],
            "profile": {k: v.to_dict() for k, v in sorted(record.profile.items())},
            "quarantine": sorted(([list(k), n] for k, n in record.quarantine.items()), key=str),
            "compute_ms": record.compute_ms, "preprocess": record.preprocess.rows,
            "last": record.last}


def _digest(record) -> str:
    return hashlib.sha256(json.dumps(_summary(record), sort_keys=True).encode()).hexdigest()


CASES = {
    # champion: explain sampled by hash, top 2 of grouped features; quarantine before and after
    # the model; statistics of features, predictions and an attribution
    "champion-explained": ("", SAMPLED, FILES, {}),
    "challenger-explained": ("c1", SAMPLED, FILES, {}),
    "champion-every-feature": ("", EVERY, FILES, {"number": 1}),
    "champion-nothing-scored": ("", None, FILES, {"raised": tuple(range(ROWS)), "nan_at": None}),
    "challenger-nothing-scored": ("c1", SAMPLED, FILES,
                                  {"raised": tuple(range(ROWS)), "nan_at": None}),
    "champion-empty": ("", None, FILES, {"rows": 0, "raised": (), "nan_at": None, "early": 0}),
    "challenger-empty": ("c1", None, FILES, {"rows": 0, "raised": (), "nan_at": None, "early": 0}),
    "champion-clean": ("", None, FILES, {"raised": (), "nan_at": None, "early": 0}),
    "champion-iceberg": ("", None, Sink(format="iceberg", column="dt", value="2026-01-31",
                                        table="db.scores"), {}),
    "challenger-iceberg": ("c1", None, Sink(format="iceberg", column="dt", value="2026-01-31",
                                            table="db.scores"), {}),
    "champion-delta": ("", SAMPLED, Sink(format="delta", column="dt", value="2026-01-31"), {}),
}

# Made by the writer of f694606 (see the module's docstring): case → (each file's path, rows and
# sha256; the sha256 of the record's summary). Made anew for issue 35, when prediction files began
# to store ``_input_hash`` without Snappy (rows/columns.py): each file read back holds the same
# table, schema and metadata as f694606's, and no other column chunk changed codec, encoding or
# statistics (checked file by file against the writer before the change).
EXPECTED: dict[str, tuple[list[list], str]] = {
    "challenger-empty": (
        [],
        "9555d500bf5714e6aab00633a3cc12ad2b0223796fd28ceeb315918dbceefc8b"),
    "challenger-explained": (
        [
            ["challengers/c1/20260131T000000Z-0123abcd/part-00000-00000.parquet", 45,
             "50d32034b1864ba0b42ba6a63a40debb4c0632a48467abc061fa18260a5c0eed"],
        ],
        "318f1c8e59f6dbacdfbf9a5576780d4bb76847c8060f7b0f29bab91f5e704f19"),
    "challenger-iceberg": (
        [
            ["_challengers/c1/dt=2026-01-31/20260131T000000Z-0123abcd/part-00000-00000.parquet", 45,
             "9cc3ce98a000ff54f6799e5d45ac95ec7db746e2be927183cd1e185ff6249473"],
        ],
        "11dbd23789cdfaa243fa9e48b24a82586fd86db91a65c31d7c5bf841488a1dc5"),
    "challenger-nothing-scored": (
        [],
        "97744b306161bcd1a5c1f2093ab4f27e3422daad7033b49f7d552148301981a9"),
    "champion-clean": (
        [
            ["predictions/20260131T000000Z-0123abcd/part-00000-00000.parquet", 48,
             "05335615d7c3a9d375860063e76bc3b8e8912e2688104e11ee8ecd3673bdc49b"],
        ],
        "866b510b2dc018a17b497e0a41facc0e4d2723071be2023d5e162e05642fef82"),
    "champion-delta": (
        [
            ["dt=2026-01-31/20260131T000000Z-0123abcd/part-00000-00000.parquet", 45,
             "13bef9f06c92a135ac107a6311ad38d45880ca6357621a15d3b95b07d213b507"],
            ["_quarantine/dt=2026-01-31/20260131T000000Z-0123abcd/part-00000-00000.parquet", 5,
             "a2991a8d8666d521f2628e3a4a4a0be1caca5c783f7643268c938f514f5bdbe8"],
        ],
        "2155b6a68e867bb69222e48d7a7b72babd18b66381113aaf39b2c2f016d5d0cb"),
    "champion-empty": (
        [],
        "803fd80d633d5505671c1d3a20f907258637d9fb380da97f667909fd68afad19"),
    "champion-every-feature": (
        [
            ["predictions/20260131T000000Z-0123abcd/part-00000-00001.parquet", 45,
             "82c4eba7e2f02ff3f526c60f99b37c515b8189d3e31950e23d3c5f47ad7a5fe4"],
            ["quarantine/20260131T000000Z-0123abcd/part-00000-00001.parquet", 5,
             "a2991a8d8666d521f2628e3a4a4a0be1caca5c783f7643268c938f514f5bdbe8"],
        ],
        "a7aeb24fed39298ee2f5b06ddb7a487d66151805dc8ceb45c4b5ead5a6ec3fe1"),
    "champion-explained": (
        [
            ["predictions/20260131T000000Z-0123abcd/part-00000-00000.parquet", 45,
             "13bef9f06c92a135ac107a6311ad38d45880ca6357621a15d3b95b07d213b507"],
            ["quarantine/20260131T000000Z-0123abcd/part-00000-00000.parquet", 5,
             "a2991a8d8666d521f2628e3a4a4a0be1caca5c783f7643268c938f514f5bdbe8"],
        ],
        "d6933df282c84e898f15416b84f81a6b4d1bfb8482f8eddb999eb8f813d26a7e"),
    "champion-iceberg": (
        [
            ["dt=2026-01-31/20260131T000000Z-0123abcd/part-00000-00000.parquet", 45,
             "9dc218e2c1b34fb430b400a84c102dfdbca210aa91b0fd58bee1f411f0c7d525"],
            ["_quarantine/dt=2026-01-31/20260131T000000Z-0123abcd/part-00000-00000.parquet", 5,
             "7330b521cf3881c220673243104928e1a08a7e8a690455aafe7fe84a5e748cbe"],
        ],
        "c0c96df8bc2c091585bdc08043dc6032a99e3fcc4dcb9a9c29c1f53b8249194c"),
    "champion-nothing-scored": (
        [
            ["quarantine/20260131T000000Z-0123abcd/part-00000-00000.parquet", 50,
             "86d5f592f51aeb103f9f69851370fc2d83471721cd254be99030215dddbb92f2"],
        ],
        "990908f689ae846e79c70fda3c2db8a9d3473c5d58e7f1989425b4d1ab4d69e1"),
}


def write_case(out: Path, case: str):
    challenger, explain, sink, batch = CASES[case]
    writer = WritePredictions(_plan(out, sink), _run(challenger, explain))
    writer.setup()
    try:
        _, record, _ = writer._complete(_result(explain=explain, **batch))
    finally:
        writer.teardown()
    return record


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_writer_writes_the_same_bytes(tmp_path, case):
    record = write_case(tmp_path, case)
    files, digest = EXPECTED[case]
    assert [[f.path, f.rows, f.sha256] for f in record.files] == files
    for path, _, sha256 in files:
        assert hashlib.sha256((tmp_path / path).read_bytes()).hexdigest() == sha256, path
    assert _digest(record) == digest, _summary(record)
