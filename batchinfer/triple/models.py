"""Where a model comes from: a file — local, or in any store fsspec reads (``s3://``, ``gs://``,
``file://``) — with its sidecar declaration beside it, or the MLflow registry
(``models:/name/version``, declaration in the model version's tags, files at the version's
artifact location).

A local file is hashed and loaded where it is. A file in a store is fetched into this machine's
model cache (triple/model_cache.py) and hashed there; workers get its URL and digest
(:class:`~batchinfer.triple.model_cache.ModelSource`) and fetch it into their own cache.
"""
from __future__ import annotations

import contextlib
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from .. import backends
from ..errors import BatchInferError, ModelFileError, SpecError, StorageError, one_line
from ..io.storage import local_path, url_to_fs
from .contract import (
    Declaration,
    Triple,
    declaration_from_tags,
    declaration_tags,
    read_sidecar,
    write_sidecar,
)
from .model_cache import ModelSource, fetch

_REGISTRY_URI = re.compile(r"models:/(?P<name>[^/]+)/(?P<version>[0-9]+)")  # fullmatch
# MLflow draws a progress bar on stderr when tqdm is installed (sentence-transformers brings it
# in): it would surround the one line an error gets (contract §2). A user's own setting wins.
QUIET_DOWNLOADS = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


@dataclass(frozen=True)
class ResolvedModel:
    """A model file and what it declares.

    Attributes:
        uri: as the job spec gives it.
        path: the local file to hash and load here: the file itself, or its entry in the model
            cache for a model in a store.
        declaration: the declared triple parts (and the backend's declared values), or None.
        registry: ``(name, version)`` for ``models:/`` URIs.
        url: the store URL of the model file, which workers fetch; None for a local file.
        digest: the model digest of ``path``, when the fetch computed it (None: not yet hashed).
    """

    uri: str
    path: Path
    declaration: Declaration | None
    registry: tuple[str, str] | None = None
    url: str | None = None
    digest: str | None = None

    @property
    def where(self) -> str:
        """The model file's own location: its store URL, or its local path."""
        return self.url or str(self.path)

    def source(self, digest: str) -> ModelSource | None:
        """What a worker fetches (the store URL and the digest checked), None for a local file."""
        return None if self.url is None else ModelSource(self.url, digest)


def registry_ref(uri: str) -> tuple[str, str] | None:
    match = _REGISTRY_URI.fullmatch(uri)
    return (match["name"], match["version"]) if match else None


def resolve_model(uri: str, backend: str, tracking_uri: str) -> ResolvedModel:
    """Find the model file and read its declaration; a model in a store is fetched into the
    model cache (no download when the entry for its declared digest is there).

    Raises:
        ModelFileError: the file or registry version does not exist, or holds no model file
            (exit 2: a retry finds the same nothing).
        SpecError: a ``models:`` URI that is not ``models:/<name>/<version>``.
        StorageError: the registry or the store cannot be reached.
    """
    ref = registry_ref(uri)
    if ref is None:
        if uri.startswith("models:"):
            raise SpecError(f"model.uri {uri!r}: use models:/<name>/<version>")
        return _file_model(uri, uri, backend, None)
    name, version = ref
    with _registry(tracking_uri, QUIET_DOWNLOADS) as client:
        try:
            model_version = client.get_model_version(name, version)
        except Exception as exc:
            raise _registry_error(exc, f"model version {uri}", tracking_uri) from None
        try:
            # Not artifact_uri="models:/…": MLflow resolves that against the default registry (a
            # mlflow.db in the working folder), not this job's; ask our registry where the files are.
            location = client.get_model_version_download_uri(name, version)
            url = _registry_model_file(location, backend, uri, tracking_uri)
        except BatchInferError:
            raise
        except Exception as exc:
            raise _registry_error(exc, f"artifacts of {uri}", tracking_uri) from None
    return _file_model(url, uri, backend, declaration_from_tags(model_version.tags or {}), ref)


def _file_model(url: str, uri: str, backend: str, declaration: Declaration | None,
                registry: tuple[str, str] | None = None) -> ResolvedModel:
    """The model file at ``url`` (local, or fetched into the cache); its sidecar's declaration
    unless ``registry`` gives one."""
    suffixes = "/".join(backends.get(backend).suffixes)
    local = local_path(url)
    if local is not None:
        path = Path(local)
        if path.is_dir():
            raise ModelFileError(f"model.uri {uri} is a folder, not a model file: point it at the "
                                 f"{suffixes} file inside")
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "not found"
            raise ModelFileError(f"model file {uri} {what}: fix model.uri")
        return ResolvedModel(uri, path, read_sidecar(path) if registry is None else declaration,
                             registry)
    if registry is None:
        try:
            fs, path_in_store = url_to_fs(url)
            is_dir = fs.isdir(path_in_store)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read model.uri {uri}: {one_line(exc)}") from None
        if is_dir:
            raise ModelFileError(f"model.uri {uri} is a folder, not a model file: point it at the "
                                 f"{suffixes} file inside")
        declaration = read_sidecar(url)
    # The launcher revalidates a warm entry against the store: a model changed there since it
    # was stamped is this run's contract mismatch (exit 3), not its workers' failure.
    fetched = fetch(url, declaration.model_digest if declaration else None, revalidate=True)
    return ResolvedModel(uri, fetched.path, declaration, registry, url, fetched.digest)


