"""``batchinfer stamp``: write a model's declaration of the version triple (contract §1)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..app.drift_baseline import read_profile
from ..app.explain_plan import background_baseline, declared_background
from ..app.explain_plan import declared as explain_declared
from ..app.resolve import resolve
from ..backends import build_facts, declared_options
from ..errors import SpecError
from ..spec import Job, resolve_path
from ..triple.contract import PACKAGE_POLICIES, PACKAGES, PACKAGES_POLICY, SCHEMA_SHA256, Triple
from ..triple.models import declare, registry_ref


def stamp(job: Job, model_uri: str | None, model_version: str | None,
          challenger: str | None = None, baseline: str | None = None,
          packages: str = "warn") -> tuple[Triple, str]:
    """Write the model's declaration for this job's schema and preprocessing; return the triple
    and where the declaration went.

    Besides the triple, the declaration records the schema version's source hash
    (``schema_sha256``) and the installed packages the preprocessing imports
    (``preprocess_packages``), which every run compares (contract §1).

    Args:
        challenger: stamp for the job's challenger of this name: its backend, declared options
            and ``version`` instead of the champion's (the schema and preprocessing are the
            job's either way).
        baseline: a profile (``batchinfer profile``) to declare as the model's drift baseline:
            jobs whose ``monitor`` names none use it. A local path is stored absolute.
        packages: what a run does when those packages' versions differ: ``warn`` or ``refuse``
            (exit 3).

    Raises:
        SpecError: no challenger of that name; a baseline that is not a readable profile; a
            model file that is both the champion's and a challenger's, declared differently;
            an ``explain.background`` that gives no baseline a run could use (not Parquet, no
            row that validates and preprocesses, a mean that is not finite).
    """
    if packages not in PACKAGE_POLICIES:
        raise SpecError(f"--packages {packages!r}: use one of {', '.join(PACKAGE_POLICIES)}")
    whole = job
    job = _one_model(job, challenger)
    spec = job.spec
    if model_uri is not None:
        job = _with_model(job, model_uri)
    if challenger is not None:
        _refuse_champions_file(whole, job.spec.model.uri, challenger)
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
    if challenger is None:
        _refuse_challengers_file(whole, model.uri, version, extra)
    facts = build_facts(model.backend, str(resolved.model.path))
    for key in sorted(extra.keys() & facts.keys()):   # the file's precision is the file's
        if facts[key] != extra[key]:
            raise SpecError(f"{job.display(model.uri)} computes in {key} {facts[key]} (how it was "
                            f"built) but the job's model.options.{key} is {extra[key]}: set "
                            f"model.options.{key}: {facts[key]} (or --set model.options.{key}="
                            f"{facts[key]}) to stamp it")
    extra.update(facts)
    extra.update(explain_declared(job.spec.explain))   # contract §6 "Explanations"
    if job.spec.explain is not None:
        # what every run would refuse (exit 2) is not declared: the background's baseline
        background_baseline(resolved, job.spec.explain)
    extra.update(declared_background(job.spec.explain))
    extra[SCHEMA_SHA256] = resolved.schema.source.sha256
    extra[PACKAGES] = " ".join(resolved.preprocessor.packages)
    extra[PACKAGES_POLICY] = packages
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


# A model file has one declaration (its sidecar, or its registry version's tags): stamping one
# file as the champion and as a challenger with other values would leave one of them running
# under the other's declaration — the champion committing under the challenger's version.

def _refuse_champions_file(job: Job, uri: str, challenger: str) -> None:
    """Refuse to stamp the champion's own model as challenger ``challenger``."""
    champion = job.spec.model.uri
    if _same_model(uri, champion):
        raise SpecError(
            f"{job.display(uri)} is the champion's model: a model file has one declaration, so "
            f"stamping it as challenger {challenger} would make the champion run under the "
            f"challenger's; copy the file for the challenger and point its uri at the copy")


def _refuse_challengers_file(job: Job, uri: str, version: str, declared: dict[str, str]) -> None:
    """Refuse to stamp the champion when its model is also a challenger's that needs other
    declared values (its ``version``, its backend's declared options)."""
    for challenger in job.spec.model.challengers:
        if not _same_model(uri, challenger.uri):
            continue
        wanted = declared_options(challenger.backend, challenger.options)
        if (challenger.version is not None and challenger.version != version) or wanted != declared:
            theirs = {"model_version": challenger.version or version, **wanted}
            ours = {"model_version": version, **declared}
            differ = "; ".join(f"{k} {ours.get(k, '(none)')} here, {theirs.get(k, '(none)')} for it"
                               for k in sorted(ours.keys() | theirs.keys())
                               if ours.get(k) != theirs.get(k))
            raise SpecError(
                f"{job.display(uri)} is also the model of challenger {challenger.name}, declared "
                f"otherwise ({differ}): a model file has one declaration; copy the file for the "
                f"challenger and point its uri at the copy")


def _same_model(a: str, b: str) -> bool:
    """Whether two model URIs name one declaration: one registry version, or one file."""
    ref_a, ref_b = registry_ref(a), registry_ref(b)
    if ref_a is not None or ref_b is not None:
        return ref_a == ref_b
    return Path(a).resolve() == Path(b).resolve()


def _with_model(job: Job, model_uri: str) -> Job:
    """``job`` with ``model.uri`` replaced; a relative path is the user's, from the cwd."""
    model = job.spec.model.model_copy(update={"uri": resolve_path(model_uri, Path.cwd())})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"model": model}))
