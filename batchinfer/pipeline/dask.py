"""Beam's DaskRunner (``runner.name: dask``), with the fixes batchinfer's pipeline needs.

Beam 2.77's DaskRunner runs each ParDo over a Dask partition in ``apply_dofn_to_bundle``, which
collects the partition's outputs *before* calling ``finish_bundle``: whatever a DoFn emits there
is lost. ``BatchElements`` (inside every ``RunInference``) emits the last batch of a bundle in
``finish_bundle``, and so does WriteBatch with its writer thread, so on the stock runner the
last batch of every partition vanished and the shard accounting failed ("5000 rows in the
footer, 4000 read"). This runner swaps in the same function with the two steps in the right
order, for the pipelines it runs (while it builds their graph only:
:func:`batchinfer.beam_compat.dask_bundles_applied_by`).

It also keeps the job alive without its launcher. dask.distributed runs a task only while some
client wants it, and releases every task of a client that disconnects: Beam's runner computes
the graph's final step (our commit, pipeline/commit_step.py) as the launcher's future, so a launcher
that died took the whole job with it and nothing was committed. The final futures are marked
``fire_and_forget``, so the cluster finishes the job, commit included, whether or not the
launcher lives; a live launcher still waits for them as before, and one that stops on purpose
(Ctrl-C, a failure it saw) cancels them before it removes the attempt's files. Everything
else is Beam's.

And it reports Beam metrics, which Beam's DaskRunner does not (its ``metrics()`` raises
NotImplementedError, and no metrics container is set on its workers, so every counter a DoFn
bumps is dropped). Each DoFn's bundle (a Dask partition) counts into a metrics container of its
own, and the worker sends its figures to the scheduler as a Dask event (``log_event`` on the
topic ``batchinfer-metrics``, tagged with the job's id): at most every second while the bundle
runs, and once when it ends. The launcher subscribes to the topic, and its result's
``metrics()`` answers from what arrived: *attempted* figures sum every attempt's latest report;
*committed* figures hold, for each task and step, the last attempt that ended (a task that a
lost worker's death reruns is counted once). The scheduler keeps the topic's last 1,000 events
(``distributed.admin.low-level-log-length``) for a launcher that subscribes late.

Imported only when a job names the ``dask`` runner (it needs ``dask.distributed``: the ``dask``
extra).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
from typing import Any

from apache_beam.metrics.cells import DistributionData, DistributionResult
from apache_beam.metrics.execution import MetricKey, MetricResult, MetricsContainer
from apache_beam.metrics.metric import MetricResults
from apache_beam.metrics.metricbase import MetricName
from apache_beam.runners.common import DoFnInvoker
from apache_beam.runners.dask import dask_runner
from apache_beam.runners.worker import statesampler
from apache_beam.utils.counters import CounterFactory

from ..beam_compat import dask_bundles_applied_by
from .counters import NAMESPACE

TOPIC = "batchinfer-metrics"
REPORT_EVERY_S = 1.0


def apply_dofn_to_bundle(job: str, items: Any, do_fn_invoker_args: Any,
                         do_fn_invoker_kwargs: Any, tagged_receivers: Any) -> list:
    """Beam's ``transform_evaluator.apply_dofn_to_bundle``, collecting after ``finish_bundle``,
    with the bundle's Beam metrics counted and reported to the launcher of ``job``."""
    report = _Report(job, getattr(do_fn_invoker_kwargs.get("context"), "label", ""))
    sampler = statesampler.StateSampler("", CounterFactory())
    previous = statesampler.get_current_tracker()
    statesampler.set_current_tracker(sampler)
    try:
        with sampler.scoped_state(report.step, "process", metrics_container=report.container):
            invoker = DoFnInvoker.create_invoker(*do_fn_invoker_args, **do_fn_invoker_kwargs)
            invoker.invoke_setup()
            invoker.invoke_start_bundle()
            for item in items:
                invoker.invoke_process(item)
                report.send()
            invoker.invoke_finish_bundle()
            invoker.invoke_teardown()
        report.send(final=True)
    finally:
        statesampler.set_current_tracker(previous)
    return [v.value for v in tagged_receivers.values]


class _Report:
    """One bundle attempt's metrics, sent to the scheduler as events (cumulative figures: the
    launcher keeps each attempt's latest)."""

    def __init__(self, job: str, step: str):
        self.job, self.step = job, step
        self.container = MetricsContainer(step)
        self.attempt = uuid.uuid4().hex
        self.seq = 0
        self.sent_at = time.monotonic()

    def send(self, final: bool = False) -> None:
        if not final and time.monotonic() - self.sent_at < REPORT_EVERY_S:
            return
        updates = self.container.get_cumulative()
        counters = {k.metric.name: int(v) for k, v in updates.counters.items()
                    if k.metric.namespace == NAMESPACE}
        distributions = {k.metric.name: [v.sum, v.count, v.min, v.max]
                         for k, v in updates.distributions.items()
                         if k.metric.namespace == NAMESPACE and v.count}
        if not counters and not distributions:
            return
        try:
            import distributed

            worker = distributed.get_worker()
            key = str(worker.get_current_task())
        except (ImportError, ValueError):   # not on a dask.distributed worker: nobody to tell
            return
        self.seq += 1
        self.sent_at = time.monotonic()
        worker.log_event(TOPIC, {"job": self.job, "attempt": self.attempt, "seq": self.seq,
                                 "key": key, "step": self.step, "final": final,
                                 "counters": counters, "distributions": distributions})


