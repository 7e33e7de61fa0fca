"""Typed records of a partition: the manifest (contract §4) and what a finished shard leaves in scratch.

Plain dataclasses with ``to_dict``/``from_dict``; JSON is only made and parsed at the edges
(:mod:`batchinfer.io.manifest`, the per-shard scratch files). Pure: no I/O here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

MANIFEST_VERSION = 1
ShardStatus = Literal["scored", "empty", "quarantined", "unreadable"]


@dataclass(frozen=True)
class FileRecord:
    """A data file of the partition: path relative to ``output.path``, rows, sha256 of its bytes."""

    path: str
    rows: int
    sha256: str

    @classmethod
    def from_dict(cls, data: dict) -> "FileRecord":
        return cls(path=data["path"], rows=data["rows"], sha256=data["sha256"])


def _with_files(record: Any) -> dict:
    """A record with a ``files`` tuple as JSON-ready data (``files`` a list, as in the manifest)."""
    data = asdict(record)
    data["files"] = [asdict(f) for f in record.files]
    return data


@dataclass(frozen=True)
class ShardRecord:
    """One input shard in the manifest (contract §4)."""

    path: str
    sha256: str | None
    rows_in: int | None
    rows_scored: int
    rows_quarantined: int
    status: ShardStatus
    reason: str | None
    files: tuple[FileRecord, ...] = ()

    def to_dict(self) -> dict:
        return _with_files(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ShardRecord":
        return cls(path=data["path"], sha256=data.get("sha256"), rows_in=data.get("rows_in"),
                   rows_scored=data["rows_scored"], rows_quarantined=data["rows_quarantined"],
                   status=data["status"], reason=data.get("reason"),
                   files=tuple(FileRecord.from_dict(f) for f in data.get("files", [])))


@dataclass(frozen=True)
class Totals:
    shards: int
    rows_in: int
    rows_scored: int
    rows_quarantined: int
    shards_unreadable: int

    @classmethod
    def of(cls, shards: list[ShardRecord] | tuple[ShardRecord, ...]) -> "Totals":
        return cls(shards=len(shards),
                   rows_in=sum(s.rows_in or 0 for s in shards),
                   rows_scored=sum(s.rows_scored for s in shards),
                   rows_quarantined=sum(s.rows_quarantined for s in shards),
                   shards_unreadable=sum(s.status == "unreadable" for s in shards))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ChallengerShard:
    """A challenger's rows of one input shard: those its model scored (written to its files) and
    those it rejected (it raised on them, or gave a non-finite output). A rejection is the
    challenger's own business: the input row is not quarantined and the champion's accounting
    is untouched."""

    path: str                     # the input shard, as the manifest's shards name it
    rows_scored: int
    rows_rejected: int
    reason: str | None = None     # the first rejection's message
    compute_ms: float = 0.0       # the challenger's model time on this shard
    files: tuple[FileRecord, ...] = ()

    def to_dict(self) -> dict:
        return _with_files(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ChallengerShard":
        return cls(path=data["path"], rows_scored=data["rows_scored"],
                   rows_rejected=data["rows_rejected"], reason=data.get("reason"),
                   compute_ms=float(data.get("compute_ms", 0.0)),
                   files=tuple(FileRecord.from_dict(f) for f in data.get("files", [])))


@dataclass(frozen=True)
class Challenger:
    """A challenger model in the manifest (contract §6 "Challengers"): its triple, how it ran, and
    its files under ``challengers/<name>/<attempt>/``, shard by shard in the manifest's order."""

    name: str
    triple: dict[str, str]
    backend: str
    device: str
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

    def to_dict(self) -> dict:
        return {"name": self.name, "triple": dict(self.triple), "backend": self.backend,
                "device": self.device, "model_options": dict(self.model_options),
                "rows_scored": self.rows_scored, "rows_rejected": self.rows_rejected,
                "compute_ms": self.compute_ms, "shards": [s.to_dict() for s in self.shards]}

    @classmethod
    def from_dict(cls, data: dict) -> "Challenger":
        return cls(name=data["name"], triple=dict(data["triple"]), backend=data.get("backend", ""),
                   device=data.get("device", ""), model_options=dict(data.get("model_options") or {}),
                   shards=tuple(ChallengerShard.from_dict(s) for s in data.get("shards", [])))

    def as_run(self) -> "tuple[str, dict[str, str], dict[str, str]]":
        """What makes two runs of this challenger the same: name, triple, declared options."""
        return self.name, dict(self.triple), dict(self.model_options)


