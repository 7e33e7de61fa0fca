"""Beam pipeline options for the runners a job spec can name (contract §3 ``runner``).

The job itself never changes between runners; only these options do. What each runner is — the
Beam runner, its required options and defaults, the package it needs, its own options classes —
is its entry in the runner registry (:mod:`batchinfer.runners`). ``runner.options`` are passed
to Beam as ``--key=value`` flags (``true`` → ``--key``), so anything Beam's runner accepts can be
set from the spec or with ``--set runner.options.key=value``. Beam itself only warns about a
flag it does not know and runs without it; :func:`check` refuses it before any work
(docs/runners.md "Runner options").
"""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import logging
from typing import Any, Iterator, Mapping

from .. import runners
from ..errors import RuntimeFailure, SpecError
from ..imports import import_beam

log = logging.getLogger("batchinfer")


def beam_args(name: str, options: Mapping[str, Any]) -> list[str]:
    """Command-line style Beam arguments for ``runner: {name, options}`` (the runner's defaults
    added where the options set none of them)."""
    runner = runners.get(name)
    args = [f"--runner={runner.beam_runner}"]
    for key, value in runner.with_defaults(options).items():
        flag = "--" + str(key).lstrip("-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            args.extend(f"{flag}={item}" for item in value)
        else:
            args.append(f"{flag}={value}")
    return args


def pipeline_options(name: str, options: Mapping[str, Any]):
    from apache_beam.options.pipeline_options import PipelineOptions

    return PipelineOptions(beam_args(name, options))



def live_metrics(name: str, options: Mapping[str, Any]) -> str:
    """Where live progress of a job on runner ``name`` comes from (``Runner.live_metrics``):
    ``process``, ``result`` or ``end``. The direct runner's multi_processing mode runs its
    workers in processes of their own, and its FnApiRunner hands over Beam's metrics only at the
    end: ``end``."""
    live = runners.get(name).live_metrics
    if live == "process" and str(options.get("direct_running_mode", "")) == "multi_processing":
        return "end"
    return live


def job_summary(result: Any) -> str:
    """What Beam's DataflowRunner built in a dry run (``result.job``): the job's name and type,
    its transforms, PCollections and stages, and the SDK container the workers would run."""
    job = result.job
    proto = job.proto_pipeline
    components = proto.components
    leaves = [t for t in components.transforms.values() if not t.subtransforms]
    images = sorted({_image(env) for env in components.environments.values()} - {""})
    kind = "streaming" if "STREAMING" in str(job.proto.type_) else "batch"
    pickled = sum(len(t.spec.payload) for t in leaves)
    steps = [components.transforms[i].unique_name for root in proto.root_transform_ids
             for i in (components.transforms[root].subtransforms or [root])]
    return (f"dataflow job {job.proto.name!r} ({kind}) built, not submitted: "
            f"{len(components.transforms)} transforms ({len(leaves)} primitive), "
            f"{len(components.pcollections)} PCollections, {len(components.coders)} coders, "
            f"{pickled:,} bytes of pickled transforms; worker image {', '.join(images) or '?'}\n"
            f"steps: {' → '.join(steps)}")


def _image(environment: Any) -> str:
    from apache_beam.portability.api import beam_runner_api_pb2

    if not environment.payload:
        return ""
    payload = beam_runner_api_pb2.DockerPayload.FromString(environment.payload)
    return str(payload.container_image)


def check_option_names(name: str, options: Mapping[str, Any]) -> list[str]:
    """Refuse ``runner.options`` keys that are not options of runner ``name``, as Beam's own
    parser registers them (the runner's module is imported first: its options class, Beam's
    ``DaskOptions``, registers there). Returns warnings for the keys a job service may know.

    Raises:
        SpecError: a key Beam does not know (with the closest known names), an option of
            another runner's own options class, or ``runner`` (exit 2).
    """
    from ..beam_compat import option_flags

    flags = option_flags()
    owners = runners.option_owners()
    owner = {flag: cls.__name__ for cls, cls_flags in flags.items() for flag in cls_flags}
    here = {flag[2:] for cls, cls_flags in flags.items()
            if name in owners.get(cls.__name__, (name,)) for flag in cls_flags} - {"runner"}
    unknown, elsewhere, warnings = [], [], []
    for key in map(str, options):
        flag = "--" + key.lstrip("-")
        if flag[2:] in here:
            continue
        if flag == "--runner":
            elsewhere.append("runner.options.runner: set runner.name instead")
            continue
        if flag in owner:
            readers = " or ".join(owners[owner[flag]])
            elsewhere.append(f"runner.options.{key} is an option of runner {readers} (Beam's "
                             f"{owner[flag]}), which runner {name} ignores: remove it "
                             f"(--set runner.options={{}} clears the file's options)")
            continue
        close = difflib.get_close_matches(flag[2:], sorted(here), n=1)
        known = f"runner.options.{key}" + (f" (did you mean {close[0]}?)" if close else "")
        if runners.get(name).job_service:
            warnings.append(f"runner {name}: {known} is not an option Beam knows here; it goes "
                            f"to the job service, which ignores it unless it is one of its own")
        else:
            unknown.append(known)
    if unknown or elsewhere:
        problems = ([f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"]
                    if unknown else []) + elsewhere
        raise SpecError(f"runner {name}: {'; '.join(problems)}. {_where_to_look(name, flags)}")
    return warnings


def _where_to_look(name: str, flags: Mapping[type, tuple[str, ...]]) -> str:
    """Where a user finds the options of runner ``name``: its own options class's, listed, and
    Beam's module for the rest."""
    own = [f[2:] for cls, cls_flags in flags.items()
           if cls.__name__ in runners.get(name).own_options for f in cls_flags]
    mine = f"Runner {name}'s own options: {', '.join(own)}; those" if own else "Those"
    return (f"{mine} of every runner are in Beam's apache_beam/options/pipeline_options.py "
            f"(docs/runners.md \"Runner options\")")


def _from(name: str) -> str:
    """`` (distribution D V)`` for a runner an installed distribution holds, else ''."""
    where = runners.provenance(name)
    if where is None or where.builtin or where.distribution is None:
        return ""
    return f" (distribution {where.distribution} {where.version or ''})".replace(" )", ")")


def _reinstall(name: str) -> str:
    """What to do about a runner whose code is missing: reinstall what holds it."""
    where = runners.provenance(name)
    if where is not None and where.distribution:
        return f"reinstall it (pip install --force-reinstall {where.distribution}) or install what it needs"
    return "install the package that provides it"


# The checks that passed in the current checked_once() block: (runner, options, Beam's options
# classes) → the warnings they gave. None outside such a block.
_passed: contextvars.ContextVar[dict[tuple, list[str]] | None] = contextvars.ContextVar(
    "batchinfer_runner_checks", default=None)


@contextlib.contextmanager
def checked_once() -> Iterator[None]:
    """Within the block, :func:`check` of the runner and options of a check that passed earlier
    in the block is not done again (its warnings are logged again): ``backfill`` checks its
    runner once, not once per date (13 ms a date here: Beam's option parsers and validator).
    Only for the block: a later check meets the packages as they are then."""
    token = _passed.set({})
    try:
        yield
    finally:
        _passed.reset(token)


def check(name: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any work, options that are not runner ``name``'s
    (:func:`check_option_names`), options Beam would refuse when the pipeline is built (the same
    validator ``beam.Pipeline`` runs), and a runner whose package is not installed.

    Raises:
        SpecError: options unknown to the runner, or that Beam cannot parse or refuses (exit 2).
        RuntimeFailure: the runner's package is missing (exit 5, like a missing backend).
    """
    import_beam(cloud_clients=runners.get(name).cloud_clients)  # before anything imports Beam
    passed = _passed.get()
    if passed is None:
        _check(name, options)
        return
    from apache_beam.options.pipeline_options import PipelineOptions

    key = (name, repr(sorted((str(k), repr(v)) for k, v in options.items())),
           tuple(sorted(map(str, PipelineOptions.__subclasses__()))))
    if key in passed:
        for warning in passed[key]:
            log.warning("%s", warning)
        return
    passed[key] = _check(name, options)


def _check(name: str, options: Mapping[str, Any]) -> list[str]:
    """:func:`check`'s checks (their warnings logged); returns the warnings."""
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
    from apache_beam.runners.runner import create_runner

    entry = runners.get(name)
    if entry.needs is not None:
        try:
            importlib.import_module(entry.needs)
        except ImportError as exc:
            raise RuntimeFailure(f"runner {name}{_from(name)} needs a package that is not installed "
                                 f"({exc.name}): {entry.install or _reinstall(name)}") from None
    try:
        runner = create_runner(entry.beam_runner)  # imports the runner's module, and its options class
    except Exception as exc:   # a plugin's Beam runner that is not there, or fails to import
        missing = f" (no module {exc.name})" if isinstance(exc, ImportError) and exc.name else ""
        raise RuntimeFailure(
            f"runner {name}{_from(name)} names the Beam runner {entry.beam_runner}, which cannot "
            f"be loaded{missing}: {type(exc).__name__}: {' '.join(str(exc).split())}; "
            f"{entry.install or _reinstall(name)}") from None
    warnings = check_option_names(name, options)
    for warning in warnings:
        log.warning("%s", warning)
    try:
        # As in Beam's dry run, the validator then checks the options without reaching Google
        # Cloud (it would look up credentials, retrying for minutes where there are none, to
        # warn about a bucket's soft-delete policy); the pipeline's own validation still does.
        parsed = pipeline_options(name, {**options, "dry_run": "true"})
        errors = PipelineOptionsValidator(parsed, runner).validate()
    except SystemExit:  # argparse refused a value (and printed its usage line to stderr)
        raise SpecError(f"runner {name}: Beam cannot parse runner.options {dict(options)}") from None
    if errors:
        raise SpecError(f"runner {name}: {' '.join(' '.join(errors).split())}")
    return warnings
