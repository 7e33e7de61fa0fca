"""Beam pipeline options for the runners a job spec can name (contract §3 ``runner``).

The job itself never changes between runners; only these options do. ``runner.options`` are
passed to Beam as ``--key=value`` flags (``true`` → ``--key``), so anything Beam's runner
accepts can be set from the spec or with ``--set runner.options.key=value``. Beam itself only
warns about a flag it does not know and runs without it; :func:`check` refuses it before any
work (docs/runners.md "Runner options").
"""
from __future__ import annotations

import difflib
import importlib
import logging
from typing import Any, Mapping

from ..errors import RuntimeFailure, SpecError

log = logging.getLogger("batchinfer")

RUNNERS = {
    # Beam's DirectRunner first tries the Prism runner (a Go binary it downloads when online,
    # 0.3-0.4 s wasted and a failure when offline) and then falls back to the FnApiRunner for
    # batch pipelines. We name the FnApiRunner directly: the same engine, predictably, on any
    # machine. It honours --direct_num_workers and --direct_running_mode.
    "direct": "apache_beam.runners.portability.fn_api_runner.FnApiRunner",
    "portable": "PortableRunner",
    "flink": "FlinkRunner",
    "dataflow": "DataflowRunner",
    # Beam's DaskRunner with one bug fixed (pipeline/dask.py); options.dask_client_address
    # names the scheduler (tcp://host:8786).
    "dask": "batchinfer.pipeline.dask.DaskRunner",
}


# Added unless runner.options sets one of the same group. Dask: Beam puts up to 128 elements in
# one Dask partition, so a partition's shards would all be read by one worker; a shard per
# partition spreads them over the cluster (each partition then loads the model once per worker
# process, from the per-process cache).
DEFAULTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "dask": (("dask_partition_size", "dask_npartitions"), {"dask_partition_size": 1}),
}


def beam_args(name: str, options: Mapping[str, Any]) -> list[str]:
    """Command-line style Beam arguments for ``runner: {name, options}``."""
    args = [f"--runner={RUNNERS[name]}"]
    group, defaults = DEFAULTS.get(name, ((), {}))
    if not any(key in options for key in group):
        options = {**defaults, **options}
    for key, value in options.items():
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


# The package a runner needs beyond Beam itself, and the extra that installs it.
NEEDS = {"dataflow": ("apache_beam.runners.dataflow.internal.apiclient", "dataflow"),
         "dask": ("dask.distributed", "dask")}


# Beam's options classes that only some runners read: on another runner their options do
# nothing. `portable` hands every option to its job service, which may be Flink's, Spark's,
# Prism's or Kafka Streams' job server, or Beam's Python one (an FnApiRunner: direct_*). Every
# other class (setup, workers, environments, file systems, debugging, ...) may matter anywhere.
OWN_OPTIONS = {"DirectOptions": ("direct", "portable"), "DaskOptions": ("dask",),
               "FlinkRunnerOptions": ("flink", "portable"), "SparkRunnerOptions": ("portable",),
               "PrismRunnerOptions": ("portable",), "KafkaStreamsRunnerOptions": ("portable",)}

# Runners whose job service adds its own options when the job is submitted (Beam's
# PortableRunner asks it, DescribePipelineOptions: the Java Flink runner's checkpointing_interval,
# say). A flag Beam's Python SDK does not know may be one of those: a warning, not an error.
JOB_SERVICE_OPTIONS = {"portable", "flink"}


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
    owner = {flag: cls.__name__ for cls, cls_flags in flags.items() for flag in cls_flags}
    here = {flag[2:] for cls, cls_flags in flags.items()
            if name in OWN_OPTIONS.get(cls.__name__, (name,)) for flag in cls_flags} - {"runner"}
    unknown, elsewhere, warnings = [], [], []
    for key in map(str, options):
        flag = "--" + key.lstrip("-")
        if flag[2:] in here:
            continue
        if flag == "--runner":
            elsewhere.append("runner.options.runner: set runner.name instead")
            continue
        if flag in owner:
            runners = " or ".join(OWN_OPTIONS[owner[flag]])
            elsewhere.append(f"runner.options.{key} is an option of runner {runners} (Beam's "
                             f"{owner[flag]}), which runner {name} ignores: remove it "
                             f"(--set runner.options={{}} clears the file's options)")
            continue
        close = difflib.get_close_matches(flag[2:], sorted(here), n=1)
        known = f"runner.options.{key}" + (f" (did you mean {close[0]}?)" if close else "")
        if name in JOB_SERVICE_OPTIONS:
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
           if OWN_OPTIONS.get(cls.__name__, ("",))[0] == name for f in cls_flags]
    mine = f"Runner {name}'s own options: {', '.join(own)}; those" if own else "Those"
    return (f"{mine} of every runner are in Beam's apache_beam/options/pipeline_options.py "
            f"(docs/runners.md \"Runner options\")")


def check(name: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any work, options that are not runner ``name``'s
    (:func:`check_option_names`), options Beam would refuse when the pipeline is built (the same
    validator ``beam.Pipeline`` runs), and a runner whose package is not installed.

    Raises:
        SpecError: options unknown to the runner, or that Beam cannot parse or refuses (exit 2).
        RuntimeFailure: the runner's package is missing (exit 5, like a missing backend).
    """
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
    from apache_beam.runners.runner import create_runner

    needed = NEEDS.get(name)
    if needed is not None:
        try:
            importlib.import_module(needed[0])
        except ImportError as exc:
            raise RuntimeFailure(f"runner {name} needs a package that is not installed ({exc.name}): "
                                 f"pip install 'batchinfer[{needed[1]}]'") from None
    runner = create_runner(RUNNERS[name])  # imports the runner's module, and its options class
    for warning in check_option_names(name, options):
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
