"""Typed records of a partition: the manifest (contract §4) and what a finished shard leaves in scratch.

Each record is declared once, here: keyword-only dataclasses (:class:`~batchinfer.codec.Record`)
whose fields are declared in the order its JSON has its keys, with what a file read back must
meet in their annotations (counts, finite numbers, non-empty names, and the checks that span
fields as pydantic validators). The same declaration writes the file (``to_dict``) and validates
it where it is read (:func:`batchinfer.io.readback.check`). JSON is only made and parsed at the
edges (:mod:`batchinfer.io.manifest`, the per-shard scratch files). Where a field has a default,
a file without its key (written by an older batchinfer) reads with it. Pure: no I/O here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Iterable, Literal, Mapping, Protocol, Sequence

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from ..codec import Count, Duration, Finite, Name, NonNegative, Record, json_validated
from ..profile_records import ColumnStatsRecord

MANIFEST_VERSION: Literal[1] = 1
ShardStatus = Literal["scored", "empty", "quarantined", "unreadable"]


def _inside_the_output(path: str) -> str:
    # Readers open output.path/<path>: a path that leaves the output is not a partition's.
    parts = path.replace("\\", "/").split("/")
    if path.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts or "" in parts:
        raise ValueError(f"{path!r} is not a path inside the output folder")
    return path


DataPath = Annotated[Name, AfterValidator(_inside_the_output)]


@dataclass(frozen=True)
class FileRecord(Record):
    """A data file of the partition: path relative to ``output.path``, rows, sha256 of its bytes."""

    path: DataPath
    rows: Count
    sha256: Name


@dataclass(frozen=True, kw_only=True)
class ShardRecord(Record):
    """One input shard in the manifest (contract §4). ``scored_by``: the attempt that scored it
    and wrote its files (an earlier, crashed attempt's for a shard a resumed run adopted; None
    in manifests written before it was recorded: the manifest's own attempt)."""

    path: Name
    sha256: Name | None = None
    rows_in: Count | None = None
    rows_scored: Count
    rows_quarantined: Count
    status: ShardStatus
    reason: str | None = None
    files: tuple[FileRecord, ...] = ()
    scored_by: Name | None = None

    @model_validator(mode="after")
    def _accounted(self) -> "ShardRecord":
        if self.rows_in is not None and self.rows_in != self.rows_scored + self.rows_quarantined:
            raise ValueError(f"rows_in {self.rows_in} is not rows_scored {self.rows_scored} + "
                             f"rows_quarantined {self.rows_quarantined}")
        return self


@dataclass(frozen=True, kw_only=True)
class Totals(Record):
    shards: Count
    rows_in: Count
    rows_scored: Count
    rows_quarantined: Count
    shards_unreadable: Count

    @classmethod
    def of(cls, shards: list[ShardRecord] | tuple[ShardRecord, ...]) -> "Totals":
        return cls(shards=len(shards),
                   rows_in=sum(s.rows_in or 0 for s in shards),
                   rows_scored=sum(s.rows_scored for s in shards),
                   rows_quarantined=sum(s.rows_quarantined for s in shards),
                   shards_unreadable=sum(s.status == "unreadable" for s in shards))


# What a manifest read back without its totals holds until they are counted from its shards.
_UNCOUNTED = Totals(shards=0, rows_in=0, rows_scored=0, rows_quarantined=0, shards_unreadable=0)


def _totals_or_null(value: Any) -> Any:
    # A validator that runs first sees Python data: validated as JSON, as the rest of the file.
    return _UNCOUNTED if value is None else json_validated(Totals, value)


@dataclass(frozen=True, kw_only=True)
class ChallengerShard(Record):
    """A challenger's rows of one input shard: those its model scored (written to its files) and
    those it rejected (it raised on them, or gave a non-finite output). A rejection is the
    challenger's own business: the input row is not quarantined and the champion's accounting
    is untouched."""

    path: Name                    # the input shard, as the manifest's shards name it
    rows_scored: Count
    rows_rejected: Count
    reason: str | None = None     # the first rejection's message
    compute_ms: Duration = 0.0    # the challenger's model time on this shard
    files: tuple[FileRecord, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Challenger(Record):
    """A challenger model in the manifest (contract §6 "Challengers"): its triple, how it ran, and
    its files under ``challengers/<name>/<attempt>/``, shard by shard in the manifest's order."""

    name: Name
    triple: dict[str, str]
    backend: str = ""
    device: str = ""
    model_options: dict[str, str] = field(default_factory=dict)
    shards: tuple[ChallengerShard, ...] = ()

    @property
    def rows_scored(self) -> int:
        return sum(s.rows_scored for s in self.shards)

    @property
    def rows_rejected(self) -> int:
        return sum(s.rows_rejected for s in self.shards)

    @property
    def compute_ms(self) -> float:
        return sum(s.compute_ms for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        # Its totals are written before its shards, for a reader of the manifest; read back,
        # they are derived again.
        data = super().to_dict()
        shards = data.pop("shards")
        return {**data, "rows_scored": self.rows_scored, "rows_rejected": self.rows_rejected,
                "compute_ms": self.compute_ms, "shards": shards}

    def as_run(self) -> "tuple[str, dict[str, str], dict[str, str]]":
        """What makes two runs of this challenger the same: name, triple, declared options."""
        return self.name, dict(self.triple), dict(self.model_options)


@dataclass(frozen=True, kw_only=True)
class AttemptKey(Record):
    """What an attempt scores, left in its scratch when it begins (``_tmp/<attempt>/attempt.json``):
    a later run of the partition adopts the shards that attempt finished only if it has the same
    key (contract §5.3 "Resume"). Challengers are held without shards."""

    job: Name
    ds: str | None
    job_spec_sha256: str
    triple: dict[str, str]
    model_options: dict[str, str] = field(default_factory=dict)
    challengers: tuple[Challenger, ...] = ()

    def same(self, other: "AttemptKey") -> bool:
        """The same job, date, spec, triple, declared options and challengers (in any order)."""
        def runs(key: "AttemptKey") -> list:
            return sorted((c.as_run() for c in key.challengers), key=repr)
        return (self.job, self.ds, self.job_spec_sha256, self.triple, self.model_options) == (
            other.job, other.ds, other.job_spec_sha256, other.triple, other.model_options) and (
            runs(self) == runs(other))


@dataclass(frozen=True, kw_only=True)
class TableVersion(Record):
    """One table's commit of a partition: ``kind`` (predictions, quarantine, challengers/<name>),
    the table (Delta: its folder relative to ``output.path``, "" for the predictions table;
    Iceberg: its identifier; never a URL), and the version it made (Delta: the log version;
    Iceberg: the snapshot id)."""

    kind: str
    table: str
    version: int


@dataclass(frozen=True, kw_only=True)
class TableCommit(Record):
    """What a partition committed to tables (``output.format`` delta or iceberg): the partition
    (``{"dt": "2026-01-31"}``), its generation (1 for the first commit of the partition, +1 for
    each replacing one: the tables' own record of it is what makes two commits of one generation
    impossible) and each table's version."""

    format: Name   # a name in the format registry (io/formats.py: checked where a job is specified)
    partition: dict[str, str]
    generation: Count
    tables: tuple[TableVersion, ...] = ()

    def version(self, kind: str) -> int | None:
        return next((t.version for t in self.tables if t.kind == kind), None)


@dataclass(frozen=True, kw_only=True)
class InputTable(Record):
    """The table a partition's shards were read from (contract §3 ``input``, §4): its format,
    the Delta table's root (``${NAME}`` values put back) or the Iceberg identifier, the version
    or snapshot id read, and the partition filter. A rerun reads this version again."""

    format: Name   # a name in the format registry (io/formats.py: checked where a job is specified)
    table: Name
    version: Count
    filter: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Plugin(Record):
    """A backend or runner of the run that is not batchinfer's own (contract §4): the
    distribution that holds it and its version (None: registered by code that no installed
    distribution holds, a script's ``register()``)."""

    kind: Literal["backend", "runner"]
    name: Name
    distribution: str | None
    version: str | None


@dataclass(frozen=True, kw_only=True)
class Manifest(Record):
    """``_manifest.json``: the commit of a partition (contract §4)."""

    manifest_version: Literal[1] = MANIFEST_VERSION
    job: Name
    ds: str | None
    attempt: Name
    triple: dict[str, str]
    # Defaults: what a manifest written before batchinfer recorded them reads with.
    job_spec_sha256: str = ""
    runner: str = ""
    device: str = ""
    backend: str = ""
    model_options: dict[str, str] = field(default_factory=dict)   # the declared ones (precision)
    started_at: str = ""
    finished_at: str = ""
    mlflow_run_id: str | None = None
    # Read back without them (or with null): counted from its shards.
    totals: Annotated[Totals, BeforeValidator(_totals_or_null)] = _UNCOUNTED
    shards: tuple[ShardRecord, ...]
    challengers: tuple[Challenger, ...] = ()
    table: TableCommit | None = None   # output.format delta / iceberg: the tables' commit
    input_table: InputTable | None = None   # None: shards listed from files
    plugins: tuple[Plugin, ...] = ()   # backends and runners from outside batchinfer

    def files(self) -> set[str]:
        """Every data file the partition consists of (relative paths), challengers' included."""
        return ({f.path for shard in self.shards for f in shard.files}
                | {f.path for c in self.challengers for s in c.shards for f in s.files})

    def scored_by(self, shard: ShardRecord) -> str:
        """The attempt that scored ``shard`` (this manifest's own when not recorded)."""
        return shard.scored_by or self.attempt

    def reused(self) -> tuple[ShardRecord, ...]:
        """The shards an earlier attempt scored (adopted by this one on resume)."""
        return tuple(s for s in self.shards if self.scored_by(s) != self.attempt)

    def challenger(self, name: str) -> Challenger | None:
        return next((c for c in self.challengers if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if not self.challengers:   # only a job with challengers has the key: a manifest
            del data["challengers"]  # without them reads as before
        if self.table is None:     # likewise the tables' commit, for files
            del data["table"]
        if self.input_table is None:   # nor does one of files
            del data["input_table"]
        if not self.plugins:   # nor one that ran on batchinfer's own backends and runner
            del data["plugins"]
        return data

    @model_validator(mode="after")
    def _counted(self) -> "Manifest":
        return replace(self, totals=Totals.of(self.shards)) if self.totals is _UNCOUNTED else self


@dataclass(frozen=True, kw_only=True)
class ModelStats(Record):
    """What the model did with a shard's rows: rows given, rows it raised on, its first error,
    out-of-memory back-offs (each halved the rows per model call), the rows per call it ended
    with (0: not recorded, or calls sized by tokens), and for a model with a lengths input the
    real tokens of the rows it scored and the tokens it was fed, padding included."""

    rows: Count = 0
    raised: Count = 0
    error: str | None = None
    oom_backoffs: Count = 0
    chunk_rows: Count = 0
    warmup_ms: Finite = 0.0   # the untimed first model call(s): one per worker process
    tokens: Count = 0
    padded_tokens: Count = 0
    # explain (contract §6 "Explanations"): rows explained, those whose attributions missed
    # completeness, and each feature's |attribution| summed over the rows explained.
    explained: Count = 0
    incomplete: Count = 0
    abs_attribution: dict[str, NonNegative] = field(default_factory=dict)
    max_gap: NonNegative = 0.0     # the largest |sum of attributions - (f(x) - f(baseline))|

    def to_dict(self) -> dict[str, Any]:
        # A run without explain writes the keys it always wrote.
        data = super().to_dict()
        if not (self.explained or self.incomplete or self.abs_attribution):
            for key in ("explained", "incomplete", "abs_attribution", "max_gap"):
                data.pop(key)
        return data

    def __add__(self, other: "ModelStats") -> "ModelStats":
        chunks = [c for c in (self.chunk_rows, other.chunk_rows) if c]
        attribution = dict(self.abs_attribution)
        for feature, value in other.abs_attribution.items():
            attribution[feature] = attribution.get(feature, 0.0) + value
        return ModelStats(rows=self.rows + other.rows, raised=self.raised + other.raised,
                          error=self.error or other.error,
                          oom_backoffs=self.oom_backoffs + other.oom_backoffs,
                          chunk_rows=min(chunks) if chunks else 0,
                          warmup_ms=self.warmup_ms + other.warmup_ms,
                          tokens=self.tokens + other.tokens,
                          padded_tokens=self.padded_tokens + other.padded_tokens,
                          explained=self.explained + other.explained,
                          incomplete=self.incomplete + other.incomplete,
                          abs_attribution=attribution,
                          max_gap=max(self.max_gap, other.max_gap))


@dataclass(frozen=True)
class PreprocessStats(Record):
    """What the preprocessing did with the valid rows it was given: how many, and the rows it
    raised on by exception type (``KeyError``), with each type's first message (``KeyError:
    'income'``) and the first failure's traceback, for ``--debug``. The commit step and
    ``validate`` tell a broken function from bad rows by them (contract §6 "Preprocessing
    faults")."""

    rows: Count = 0
    raised: dict[str, Count] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    trace: str | None = None

    def __add__(self, other: "PreprocessStats") -> "PreprocessStats":
        raised = dict(self.raised)
        for kind, n in other.raised.items():
            raised[kind] = raised.get(kind, 0) + n
        return PreprocessStats(self.rows + other.rows, raised, {**other.first, **self.first},
                               self.trace or other.trace)


def _column_stats(value: Any) -> dict[str, Any]:
    # Checked as a ColumnStatsRecord, kept as its plain data (every key, numbers as declared).
    return json_validated(ColumnStatsRecord, value).to_dict()


ColumnStatsData = Annotated[dict[str, Any], BeforeValidator(_column_stats)]


@dataclass(frozen=True, kw_only=True)
class ShardResult(Record):
    """What a finished shard leaves in scratch for the commit: its manifest entry, plus what goes
    to the metrics, not the manifest: the time spent per stage, the model's statistics, the
    column statistics for drift (``rows.column_profiles.ColumnStats.to_dict`` by column; plain data
    here, the io layer does not interpret them), quarantined rows by (column, check) and each
    model batch's (rows, model ms)."""

    record: ShardRecord
    seconds: dict[str, Finite] = field(default_factory=dict)
    model: ModelStats = ModelStats()
    profile: dict[str, ColumnStatsData] = field(default_factory=dict)
    quarantine: tuple[tuple[str | None, str, Count], ...] = ()
    batches: tuple[tuple[Count, Finite], ...] = ()
    challengers: dict[str, ChallengerShard] = field(default_factory=dict)   # by challenger name
    preprocess: PreprocessStats = PreprocessStats()

    @property
    def scored_rows(self) -> bool:
        """Whether any of its batches reached the models: then each challenger scored it too and
        left its part of the result (unreadable and empty shards have none)."""
        return self.record.status != "unreadable" and bool(self.record.rows_in)

    def joined(self, parts: Mapping[str, ChallengerShard]) -> "ShardResult":
        """The champion's result of a shard with each challenger's part (by name), as the writers
        of the champion and of each challenger left them in scratch, each once its own files were
        written (pipeline/transforms.py).

        Raises:
            RuntimeError: a challenger was given other rows than the champion's model (a bug,
                never bad data).
        """
        given = self.model.rows
        for name, part in parts.items():
            if part.rows_scored + part.rows_rejected != given:
                raise RuntimeError(f"accounting failed for challenger {name} on shard "
                                   f"{self.record.path}: it was given "
                                   f"{part.rows_scored + part.rows_rejected} rows, the champion's "
                                   f"model {given}")
        return replace(self, challengers={**self.challengers, **parts})


def with_challenger_shards(challengers: tuple[Challenger, ...],
                           results: "Iterable[ShardResult]") -> tuple[Challenger, ...]:
    """The manifest's challenger entries (known before any work) with each shard's rows and
    files from the shards' results, in shard order. A shard without an entry for a challenger
    (unreadable) gets an empty one."""
    return challenger_entries(challengers, [(r.record.path, r.challengers) for r in results])


def challenger_entries(challengers: tuple[Challenger, ...],
                       parts: "Sequence[tuple[str, Mapping[str, ChallengerShard]]]") -> tuple[Challenger, ...]:
    """:func:`with_challenger_shards` from each shard's (path, challengers' parts by name)."""
    return tuple(
        replace(c, shards=tuple(by_name.get(c.name)
                                or ChallengerShard(path=path, rows_scored=0, rows_rejected=0)
                                for path, by_name in parts))
        for c in challengers)


# -- the partition's results folded (what the commit step and the launcher need of them) ----------

@dataclass(frozen=True, kw_only=True)
class ChallengerSums(Record):
    """A challenger's rows scored and rejected, and its model time, summed over the shards."""

    rows_scored: Count = 0
    rows_rejected: Count = 0
    compute_ms: Duration = 0.0


@dataclass(frozen=True, kw_only=True)
class ScoredBy(Record):
    """The shards one attempt scored (as their manifest entries record it), and their rows in."""

    shards: Count = 0
    rows_in: Count = 0


# One shard's column statistics, or several shards' merged: column → ColumnStats.to_dict().
ProfileData = dict[str, ColumnStatsData]


@dataclass(frozen=True, kw_only=True)
class ResultsSummary(Record):
    """Every shard's :class:`ShardResult` of a partition folded, in shard order (:func:`fold`):
    what the commit step decides on and the launcher's metrics, profile and report are made of,
    without holding 20,000 results (bench/README.md "Many small shards").

    Attributes:
        totals: the manifest's totals of the shards' entries.
        scored_by: for the shards whose entry records the attempt that scored them, by attempt
            (:meth:`reused` counts those of other attempts than the run's).
        seconds: time per stage, summed (in shard order, as the metrics always summed them).
        model, preprocess: the shards' statistics added up.
        quarantine: quarantined rows by (column, check), summed, in the order first seen.
        batches: every model batch's (rows, model ms), in shard order (for the percentiles).
        challengers: each challenger's sums, by name, in the order first seen.
        profiles: the column statistics: the shards' merged into one (the commit step merges
            them, rows/drift.py ``MergedProfiles``), or each shard's (the io layer does not
            interpret them: an outcome written before the results were folded keeps each). The
            drift verdict on either is the same (rows/drift.py ``run_columns`` merges them).
    """

    totals: Totals = _UNCOUNTED
    scored_by: dict[str, ScoredBy] = field(default_factory=dict)
    seconds: dict[str, Finite] = field(default_factory=dict)
    model: ModelStats = ModelStats()
    preprocess: PreprocessStats = PreprocessStats()
    quarantine: tuple[tuple[str | None, str, Count], ...] = ()
    batches: tuple[tuple[Count, Finite], ...] = ()
    challengers: dict[str, ChallengerSums] = field(default_factory=dict)
    profiles: tuple[ProfileData, ...] = ()

    def reused(self, attempt: str | None) -> ScoredBy:
        """The shards (and their rows in) that another attempt than ``attempt`` scored: adopted
        from a crashed attempt, or kept by an update (none without an ``attempt``)."""
        others = [n for by, n in self.scored_by.items() if attempt and by != attempt]
        return ScoredBy(shards=sum(n.shards for n in others), rows_in=sum(n.rows_in for n in others))


class ProfileFold(Protocol):
    """How :class:`ResultsFold` folds the shards' column statistics (plain data to the io
    layer): ``add`` each shard's, in shard order; ``profiles`` what the summary keeps."""

    def add(self, profile: Mapping[str, Mapping[str, Any]]) -> None: ...

    def profiles(self) -> tuple[ProfileData, ...]: ...


class EachProfile:
    """Keeps every shard's column statistics as they are (what a reader without the rows layer
    can do: an outcome written before the fold)."""

    def __init__(self) -> None:
        self._each: list[ProfileData] = []

    def add(self, profile: Mapping[str, Mapping[str, Any]]) -> None:
        if profile:
            self._each.append(dict(profile))   # type: ignore[arg-type]

    def profiles(self) -> tuple[ProfileData, ...]:
        return tuple(self._each)


class ResultsFold:
    """The fold of a partition's shards' results, one at a time and in shard order: the sums of
    :class:`ResultsSummary`, and, for the manifest, each shard's entry and its challengers'
    parts (``keep``). No result is held once added.

        fold = ResultsFold(profiles)
        for result in results: fold.add(result)
        fold.summary(), fold.records, fold.challenger_entries(challengers)
    """

    def __init__(self, profiles: ProfileFold | None = None, *, keep: bool = True):
        self.keep = keep
        self.records: list[ShardRecord] = []
        self._parts: list[tuple[str, Mapping[str, ChallengerShard]]] = []
        self._profiles = profiles if profiles is not None else EachProfile()
        self._totals = [0, 0, 0, 0, 0]
        self._scored_by: dict[str, list[int]] = {}
        self._seconds: dict[str, float] = {}
        self._model = ModelStats()
        self._preprocess = PreprocessStats()
        self._quarantine: dict[tuple[str | None, str], int] = {}
        self._batches: list[tuple[int, float]] = []
        self._challengers: dict[str, list[float]] = {}

    def add(self, result: ShardResult) -> "ResultsFold":
        record = result.record
        if self.keep:
            self.records.append(record)
            self._parts.append((record.path, result.challengers))
        totals = self._totals
        totals[0] += 1
        totals[1] += record.rows_in or 0
        totals[2] += record.rows_scored
        totals[3] += record.rows_quarantined
        totals[4] += record.status == "unreadable"
        if record.scored_by is not None:
            by = self._scored_by.setdefault(record.scored_by, [0, 0])
            by[0] += 1
            by[1] += record.rows_in or 0
        seconds = self._seconds
        for stage, value in result.seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
        self._model = self._model + result.model
        self._preprocess = self._preprocess + result.preprocess
        quarantine = self._quarantine
        for column, check, n in result.quarantine:
            quarantine[(column, check)] = quarantine.get((column, check), 0) + n
        self._batches.extend(result.batches)
        for name, shard in result.challengers.items():
            sums = self._challengers.setdefault(name, [0, 0, 0.0])
            sums[0] += shard.rows_scored
            sums[1] += shard.rows_rejected
            sums[2] += shard.compute_ms
        self._profiles.add(result.profile)
        return self

    def summary(self) -> ResultsSummary:
        shards, rows_in, rows_scored, rows_quarantined, unreadable = self._totals
        return ResultsSummary(
            totals=Totals(shards=shards, rows_in=rows_in, rows_scored=rows_scored,
                          rows_quarantined=rows_quarantined, shards_unreadable=unreadable),
            scored_by={by: ScoredBy(shards=n, rows_in=rows) for by, (n, rows) in self._scored_by.items()},
            seconds=dict(self._seconds), model=self._model, preprocess=self._preprocess,
            quarantine=tuple((c, k, n) for (c, k), n in self._quarantine.items()),
            batches=tuple(self._batches),
            challengers={name: ChallengerSums(rows_scored=int(s), rows_rejected=int(r), compute_ms=ms)
                         for name, (s, r, ms) in self._challengers.items()},
            profiles=self._profiles.profiles())

    def challenger_entries(self, challengers: tuple[Challenger, ...]) -> tuple[Challenger, ...]:
        """The manifest's challenger entries with the shards' parts (:func:`challenger_entries`)."""
        return challenger_entries(challengers, self._parts)


def fold(results: Iterable[ShardResult], profiles: ProfileFold | None = None) -> ResultsSummary:
    """``results`` (in shard order) folded into their :class:`ResultsSummary`, one at a time;
    ``profiles``: how their column statistics are (default: each kept, :class:`EachProfile`)."""
    folding = ResultsFold(profiles, keep=False)
    for result in results:
        folding.add(result)
    return folding.summary()


# -- _metrics.json (contract §6 "Tracking record") --------------------------------------------------

Scalar = str | int | float | bool | None
# A metric may be NaN or infinite: MLflow takes them, and a run may have logged one.
Metric = Annotated[float, Field(allow_inf_nan=True)]


@dataclass(frozen=True, kw_only=True)
class MetricsRecord(Record):
    """``_metrics.json``: what MLflow got of a committed run (or was to get, when it could not be
    reached: ``batchinfer track`` uploads it later), written by ``app.run_record.publish``."""

    mlflow_run_id: str | None = None
    uploaded: bool = False
    error: str | None = None
    tracking_uri: Name
    experiment: Name
    run_name: str | None = None
    params: dict[str, Scalar] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
