"""The application layer: what the commands share, one module per meaning —

- ``resolve``: a job resolved (everything it names looked up, the triple computed and checked),
  its partition, input listing and sink; used by every command that reads a job;
- ``input_validation``: a partition's shards checked against the schema and the preprocessing
  (``validate``), and the read → validate loop every reader of a job's input outside the
  pipeline shares;
- ``explain_plan``: the job's ``explain`` section resolved against each loaded model;
- ``model_runs``: the champion and each challenger built, checked and loaded as the pipeline's
  ``ModelRun``;
- ``drift_baseline``: the drift baseline a run is compared with, read and checked;
- ``pipeline_run``: the Beam pipeline of a run, and Beam's errors made ours;
- ``run_progress``: live progress of a run while it scores;
- ``run_record``: the record of a run (MLflow, ``_metrics.json``, ``_profile.json``, the drift
  report);
- ``job_report``: the job report (``report.html``);
- ``job_history``: a job over a range of dates, from each date's records (``batchinfer history``,
  pure), and ``history_page``, its page;
- ``html_parts``: what the report and the history page share (stylesheet, escaping, tables).
- ``run_lineage``: a run's OpenLineage events as its phases pass (``io.lineage`` builds and
  sends them).

May import every package below the commands (``spec``, ``triple``, ``rows``, ``io``,
``handlers``, ``pipeline``, ``beam_compat``) and the core; never ``convert``, ``commands``,
``demo`` or ``cli``, which import it.
"""
