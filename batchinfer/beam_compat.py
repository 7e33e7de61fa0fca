"""Apache Beam, as batchinfer imports it, and the parts of it that batchinfer uses beyond its
documented surface, in one place. Modules of batchinfer import ``beam`` from here.

``tests/unit/test_beam_compat.py`` exercises each of them against the installed Beam, so an upgrade
that moves or changes one fails there, with its name, rather than somewhere inside a run.

- Beam imports torch for a RunInference model manager batchinfer does not use (1–6 s here when
  torch is installed) and boto3 for an S3 client it does not use (fsspec reads S3); both
  imports are guarded by ``except ImportError`` in Beam, so they are hidden while Beam is first
  imported (:func:`batchinfer.imports.without`; both stay importable afterwards). This works
  only if no other module imported Beam first — hence one place.
- A coder that only *estimates* element sizes (``CallbackCoderImpl(size_estimator=…)``): Beam
  samples sizes by encoding elements, which pickles whole batches with the default coder.
- Emitting elements from ``finish_bundle`` needs a ``WindowedValue``; batchinfer's elements
  live in the global window.
- The flags Beam's option parser knows, by the options class that registers them
  (``PipelineOptions._add_argparse_args``, on Beam's own parser class): Beam only warns about a
  flag it does not know and runs without it; batchinfer refuses it (``pipeline/runner_options.py``).
- Two replacements, each scoped to one call and restored after it (nothing else in batchinfer
  assigns to Beam's modules or objects; ``tests/unit/test_beam_compat.py`` checks it):
  :func:`dask_bundles_applied_by` swaps the function the DaskRunner applies to each bundle
  while it builds a graph (``pipeline/dask.py``), and :func:`pipeline_handing_over` lets the
  caller see a pipeline's result between ``run`` and ``wait_until_finish`` (what
  ``with beam.Pipeline(...)`` does, with Beam's services context and its
  ``no_wait_until_finish`` kept).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .imports import without

with without("torch", "boto3"):  # first: whichever Beam module imports them first would
    import apache_beam as beam
    import apache_beam.ml.inference.base as _inference
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

ModelHandler = _inference.ModelHandler
PredictionResult = _inference.PredictionResult
RunInference = _inference.RunInference


def size_estimating_coder_impl(encode: Callable[[Any], bytes], decode: Callable[[bytes], Any],
                               size_estimator: Callable[[Any], int]):
    """A coder implementation that encodes with ``encode`` but sizes with ``size_estimator``."""
    return beam.coders.coder_impl.CallbackCoderImpl(encode, decode, size_estimator=size_estimator)


def option_flags() -> dict[type, tuple[str, ...]]:
    """The flags (``--name``, aliases included) of every ``PipelineOptions`` subclass imported
    so far, by class, as Beam's own parser registers them (``get_all_options`` does the same).
    A runner's own options class (Beam's ``DaskOptions``) is known once its module is imported."""
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    flags = {}
    # Beam's get_all_options: the last of classes that share a name wins (a module imported twice).
    for cls in {str(c): c for c in PipelineOptions.__subclasses__()}.values():
        parser = _BeamArgumentParser(allow_abbrev=False, add_help=False)
        cls._add_argparse_args(parser)
        flags[cls] = tuple(s for action in parser._actions for s in action.option_strings
                           if s.startswith("--"))
    return flags


def in_global_window(value: Any) -> WindowedValue:
    """``value`` as an element of the global window (what ``finish_bundle`` must yield)."""
    return WindowedValue(value, MIN_TIMESTAMP, (GlobalWindow(),))


@contextlib.contextmanager
def dask_bundles_applied_by(apply: Callable[..., list]) -> Iterator[None]:
    """While it lasts, Beam's DaskRunner builds each ParDo as ``apply`` over a Dask partition
    instead of its own ``transform_evaluator.apply_dofn_to_bundle``. The translation looks the
    function up when the graph is built, so the graph keeps naming ``apply`` after this ends."""
    from apache_beam.runners.dask import transform_evaluator

    stock = transform_evaluator.apply_dofn_to_bundle
    transform_evaluator.apply_dofn_to_bundle = apply
    try:
        yield
    finally:
        transform_evaluator.apply_dofn_to_bundle = stock


@contextlib.contextmanager
def pipeline_handing_over(options: Any, on_result: Callable[[Any], None]) -> Iterator[Any]:
    """``with beam.Pipeline(options=options) as pipeline`` (run when the block ends without an
    exception, then wait), with ``on_result(result)`` called once ``run`` returns, before the
    wait: a runner that hands over a running job is followed while it runs."""
    pipeline = beam.Pipeline(options=options)
    run = pipeline.run

    def handing_over(*args: Any, **kwargs: Any) -> Any:
        result = run(*args, **kwargs)
        on_result(result)
        return result

    pipeline.run = handing_over  # type: ignore[method-assign]  # this instance, this block only
    try:
        with pipeline:
            yield pipeline
    finally:
        del pipeline.run
