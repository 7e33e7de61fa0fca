"""Beam pipeline options for the runners a job spec can name (SPEC §3 ``runner``).

The job itself never changes between runners; only these options do. ``runner.options`` are
passed to Beam as ``--key=value`` flags (``true`` → ``--key``), so anything Beam's runner
accepts can be set from the spec or with ``--set runner.options.key=value``.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping

from ..errors import RuntimeFailure, SpecError

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


def check(name: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any work, options Beam would refuse when the pipeline is built (the same
    validator ``beam.Pipeline`` runs), and a runner whose package is not installed.

    Raises:
        SpecError: options Beam cannot parse or refuses (exit 2).
        RuntimeFailure: the runner's package is missing (exit 5, like a missing backend).
    """
    from apache_beam.options.pipeline_options import StandardOptions
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
    from apache_beam.runners.runner import create_runner

    needed = NEEDS.get(name)
    if needed is not None:
        try:
            importlib.import_module(needed[0])
        except ImportError as exc:
            raise RuntimeFailure(f"runner {name} needs a package that is not installed ({exc.name}): "
                                 f"pip install 'batchinfer[{needed[1]}]'") from None
    try:
        # As in Beam's dry run, the validator then checks the options without reaching Google
        # Cloud (it would look up credentials, retrying for minutes where there are none, to
        # warn about a bucket's soft-delete policy); the pipeline's own validation still does.
        parsed = pipeline_options(name, {**options, "dry_run": "true"})
        runner = create_runner(parsed.view_as(StandardOptions).runner)
        errors = PipelineOptionsValidator(parsed, runner).validate()
    except SystemExit:  # argparse refused a value (and printed its usage line to stderr)
        raise SpecError(f"runner {name}: Beam cannot parse runner.options {dict(options)}") from None
    if errors:
        raise SpecError(f"runner {name}: {' '.join(' '.join(errors).split())}")
