"""``batchinfer validate``: check a partition's shards against the schema and the preprocessing
(contract §2) — the pipeline's own Prepare step (pipeline/prepare.py), no model — and the read →
validate loop that every reader of a job's input outside the pipeline shares."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import PreprocessError
from ..io.records import InputTable, PreprocessStats
from ..io.shards import ShardReader, Unreadable
from ..pipeline.prepare import prepare_batch, preprocess_fault
from ..rows.validation import ValidationResult, validate_batch
from ..spec import Job
from ..triple.schemas import SchemaVersion
from .resolve import check_table_columns, list_job_input, resolve_inputs

log = logging.getLogger("batchinfer")


@dataclass
class ValidationReport:
    shards: int
    rows_in: int
    rows_bad: int
    unreadable: list[tuple[str, str]]
    by_reason: dict[tuple[str, str], int]     # (column, check) → rows whose first failure it is
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched
    preprocess: PreprocessStats = PreprocessStats()   # the rows it raised on, by exception type
    table: InputTable | None = None   # a table input: the table and version read

    @property
    def bad_fraction(self) -> float:
        return self.rows_bad / self.rows_in if self.rows_in else 0.0

    def breach(self, job: Job) -> str | None:
        """Why ``run`` would refuse to commit this input (exit 4), or None.

        Raises:
            PreprocessError: the rows over the thresholds are a preprocessing fault, as ``run``
                would say (exit 2; pipeline/prepare.py rule (b)).
        """
        why = job.spec.quarantine.breach(self.rows_in, self.rows_bad, len(self.unreadable))
        fault = preprocess_fault(self.preprocess, job.spec.preprocess) if why else None
        if fault:
            if self.preprocess.trace:
                log.debug("the preprocessing's first failure:\n%s", self.preprocess.trace.rstrip())
            raise PreprocessError(fault)
        return why


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
    """Check every shard against the schema and the preprocessing, batch by batch as ``run``
    does (no model, no writes).

    Unlike ``run``, this needs no model declaration: it answers "is this data fit?" alone.

    Raises:
        PreprocessError: the preprocessing cannot be loaded, or fails on every row of a batch
            (a fault of the function, exit 2 as in ``run``).
    """
    spec = job.spec
    schema, _, preprocessor = resolve_inputs(job)
    listing = list_job_input(job)
    check_table_columns(job, schema, listing)
    rows_in = rows_bad = 0
    unreadable: list[tuple[str, str]] = []
    by_reason: dict[tuple[str, str], int] = {}
    preprocess = PreprocessStats()
    for shard in listing.shards:
        name = job.display(shard.url)
        counts: dict[tuple[str, str], int] = {}
        bad = 0
        stats = PreprocessStats()
        try:
            reader = ShardReader(shard.url)
            first = 0
            for batch in reader.batches(spec.batch.rows):
                prepared = prepare_batch(batch, schema, preprocessor, source_shard=name,
                                         first_row=first)
                first += batch.num_rows
                stats += prepared.stats
                for q in prepared.quarantine:
                    bad += q.num_rows
                    pairs = zip(q.column("_column").to_pylist(), q.column("_check").to_pylist())
                    for column, check in pairs:
                        key = (column or "", check)
                        counts[key] = counts.get(key, 0) + 1
        except Unreadable as exc:
            unreadable.append((name, str(exc)))
            continue
        rows_in += reader.num_rows
        rows_bad += bad
        preprocess += stats
        for key, n in counts.items():
            by_reason[key] = by_reason.get(key, 0) + n
    return ValidationReport(len(listing.shards), rows_in, rows_bad, unreadable, by_reason,
                            [job.display(url) for url in listing.ignored], preprocess,
                            listing.table)
