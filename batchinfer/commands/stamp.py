"""``batchinfer stamp``: write a model's declaration of the version triple (SPEC §1)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..backends import declared_options, handler_class
from ..errors import SpecError
from ..spec import Job, resolve_path
from ..triple.contract import Triple
from ..triple.models import declare
from .monitor import read_profile
from .resolve import resolve


def stamp(job: Job, model_uri: str | None, model_version: str | None,
          challenger: str | None = None, baseline: str | None = None) -> tuple[Triple, str]:
    """Write the model's declaration for this job's schema and preprocessing; return the triple
    and where the declaration went.

    Args:
        challenger: stamp for the job's challenger of this name: its backend, declared options
            and ``version`` instead of the champion's (the schema and preprocessing are the
            job's either way).
        baseline: a profile (``batchinfer profile``) to declare as the model's drift baseline:
            jobs whose ``monitor`` names none use it. A local path is stored absolute.

    Raises:
        SpecError: no challenger of that name; a baseline that is not a readable profile.
    """
    job = _one_model(job, challenger)
    spec = job.spec
    if model_uri is not None:
        job = _with_model(job, model_uri)
    resolved = resolve(job, list_input_files=False, check=False)
    version = model_version or spec.model.version
    if not version:
        if resolved.model.registry:
            version = ":".join(resolved.model.registry)
        else:
            raise SpecError("stamp needs a model version: pass --model-version NAME:V or set "
                            "model.version in the job")
    triple = Triple(version, resolved.triple.model_digest, resolved.triple.schema_version,
                    resolved.triple.preprocess_hash)
    model = job.spec.model
    extra = declared_options(model.backend, model.options)
    extra.update(handler_class(model.backend).build_facts(str(resolved.model.path)))
    if baseline is not None:
        url = resolve_path(baseline, Path.cwd())
        read_profile(url, baseline, "--baseline")   # a profile, readable now (exit 2 otherwise)
        extra["baseline"] = url
    where = declare(resolved.model, triple, job.spec.tracking.uri, extra)
    return triple, where


def _one_model(job: Job, challenger: str | None) -> Job:
    """``job`` with one model to stamp: the champion, or the named challenger in its place.
    Challengers are dropped: stamping one model must not need the others' files."""
    model = job.spec.model
    if challenger is not None:
        found = next((c for c in model.challengers if c.name == challenger), None)
        if found is None:
            known = ", ".join(c.name for c in model.challengers) or "none"
            raise SpecError(f"the job has no challenger {challenger!r} (its challengers: {known})")
        model = model.model_copy(update={key: getattr(found, key) for key in
                                         ("uri", "backend", "device", "version", "options")})
    model = model.model_copy(update={"challengers": []})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"model": model}))


def _with_model(job: Job, model_uri: str) -> Job:
    """``job`` with ``model.uri`` replaced; a relative path is the user's, from the cwd."""
    model = job.spec.model.model_copy(update={"uri": resolve_path(model_uri, Path.cwd())})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"model": model}))
