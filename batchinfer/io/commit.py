"""The commit protocol of one output partition (SPEC §4, §5.2–5.3), with the life cycle of a sink.

    partition = PartitionCommit(url)
    partition.committed()                       # what is committed there now, or None
    attempt = partition.begin(attempt_id, replacing=manifest_or_None)
    ...                                         # writers put files under attempt.layout and
                                                # each finished shard's result in scratch
    results = attempt.results(shard_count)      # the per-shard results, in shard order
    outcome = attempt.commit(manifest)          # committed | lost_race | conflict
    attempt.abort()                             # on any failure: this attempt's files go

Exactly one run creates ``_manifest.json`` (see :mod:`batchinfer.io.manifest`); a run that
loses removes its own files, and the winner removes every other attempt and the scratch after
committing. Both objects hold only a URL and ids, so they pickle: whichever process runs the
commit — the launcher, or a worker of a distributed runner — drives the same protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsspec import AbstractFileSystem

from .. import faults
from ..errors import RuntimeFailure
from .manifest import clean_after_commit, create_manifest, read_manifest, remove_attempt
from .outputs import Layout, read_json
from .records import Manifest, ShardResult
from .storage import url_to_fs


@dataclass(frozen=True)
class CommitOutcome:
    """What :meth:`Attempt.commit` did.

    Attributes:
        status: ``committed`` (this attempt's manifest is the partition), ``lost_race`` (another
            run committed the same triple first; this attempt's files are gone), ``conflict``
            (another run committed another triple first; this attempt's files are gone).
        manifest: the manifest now committed (this attempt's, or the winner's).
    """

    status: Literal["committed", "lost_race", "conflict"]
    manifest: Manifest | None


class PartitionCommit:
    """An output partition (``output.path``) and its commit protocol."""

    def __init__(self, url: str):
        self.url = url

    def _fs_root(self) -> "tuple[AbstractFileSystem, str]":
        return url_to_fs(self.url)

    def is_file(self) -> bool:
        fs, root = self._fs_root()
        return bool(fs.isfile(root))

    def committed(self) -> Manifest | None:
        """The manifest committed at this partition now, or None."""
        fs, root = self._fs_root()
        return read_manifest(fs, root)

    def tidy(self, manifest: Manifest) -> None:
        """Remove what a run that crashed after committing ``manifest`` left behind."""
        clean_after_commit(self.layout(manifest.attempt), manifest)

    def layout(self, attempt: str) -> Layout:
        fs, root = self._fs_root()
        return Layout(fs, root, attempt)

    def begin(self, attempt: str, *, replacing: Manifest | None = None) -> "Attempt":
        """Start an attempt. Nothing is written until the attempt's writers write.

        Args:
            attempt: the attempt id (``<UTC time>-<8 hex>``).
            replacing: the manifest an ``--overwrite`` run sets out to replace (None: the
                partition must not be committed by anyone else when this attempt commits).
        """
        return Attempt(self, attempt, replacing)


@dataclass(frozen=True)
class Attempt:
    """One run's attempt at a partition: its files under ``layout``, then one commit."""

    partition: PartitionCommit
    attempt: str
    replacing: Manifest | None = None

    @property
    def layout(self) -> Layout:
        return self.partition.layout(self.attempt)

    def results(self, shard_count: int) -> list[ShardResult]:
        """Every shard's result from scratch, by shard index.

        Raises:
            RuntimeFailure: a shard has no result (the pipeline ended without finishing it, or
                another run's cleanup removed this attempt's scratch).
        """
        layout = self.layout
        results = []
        for index in range(shard_count):
            try:
                results.append(ShardResult.from_dict(read_json(layout.fs, layout.shard_result(index))))
            except FileNotFoundError:
                raise RuntimeFailure(f"shard {index} has no result: the pipeline ended without "
                                     f"finishing it (or another run removed this attempt's "
                                     f"files)") from None
        return results

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
        """Create the manifest; on success remove the replaced attempt and every leftover."""
        faults.point("before_commit")
        layout = self.layout
        # Replace only the manifest this run set out to replace: if another --overwrite run
        # committed meanwhile (and its cleanup removed this attempt's files), this run lost.
        replacing = self.replacing
        current = self.partition.committed() if replacing is not None else None
        replace = current is not None and replacing is not None and current.attempt == replacing.attempt
        if not create_manifest(layout, manifest, replace=replace):
            winner = self.partition.committed()
            self.abort()
            same = winner is not None and winner.triple == manifest.triple
            return CommitOutcome("lost_race" if same else "conflict", winner)
        faults.point("after_commit")
        if self.replacing is not None:
            remove_attempt(layout, self.replacing.attempt)
        clean_after_commit(layout, manifest)
        return CommitOutcome("committed", manifest)

    def abort(self) -> None:
        """Remove this attempt's files (best effort: debris is never part of a partition)."""
        remove_attempt(self.layout, self.attempt)
