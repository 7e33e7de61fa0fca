"""Beam's DaskRunner (``runner.name: dask``), with the one fix batchinfer's pipeline needs.

Beam 2.77's DaskRunner runs each ParDo over a Dask partition in ``apply_dofn_to_bundle``, which
collects the partition's outputs *before* calling ``finish_bundle``: whatever a DoFn emits there
is lost. ``BatchElements`` (inside every ``RunInference``) emits the last batch of a bundle in
``finish_bundle``, and so does WriteBatch with its writer thread, so on the stock runner the
last batch of every partition vanished and the shard accounting failed ("5000 rows in the
footer, 4000 read"). This runner swaps in the same function with the two steps in the right
order, for the pipelines it runs; everything else is Beam's.

Imported only when a job names the ``dask`` runner (it needs ``dask.distributed``: the ``dask``
extra).
"""
from __future__ import annotations

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
    """Executes a pipeline on a ``dask.distributed`` cluster, keeping ``finish_bundle`` outputs."""

    def run_pipeline(self, pipeline, options):
        # ParDo's translation looks the function up when the task graph is built (here, in the
        # launching process); the graph then names this module's function, which the workers
        # import (batchinfer is installed there, as for every runner).
        transform_evaluator.apply_dofn_to_bundle = apply_dofn_to_bundle
        return super().run_pipeline(pipeline, options)
