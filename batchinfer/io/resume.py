"""Resume: the shards that earlier, crashed attempts finished, and which a run may adopt
(contract §5.3 "Resume").

An attempt leaves its key (:class:`~batchinfer.io.records.AttemptKey`: job, date, spec hash,
triple, declared options, challengers) in its scratch when it begins, and each finished shard's
result beside it (``_tmp/<attempt>/shards/SSSSS.json``, and each challenger's part,
``_tmp/<attempt>/challengers/<name>/SSSSS.json``), each written the moment the writer has
written the shard's last file — whatever stopped the attempt afterwards: a kill, a lost node, a
failure (exit 4 or 5), Ctrl-C. A run of a partition that is not committed adopts a shard another
attempt finished when:

* that attempt's key is this run's;
* its result is there, and every challenger's part of it;
* the shard, as ``input.path`` lists it now, has the sha256 the result was scored from (it is
  hashed again: a shard rewritten since the crash is scored again, never adopted);
* every file of its result (predictions, quarantine, each challenger's) is on the output store
  with the sha256 the result records (read and hashed again).

Everything it reads is on the output store, so it is the same on every runner. Pure reads:
nothing is written or removed here.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Sequence, TypeVar

from fsspec import AbstractFileSystem

from ..errors import StorageError
from .outputs import ATTEMPT, CHALLENGERS, Layout
from .readback import check
from .records import AttemptKey, ChallengerShard, ShardResult
from .storage import join, url_to_fs

R = TypeVar("R", AttemptKey, ShardResult, ChallengerShard)

KEY = "attempt.json"   # _tmp/<attempt>/attempt.json: the attempt's key
CHUNK = 8 << 20
THREADS = 8            # shards and files hashed at once (object stores: latency-bound)


@dataclass(frozen=True)
class Resume:
    """What a run adopts.

    Attributes:
        adopted: by shard index (as listed now), the result an earlier attempt left, its files
            where that attempt wrote them (``record.scored_by`` names it).
        changed: shards an earlier attempt finished from other bytes than they have now
            (rescored).
        damaged: shards whose finished files are missing or do not match their sha256
            (rescored).
    """

    adopted: dict[int, ShardResult] = field(default_factory=dict)
    changed: tuple[str, ...] = ()
    damaged: tuple[str, ...] = ()

    @property
    def attempts(self) -> list[str]:
        return sorted({r.record.scored_by or "" for r in self.adopted.values()})

    @property
    def rows(self) -> int:
        return sum(r.record.rows_in or 0 for r in self.adopted.values())

    def summary(self, total: int, scoring: int | None = None) -> str:
        """``reusing 3 of 8 shards (6,000 rows) finished by attempt(s) …; scoring 5``
        (``scoring``: how many the run scores, if not the others: an update keeps some)."""
        scoring = total - len(self.adopted) if scoring is None else scoring
        line = (f"reusing {len(self.adopted)} of {total} shards ({self.rows:,} rows) finished by "
                f"crashed attempt(s) {', '.join(self.attempts)}; scoring {scoring}")
        if self.changed:
            line += f" ({len(self.changed)} rewritten since, e.g. {self.changed[0]})"
        if self.damaged:
            line += f" ({len(self.damaged)} with missing or damaged files, e.g. {self.damaged[0]})"
        return line


def find(url: str, key: AttemptKey, shards: Sequence[tuple[str, str]], *,
         exclude: str | None = None, partition: str = "") -> Resume:
    """The shards of ``shards`` ((name, url) by index, as listed now) that an attempt with
    ``key`` finished under ``url`` (``output.path``; ``partition``: a table partition's
    folder, io/outputs.py) and that may be adopted (the module says when); ``exclude``: this
    run's own attempt."""
    layout = Layout.for_url(url, "", partition)
    fs, root = layout.fs, layout.root
    candidates = finished(fs, layout.scratch(""), key, exclude=exclude)
    wanted = {i: candidates[name] for i, (name, _) in enumerate(shards) if name in candidates}
    if not wanted:
        return Resume()
    with ThreadPoolExecutor(THREADS) as pool:
        digests = dict(zip(wanted, pool.map(lambda i: digest_url(shards[i][1]), wanted)))
        adopted: dict[int, ShardResult] = {}
        changed, damaged = [], []
        for index, results in wanted.items():
            same = [r for r in results if digests[index] is not None and r.record.sha256 == digests[index]]
            if not same:
                changed.append(shards[index][0])
                continue
            good = next((r for r in same if all(pool.map(lambda f: _digest(fs, join(root, f[0])) == f[1],
                                                         _files(r)))), None)
            if good is None:
                damaged.append(shards[index][0])
            else:
                adopted[index] = good
    return Resume(adopted, tuple(changed), tuple(damaged))


