"""The manifest: the one commit point of a partition (contract §4, §5.2).

``_manifest.json`` is created exclusively and written last. On a local file system the bytes
are written to scratch first and hard-linked into place (``link`` fails if the name exists, and
the manifest appears whole or not at all); on object stores a conditional put
(``pipe_file(mode="create")``) does the same. Whoever creates it has committed; everyone else
sees it exists.
"""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from typing import Iterator

from fsspec import AbstractFileSystem

from .. import faults
from ..errors import Action, ContractError, Remedy, StorageError
from .outputs import (
    ATTEMPT,
    CHALLENGERS,
    MANIFEST,
    PREDICTIONS,
    QUARANTINE,
    TABLE_FOLDERS,
    Layout,
    challenger_folder,
    write_file,
)
from .readback import check
from .records import Manifest
from .storage import is_local, join


def read_manifest(fs: AbstractFileSystem, root: str) -> Manifest | None:
    """The committed manifest under ``root`` (a partition's records: ``Layout.records``), or
    None if the partition is not committed.

    Raises:
        ContractError: the manifest is malformed (io/readback.py: exit 3, like a partition of
            another triple: ``--overwrite`` scores it again).
        StorageError: it cannot be read.
    """
    path = join(root, MANIFEST)
    try:
        data = fs.cat_file(path)
    except (FileNotFoundError, NotADirectoryError):  # root is absent, or a file: not committed
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from None
    return check(Manifest, data, path, ContractError,
                 "not a manifest batchinfer wrote (edited or damaged)",
                 remedies=[Remedy(Action.OVERWRITE, "to score the partition again")])


def manifest_bytes(manifest: Manifest) -> bytes:
    return (json.dumps(manifest.to_dict(), indent=2) + "\n").encode()


def create_manifest(layout: Layout, manifest: Manifest, *, replace: bool = False,
                    expected: str | None = None) -> bool:
    """Create the manifest. Return False if another run committed first (and not ``replace``).

    ``replace`` with ``expected`` (the attempt of the manifest being replaced): on a local disk
    the manifest is replaced only if it is still that attempt's, checked and replaced under an
    exclusive lock of the partition's folder, so of two runs replacing one manifest at once
    (``--update``, ``--overwrite``) exactly one does; the other returns False (it lost).
    """
    fs, data = layout.fs, manifest_bytes(manifest)
    final = layout.manifest
    try:
        if is_local(fs):
            scratch = join(layout.scratch(), MANIFEST)
            write_file(fs, scratch, data)
            faults.point("during_commit")
            if replace:
                with _locked(layout.records):
                    if expected is not None and _attempt_now(fs, layout.records) != expected:
                        os.unlink(scratch)
                        return False
                    os.replace(scratch, final)
            else:
                try:
                    os.link(scratch, final)
                except FileExistsError:
                    return False
                finally:
                    # A committed manifest must not share its inode with a scratch path that a
                    # retried commit would rewrite in place.
                    os.unlink(scratch)
        elif replace:
            fs.pipe_file(final, data)
        else:
            try:
                fs.pipe_file(final, data, mode="create")
            except FileExistsError:
                return False
    except OSError as exc:
        raise StorageError(f"cannot write {final}: {exc}") from None
    return True


@contextmanager
def _locked(root: str) -> Iterator[None]:
    """An exclusive lock of the partition's folder for the block (flock: the kernel releases it
    when the process dies, so a killed run never leaves it held)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _attempt_now(fs: AbstractFileSystem, root: str) -> str | None:
    """The attempt of the manifest committed under ``root`` now (None: none, or unreadable)."""
    try:
        current = read_manifest(fs, root)
    except (ContractError, StorageError):
        return None
    return current.attempt if current is not None else None


def data_folders(layout: Layout) -> list[str]:
    """The folders (relative) whose sub-folders are attempts: predictions', quarantine's and
    each challenger's there is now (whichever run wrote it: a crashed run's challenger may no
    longer be in the job); ``layout.folder`` says where a kind's are."""
    folders = [layout.folder(PREDICTIONS), layout.folder(QUARANTINE)]
    base = join(layout.root, TABLE_FOLDERS[CHALLENGERS] if layout.partition else CHALLENGERS)
    try:
        entries = layout.fs.ls(base, detail=True) if layout.fs.exists(base) else []
    except OSError:
        entries = []
    for entry in sorted(entries, key=lambda e: e["name"]):
        if entry.get("type") == "directory":
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            folders.append(layout.folder(challenger_folder(name)))
    return folders


def remove_attempt(layout: Layout, attempt: str) -> None:
    """Delete an attempt's data files and scratch (best effort: debris is never part of a
    partition, and the next run cleans what this one could not)."""
    fs = layout.fs
    for kind in data_folders(layout):
        _remove_tree(fs, join(layout.root, kind, attempt))
    _remove_tree(fs, layout.scratch(attempt))
    _remove_empty_challengers(layout)
    _remove_if_empty(fs, layout.scratch(""))


