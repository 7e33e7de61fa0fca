"""The version triple's parts and where they come from: schema versions (``schemas``), the
preprocessing step (``preprocess``) and the user code they are loaded from (``sources``), the
model file or registry version (``models``) and the local copies of registry models
(``model_cache``), the triple, declarations and digests (``contract``), and the walk over the
preprocessing's imports that finds its code and packages (``import_walk``).

May import the core (``errors``, ``backends``, ``imports``), ``rows`` (a schema's columns) and
``io`` (MLflow clients for registry models); never the pipeline, handlers or commands.
"""
