"""The writer's parts: one model's scored batch → its prediction file, its quarantine file and
its record, each part with one job. ``WritePredictions`` (pipeline/transforms.py) composes them
on its writer thread, the same code for the champion and each challenger:

- ``scored``: the batch as the model scored it — screened once (finite outputs), the scored rows,
  their ``_input_hash``, the attributions by feature — which every part below reads;
- ``table``: a prediction file's table from the parts that make its columns, in order:
  ``predictions`` (the id and prediction columns), ``explanations`` (with ``explain``: the
  explanation columns, their metadata, the batch's explanation figures), ``audit`` (the audit
  columns, as rows/columns.py declares them);
- ``profiling``: the batch's drift statistics (rows/column_profiles.py);
- ``rejects``: the rejected rows, quarantined or only counted;
- ``policy``: what differs between the champion and a challenger (``WritePolicy``): where its
  files go, what becomes of its rejected rows, whether it is profiled, the record it emits, how
  a shard's records fold into its result;
- ``finished``: the shards a writer has not finished writing (``OpenShards``), until it writes
  a shard's last batch — then the shard's result, which it writes at once.

All pure (Arrow and numpy in, Arrow tables and records out); the files are put by
``WritePredictions``, at the edge.

Part of the ``pipeline`` unit: may import the core, ``rows``, ``io`` (records, output folders),
``triple`` and ``handlers`` (the inference result, the explain plan), and ``pipeline.shard_reports``;
never ``commands``. No part uses Beam: ``WritePredictions`` is the DoFn that composes them.
"""
