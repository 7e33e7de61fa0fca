"""Validating OpenLineage events as a lineage tool receives them, against the specification as the
installed client (openlineage-python, the ``lineage`` extra) ships it: its generated attrs
classes, one per definition of the spec's JSON schemas, with the spec's validators.

:func:`validate` rebuilds a received event (its JSON) into those classes — ``RunEvent``,
``Run``, ``Job``, ``InputDataset``, ``OutputDataset``, and each standard facet into the class
its key names (:data:`STANDARD`) — and fails on a key no class has, a required field missing, a
value of another type than the class annotates, a validator that refuses (``eventTime``, a run
id that is not a UUID), a ``schemaURL``/``_schemaURL`` other than the one the class names (so
the versions in our events are those of the installed client), and a facet key nobody can check.
Then ``Serde.to_dict`` of what it rebuilt must be the event received: nothing lost, nothing
added, every value of the same type. batchinfer's own facets (``batchinfer_*``) are checked
with jsonschema against ``batchinfer/io/lineage_facets.json``.

It does not check what only the JSON schemas say and the generated classes do not: formats
(``uri``, ``date-time`` beyond ``eventTime``), enums given as strings (``processingType``), and
the extra properties the spec allows on a facet (refused here: batchinfer sends none).
"""
from __future__ import annotations

import enum
import json
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import attrs
import jsonschema

from factories import REPO

OURS = REPO / "batchinfer" / "io" / "lineage_facets.json"
# The version of the spec contract §6 "Lineage" names: a client that names another fails here,
# so that the contract is updated with it.
RUN_EVENT_SCHEMA = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
OUR_PREFIX = "batchinfer_"


class Invalid(AssertionError):
    """The event does not match the specification; the message says where and why."""


