"""``batchinfer validate``: check a partition's shards against the schema only (SPEC §2), and
the read → validate loop that every reader of a job's input outside the pipeline shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..io.shards import ShardReader, Unreadable, list_input
from ..rows.validation import ValidationResult, validate_batch
from ..spec import Job
from ..triple.schemas import SchemaVersion, resolve_schema


@dataclass
class ValidationReport:
    shards: int
    rows_in: int
    rows_bad: int
    unreadable: list[tuple[str, str]]
    by_reason: dict[tuple[str, str], int]     # (column, check) → rows whose first failure it is
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_in if self.rows_in else 0.0

    def breach(self, job: Job) -> str | None:
        """Why ``run`` would refuse to commit this input (exit 4), or None."""
        return job.spec.quarantine.breach(self.rows_in, self.rows_bad, len(self.unreadable))


def validated_batches(reader: ShardReader, schema: SchemaVersion, rows: int,
                      name: str) -> Iterator[ValidationResult]:
    """Read a shard in batches of ``rows`` and validate each (rows numbered within the shard).

    Raises:
        Unreadable: the shard's bytes are not (or stop being) a readable Parquet file.
    """
    first = 0
    for batch in reader.batches(rows):
        yield validate_batch(batch, schema.schema, source_shard=name, first_row=first)
        first += batch.num_rows


def validate_input(job: Job) -> ValidationReport:
    """Check every shard against the schema only (no preprocessing, no model, no writes).

    Unlike ``run``, this needs no model declaration: it answers "is this data fit?" alone.
    """
    spec = job.spec
    schema = resolve_schema(spec.schemas.root, spec.schema_)
    listing = list_input(spec.input.path)
    rows_in = rows_bad = 0
    unreadable: list[tuple[str, str]] = []
    by_reason: dict[tuple[str, str], int] = {}
    for shard in listing.shards:
        name = job.display(shard.url)
        counts: dict[tuple[str, str], int] = {}
        bad = 0
        try:
            reader = ShardReader(shard.url)
            for result in validated_batches(reader, schema, spec.batch.rows, name):
                q = result.quarantine
                bad += q.num_rows
                if q.num_rows:
                    pairs = zip(q.column("_column").to_pylist(), q.column("_check").to_pylist())
                    for column, check in pairs:
                        key = (column or "", check)
                        counts[key] = counts.get(key, 0) + 1
        except Unreadable as exc:
            unreadable.append((name, str(exc)))
            continue
        rows_in += reader.num_rows
        rows_bad += bad
        for key, n in counts.items():
            by_reason[key] = by_reason.get(key, 0) + n
    return ValidationReport(len(listing.shards), rows_in, rows_bad, unreadable, by_reason,
                            [job.display(url) for url in listing.ignored])
