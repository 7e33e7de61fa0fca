"""The commit protocol of one output partition (contract §4, §5.2–5.3), with the life cycle of a sink.

    partition = PartitionCommit(url)
    partition.committed()                       # what is committed there now, or None
    decision = partition.decide(identity, overwrite=False, shown=url)   # reuse | replace | conflict
    attempt = partition.begin(attempt_id, replacing=decision.manifest)
    attempt.start(key)                          # its key in scratch (what a resume must match)
    ...                                         # writers put files under attempt.layout and
                                                # each finished shard's result in scratch
    results = attempt.results(shard_count, adopted)   # per-shard results, in shard order
                                                # (adopted: io/resume.py, a crashed attempt's)
    folded = attempt.fold(shard_count, adopted)  # ... folded as they are read (the commit step)
    outcome = attempt.commit(manifest)          # committed | lost_race | conflict
    attempt.record(outcome)                     # what the commit did, for the launcher to read
    attempt.outcome(triple)                     # ... read back (or learned from the manifest)
    attempt.stop()                              # a failure: its finished shards stay for a
                                                # rerun to adopt (none finished: its files go)
    attempt.abort()                             # a lost race: this attempt's files go

Exactly one run creates ``_manifest.json`` (see :mod:`batchinfer.io.manifest`); a run that
loses removes its own files, and the winner removes every other attempt and the scratch after
committing. Both objects hold only a URL and ids (and the run's clock), so they pickle: the commit runs in the
pipeline's last step (:mod:`batchinfer.pipeline.commit_step`), on whichever worker the runner picks,
and the launching process only reads its outcome back (docs/runners.md says why).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Sequence, TypeVar

from fsspec import AbstractFileSystem
from pydantic import model_validator

from .. import backends, faults
from ..clock import Clock, utc_now
from ..codec import Count, NonNegative, Record
from ..errors import Action, ContractError, Remedy, RuntimeFailure, SpecError, StorageError
from . import formats
from .manifest import (
    clean_after_commit,
    create_manifest,
    holds,
    read_manifest,
    remove_attempt,
    remove_unlisted,
)
from .outputs import CHALLENGERS, PREDICTIONS, QUARANTINE, TMP, Layout, write_json
from .readback import check
from .records import (
    AttemptKey,
    ChallengerShard,
    FileRecord,
    Manifest,
    ProfileFold,
    ResultsFold,
    ResultsSummary,
    ShardResult,
    TableCommit,
    TableVersion,
    fold,
)
from .resume import KEY
from .sinks import FILES, LostRace, Sink
from .storage import join, url_to_fs


@dataclass(frozen=True)
class CommitOutcome(Record):
    """What :meth:`Attempt.commit` did, or why the commit step refused to commit.

    Attributes:
        status: ``committed`` (this attempt's manifest is the partition), ``lost_race`` (another
            run committed the same triple first; this attempt's files are gone), ``conflict``
            (another run committed another triple first; this attempt's files are gone),
            ``refused`` (the thresholds, or a model that raised on every row: nothing committed).
        manifest: the manifest now committed (this attempt's, or the winner's).
        code: the exit code of a refusal (4 or 5); 0 otherwise.
        message: the one-line reason of a refusal.
        error: the class of the refusal's error (``batchinfer/errors.py``), so that the launcher
            raises what the commit step raised, not a class guessed from ``code``; "" in
            outcomes written before it was recorded, and for every other status.
        summary: the shards' results the commit step read, folded (for the metrics, the
            profile and the report); None for an outcome learned without the commit step's
            record (from the manifest).
        seconds: how long the commit itself took (the manifest, and the tables' commits).
        results: only in an outcome written before the results were folded (every shard's
            result): read, they are folded into ``summary``, and never written again.
    """

    status: Literal["committed", "lost_race", "conflict", "refused"]
    manifest: Manifest | None = None
    code: Count = 0
    message: str | None = None
    summary: ResultsSummary | None = None
    seconds: NonNegative = 0.0
    error: str = ""
    results: tuple[ShardResult, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        keys = ("status", "code", "message", "manifest", "summary", "seconds")
        return {key: data[key] for key in keys + (("error",) if self.error else ())}

    @model_validator(mode="after")
    def _folded(self) -> "CommitOutcome":
        # An outcome of 20,000 shards' results was ~120 MB of JSON, read back whole by the
        # launcher: an older one's results are folded as it is read.
        if self.results:
            return dataclasses.replace(self, summary=fold(self.results), results=())
        return self


# A challenger as a manifest holds it and a run declares it: name, triple, declared options.
ChallengerRun = tuple[str, dict[str, str], dict[str, str]]


@dataclass(frozen=True, kw_only=True)
class Identity:
    """What a committed partition must be to be this run's (contract §4): of this job and date,
    from these shards, with this triple and declared options, holding these challengers.

    Attributes:
        shards: the shard names ``input.path`` lists now.
        shards_as_then: the same shards named with every ``${NAME}`` value put back, as
            partitions committed before only secrets were masked name them.
        challengers: each challenger the run declares (:data:`ChallengerRun`).
    """

    job: str
    ds: str | None
    shards: frozenset[str]
    shards_as_then: frozenset[str]
    triple: dict[str, str]
    model_options: dict[str, str]
    challengers: tuple[ChallengerRun, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What a run does with the partition as it is.

    Attributes:
        action: ``reuse`` (committed already as this run would: nothing to do), ``replace``
            (score a new attempt that replaces ``manifest``, None when nothing is committed),
            ``update`` (``--update`` of a partition this run's but maybe for its shards: which
            to keep, score and drop is io/update.py's, from the shards' bytes), ``conflict``
            (committed as another partition: exit 3, ``refusal`` is the error to raise).
        manifest: the manifest committed now, or None.
    """

    action: Literal["reuse", "replace", "update", "conflict"]
    manifest: Manifest | None = None
    refusal: ContractError | None = None


def decide(committed: Manifest | None, wanted: Identity, *, overwrite: bool, shown: str,
           update: bool = False) -> Decision:
    """Reuse, replace or refuse the ``committed`` manifest (``shown`` names the partition).

    A committed manifest is "this partition" only if it is of this job, this date and these
    shards, with this triple; otherwise a run would call another partition's predictions its
    own (exit 0, nothing scored). ``--overwrite`` replaces whatever is committed. ``update``
    (``--update``): a partition of this job, date, triple, declared options and challengers is
    ``update``d whatever its shards (io/update.py compares them); anything else is refused as
    without it.
    """
    if committed is None or overwrite:
        return Decision("replace", committed)
    if committed.job != wanted.job or committed.ds != wanted.ds:
        return Decision("conflict", committed, ContractError(
            f"{shown} holds the partition of job {committed.job!r}, ds {committed.ds!r}, not of job "
            f"{wanted.job!r}, ds {wanted.ds!r}: give each job and date its own output.path (e.g. "
            f"out/dt={{ds}})", path=shown, remedies=[Remedy(Action.OVERWRITE, "to replace it")]))
    held = {s.path for s in committed.shards}
    listed = set(wanted.shards)
    if not update and held != listed and held != wanted.shards_as_then:
        added, gone = len(listed - held), len(held - listed)
        return Decision("conflict", committed, ContractError(
            f"{shown} was committed from other shards than input.path lists now ({added} new, "
            f"{gone} no longer listed; e.g. {sorted(listed ^ held)[0]})", path=shown, remedies=[
                Remedy(Action.UPDATE, "to score only the new and changed shards"),
                Remedy(Action.OVERWRITE, "to score the partition as it is now")]))
    if committed.triple != wanted.triple:
        return Decision("conflict", committed, triple_conflict(shown, committed.triple, wanted.triple))
    if with_implied(committed.model_options, committed.backend) != with_implied(
            wanted.model_options, committed.backend):
        return Decision("conflict", committed, ContractError(
            f"{shown} was committed with model.options {committed.model_options or '{}'}, which "
            f"change predictions; this run has {wanted.model_options}", path=shown,
            field="model.options", remedies=[Remedy(Action.OVERWRITE, "to replace it")]))
    missing = not_committed(committed, wanted.challengers)
    if missing:
        # The job asks for challenger predictions the partition does not have: a silent no-op
        # would leave the user without them. Challengers it has and this run does not ask for
        # (an analyst's one-off comparison) are no reason to refuse: the champion's are here.
        names = ", ".join(c.name for c in committed.challengers) or "none"
        return Decision("conflict", committed, ContractError(
            f"{shown} was committed without challenger {', '.join(missing)} as this run declares "
            f"it (committed: {names}; a challenger counts only with the same name, triple and "
            f"declared options)", path=shown, field="challengers", remedies=[
                Remedy(Action.OVERWRITE, "to score the partition with this run's challengers")]))
    return Decision("update" if update else "reuse", committed)


def not_committed(manifest: Manifest, challengers: tuple[ChallengerRun, ...]) -> list[str]:
    """The names of ``challengers`` that ``manifest`` does not hold as they are declared now
    (same name, triple and declared options); the manifest may hold others besides."""
    held = {c.name: c for c in manifest.challengers}
    return [name for name, triple, options in challengers
            if name not in held or dict(held[name].triple) != triple
            or with_implied(held[name].model_options, held[name].backend)
            != with_implied(options, held[name].backend)]


def with_implied(options: Mapping[str, str], backend: str) -> dict[str, str]:
    """``options`` with the backend's implied values where they say nothing: a partition
    committed before a backend declared an option (onnxruntime's ``precision``, recorded since
    as ``fp32``) ran with the value now implied, and is the same partition."""
    implied = backends.implied_options(backend) if backend in backends.names() else {}
    return {**implied, **options}


def triple_conflict(shown: str, committed: dict, wanted: dict) -> ContractError:
    """The error of a partition committed under another triple than ``wanted``."""
    diffs = [f"{k} committed {committed.get(k)} now {wanted[k]}" for k in wanted
             if committed.get(k) != wanted[k]]
    return ContractError(f"{shown} is committed under another triple ({'; '.join(diffs)})",
                         path=shown, field="triple",
                         remedies=[Remedy(Action.OVERWRITE, "to replace it")])


class PartitionCommit:
    """An output partition (``output.path``, stored as ``sink`` says) and its commit protocol."""

    def __init__(self, url: str, sink: Sink = FILES):
        self.url = url
        self.sink = sink

    def _fs_root(self) -> "tuple[AbstractFileSystem, str]":
        return url_to_fs(self.url)

    def is_file(self) -> bool:
        fs, root = self._fs_root()
        return bool(fs.isfile(root))

    def committed(self) -> Manifest | None:
        """The manifest committed at this partition now, or None. For tables, a partition whose
        tables hold a commit that its manifest does not name yet (the run died between the two)
        is finished first, from that run's pending manifest (:meth:`repair`)."""
        if self.sink.is_table:
            self.repair()
        layout = self.layout("")
        return read_manifest(layout.fs, layout.records)

    def repair(self) -> None:
        """Tables: finish the commit of a run that committed the predictions table but died
        before its manifest (or before the other tables): its other tables committed as the
        same generation, and its pending manifest, with the tables' versions, put in place.
        Nothing to do when the manifest names the tables' generation."""
        layout = self.layout("")
        tables = self.sink.tables(self.url)
        if tables is None:
            return
        generation, attempt = tables.generation()
        if not generation or attempt is None:
            return
        current = read_manifest(layout.fs, layout.records)
        if current is not None and current.table is not None and current.table.generation >= generation:
            return
        pending = _pending(self.layout(attempt))
        if pending is None:   # its scratch is gone: nothing to finish from
            return
        finishing = Attempt(self, attempt)
        try:
            committed = finishing.publish(pending, generation)
        except LostRace:   # the run itself (or another repair) is finishing it right now
            return
        finishing._clean(committed)   # its scratch goes: it is a committed attempt now

    def decide(self, wanted: Identity, *, overwrite: bool, shown: str,
               update: bool = False) -> Decision:
        """What a run of ``wanted`` does with the partition as it is now (:func:`decide`).

        Raises:
            SpecError: ``output.path`` is a file.
        """
        if self.is_file():
            raise SpecError(f"output.path {shown} is a file; it must be a folder (or not exist)")
        return decide(self.committed(), wanted, overwrite=overwrite, shown=shown, update=update)

    def tidy(self, manifest: Manifest) -> None:
        """Remove what a run that crashed after committing ``manifest`` left behind."""
        clean_after_commit(self.layout(manifest.attempt), manifest)

    def layout(self, attempt: str) -> Layout:
        fs, root = self._fs_root()
        return Layout(fs, root, attempt, self.sink.partition)

    def begin(self, attempt: str, *, replacing: Manifest | None = None,
              clock: Clock = utc_now) -> "Attempt":
        """Start an attempt. Nothing is written until the attempt's writers write.

        Args:
            attempt: the attempt id (``<UTC time>-<8 hex>``).
            replacing: the manifest an ``--overwrite`` run sets out to replace (None: the
                partition must not be committed by anyone else when this attempt commits).
            clock: the run's clock, which the commit step stamps the manifest's end with.
        """
        return Attempt(self, attempt, replacing, clock)


@dataclass(frozen=True)
class Attempt:
    """One run's attempt at a partition: its files under ``layout``, then one commit."""

    partition: PartitionCommit
    attempt: str
    replacing: Manifest | None = None
    clock: Clock = field(default=utc_now, compare=False)

    @property
    def layout(self) -> Layout:
        return self.partition.layout(self.attempt)

    def start(self, key: AttemptKey) -> None:
        """Leave the attempt's key in its scratch, before any shard is scored: what a later run
        must be to adopt the shards this attempt finishes, should it crash (io/resume.py)."""
        layout = self.layout
        write_json(layout.fs, join(layout.scratch(), KEY), key.to_dict())

    def results(self, shard_count: int, adopted: Mapping[int, ShardResult] | None = None,
                challengers: Sequence[str] = ()) -> list[ShardResult]:
        """Every shard's result, by shard index: those in ``adopted`` (finished by an earlier
        attempt, io/resume.py) as they are, the others from this attempt's scratch, each joined
        with the part of every challenger named in ``challengers`` (``ShardResult.joined``).

        Raises:
            RuntimeFailure: a shard (or a challenger's part of it) has no result: the pipeline
                ended without finishing it, or another run's cleanup removed this attempt's
                scratch.
        """
        return list(self.each_result(shard_count, adopted, challengers))

    def fold(self, shard_count: int, adopted: Mapping[int, ShardResult] | None = None,
             challengers: Sequence[str] = (), profiles: ProfileFold | None = None) -> ResultsFold:
        """Every shard's result (as :meth:`results` has them) folded as it is read
        (:class:`~batchinfer.io.records.ResultsFold`: the manifest's entries and the sums; no
        more than one result in memory at a time). ``profiles``: how their column statistics
        are folded (the commit step merges them; the io layer does not interpret them).

        Raises:
            RuntimeFailure: as :meth:`results`.
        """
        folding = ResultsFold(profiles)
        for result in self.each_result(shard_count, adopted, challengers):
            folding.add(result)
        return folding

    def each_result(self, shard_count: int, adopted: Mapping[int, ShardResult] | None = None,
                    challengers: Sequence[str] = ()) -> Iterator[ShardResult]:
        """:meth:`results`, one at a time (each read when asked for).

        Raises:
            RuntimeFailure: as :meth:`results`, when the iteration reaches the shard.
        """
        layout = self.layout
        for index in range(shard_count):
            if adopted and index in adopted:
                yield adopted[index]
                continue
            path = layout.shard_result(index)
            try:
                result = _read_scratch(layout, path, ShardResult)
                if result.scored_rows and challengers:
                    parts = {}
                    for name in challengers:
                        path = layout.challenger_result(name, index)
                        parts[name] = _read_scratch(layout, path, ChallengerShard)
                    result = result.joined(parts)
            except FileNotFoundError:
                raise RuntimeFailure(f"shard {index} has no result ({path}): the pipeline ended "
                                     f"without finishing it (or another run removed this "
                                     f"attempt's files)") from None
            yield result

    def missing(self, paths: "set[str]") -> list[str]:
        """Which of ``paths`` (relative data files) are not on the store now, by one listing
        per folder: the files of shards this attempt adopted, checked before it commits (another
        attempt's cleanup, or a failing attempt's abort, may have removed them since)."""
        layout = self.layout
        present: set[str] = set()
        for folder in sorted({p.rsplit("/", 1)[0] for p in paths}):
            try:
                found = layout.fs.find(join(layout.root, folder))
            except FileNotFoundError:
                found = []
            except OSError as exc:
                raise StorageError(f"cannot list {join(layout.root, folder)}: {exc}") from None
            present |= {f[len(layout.root):].lstrip("/") for f in found}
        return sorted(paths - present)

    def committed_meanwhile(self) -> Manifest | None:
        """A manifest that another run committed since this attempt began, if any (its cleanup
        removes this attempt's files, which is how a losing pipeline usually learns it lost)."""
        try:
            current = self.partition.committed()
        except Exception:  # nothing to learn from a store that cannot be read now
            return None
        if current is None or (self.replacing is not None and current.attempt == self.replacing.attempt):
            return None
        return current

    def commit(self, manifest: Manifest) -> CommitOutcome:
        """Create the manifest; on success remove the replaced attempt and every leftover.

        Safe to call again for the same attempt (a runner retries a commit step whose worker
        died): a manifest that is already this attempt's is this attempt's commit."""
        faults.point("before_commit")
        if self.partition.sink.is_table:
            return self._commit_tables(manifest)
        layout = self.layout
        # Replace only the manifest this run set out to replace: if another --overwrite run
        # committed meanwhile (and its cleanup removed this attempt's files), this run lost.
        replacing = self.replacing
        current = self.partition.committed() if replacing is not None else None
        replace = current is not None and replacing is not None and current.attempt == replacing.attempt
        if not create_manifest(layout, manifest, replace=replace,
                               expected=replacing.attempt if replace and replacing else None):
            winner = self.partition.committed()
            if winner is not None and winner.attempt == self.attempt:
                # An earlier try of this commit created it: finish its cleanup, never abort it.
                self._clean(winner)
                return CommitOutcome("committed", winner)
            self.abort()
            same = winner is not None and winner.triple == manifest.triple
            return CommitOutcome("lost_race" if same else "conflict", winner)
        faults.point("after_commit")
        self._clean(manifest)
        return CommitOutcome("committed", manifest)

    def _commit_tables(self, manifest: Manifest) -> CommitOutcome:
        """The commit to tables (io/sinks.py): the pending manifest, then the predictions table
        as the arbiter (this attempt's generation is the replaced manifest's + 1), the other
        tables, then ``_manifest.json``."""
        replacing = self.replacing
        expected = replacing.table.generation if replacing is not None and replacing.table else 0
        tables = self.partition.sink.tables(self.partition.url)
        assert tables is not None
        held, by = tables.generation()
        if held > expected and by != self.attempt:
            if not self._orphan(held, by):
                return self._lost(manifest)
            # An orphan: a commit to the tables whose run left nothing to finish it from (its
            # scratch gone or damaged, no manifest naming it). This attempt replaces it, as the
            # next generation.
            expected = held
        layout = self.layout
        write_json(layout.fs, layout.sink, self.partition.sink.to_dict())
        write_json(layout.fs, layout.pending, manifest.to_dict())
        try:
            committed = self.publish(manifest, expected + 1)
        except LostRace:
            return self._lost(manifest)
        self._clean(committed)
        return CommitOutcome("committed", committed)

    def _orphan(self, held: int, by: str | None) -> bool:
        """Whether generation ``held`` of the tables, committed by attempt ``by`` since this
        attempt began, is an orphan that nothing will finish — rather than a commit this attempt
        lost to. Lost to: a commit whose manifest names it (it finished, and its cleanup
        removed its scratch: a finished winner leaves no pending manifest), or one whose pending
        manifest is in its scratch (its run, or the next run or reader, finishes it)."""
        layout = self.layout
        try:
            current = read_manifest(layout.fs, layout.records)
        except Exception:   # a damaged manifest names nothing; the pending one may still
            current = None
        if current is not None and current.table is not None and current.table.generation >= held:
            return False
        return by is None or _pending(self.partition.layout(by)) is None

    def publish(self, manifest: Manifest, generation: int) -> Manifest:
        """Commit ``manifest``'s files to each table as ``generation`` (predictions first: a
        table that holds the generation already is not written again), then put the manifest,
        naming the tables' versions, in place. What a run that died midway is finished with.

        Raises:
            LostRace: another attempt committed the generation to the predictions table first.
        """
        layout = self.layout
        tables = self.partition.sink.tables(self.partition.url)
        assert tables is not None
        summary = {f"batchinfer.{part}": value for part, value in sorted(manifest.triple.items())}
        summary["batchinfer.job"] = manifest.job
        versions = []
        for kind, files in kinds(manifest, layout) + self._emptied(manifest, layout):
            version = tables.commit(layout, kind, files, generation=generation,
                                    attempt=self.attempt, summary=summary)
            if kind == PREDICTIONS:
                faults.point("after_table_commit")
            if version is not None:
                versions.append(TableVersion(kind=kind, table=tables.describe(kind), version=version))
        committed = dataclasses.replace(manifest, table=TableCommit(
            format=self.partition.sink.format,
            partition={self.partition.sink.column: self.partition.sink.value},
            generation=generation, tables=tuple(versions)))
        # The tables decided: the manifest follows them, whatever was there.
        create_manifest(layout, committed, replace=True)
        faults.point("after_commit")
        return committed

    def _emptied(self, manifest: Manifest, layout: Layout) -> list[tuple[str, list[FileRecord]]]:
        """The kinds whose tables the partition's previous commit wrote and ``manifest`` does
        not (a challenger the job no longer has), each with no files: the commit replaces the
        partition there too, so no table serves rows that the committed manifest does not
        list. The previous commit is the manifest in place now (an ``--overwrite`` or
        ``--update`` replaces it; a repair finishes over it), and the one this attempt set out
        to replace."""
        try:
            current = read_manifest(layout.fs, layout.records)
        except Exception:   # a damaged manifest: the replaced one still names its tables
            current = None
        ours = {kind for kind, _ in kinds(manifest, layout)}
        before: list[str] = []
        for previous in (current, self.replacing):
            if previous is None:
                continue
            held = [t.kind for t in previous.table.tables] if previous.table else []
            held += [f"{CHALLENGERS}/{c.name}" for c in previous.challengers]
            before += [kind for kind in held if kind not in ours and kind not in before]
        return [(kind, []) for kind in before]

    def _lost(self, manifest: Manifest) -> CommitOutcome:
        """Another attempt committed the tables first: this attempt's files go (never a file of
        a table's version: they were never added), and the winner's manifest is the outcome."""
        self.abort()
        try:
            winner = self.partition.committed()
        except Exception:  # the winner's manifest is its own business
            winner = None
        same = winner is not None and winner.triple == manifest.triple
        return CommitOutcome("lost_race" if same or winner is None else "conflict", winner)

    def _clean(self, manifest: Manifest) -> None:
        layout = self.layout
        if self.partition.sink.is_table:
            # A replaced attempt's files stay: the tables' earlier versions hold them (time
            # travel) until the table's own VACUUM or expire_snapshots removes them.
            clean_after_commit(layout, manifest)
            return
        if (self.replacing is not None and self.replacing.attempt != manifest.attempt
                and not holds(manifest, self.replacing.attempt)):
            remove_attempt(layout, self.replacing.attempt)
        clean_after_commit(layout, manifest)

    def record(self, outcome: CommitOutcome) -> None:
        """Leave ``outcome`` in this attempt's scratch for the launching process to read (the
        commit step may run on another machine; scratch is never part of a partition, and the
        next commit or no-op rerun removes what a dead launcher never read)."""
        layout = self.layout
        write_json(layout.fs, layout.outcome, outcome.to_dict())

    def outcome(self, triple: dict[str, str]) -> CommitOutcome:
        """What this attempt's commit step did, once the pipeline has finished.

        Its record when there is one; otherwise the manifest tells (a winner's cleanup removes
        a loser's record with the rest of the scratch): this attempt's manifest, or another
        run's (``lost_race`` with ``triple``, else ``conflict``).

        Raises:
            RuntimeFailure: neither a record nor a manifest of a commit since this attempt began.
        """
        layout = self.layout
        try:
            return _read_scratch(layout, layout.outcome, CommitOutcome)
        except FileNotFoundError:
            pass
        current = self.partition.committed()
        if current is not None and current.attempt == self.attempt:
            return CommitOutcome("committed", current)
        winner = self.committed_meanwhile()
        if winner is not None:
            return CommitOutcome("lost_race" if winner.triple == triple else "conflict", winner)
        raise RuntimeFailure("the pipeline finished but its commit step left no outcome and no "
                             "manifest: the runner did not run the commit step; nothing committed")

    def stop(self) -> int:
        """A run that ends without committing — it failed (exit 4 or 5), was refused, or was
        stopped (Ctrl-C) — keeps the shards it finished, their files and results in scratch,
        for the next run of the partition to adopt (io/resume.py); the next commit's cleanup
        removes whatever it does not adopt (contract §4). Returns how many it kept: an attempt
        that finished none is removed now (:meth:`abort`): it is only debris."""
        layout = self.layout
        try:
            kept = len(layout.fs.find(join(layout.scratch(), "shards")))
        except OSError:
            kept = 0
        if not kept:
            self.abort()
        return kept

    def abort(self) -> None:
        """Remove this attempt's files (best effort: debris is never part of a partition) —
        except those a committed manifest lists: another run may have adopted shards this
        attempt finished (io/resume.py) and committed them while this one was still going."""
        if self.partition.sink.is_table and self._in_tables():
            return   # its files are a table's now: the next run finishes the commit (repair)
        try:
            current = self.partition.committed()
        except Exception:  # an unreadable manifest lists nothing this attempt can know of
            current = None
        if current is not None and holds(current, self.attempt):
            remove_unlisted(self.layout, current, self.attempt)
        else:
            remove_attempt(self.layout, self.attempt)

    def _in_tables(self) -> bool:
        """Whether this attempt committed the predictions table (best effort: a table that
        cannot be read now is taken to hold it, so its files are kept)."""
        try:
            tables = self.partition.sink.tables(self.partition.url)
            return tables is not None and tables.generation()[1] == self.attempt
        except Exception:
            return True


def finish_for_reader(root_url: str, records: str, fs: AbstractFileSystem) -> None:
    """What a reader of a table partition does first (contract §4 "Exactly once"): finish a
    commit whose run committed the tables but died before its manifest, from the pending
    manifest and sink the run left in its scratch (``records``: the partition's records folder
    on ``fs``; ``root_url``: ``output.path``). Nothing to do without scratch — a finished commit
    leaves none — or when the tables hold no commit that the manifest does not name.

    Raises:
        StorageError: there is such a commit and this reader cannot finish it (the tables or the
            catalog cannot be reached from here, the store is read-only for it): one line that
            says so, and that the job's next run finishes it.
    """
    scratch = join(records, TMP)
    try:
        attempts = sorted(fs.ls(scratch, detail=False)) if fs.exists(scratch) else []
    except OSError:
        return
    for folder in attempts:
        attempt = folder.rstrip("/").rsplit("/", 1)[-1]
        try:
            sink = check(Sink, fs.cat_file(join(folder, "sink.json")), "sink.json", StorageError)
        except (OSError, StorageError):
            continue   # no commit began there (or not one of ours to finish)
        if formats.find(sink.format) is None:
            continue   # a format this batchinfer does not have: not one of ours to finish
        partition = PartitionCommit(root_url, sink)
        try:
            partition.repair()
        except Exception as exc:
            raise StorageError(
                f"{records}: attempt {attempt} may have committed the tables of {sink.partition} "
                f"without its manifest, and this reader cannot finish that commit "
                f"({type(exc).__name__}: {exc}): run the job for {sink.value} again to finish it "
                f"(nothing is scored again)") from None
        return   # every attempt's sink names the same tables; one repair finishes the partition


def kinds(manifest: Manifest, layout: Layout) -> list[tuple[str, list[FileRecord]]]:
    """The manifest's files by kind, predictions first (the arbiter's table), then quarantine
    and each challenger."""
    quarantine = layout.folder(QUARANTINE) + "/"
    champion = [f for s in manifest.shards for f in s.files]
    out = [(PREDICTIONS, [f for f in champion if not f.path.startswith(quarantine)]),
           (QUARANTINE, [f for f in champion if f.path.startswith(quarantine)])]
    for challenger in manifest.challengers:
        out.append((f"{CHALLENGERS}/{challenger.name}",
                    [f for s in challenger.shards for f in s.files]))
    return out


def _pending(layout: Layout) -> Manifest | None:
    """The manifest an attempt left in its scratch before committing to tables, or None (none
    there, or damaged: then nothing can finish that commit, and the next run replaces it)."""
    path = layout.pending
    try:
        return check(Manifest, layout.fs.cat_file(path), path, StorageError, "damaged")
    except (OSError, StorageError):
        return None


S = TypeVar("S", ShardResult, ChallengerShard, CommitOutcome)


def _read_scratch(layout: Layout, path: str, record: type[S]) -> S:
    """A record this run left in scratch, checked (io/readback.py: bad bytes there are the
    store's fault, exit 5).

    Raises:
        FileNotFoundError: there is none.
        StorageError: it cannot be read, or is malformed.
    """
    try:
        data = layout.fs.cat_file(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from None
    return check(record, data, path, StorageError,
                 "the run's scratch record is damaged: run the job again (a new attempt)")
