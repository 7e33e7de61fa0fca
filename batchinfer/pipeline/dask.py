"""Beam's DaskRunner (``runner.name: dask``), with the two fixes batchinfer's pipeline needs.

Beam 2.77's DaskRunner runs each ParDo over a Dask partition in ``apply_dofn_to_bundle``, which
collects the partition's outputs *before* calling ``finish_bundle``: whatever a DoFn emits there
is lost. ``BatchElements`` (inside every ``RunInference``) emits the last batch of a bundle in
``finish_bundle``, and so does WriteBatch with its writer thread, so on the stock runner the
last batch of every partition vanished and the shard accounting failed ("5000 rows in the
footer, 4000 read"). This runner swaps in the same function with the two steps in the right
order, for the pipelines it runs.

It also keeps the job alive without its launcher. dask.distributed runs a task only while some
client wants it, and releases every task of a client that disconnects: Beam's runner computes
the graph's final step (our commit, pipeline/commit.py) as the launcher's future, so a launcher
that died took the whole job with it and nothing was committed. The final futures are marked
``fire_and_forget``, so the cluster finishes the job, commit included, whether or not the
launcher lives; a live launcher still waits for them as before, and one that stops on purpose
(Ctrl-C, a failure it saw) cancels them before it removes the attempt's files. Everything
else is Beam's.

Imported only when a job names the ``dask`` runner (it needs ``dask.distributed``: the ``dask``
extra).
"""
from __future__ import annotations

import contextlib
from typing import Any

from apache_beam.runners.common import DoFnInvoker
from apache_beam.runners.dask import dask_runner, transform_evaluator


def apply_dofn_to_bundle(items: Any, do_fn_invoker_args: Any, do_fn_invoker_kwargs: Any,
                         tagged_receivers: Any) -> list:
    """Beam's ``transform_evaluator.apply_dofn_to_bundle``, collecting after ``finish_bundle``."""
    invoker = DoFnInvoker.create_invoker(*do_fn_invoker_args, **do_fn_invoker_kwargs)
    invoker.invoke_setup()
    invoker.invoke_start_bundle()
    for item in items:
        invoker.invoke_process(item)
    invoker.invoke_finish_bundle()
    invoker.invoke_teardown()
    return [v.value for v in tagged_receivers.values]


class DaskRunner(dask_runner.DaskRunner):
    """Executes a pipeline on a ``dask.distributed`` cluster, keeping ``finish_bundle`` outputs
    and finishing the job without its launcher."""

    def run_pipeline(self, pipeline, options):
        # ParDo's translation looks the function up when the task graph is built (here, in the
        # launching process); the graph then names this module's function, which the workers
        # import (batchinfer is installed there, as for every runner).
        transform_evaluator.apply_dofn_to_bundle = apply_dofn_to_bundle
        result = super().run_pipeline(pipeline, options)
        return DaskRunnerResult(result.client, result.futures)


class DaskRunnerResult(dask_runner.DaskRunnerResult):
    """Beam's result, with the job's final futures owned by the cluster (``fire_and_forget``)
    rather than by the launcher's client alone."""

    def __post_init__(self):
        import distributed

        super().__post_init__()
        # Sent on the client's stream right after the graph, so the scheduler learns both in order.
        distributed.fire_and_forget(self.futures)

    def wait_until_finish(self, duration=None) -> str:
        try:
            return super().wait_until_finish(duration)
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