@dataclass(frozen=True)
class Manifest:
    """``_manifest.json``: the commit of a partition (contract §4)."""

    job: str
    ds: str | None
    attempt: str
    triple: dict[str, str]
    job_spec_sha256: str
    runner: str
    device: str
    started_at: str
    finished_at: str
    mlflow_run_id: str | None
    totals: Totals
    shards: tuple[ShardRecord, ...]
    manifest_version: int = MANIFEST_VERSION
    backend: str = ""
    model_options: dict[str, str] = field(default_factory=dict)   # the declared ones (precision)
    challengers: tuple[Challenger, ...] = ()

    def files(self) -> set[str]:
        """Every data file the partition consists of (relative paths), challengers' included."""
        return ({f.path for shard in self.shards for f in shard.files}
                | {f.path for c in self.challengers for s in c.shards for f in s.files})

    def challenger(self, name: str) -> Challenger | None:
        return next((c for c in self.challengers if c.name == name), None)

    def to_dict(self) -> dict:
        return {"manifest_version": self.manifest_version, "job": self.job, "ds": self.ds,
                "attempt": self.attempt, "triple": dict(self.triple),
                "job_spec_sha256": self.job_spec_sha256, "runner": self.runner,
                "device": self.device, "backend": self.backend,
                "model_options": dict(self.model_options), "started_at": self.started_at,
                "finished_at": self.finished_at, "mlflow_run_id": self.mlflow_run_id,
                "totals": self.totals.to_dict(), "shards": [s.to_dict() for s in self.shards],
                # Only a job with challengers has the key: a manifest without them reads as before.
                **({"challengers": [c.to_dict() for c in self.challengers]}
                   if self.challengers else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        shards = tuple(ShardRecord.from_dict(s) for s in data.get("shards", []))
        totals = data.get("totals")
        return cls(job=data.get("job", ""), ds=data.get("ds"), attempt=data.get("attempt", ""),
                   triple=dict(data.get("triple", {})),
                   job_spec_sha256=data.get("job_spec_sha256", ""),
                   runner=data.get("runner", ""), device=data.get("device", ""),
                   started_at=data.get("started_at", ""), finished_at=data.get("finished_at", ""),
                   mlflow_run_id=data.get("mlflow_run_id"),
                   totals=Totals(**totals) if totals else Totals.of(shards), shards=shards,
                   manifest_version=data.get("manifest_version", MANIFEST_VERSION),
                   backend=data.get("backend", ""),
                   model_options=dict(data.get("model_options") or {}),
                   challengers=tuple(Challenger.from_dict(c) for c in data.get("challengers", [])))


@dataclass(frozen=True)
class ModelStats:
    """What the model did with a shard's rows: rows given, rows it raised on, its first error,
    out-of-memory back-offs (each halved the rows per model call), the rows per call it ended
    with (0: not recorded, or calls sized by tokens), and for a model with a lengths input the
    real tokens of the rows it scored and the tokens it was fed, padding included."""

    rows: int = 0
    raised: int = 0
    error: str | None = None
    oom_backoffs: int = 0
    chunk_rows: int = 0
    warmup_ms: float = 0.0   # the untimed first model call(s): one per worker process
    tokens: int = 0
    padded_tokens: int = 0

    def __add__(self, other: "ModelStats") -> "ModelStats":
        chunks = [c for c in (self.chunk_rows, other.chunk_rows) if c]
        return ModelStats(self.rows + other.rows, self.raised + other.raised,
                          self.error or other.error, self.oom_backoffs + other.oom_backoffs,
                          min(chunks) if chunks else 0, self.warmup_ms + other.warmup_ms,
                          self.tokens + other.tokens, self.padded_tokens + other.padded_tokens)


@dataclass(frozen=True)
class PreprocessStats:
    """What the preprocessing did with the valid rows it was given: how many, and the rows it
    raised on by exception type (``KeyError``), with each type's first message (``KeyError:
    'income'``) and the first failure's traceback, for ``--debug``. The commit step and
    ``validate`` tell a broken function from bad rows by them (contract §6 "Preprocessing
    faults")."""

    rows: int = 0
    raised: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    trace: str | None = None

    def __add__(self, other: "PreprocessStats") -> "PreprocessStats":
        raised = dict(self.raised)
        for kind, n in other.raised.items():
            raised[kind] = raised.get(kind, 0) + n
        return PreprocessStats(self.rows + other.rows, raised, {**other.first, **self.first},
                               self.trace or other.trace)

    @classmethod
    def from_dict(cls, data: dict) -> "PreprocessStats":
        return cls(int(data.get("rows", 0)), {str(k): int(n) for k, n in data.get("raised", {}).items()},
                   {str(k): str(m) for k, m in data.get("first", {}).items()}, data.get("trace"))


@dataclass(frozen=True)
class ShardResult:
    """What a finished shard leaves in scratch for the commit: its manifest entry, plus what goes
    to the metrics, not the manifest: the time spent per stage, the model's statistics, the
    column statistics for drift (``rows.profile.ColumnStats.to_dict`` by column; plain data
    here, the io layer does not interpret them), quarantined rows by (column, check) and each
    model batch's (rows, model ms)."""

    record: ShardRecord
    seconds: dict[str, float] = field(default_factory=dict)
    model: ModelStats = ModelStats()
    profile: dict[str, dict] = field(default_factory=dict)
    quarantine: tuple[tuple[str | None, str, int], ...] = ()
    batches: tuple[tuple[int, float], ...] = ()
    challengers: dict[str, ChallengerShard] = field(default_factory=dict)   # by challenger name
    preprocess: PreprocessStats = PreprocessStats()

    def to_dict(self) -> dict[str, Any]:
        return {"record": self.record.to_dict(), "seconds": dict(self.seconds),
                "model": asdict(self.model), "profile": dict(self.profile),
                "quarantine": [list(q) for q in self.quarantine],
                "batches": [list(b) for b in self.batches],
                "challengers": {k: v.to_dict() for k, v in self.challengers.items()},
                "preprocess": asdict(self.preprocess)}

    @classmethod
    def from_dict(cls, data: dict) -> "ShardResult":
        return cls(ShardRecord.from_dict(data["record"]), dict(data.get("seconds", {})),
                   ModelStats(**data.get("model", {})), dict(data.get("profile", {})),
                   tuple((c, k, int(n)) for c, k, n in data.get("quarantine", [])),
                   tuple((int(r), float(ms)) for r, ms in data.get("batches", [])),
                   {k: ChallengerShard.from_dict(v) for k, v in data.get("challengers", {}).items()},
                   PreprocessStats.from_dict(data.get("preprocess", {})))


def with_challenger_shards(challengers: tuple[Challenger, ...],
                           results: "list[ShardResult] | tuple[ShardResult, ...]") -> tuple[Challenger, ...]:
    """The manifest's challenger entries (known before any work) with each shard's rows and
    files from the shards' results, in shard order. A shard without an entry for a challenger
    (unreadable) gets an empty one."""
    return tuple(
        replace(c, shards=tuple(r.challengers.get(c.name) or ChallengerShard(r.record.path, 0, 0)
                                for r in results))
        for c in challengers)
