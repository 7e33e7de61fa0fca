"""The Beam pipeline that scores one partition: the transforms (``transforms``), the writer's
parts that its one writer composes (``writer``: a file's columns, the drift statistics, the
rejected rows, the champion's or a challenger's policy), what they say about each shard and how
that folds into a shard's result (``records``), the coder of batch elements (``coders``) and the
runners a job can name (``runners``).

May import the core, ``beam_compat``, ``rows``, ``io``, ``triple`` and ``handlers``; never
``commands`` (the commands drive the pipeline, not the other way round).
"""
