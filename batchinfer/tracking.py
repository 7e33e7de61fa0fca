"""Job metrics to MLflow, without ever losing results (SPEC §5.7).

The run is opened in a background thread as soon as a job starts, so MLflow's import and a new
store's migrations (about 2.5 s here) overlap the scoring. After the commit, metrics and the
manifest are logged. Whatever MLflow does, the same record is written beside the manifest as
``_metrics.json``; when MLflow failed it says ``"uploaded": false`` and
``batchinfer track OUTPUT`` uploads it later.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Mapping

# MLflow's HTTP client retries for minutes by default; a nightly job should say "tracking is
# down" in seconds and commit anyway. A user's own settings win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
# MLflow logs store migrations at INFO; batchinfer reports tracking in its own summary line.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


class TrackingRun:
    """An MLflow run opened in the background; :meth:`finish` logs and closes it.

    Args:
        uri: tracking URI (``sqlite:///…``, ``http://…``, a folder).
        experiment: experiment name (created if missing).
        run_name: the run's name.
        tags: tags set at creation.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, tags: Mapping[str, str]):
        self.uri = uri
        self.experiment = experiment
        self.run_id: str | None = None
        self.error: str | None = None
        self._client = None
        self._thread = threading.Thread(target=self._open, args=(run_name, dict(tags)),
                                        name="batchinfer-mlflow", daemon=True)
        self._thread.start()

    def _open(self, run_name: str, tags: dict) -> None:
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.uri)
            experiment = client.get_experiment_by_name(self.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.experiment))
            run = client.create_run(experiment_id, run_name=run_name, tags=tags)
            self._client, self.run_id = client, run.info.run_id
        except Exception as exc:  # tracking must never sink a job
            self.error = short_error(exc)

    def wait(self, timeout: float | None = 120.0) -> str | None:
        """Wait for the run to open; return its id (None if MLflow failed)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.error = self.error or f"MLflow at {self.uri} did not answer within {timeout:.0f} s"
            return None
        return self.run_id

    def finish(self, params: Mapping[str, Any], metrics: Mapping[str, float],
               artifacts: Mapping[str, str], status: str = "FINISHED") -> bool:
        """Log params, metrics and text artifacts; close the run. True if all was uploaded."""
        if self.wait() is None:
            return False
        try:
            upload(self._client, self.run_id, params, metrics, artifacts, status)
            return True
        except Exception as exc:
            self.error = short_error(exc)
            return False


def upload(client, run_id: str, params: Mapping[str, Any], metrics: Mapping[str, float],
           artifacts: Mapping[str, str], status: str = "FINISHED") -> None:
    import time

    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    client.log_batch(run_id,
                     metrics=[Metric(k, float(v), now, 0) for k, v in sorted(metrics.items())],
                     params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
    for name, text in artifacts.items():
        client.log_text(run_id, text, name)
    client.set_terminated(run_id, status)


def upload_pending(uri: str, experiment: str, record: dict) -> str:
    """Upload a ``_metrics.json`` record that could not be uploaded at run time; return run id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run_id = record.get("mlflow_run_id")
    if run_id is None:
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run_id = client.create_run(experiment_id, run_name=record.get("run_name"),
                                   tags=record.get("tags", {})).info.run_id
    upload(client, run_id, record["params"], record["metrics"],
           {"manifest.json": record.get("manifest_text", "")})
    return run_id
