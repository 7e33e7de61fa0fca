"""Model handlers: one module per backend, each a subclass of
:class:`~batchinfer.handlers.base.BatchModelHandler` (Beam's ``ModelHandler`` over prepared
batches).

Which backends exist, their file suffixes and options, and which class runs each, is said once,
in :mod:`batchinfer.backends`; this package holds the implementations. It may import the core
(``errors``, ``backends``, ``beam_compat``, ``imports``) and ``rows`` (row isolation), never the
pipeline, commands or I/O.
"""
