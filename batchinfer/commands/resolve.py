"""Resolving a job: everything it names looked up, the triple computed and checked (SPEC §1).

Used by ``plan``, ``run``, ``stamp`` and ``export``; nothing here writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import declared_options
from ..errors import SpecError
from ..io.shards import Shard, list_input
from ..spec import Job
from ..triple.contract import Triple, check_contract, model_digest, refuse_pickle
from ..triple.models import ResolvedModel, resolve_model
from ..triple.preprocess import Preprocessor, load_preprocessor
from ..triple.schemas import SchemaVersion, resolve_schema


@dataclass
class Resolved:
    """A job with everything it names looked up and the triple computed."""

    job: Job
    schema: SchemaVersion
    preprocessor: Preprocessor
    features: tuple[str, ...]
    model: ResolvedModel
    triple: Triple
    shards: list[Shard] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)   # metadata files input.path matched

    def shard_names(self) -> tuple[str, ...]:
        """What ``_source_shard`` records for each shard (``${NAME}`` values put back)."""
        return tuple(self.job.display(s.url) for s in self.shards)


def resolve_inputs(job: Job) -> tuple[SchemaVersion, tuple[str, ...], Preprocessor]:
    """The job's schema version, the model's feature columns and the preprocessing step."""
    spec = job.spec
    schema = resolve_schema(spec.schemas.root, spec.schema_)
    missing_ids = [c for c in spec.output.id_columns if c not in schema.columns]
    if missing_ids:
        raise SpecError(f"output.id_columns {missing_ids} are not columns of schema {schema.ref}")
    features = schema.features_for(spec.output.id_columns)
    return schema, features, load_preprocessor(spec.preprocess, job.folder, features)


def resolve(job: Job, *, list_input_files: bool = True, check: bool = True) -> Resolved:
    """Look up schema, preprocessing, model and shards; compute the triple; check the contract.

    Raises:
        UsageError: the schema, preprocessing or shards cannot be found (exit 2).
        ContractError: the triple does not match the model's declaration (exit 3).
        ModelError: the model cannot be found (exit 5).
    """
    spec = job.spec
    schema, features, preprocessor = resolve_inputs(job)
    refuse_pickle(spec.model.uri, bool(spec.model.options.get("allow_pickle", False)))
    model = resolve_model(spec.model.uri, spec.model.backend, spec.tracking.uri)
    digest = model_digest(model.path)
    declared_version = (model.declaration or {}).get("model_version") or spec.model.version or ""
    triple = Triple(declared_version, digest, schema.ref, preprocessor.hash)
    if check:
        check_contract(job.display(spec.model.uri), model.declaration, triple, spec.model.version,
                       declared_options(spec.model.backend, spec.model.options))
    listing = list_input(spec.input.path) if list_input_files else None
    return Resolved(job, schema, preprocessor, features, model, triple,
                    listing.shards if listing else [], listing.ignored if listing else [])
