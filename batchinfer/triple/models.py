"""Where a model comes from: a file (with its sidecar declaration) or the MLflow registry
(``models:/name/version``, declaration in the model version's tags)."""
from __future__ import annotations

import contextlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from .. import backends
from ..errors import ModelFileError, SpecError, StorageError, one_line
from .contract import Triple, declaration_from_tags, declaration_tags, read_sidecar, write_sidecar

_REGISTRY_URI = re.compile(r"models:/(?P<name>[^/]+)/(?P<version>[0-9]+)")  # fullmatch
# MLflow draws a progress bar on stderr when tqdm is installed (sentence-transformers brings it
# in): it would surround the one line an error gets (contract §2). A user's own setting wins.
QUIET_DOWNLOADS = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


@dataclass(frozen=True)
class ResolvedModel:
    """A model file on local disk and what it declares.

    Attributes:
        uri: as the job spec gives it.
        path: the local file to load (downloaded for registry models).
        declaration: the declared triple parts (and the backend's declared values), or None.
        registry: ``(name, version)`` for ``models:/`` URIs.
    """

    uri: str
    path: Path
    declaration: dict | None
    registry: tuple[str, str] | None = None


def registry_ref(uri: str) -> tuple[str, str] | None:
    match = _REGISTRY_URI.fullmatch(uri)
    return (match["name"], match["version"]) if match else None


def resolve_model(uri: str, backend: str, tracking_uri: str) -> ResolvedModel:
    """Find the model file and read its declaration.

    Raises:
        ModelFileError: the file or registry version does not exist, or holds no model file
            (exit 2: a retry finds the same nothing).
        SpecError: a ``models:`` URI that is not ``models:/<name>/<version>``.
        StorageError: the registry cannot be reached.
    """
    ref = registry_ref(uri)
    if ref is None:
        if uri.startswith("models:"):
            raise SpecError(f"model.uri {uri!r}: use models:/<name>/<version>")
        path = Path(uri)
        if path.is_dir():
            raise ModelFileError(f"model.uri {uri} is a folder, not a model file: point it at the "
                             f"{'/'.join(backends.get(backend).suffixes)} file inside")
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "not found"
            raise ModelFileError(f"model file {uri} {what}: fix model.uri")
        return ResolvedModel(uri, path, read_sidecar(path))
    name, version = ref
    with _registry(tracking_uri, QUIET_DOWNLOADS) as client:
        try:
            model_version = client.get_model_version(name, version)
        except Exception as exc:
            raise _registry_error(exc, f"model version {uri}", tracking_uri) from None
        try:
            import mlflow.artifacts

            # Not artifact_uri="models:/…": MLflow resolves that against the default registry (a
            # mlflow.db in the working folder), not this job's; ask our registry where the files are.
            folder = mlflow.artifacts.download_artifacts(
                artifact_uri=client.get_model_version_download_uri(name, version),
                tracking_uri=tracking_uri, dst_path=tempfile.mkdtemp(prefix="batchinfer-model-"))
        except Exception as exc:
            raise _registry_error(exc, f"artifacts of {uri}", tracking_uri) from None
    path = _model_file(Path(folder), backend, uri)
    return ResolvedModel(uri, path, declaration_from_tags(model_version.tags or {}), ref)


def declare(model: ResolvedModel, triple: Triple, tracking_uri: str,
            extra: Mapping[str, str] | None = None) -> str:
    """Write the declaration — the triple and the backend's ``extra`` declared values —
    (sidecar, or registry tags); return where it went."""
    if model.registry is None:
        return str(write_sidecar(model.path, triple, extra))
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
