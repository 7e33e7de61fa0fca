"""Models: the small model protocol a backend implements, the backends, and the one Beam handler
that composes the run's policies around them.

- ``protocol``: ``ModelBackend`` (``load``, ``facts``, ``predict``; optional traits and hooks),
  ``ModelFacts``, ``cast_input``;
- ``onnx``, ``pytorch``, ``tensorrt``: batchinfer's backends (``explain`` is not one: the
  attribution methods, pure apart from the model calls);
- ``base``: ``BatchModelHandler``, Beam's ``ModelHandler`` around any backend, and
  ``handler_for`` (a registered backend's handler);
- ``loaded``: ``LoadedModel``, the one surface to a loaded model (facts, predict under the call
  lock, attribute);
- ``scorer``: ``Scorer``, one batch scored: ``Prepared`` in, ``Inference`` out;
- the policies it composes: ``tokens`` (token ordering), ``calls`` (call planning), ``oom``
  (out-of-memory back-off), ``batch_contract``; ``sharing`` (the per-process model cache and
  call locks); row isolation is ``rows/isolation.py``.

Which backends exist, their file suffixes and options, and which class implements each, is said
once, in :mod:`batchinfer.backends`. This package may import the core (``errors``, ``backends``,
``beam_compat``, ``imports``) and ``rows`` (row isolation), never the pipeline, commands or I/O.
"""
