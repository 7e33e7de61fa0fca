"""The local, content-addressed model cache: a model in a store (any fsspec URL) fetched once per
digest and machine, and verified before anything loads it.

Layout, under the root (``$BATCHINFER_MODEL_CACHE``, else ``~/.cache/batchinfer/models``)::

    <sha256>/<model file name>          the model, named as in the store
    <sha256>/<external-data location>   an ONNX model's external data, as its entries name them
    <sha256>.lock                       held while one process fetches that digest
    sources/<sha256 of the URL>.json    the digest a URL held, and what the store said of it
    .tmp-<random>/                      a fetch under way

``<sha256>`` is the model digest (contract §1: the file's bytes, then the external-data files'
in name order), so an entry's name says what it holds. A fetch downloads into a ``.tmp-`` folder
of the root (the same file system, so the rename is atomic), hashes what it downloaded and
renames the folder to its digest: a reader sees a whole, verified entry or none. Processes that
want the same digest take its lock, so one downloads and the others find the entry; when two
place the same digest anyway (without a lock, or on a file system whose locks do not hold), the
first rename wins and the other copy is removed. Every use of an entry hashes it again before
anything loads it (an entry damaged on disk is removed and fetched again); the launcher also
revalidates it against the store's listing of the files (:func:`fetch`'s ``revalidate``), so a
model changed in the store after stamping is refused even where the cache holds the stamped one.

Only the files the digest covers come along: the model file and the external-data files its
ONNX entries name — exactly what is verified, and not the store folder's other files (other
models, their sidecars, engine caches), which would be unverified bytes in a verified folder.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ContractError, ModelFileError, StorageError, one_line
from ..io.storage import url_to_fs
from .contract import model_digest, onnx_external_locations

log = logging.getLogger("batchinfer")

CACHE_ENV = "BATCHINFER_MODEL_CACHE"
_TMP_PREFIX = ".tmp-"


def cache_root() -> Path:
    """Where models are cached on this machine: ``$BATCHINFER_MODEL_CACHE``, else
    ``~/.cache/batchinfer/models``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "batchinfer" / "models"


def entry_file(root: Path, digest: str, url: str) -> Path:
    """The cached model file for ``digest``, named like the file at ``url``."""
    return root / digest / posixpath.basename(url.rstrip("/"))


@dataclass(frozen=True, kw_only=True)
class Fetched:
    """A model in the cache.

    Attributes:
        path: the model file in the cache (its external data beside it).
        digest: its model digest, computed from the bytes in the cache (fetched, or found).
        downloaded: whether this call downloaded it (False: the entry was there).
        seconds: how long the call took, download and hashing included.
    """

    path: Path
    digest: str
    downloaded: bool
    seconds: float


def fetch(url: str, expected: str | None = None, root: Path | None = None, *,
          revalidate: bool = False) -> Fetched:
    """The model at ``url`` in the local cache, downloaded unless the entry for ``expected`` is
    there already (and still hashes to ``expected``).

    What is downloaded is placed under the digest of its bytes, whatever ``expected`` says: the
    caller compares (a mismatch is the contract's, exit 3, or a changed store under a running
    job). With ``expected``, the fetch holds that digest's lock, so concurrent fetches of one
    model make one download.

    Args:
        revalidate: use the entry only if the store's files are still those it was fetched
            from (their sizes and ETags, or mtimes, as the store lists them: one metadata
            request a file), else download again. The launcher revalidates, so a model changed
            in the store after stamping is caught before any work (exit 3) even with a warm
            cache; workers trust the digest the launcher checked.

    Raises:
        ModelFileError: nothing at ``url`` (or a missing external-data file).
        StorageError: the store cannot be read, or the cache cannot be written.
    """
    root = cache_root() if root is None else root
    start = time.monotonic()

    def found() -> Fetched | None:
        if expected is None or not entry_file(root, expected, url).is_file():
            return None
        if revalidate and not _unchanged(root, url, expected):
            return None
        if _digest_or_none(entry_file(root, expected, url)) != expected:   # damaged since placed
            log.warning("model cache: the entry %s does not hash to its name: fetching it again",
                        root / expected)
            _discard(root, root / expected)
            return None
        return Fetched(path=entry_file(root, expected, url), digest=expected, downloaded=False,
                       seconds=time.monotonic() - start)

    hit = found()
    if hit is not None:
        return hit
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the model cache {root} (set ${CACHE_ENV}): "
                           f"{one_line(exc)}") from None
    with _locked(root, expected):
        hit = found()   # fetched meanwhile, by the process that held the lock
        if hit is not None:
            return hit
        digest, size, external = _download(url, root)
        _record(root, url, digest, external)
    log.info("model cache: fetched %s (%d bytes, sha256 %s…) in %.2f s", url, size, digest[:12],
             time.monotonic() - start)
    return Fetched(path=entry_file(root, digest, url), digest=digest, downloaded=True,
                   seconds=time.monotonic() - start)


