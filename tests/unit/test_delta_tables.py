"""io/delta_tables.py on real Delta tables (delta-rs) in tmp_path: a partition's commit replaces
exactly that partition, is idempotent for its attempt, and of two attempts committing one
generation at once exactly one lands — the race forced, both past their check before either
commits."""
from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from batchinfer.errors import ContractError
from batchinfer.io.delta_tables import DeltaTables, storage_options
from batchinfer.io.outputs import PREDICTIONS, QUARANTINE
from batchinfer.io.records import FileRecord
from batchinfer.io.sinks import LostRace, Sink


def sink(ds: str) -> Sink:
    return Sink(format="delta", column="dt", value=ds)


def files(root: Path, ds: str, attempt: str, rows: list[int], kind: str = PREDICTIONS) -> list[FileRecord]:
    """Data files of ``attempt`` where its writers would put them, one per entry of ``rows``."""
    layout = sink(ds).layout(str(root), attempt)
    out = []
    for batch, n in enumerate(rows):
        relative = layout.part(kind, 0, batch)
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()),
                                 "y": pa.array([float(batch)] * n, pa.float32()),
                                 "_inference_id": pa.array([attempt] * n)}), path)
        out.append(FileRecord(relative, n, "-"))
    return out


def commit(root: Path, ds: str, attempt: str, batch: list[FileRecord], generation: int,
           kind: str = PREDICTIONS) -> int | None:
    tables = DeltaTables(str(root), sink(ds))
    return tables.commit(sink(ds).layout(str(root), attempt), kind, batch, generation=generation,
                         attempt=attempt, summary={"batchinfer.job": "j"})


def rows(root: Path, ds: str, version: int | None = None) -> list[str]:
    table = DeltaTable(str(root), version=version).to_pyarrow_table()
    return sorted(table.filter(pa.compute.field("dt") == ds)["_inference_id"].to_pylist())


def test_a_commit_replaces_its_partition_and_leaves_the_others(tmp_path):
    assert commit(tmp_path, "d1", "A", files(tmp_path, "d1", "A", [3, 2]), 1) == 0
    assert commit(tmp_path, "d2", "B", files(tmp_path, "d2", "B", [4]), 1) == 1
    assert commit(tmp_path, "d1", "C", files(tmp_path, "d1", "C", [1]), 2) == 2
    assert rows(tmp_path, "d1") == ["C"] and rows(tmp_path, "d2") == ["B"] * 4
    assert rows(tmp_path, "d1", version=1) == ["A"] * 5          # time travel
    assert DeltaTables(str(tmp_path), sink("d1")).generation() == (2, "C")
    assert DeltaTables(str(tmp_path), sink("d2")).generation() == (1, "B")
    assert DeltaTables(str(tmp_path), sink("d3")).generation() == (0, None)


def test_a_retried_commit_of_the_same_attempt_writes_nothing(tmp_path):
    batch = files(tmp_path, "d1", "A", [3])
    assert commit(tmp_path, "d1", "A", batch, 1) == 0
    assert commit(tmp_path, "d1", "A", batch, 1) == 0
    assert DeltaTable(str(tmp_path)).version() == 0
    with pytest.raises(LostRace):   # another attempt of the generation the table holds
        commit(tmp_path, "d1", "B", files(tmp_path, "d1", "B", [1]), 1)
    with pytest.raises(LostRace):   # an attempt that set out to replace an older generation
        commit(tmp_path, "d1", "A", batch, 0)


def test_an_update_keeps_the_files_it_keeps_and_swaps_the_rest(tmp_path):
    first = files(tmp_path, "d1", "A", [3, 2, 1])
    commit(tmp_path, "d1", "A", first, 1)
    kept, new = first[:2], files(tmp_path, "d1", "U", [5])
    commit(tmp_path, "d1", "U", kept + new, 2)
    table = DeltaTable(str(tmp_path))
    held = {Path(u).relative_to(tmp_path).as_posix() for u in table.file_uris()}
    assert held == {f.path for f in kept + new}
    assert rows(tmp_path, "d1") == ["A"] * 5 + ["U"] * 5


def test_a_kind_without_files_and_without_a_table_makes_none(tmp_path):
    assert commit(tmp_path, "d1", "A", [], 1, kind=QUARANTINE) is None
    assert not (tmp_path / "_quarantine").exists()


def race(root: Path, racers: list[tuple[str, str, int, list[FileRecord]]]) -> dict[str, object]:
    """Commit each (date, attempt, generation, files) in its own thread, every racer past its
    first read of the table before any commits; by attempt, its version or its LostRace."""
    gate = threading.Barrier(len(racers))
    outcomes: dict[str, object] = {}

    class Held(DeltaTables):
        opened = 0

        def _open(self, uri):
            table = super()._open(uri)
            Held.opened += 1
            if Held.opened <= len(racers):
                gate.wait(timeout=30)
            return table

    def attempt(ds: str, name: str, generation: int, batch: list[FileRecord]) -> None:
        try:
            outcomes[name] = Held(str(root), sink(ds)).commit(
                sink(ds).layout(str(root), name), PREDICTIONS, batch, generation=generation,
                attempt=name, summary={})
        except LostRace as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=attempt, args=r) for r in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