class DaskMetrics(MetricResults):
    """The Beam metrics of one job, from the events its workers sent (see the module docstring):
    attempted and committed counters and distributions, by step."""

    def __init__(self, attempts: dict[str, dict]):
        self.attempted = _sum(attempts.values())
        ended: dict[tuple[str, str], dict] = {}
        for report in attempts.values():   # in arrival order: the last attempt that ended wins
            if report["final"]:
                ended[(report["key"], report["step"])] = report
        self.committed = _sum(ended.values())

    def query(self, filter=None):
        results: dict[str, list] = {self.COUNTERS: [], self.DISTRIBUTIONS: []}
        for kind in (self.COUNTERS, self.DISTRIBUTIONS):
            for key in sorted(set(self.attempted[kind]) | set(self.committed[kind])):
                metric = MetricKey(key[0], MetricName(NAMESPACE, key[1]))
                if self.matches(filter, metric):
                    results[kind].append(MetricResult(metric, self.committed[kind].get(key),
                                                      self.attempted[kind].get(key)))
        return {**results, self.GAUGES: [], self.STRINGSETS: [], self.BOUNDED_TRIES: []}


def _sum(reports) -> dict[str, dict]:
    """Counters and distributions (as Beam's results) summed over ``reports``, by (step, name)."""
    counters: dict[tuple[str, str], int] = {}
    data: dict[tuple[str, str], DistributionData] = {}
    for report in reports:
        for name, value in report["counters"].items():
            key = (report["step"], name)
            counters[key] = counters.get(key, 0) + value
        for name, (total, count, low, high) in report["distributions"].items():
            key = (report["step"], name)
            one = DistributionData(total, count, low, high)
            data[key] = data[key].combine(one) if key in data else one
    return {MetricResults.COUNTERS: counters,
            MetricResults.DISTRIBUTIONS: {k: DistributionResult(v) for k, v in data.items()}}


class _Events:
    """The metrics events of one job, as they arrive on the launcher's client (from its event
    loop's thread); each attempt's latest report."""

    def __init__(self, job: str):
        self.job = job
        self._lock = threading.Lock()
        self._attempts: dict[str, dict] = {}

    def add(self, event: Any) -> None:
        _, msg = event
        if not isinstance(msg, dict) or msg.get("job") != self.job:
            return
        with self._lock:
            known = self._attempts.get(msg["attempt"])
            if known is None or known["seq"] < msg["seq"]:
                self._attempts.pop(msg["attempt"], None)   # arrival order: latest last
                self._attempts[msg["attempt"]] = msg

    def metrics(self) -> DaskMetrics:
        with self._lock:
            return DaskMetrics(dict(self._attempts))


class DaskRunner(dask_runner.DaskRunner):
    """Executes a pipeline on a ``dask.distributed`` cluster, keeping ``finish_bundle`` outputs
    and finishing the job without its launcher."""

    def run_pipeline(self, pipeline, options):
        # ParDo's translation looks the function up when the task graph is built (here, in the
        # launching process); the graph then names this module's function, which the workers
        # import (batchinfer is installed there, as for every runner).
        # The job's id goes with the function: workers tag their metrics with it.
        job = uuid.uuid4().hex
        with dask_bundles_applied_by(functools.partial(apply_dofn_to_bundle, job)):
            result = super().run_pipeline(pipeline, options)
        ours = DaskRunnerResult(result.client, result.futures)
        ours.follow(job)
        return ours


class DaskRunnerResult(dask_runner.DaskRunnerResult):
    """Beam's result, with the job's final futures owned by the cluster (``fire_and_forget``)
    rather than by the launcher's client alone."""

    def __post_init__(self):
        import distributed

        super().__post_init__()
        # Sent on the client's stream right after the graph, so the scheduler learns both in order.
        distributed.fire_and_forget(self.futures)
        self._events: _Events | None = None

    def follow(self, job: str) -> None:
        """Collect the metrics events of ``job`` (those sent before, kept by the scheduler, too)."""
        self._events = _Events(job)
        self.client.subscribe_topic(TOPIC, self._events.add)
        self._catch_up()

    def _catch_up(self) -> None:
        if self._events is not None:
            with contextlib.suppress(Exception):
                for event in self.client.get_events(TOPIC):
                    self._events.add(event)

    def metrics(self) -> MetricResults:
        """The job's Beam metrics so far (attempted), and of the bundles that ended (committed)."""
        if self._events is None:
            raise NotImplementedError("this job's metrics are not followed")
        return self._events.metrics()

    def wait_until_finish(self, duration=None) -> str:
        try:
            state = super().wait_until_finish(duration)
            self._catch_up()   # an event the subscription missed, if the scheduler kept it
            return state
        except BaseException as exc:
            if duration is None or not isinstance(exc, TimeoutError):
                self._stop()
            raise

    def _stop(self) -> None:
        # The launcher stops waiting (Ctrl-C, or the job failed) and will then remove the
        # attempt's files: the job must not go on to write or commit behind it. ``force``: the
        # fire-and-forget pseudo-client wants the futures too. Closing the client flushes the
        # cancellation to the scheduler before the process can exit.
        with contextlib.suppress(Exception):
            self.client.cancel(self.futures, force=True)
            self.client.close()