def remove_unlisted(layout: Layout, manifest: Manifest, attempt: str) -> None:
    """Delete ``attempt``'s files that ``manifest`` does not list, and its scratch: what an
    attempt that lost to a run that adopted some of its shards removes (the rest is the
    partition now)."""
    fs, listed = layout.fs, manifest.files()
    for kind in data_folders(layout):
        _remove_files_not_listed(layout, join(layout.root, kind, attempt), listed)
        _remove_if_empty(fs, join(layout.root, kind, attempt))
    _remove_tree(fs, layout.scratch(attempt))
    _remove_empty_challengers(layout)
    _remove_if_empty(fs, layout.scratch(""))



def _remove_tree(fs: AbstractFileSystem, path: str) -> None:
    """Delete ``path`` and all under it, if it is there (best effort, as all cleanup here)."""
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except OSError:
        pass

def _remove_if_empty(fs: AbstractFileSystem, path: str) -> None:
    """Remove a folder that holds nothing (on object stores folders are not kept anyway). The
    last run out leaves no empty `_tmp/`; a run still writing there keeps it (not empty)."""
    if not is_local(fs):
        return
    try:
        os.rmdir(path)
    except OSError:  # absent, or not empty: another run is using it
        pass


def _remove_empty_challengers(layout: Layout) -> None:
    """challengers/<name>/ folders left empty (their attempts removed), then challengers/ (a
    table's folder is never empty: it holds the table's log)."""
    if layout.partition:
        return
    for kind in data_folders(layout)[2:]:
        _remove_if_empty(layout.fs, join(layout.root, kind))
    _remove_if_empty(layout.fs, join(layout.root, CHALLENGERS))


def holds(manifest: Manifest, attempt: str) -> bool:
    """Whether ``manifest`` lists a file under ``attempt``'s folders (a shard it adopted)."""
    return any(_attempt_of(path) == attempt for path in manifest.files())



def _remove_files_not_listed(layout: Layout, base: str, listed: set[str]) -> None:
    """Delete the files under ``base`` (an attempt's folder) whose path relative to the partition
    is not in ``listed``; a file that cannot be removed is left (the next cleanup tries again)."""
    fs = layout.fs
    try:
        present = fs.find(base) if fs.exists(base) else []
    except OSError:
        return
    for path in present:
        if path[len(layout.root):].lstrip("/") not in listed:
            try:
                fs.rm(path)
            except OSError:
                pass

def _attempt_of(relative: str) -> str:
    """The attempt folder of a data file's relative path (``<kind>/<attempt>/part-….parquet``)."""
    return relative.rsplit("/", 2)[-2]


def clean_after_commit(layout: Layout, manifest: Manifest) -> None:
    """Remove every attempt but those holding the committed files (the committed one, and the
    earlier ones whose shards it adopted), scratch, and every file the manifest does not list.

    Tables: an attempt that committed once stays whole, since the tables' earlier versions hold
    its files (until the table's own VACUUM or expire_snapshots); only attempts that never
    committed (those that still have scratch: a commit removes its own) are removed, and the
    unlisted files of those adopted."""
    fs = layout.fs
    listed = manifest.files()
    keep = {manifest.attempt} | {_attempt_of(path) for path in listed}
    folders = data_folders(layout)
    uncommitted = _scratch_attempts(layout) if layout.partition else None
    for kind in (*folders, ""):
        base = join(layout.root, kind) if kind else layout.scratch("")
        try:
            entries = fs.ls(base, detail=False) if fs.exists(base) else []
        except OSError:
            continue
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            # _tmp/ is ours alone (contract §4); in predictions/, quarantine/ and challengers/<name>/
            # only attempts are.
            doomed = ATTEMPT.fullmatch(name) and name not in keep and (
                uncommitted is None or name in uncommitted)
            if not kind or doomed:
                try:
                    fs.rm(entry, recursive=True)
                except OSError:
                    pass
    for kind in folders:
        for attempt in sorted(keep if uncommitted is None else keep & uncommitted):
            _remove_files_not_listed(layout, join(layout.root, kind, attempt), listed)
    _remove_empty_attempts(layout, folders, keep - {manifest.attempt})
    _remove_empty_challengers(layout)
    _remove_if_empty(fs, layout.scratch(""))


def _scratch_attempts(layout: Layout) -> set[str]:
    """The attempts that have scratch now: they never committed (a commit removes all scratch)."""
    try:
        base = layout.scratch("")
        entries = layout.fs.ls(base, detail=False) if layout.fs.exists(base) else []
    except OSError:
        return set()
    return {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}


def _remove_empty_attempts(layout: Layout, folders: list[str], attempts: set[str]) -> None:
    """An attempt folder emptied by the cleanup (a crashed attempt none of whose files are in a
    kind, e.g. its quarantine) goes too."""
    for kind in folders:
        for attempt in attempts:
            _remove_if_empty(layout.fs, join(layout.root, kind, attempt))