@cache
def standard() -> dict[str, dict[str, type]]:
    """Each group of facets (the base class the spec's facets of that place extend) and, in it,
    the standard facets by the key the spec gives them. Only those batchinfer sends or receives
    (a parent's) are here: a standard key not listed fails — add its class when we start to
    send it. The keys are the spec's (each facet's JSON schema names its key)."""
    from openlineage.client.facet_v2 import (
        BaseFacet,
        DatasetFacet,
        InputDatasetFacet,
        JobFacet,
        OutputDatasetFacet,
        RunFacet,
        data_quality_assertions_dataset,
        data_quality_metrics_input_dataset,
        dataset_version_dataset,
        error_message_run,
        job_type_job,
        output_statistics_output_dataset,
        parent_run,
        processing_engine_run,
        schema_dataset,
        tags_run,
    )

    groups: dict[type, dict[str, type]] = {
        RunFacet: {"parent": parent_run.ParentRunFacet,
                   "processing_engine": processing_engine_run.ProcessingEngineRunFacet,
                   "errorMessage": error_message_run.ErrorMessageRunFacet, "tags": tags_run.TagsRunFacet},
        JobFacet: {"jobType": job_type_job.JobTypeJobFacet},
        DatasetFacet: {"schema": schema_dataset.SchemaDatasetFacet,
                       "version": dataset_version_dataset.DatasetVersionDatasetFacet},
        InputDatasetFacet: {
            "dataQualityMetrics": data_quality_metrics_input_dataset.DataQualityMetricsInputDatasetFacet,
            "dataQualityAssertions": data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet},
        OutputDatasetFacet: {"outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet},
    }
    for base, classes in groups.items():   # a facet in the wrong group is the table's mistake
        assert issubclass(base, BaseFacet) and all(issubclass(c, base) for c in classes.values())
    return {base.__name__: classes for base, classes in groups.items()}


@cache
def _ours() -> dict[str, Any]:
    return json.loads(OURS.read_text())


def _check_ours(where: str, facet: Any) -> dict[str, Any]:
    """One of batchinfer's facets, against its definition in lineage_facets.json."""
    if not isinstance(facet, dict) or not isinstance(facet.get("_schemaURL"), str):
        raise Invalid(f"{where}: a facet is an object with a _schemaURL")
    base, _, pointer = facet["_schemaURL"].partition("#/$defs/")
    if base != _ours()["$id"] or pointer not in _ours()["$defs"]:
        raise Invalid(f"{where}: _schemaURL {facet['_schemaURL']} is not in {OURS.name}")
    schema = {**_ours(), "$ref": f"#/$defs/{pointer}"}
    try:
        jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(facet)
    except jsonschema.ValidationError as exc:
        raise Invalid(f"{where} does not match {facet['_schemaURL']}: {exc.message}") from None
    return facet


def _facets(where: str, group: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{where}: facets are an object, not {type(value).__name__}")
    built: dict[str, Any] = {}
    for key, facet in value.items():
        at = f"{where}.{key}"
        if key.startswith(OUR_PREFIX):
            built[key] = _check_ours(at, facet)
        elif key in standard()[group]:
            built[key] = _build(standard()[group][key], facet, at)
        else:
            raise Invalid(f"{at}: no standard {group} named {key!r} (known: {sorted(standard()[group])})")
    return built


def _convert(hint: Any, value: Any, where: str) -> Any:
    """``value`` (JSON) as the type ``hint`` the generated class annotates, or Invalid."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        [hint] = [a for a in args if a is not type(None)]   # the generated classes: `X | None`
        return _convert(hint, value, where)
    if hint is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise Invalid(f"{where}: a list, not {type(value).__name__}")
        return [_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if isinstance(args[1], type) and args[1].__name__ in standard():   # a place for facets
            return _facets(where, args[1].__name__, value)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise Invalid(f"{where}: an object, not {type(value).__name__}")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise Invalid(f"{where}: {value!r} is not one of {[e.value for e in hint]}") from None
    if attrs.has(hint):
        return _build(hint, value, where)
    # JSON has one kind of number: an int is a float's value, a float never an int's; a bool is
    # neither (Python's bool is an int).
    kinds = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}.get(hint)
    if kinds is None:
        raise Invalid(f"{where}: {hint!r} is not a type this validator knows")
    if isinstance(value, bool) and hint is not bool or not isinstance(value, kinds):
        raise Invalid(f"{where}: {hint.__name__}, not {type(value).__name__} {value!r}")
    return value


def _build(cls: type, value: Any, where: str) -> Any:
    """An instance of the generated class ``cls`` from its JSON: every key a field of it, its
    schema URL the one it names, its required fields there, its validators passed."""
    if not isinstance(value, dict):
        raise Invalid(f"{where}: a {cls.__name__} is an object, not {type(value).__name__}")
    fields = {f.name: f for f in attrs.fields(cls)}   # the JSON keys (asdict writes the names)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        field = fields.get(key)
        if field is None:
            raise Invalid(f"{where}: {cls.__name__} has no field {key!r} (fields: {sorted(fields)})")
        if not field.init:   # schemaURL / _schemaURL: set by the class, from _get_schema()
            named = cls._get_schema()   # type: ignore[attr-defined]
            if item != named:
                raise Invalid(f"{where}.{key} is {item!r}; the installed client's {cls.__name__} names {named!r}")
            continue
        kwargs[field.alias] = _convert(hints[field.name], item, f"{where}.{key}")
    missing = [f.name for f in fields.values() if f.init and f.default is attrs.NOTHING and f.alias not in kwargs]
    if missing:
        raise Invalid(f"{where}: {cls.__name__} needs {missing}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:   # a validator's refusal (eventTime, UUID(runId), …)
        raise Invalid(f"{where}: {cls.__name__} refuses it: {exc}") from None


def validate(event: dict[str, Any]) -> None:
    """Raise :class:`Invalid` (an AssertionError) unless ``event`` is a RunEvent of the spec as
    the installed client ships it, with only the standard facets it knows and batchinfer's own."""
    from openlineage.client.event_v2 import RunEvent
    from openlineage.client.serde import Serde

    if event.get("schemaURL") != RUN_EVENT_SCHEMA:
        raise Invalid(f"schemaURL is {event.get('schemaURL')!r}, not {RUN_EVENT_SCHEMA}")
    rebuilt = Serde.to_dict(_build(RunEvent, event, "event"))
    # As JSON: Python's == takes 1 for True and 1.0 for 1, a lineage tool's parser does not.
    if json.dumps(rebuilt, sort_keys=True) != json.dumps(event, sort_keys=True):
        raise Invalid(f"the event is not what its classes make of it: {_first_difference(event, rebuilt)}")


def _first_difference(sent: Any, rebuilt: Any, where: str = "event") -> str:
    if type(sent) is not type(rebuilt):
        return f"{where}: {sent!r} became {rebuilt!r}"
    if isinstance(sent, dict):
        for key in sorted(sent.keys() | rebuilt.keys()):
            if key not in rebuilt:
                return f"{where}.{key} lost"
            if key not in sent:
                return f"{where}.{key} added ({rebuilt[key]!r})"
            if sent[key] != rebuilt[key]:
                return _first_difference(sent[key], rebuilt[key], f"{where}.{key}")
    if isinstance(sent, list):
        if len(sent) != len(rebuilt):
            return f"{where}: {len(sent)} items became {len(rebuilt)}"
        for i, (a, b) in enumerate(zip(sent, rebuilt)):
            if a != b:
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where}: {sent!r} became {rebuilt!r}"


def read_events(path: Path) -> list[dict]:
    """A file transport's events, one JSON object a line."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