def _registry_model_file(location: str, backend: str, uri: str, tracking_uri: str) -> str:
    """The URL of the one model file at a model version's artifact location, in a form fsspec
    reads on any machine that reaches the registry: a local path as it is, a store URL as it
    is, ``mlflow-artifacts:`` as the tracking server's artifact endpoint (``http(s)://…``)."""
    suffixes = tuple(backends.get(backend).suffixes)
    local = local_path(location)
    if local is not None:
        return str(_model_file(Path(local), backend, uri)) if Path(local).is_dir() else local
    readable = location
    if location.startswith("mlflow-artifacts:"):
        from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

        readable = MlflowArtifactsRepository.resolve_uri(location, tracking_uri)
    if location.lower().endswith(suffixes):
        return readable
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(location, tracking_uri=tracking_uri)
    found: list[str] = []
    folders: list[str | None] = [None]
    while folders:   # the whole tree, as _model_file's rglob walks a local folder
        for info in repo.list_artifacts(folders.pop()):
            if info.is_dir:
                folders.append(info.path)
            elif info.path.lower().endswith(suffixes):
                found.append(info.path)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ModelFileError(f"{uri} holds {what} {'/'.join(suffixes)} files; it must hold exactly one")
    return posixpath.join(readable.rstrip("/"), found[0])


def declare(model: ResolvedModel, triple: Triple, tracking_uri: str,
            extra: Mapping[str, str] | None = None) -> str:
    """Write the declaration — the triple and the backend's ``extra`` declared values —
    (sidecar, or registry tags); return where it went."""
    if model.registry is None:
        return str(write_sidecar(model.where, triple, extra))
    name, version = model.registry
    with _registry(tracking_uri) as client:
        try:
            for key, value in declaration_tags(triple, extra).items():
                client.set_model_version_tag(name, version, key, value)
        except Exception as exc:
            raise _registry_error(exc, f"tags of {model.uri}", tracking_uri) from None
    return f"tags of {model.uri}"


def _model_file(folder: Path, backend: str, uri: str) -> Path:
    suffixes = backends.get(backend).suffixes
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ModelFileError(f"{uri} holds {what} {'/'.join(suffixes)} files; it must hold exactly one")
    return found[0]


@contextlib.contextmanager
def _registry(tracking_uri: str, settings: Mapping[str, str] | None = None) -> Iterator[Any]:
    """An MLflow client of the registry at ``tracking_uri``, with batchinfer's MLflow settings
    (and ``settings``) while the block runs (:func:`~batchinfer.io.tracking.mlflow_settings`)."""
    from ..io.tracking import mlflow_client, mlflow_settings

    with mlflow_settings(settings):
        yield mlflow_client(tracking_uri)


def _registry_error(exc: Exception, what: str, tracking_uri: str) -> Exception:
    text = one_line(exc, 200)
    if "RESOURCE_DOES_NOT_EXIST" in text or "not found" in text.lower():
        return ModelFileError(f"{what} not found in the registry at {tracking_uri}: {text}")
    return StorageError(f"cannot read {what} from the registry at {tracking_uri}: {text}")


def register_model(folder: Path, name: str, tracking_uri: str) -> str:
    """Register the model files in ``folder`` as a version of ``name`` in the registry at
    ``tracking_uri`` (a version with that source already there is reused); its ``models:/`` URI.

    Raises:
        StorageError: the registry cannot be reached or refuses the version.
    """
    source = str(folder.resolve())
    with _registry(tracking_uri) as client:
        try:
            if not client.search_registered_models(filter_string=f"name = '{name}'"):
                client.create_registered_model(name)
            found = [v for v in client.search_model_versions(f"name = '{name}'") if v.source == source]
            version = found[0] if found else client.create_model_version(name, source=source)
        except Exception as exc:
            raise StorageError(f"cannot register {source} as {name} in the registry at {tracking_uri}: "
                               f"{one_line(exc, 200)}") from None
    return f"models:/{name}/{version.version}"