def finished(fs: AbstractFileSystem, base: str, key: AttemptKey, *,
             exclude: str | None = None) -> dict[str, list[ShardResult]]:
    """By shard name, the results that attempts with ``key`` left in scratch (``base``: the
    folder of every attempt's scratch), newest attempt first, each joined with every
    challenger's part; shards that were unreadable are not among them (they are read again),
    nor those a challenger did not finish. A key, a result or a part that cannot be read or is
    malformed is skipped (debris, never an error)."""
    try:
        entries = sorted((e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(base, detail=False)),
                         reverse=True) if fs.isdir(base) else []
    except OSError:
        return {}
    found: dict[str, list[ShardResult]] = {}
    for attempt in entries:
        if not ATTEMPT.fullmatch(attempt) or attempt == exclude:
            continue
        theirs = _key(fs, join(base, attempt, KEY))
        if theirs is None or not theirs.same(key):
            continue
        try:
            paths = fs.find(join(base, attempt, "shards"))
        except OSError:
            continue
        for path in sorted(paths):
            result = _result(fs, path)
            if result is None or result.record.status == "unreadable":
                continue
            result = _joined(fs, join(base, attempt), path.rsplit("/", 1)[-1], result, key)
            if result is None:
                continue
            if result.record.scored_by is None:
                result = replace(result, record=replace(result.record, scored_by=attempt))
            found.setdefault(result.record.path, []).append(result)
    return found


def _joined(fs: AbstractFileSystem, scratch: str, name: str, result: ShardResult,
            key: AttemptKey) -> ShardResult | None:
    """``result`` with each of ``key``'s challengers' parts (``name``: the result's file name), or
    None if one is missing, malformed or does not account for the champion's rows. (A result
    written before the writers finished shards holds its challengers' parts already.)"""
    wanted = [c for c in key.challengers if c.name not in result.challengers]
    if not wanted or not result.scored_rows:
        return result
    parts = {}
    for challenger in wanted:
        part = _read(fs, join(scratch, CHALLENGERS, challenger.name, name), ChallengerShard)
        if part is None:
            return None
        parts[challenger.name] = part
    try:
        return result.joined(parts)
    except RuntimeError:
        return None


def _key(fs: AbstractFileSystem, path: str) -> AttemptKey | None:
    return _read(fs, path, AttemptKey)


def _result(fs: AbstractFileSystem, path: str) -> ShardResult | None:
    return _read(fs, path, ShardResult)


def _read(fs: AbstractFileSystem, path: str, record: type[R]) -> R | None:
    """The ``record`` in the file at ``path``, checked; None if it cannot be read or is
    malformed (a crashed attempt's scratch may be either: it is then not adopted)."""
    try:
        return check(record, fs.cat_file(path), path, StorageError)
    except (OSError, StorageError):
        return None


def _files(result: ShardResult) -> list[tuple[str, str]]:
    """(relative path, sha256) of every file of a shard's result, challengers' included."""
    return [(f.path, f.sha256) for f in result.record.files] + [
        (f.path, f.sha256) for c in result.challengers.values() for f in c.files]


def digest_url(url: str) -> str | None:
    fs, path = url_to_fs(url)
    return _digest(fs, path)


def _digest(fs: AbstractFileSystem, path: str) -> str | None:
    """The sha256 of a file's bytes, or None if it cannot be read."""
    sha = hashlib.sha256()
    try:
        with fs.open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                sha.update(chunk)
    except (OSError, ValueError):
        return None
    return sha.hexdigest()