@pytest.mark.parametrize("same_partition", [True, False])
def test_two_attempts_at_once_one_generation_lands_once_two_partitions_both(tmp_path, same_partition):
    commit(tmp_path, "d0", "Z", files(tmp_path, "d0", "Z", [1]), 1)   # the table exists
    dates = ("d1", "d1") if same_partition else ("d1", "d2")
    outcomes = race(tmp_path, [(ds, name, 1, files(tmp_path, ds, name, [2])) for ds, name in zip(dates, "AB")])
    lost = [n for n, o in outcomes.items() if isinstance(o, LostRace)]
    if same_partition:
        assert len(lost) == 1, outcomes
        winner = ({"A", "B"} - set(lost)).pop()
        assert rows(tmp_path, "d1") == [winner] * 2      # never both
    else:
        assert lost == [], outcomes
        assert rows(tmp_path, "d1") == ["A"] * 2 and rows(tmp_path, "d2") == ["B"] * 2


def test_s3_urls_get_conditional_puts_and_the_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert storage_options("s3://bucket/tables") == {"conditional_put": "etag",
                                                     "endpoint_url": "http://127.0.0.1:9",
                                                     "allow_http": "true"}
    assert storage_options("/local/tables") == {}


def other_file(root: Path, ds: str, attempt: str, columns: dict) -> list[FileRecord]:
    layout = sink(ds).layout(str(root), attempt)
    path = root / layout.part(PREDICTIONS, 0, 0)
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table(columns), path)
    return [FileRecord(layout.part(PREDICTIONS, 0, 0), 1, "-")]


def test_a_column_the_run_adds_is_added_one_it_drops_reads_null_one_it_retypes_is_refused(tmp_path):
    commit(tmp_path, "d1", "A", files(tmp_path, "d1", "A", [3]), 1)
    wider = {"id": pa.array([1], pa.int64()), "y": pa.array([0.5], pa.float32()),
             "_inference_id": pa.array(["B"]), "why": pa.array([2.0])}
    commit(tmp_path, "d2", "B", other_file(tmp_path, "d2", "B", wider), 1)
    table = DeltaTable(str(tmp_path)).to_pyarrow_table()
    assert "why" in table.column_names
    assert table.filter(pa.compute.field("dt") == "d2")["why"].to_pylist() == [2.0]
    assert table.filter(pa.compute.field("dt") == "d1")["why"].to_pylist() == [None] * 3
    narrower = {"id": pa.array([7], pa.int64()), "y": pa.array([0.5], pa.float32())}
    commit(tmp_path, "d4", "D", other_file(tmp_path, "d4", "D", narrower), 1)
    assert DeltaTable(str(tmp_path)).to_pyarrow_table().filter(
        pa.compute.field("dt") == "d4")["_inference_id"].to_pylist() == [None]
    retyped = {"id": pa.array(["1"]), "y": pa.array([0.5], pa.float32()), "_inference_id": pa.array(["C"])}
    version = DeltaTable(str(tmp_path)).version()
    with pytest.raises(ContractError, match="has a column this run writes with another type"):
        commit(tmp_path, "d3", "C", other_file(tmp_path, "d3", "C", retyped), 1)
    assert DeltaTable(str(tmp_path)).version() == version


def test_two_first_commits_at_once_make_one_table(tmp_path):
    """delta-rs retries a create that lost version 0 as a CREATE TABLE at version 1 over the
    winner's files; ours is refused and committed into the table made (or loses the race)."""
    gate = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def attempt(ds: str, name: str) -> None:
        batch = files(tmp_path, ds, name, [2])
        gate.wait(timeout=30)
        try:
            outcomes[name] = commit(tmp_path, ds, name, batch, 1)
        except LostRace as exc:
            outcomes[name] = exc

    for dates in (("d1", "d2"), ("d3", "d3")):
        outcomes.clear()
        names = ("A" + dates[0], "B" + dates[1])
        threads = [threading.Thread(target=attempt, args=(ds, n)) for ds, n in zip(dates, names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        creates = [h for h in DeltaTable(str(tmp_path)).history() if h["operation"] == "CREATE TABLE"]
        assert len(creates) == 1
    table = DeltaTable(str(tmp_path)).to_pyarrow_table()
    counts = {ds: table.filter(pa.compute.field("dt") == ds).num_rows for ds in ("d1", "d2", "d3")}
    assert counts == {"d1": 2, "d2": 2, "d3": 2}          # two dates both land; one date once


def test_a_first_commit_lands_beside_another_partitions_overwrite_at_once(tmp_path):
    """An --overwrite of one date removes files; delta-rs takes a concurrent append of another
    date for a conflict with it. The append commits again on top: both land (seen in the full
    suite: the other date's run lost its rows and said 'already committed')."""
    commit(tmp_path, "d1", "A", files(tmp_path, "d1", "A", [3]), 1)
    outcomes = race(tmp_path, [("d1", "B", 2, files(tmp_path, "d1", "B", [2])),
                               ("d2", "C", 1, files(tmp_path, "d2", "C", [2]))])
    assert not any(isinstance(o, LostRace) for o in outcomes.values()), outcomes
    assert rows(tmp_path, "d1") == ["B"] * 2 and rows(tmp_path, "d2") == ["C"] * 2