# What a store says of a file that changes when its bytes do (s3fs: ETag; gcsfs: md5Hash; local
# and most others: mtime), and its size.
_IDENTITY_KEYS = ("size", "ETag", "etag", "md5Hash", "crc32c", "VersionId", "mtime", "created",
                  "LastModified", "last_modified", "updated")


def _identity(url: str, external: list[str]) -> list[list[str]]:
    """What the store lists of the model file and of its external-data files, for
    :func:`fetch`'s revalidation."""
    fs, path = url_to_fs(url)
    files = [path, *(posixpath.join(posixpath.dirname(path), loc) for loc in external)]
    try:
        fs.invalidate_cache()
        infos = [fs.info(f) for f in files]
    except FileNotFoundError:
        raise ModelFileError(f"{url} not found: fix model.uri") from None
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot read the model {url}: {one_line(exc)}") from None
    return [[f"{key}={info[key]}" for key in _IDENTITY_KEYS if key in info] for info in infos]


def _source_record(root: Path, url: str) -> Path:
    return root / "sources" / f"{hashlib.sha256(url.encode()).hexdigest()}.json"


def _unchanged(root: Path, url: str, digest: str) -> bool:
    """Whether ``url`` held ``digest`` when last fetched here and the store still lists its files
    as it did then."""
    try:
        data = json.loads(_source_record(root, url).read_text())
        recorded, external, identity = data["digest"], list(data["external"]), data["identity"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return recorded == digest and _identity(url, external) == identity


def _record(root: Path, url: str, digest: str, external: list[str]) -> None:
    """Remember which digest ``url`` held, its external-data files, and what the store said of
    them all then (listed after the download: a change in between costs a download next time)."""
    path = _source_record(root, url)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps({"url": url, "digest": digest, "external": external,
                               "identity": _identity(url, external)}))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(root: Path, digest: str | None) -> Iterator[None]:
    if digest is None:   # what is wanted is unknown (stamp): rename-wins alone
        yield
        return
    with open(root / f"{digest}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download(url: str, root: Path) -> tuple[str, int, list[str]]:
    """Download the model and its external data into a fresh folder of ``root``, hash it and
    rename it to its digest; the digest, the bytes downloaded and the external-data files."""
    tmp = root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        fs, path = url_to_fs(url)
        name = posixpath.basename(path)
        size = _get(fs, path, tmp / name, url)
        external = onnx_external_locations(tmp / name) if name.lower().endswith(".onnx") else []
        if external:
            folder = posixpath.dirname(path)
            for location in external:
                target = tmp / location
                target.parent.mkdir(parents=True, exist_ok=True)
                size += _get(fs, posixpath.join(folder, location), target,
                             f"{url}: external data file {location!r}")
        digest = model_digest(tmp / name)
        final = root / digest
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():   # not another fetch's verified copy: a real failure
                raise
            if not (final / name).is_file():   # the same bytes, under another file name
                os.replace(tmp / name, final / name)
        return digest, size, external
    except OSError as exc:
        raise StorageError(f"cannot fetch the model {url} into the cache {root}: "
                           f"{one_line(exc)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _digest_or_none(path: Path) -> str | None:
    """The model digest of a cache entry; None when it cannot be hashed (a file of it gone, an
    ONNX model damaged past reading)."""
    try:
        return model_digest(path)
    except (ModelFileError, ContractError, OSError):
        return None


def _discard(root: Path, entry: Path) -> None:
    """Remove an entry at once (renamed away, then deleted): a reader finds it whole or not."""
    gone = root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    with contextlib.suppress(OSError):
        os.rename(entry, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _get(fs, path: str, local: Path, what: str) -> int:
    try:
        fs.get_file(path, str(local))
    except FileNotFoundError:
        raise ModelFileError(f"{what} not found: fix model.uri") from None
    return local.stat().st_size


@dataclass(frozen=True)
class ModelSource:
    """Where a worker gets a model from: a store URL and the digest the launcher checked.

    Pickled with the handler to the workers, which call :meth:`local_path` when they load the
    model (``handlers.base.BatchModelHandler.load_model``).
    """

    url: str
    sha256: str

    def local_path(self) -> str:
        """The model file in this machine's cache, fetched if need be.

        Raises:
            ContractError: the store's bytes are not those the launcher checked (the model
                changed in the store since the run began).
        """
        fetched = fetch(self.url, self.sha256)
        if fetched.digest != self.sha256:
            raise ContractError(
                f"contract mismatch for {self.url}: model_digest declared {self.sha256} found "
                f"{fetched.digest} (the model in the store changed since the run checked it)")
        return str(fetched.path)
