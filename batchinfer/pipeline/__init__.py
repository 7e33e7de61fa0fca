"""The Beam pipeline that scores one partition: the transforms (``transforms``), the reading of
a shard into prepared batches (``prepare``), the writer's parts that its one writer composes
(``writer``: a file's columns, the drift statistics, the rejected rows, the champion's or a
challenger's policy), what the stages report about each shard and how that folds into a shard's
result (``shard_reports``), the pipeline's last step that commits the partition
(``commit_step``), what the stages count as Beam metrics (``counters``), the coder of batch
elements (``coders``), the Beam options of the runners a job can name (``runner_options``) and
batchinfer's Dask runner (``dask``).

May import the core, ``beam_compat``, ``rows``, ``io``, ``triple`` and ``handlers``; never
``commands`` (the commands drive the pipeline, not the other way round).
"""
