"""The runner registry: the one place that says what a ``runner.name`` is (contract §3 ``runner``).

A :class:`Runner` owns its name, the Beam runner it names (as a string: checking a job spec never
imports Beam), the options it cannot start without, batchinfer's defaults for it, the package
it needs beyond Beam, whether ``run --dry-run`` builds its job, and which of Beam's options
classes are its own. The spec validates ``runner.name`` and the required options here;
``pipeline/runner_options.py`` turns the rest into Beam's pipeline options and checks them.
``register()`` adds a runner everywhere at once, and so does an installed distribution that names
a :class:`Runner` in the ``batchinfer.runners`` entry-point group (:mod:`batchinfer.registry`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import SpecError
from .registry import Provenance, Registry


@dataclass(frozen=True, kw_only=True)
class Runner:
    """A Beam runner a job can name.

    Attributes:
        name: the ``runner.name`` value.
        beam_runner: what Beam's ``--runner`` gets: a runner Beam knows by name
            (``FlinkRunner``), or ``package.module.Class``.
        required: ``runner.options`` it must be given (without them Beam starts something else
            or fails once the work has begun).
        defaults: options added when ``runner.options`` sets none of them, nor any of
            ``defaults_unless``.
        defaults_unless: options that say what ``defaults`` says another way.
        needs: a module it needs beyond Beam, imported before any work.
        install: what to install when ``needs`` is missing.
        builds_job: ``run --dry-run`` builds its job (Beam's ``dry_run`` option: the job graph
            is built, the DoFns pickled, the options validated, nothing submitted). Only a
            runner that honours ``dry_run``; any other would run the job.
        own_options: the names of Beam's options classes that belong to it: on another runner
            their options do nothing (and are refused), unless that runner reads them too.
        reads_options_of: other runners whose own options it reads as well.
        job_service: its job service adds options of its own when the job is submitted, so an
            option Beam's Python SDK does not know is a warning here, not an error.
        fixes: what batchinfer changes in Beam's own runner, and why ('' for none).
        live_metrics: where live progress comes from while the job runs (docs/runners.md
            "Progress and metrics"): ``process`` — the work runs in the launching process,
            whose own counters move (Beam's metrics come only at the end; ``direct``, except in
            its multi_processing mode); ``result`` — the pipeline result's Beam metrics,
            polled; ``end`` — none: the runner reports its metrics when the job ends. Every
            runner's final figures are its Beam metrics.
        cloud_clients: its launcher may need Beam's own Google Cloud and AWS clients (the
            Dataflow API, staging to ``gs://``). False: when its check is the first thing to
            import Beam, Beam is imported without them (:data:`batchinfer.imports.CLOUD_CLIENTS`).
    """

    name: str
    beam_runner: str
    required: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    defaults_unless: tuple[str, ...] = ()
    needs: str | None = None
    install: str = ""
    builds_job: bool = False
    own_options: tuple[str, ...] = ()
    reads_options_of: tuple[str, ...] = ()
    job_service: bool = False
    fixes: str = ""
    live_metrics: str = "end"
    cloud_clients: bool = True

    def with_defaults(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with :attr:`defaults` first, unless it sets one of them already."""
        if any(key in options for key in (*self.defaults, *self.defaults_unless)):
            return dict(options)
        return {**self.defaults, **options}


def register(runner: Runner, *, clobber: bool = False) -> None:
    """Make ``runner`` available under ``runner.name``.

    Raises:
        ValueError: another runner has that name and ``clobber`` is False, or batchinfer or an
            installed distribution has it (their entries are never replaced).
    """
    _REGISTRY.register(runner, clobber=clobber)


def provenance(name: str) -> Provenance | None:
    """Where runner ``name`` came from: batchinfer, or the distribution that holds it (None: no
    such runner)."""
    return _REGISTRY.provenance(name)


def entries() -> Mapping[str, Runner]:
    """Every runner by name (a read-only view), those of installed distributions included."""
    return _REGISTRY.entries()


def names() -> tuple[str, ...]:
    """The runners' names, batchinfer's first, in the order they were registered."""
    return _REGISTRY.names()


def get(name: str) -> Runner:
    """The runner called ``name``.

    Raises:
        SpecError: no runner has that name (the message lists the known ones).
    """
    runner = _REGISTRY.find(name)
    if runner is None:
        raise SpecError(f"unknown runner.name {name!r} (known: {', '.join(names())})")
    return runner


def option_owners() -> dict[str, tuple[str, ...]]:
    """Beam's options classes that only some runners read, each with those runners (the one it
    belongs to first). Every other class (setup, workers, environments, file systems,
    debugging, ...) may matter on any runner."""
    runners = entries().values()
    return {cls: (owner.name, *(r.name for r in runners if owner.name in r.reads_options_of))
            for owner in runners for cls in owner.own_options}


# batchinfer's own runners; installed distributions add theirs (group batchinfer.runners).
BUILTIN: tuple[Runner, ...] = (
    Runner(
        name="direct",
        beam_runner="apache_beam.runners.portability.fn_api_runner.FnApiRunner",
        own_options=("DirectOptions",),
        fixes="Beam's DirectRunner first tries the Prism runner (a Go binary it downloads when "
              "online, 0.3-0.4 s wasted and a failure when offline) and then falls back to the "
              "FnApiRunner for batch pipelines. batchinfer names the FnApiRunner directly: the "
              "same engine, predictably, on any machine. It honours --direct_num_workers and "
              "--direct_running_mode.",
        live_metrics="process", cloud_clients=False),
    # `portable` hands every option to its job service, which may be Flink's, Spark's, Prism's
    # or Kafka Streams' job server, or Beam's Python one (an FnApiRunner: direct_*).
    Runner(
        name="portable", beam_runner="PortableRunner", required=("job_endpoint",),
        own_options=("SparkRunnerOptions", "PrismRunnerOptions", "KafkaStreamsRunnerOptions"),
        reads_options_of=("direct", "flink"), job_service=True),
    # Beam's PortableRunner asks the job service for its options when the job is submitted
    # (DescribePipelineOptions: the Java Flink runner's checkpointing_interval, say).
    Runner(
        name="flink", beam_runner="FlinkRunner", required=("flink_master",),
        own_options=("FlinkRunnerOptions",), job_service=True),
    Runner(
        name="dataflow", beam_runner="DataflowRunner",
        required=("project", "region", "temp_location"),
        needs="apache_beam.runners.dataflow.internal.apiclient",
        install="pip install 'batchinfer[dataflow]'", builds_job=True, live_metrics="result"),
    # Beam puts up to 128 elements in one Dask partition, so a partition's shards would all be
    # read by one worker; a shard per partition spreads them over the cluster (each partition
    # then loads the model once per worker process, from the per-process cache).
    # runner.options.dask_client_address names the scheduler (tcp://host:8786).
    Runner(
        name="dask", beam_runner="batchinfer.pipeline.dask.DaskRunner",
        defaults={"dask_partition_size": 1}, defaults_unless=("dask_npartitions",),
        needs="dask.distributed", install="pip install 'batchinfer[dask]'",
        own_options=("DaskOptions",), live_metrics="result",
        fixes="Beam's DaskRunner with its finish_bundle outputs kept and the job finished "
              "without its launcher, and Beam metrics reported from its workers "
              "(pipeline/dask.py)."),
)

_REGISTRY: Registry[Runner] = Registry(kind="runner", entry_type=Runner, group="batchinfer.runners",
                                       builtin=BUILTIN)
