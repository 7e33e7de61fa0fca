"""MLflow's log_batch limits (1000 metrics, 100 params, 100 tags a call) against a real local
server's REST API: a run with more of each is logged whole (batchinfer chunks the calls itself;
MLflow 3.17's client happens to split them too), and the input partition is a dataset input."""
from __future__ import annotations

import pytest

from batchinfer.io.tracking import connect, upload

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_more_than_one_batch_of_everything_is_logged(mlflow_live):
    client, experiment = connect(mlflow_live.uri, "chunks")
    metrics = {f"drift_psi.c{i:04d}": i / 10 for i in range(2500)}
    params = {f"p{i:03d}": str(i) for i in range(250)}
    tags = {f"batchinfer.t{i:03d}": "x" for i in range(150)}
    run = client.create_run(experiment).info.run_id
    upload(client, run, params, metrics, {"report.html": "<!DOCTYPE html>"}, tags=tags,
           dataset={"name": "job-input-2026-01-31", "digest": "ab" * 16, "source": "/data/dt=2026-01-31",
                    "rows": "10", "shards": "2"})
    got = client.get_run(run)
    assert got.data.metrics == metrics
    assert got.data.params == params
    assert {k: v for k, v in got.data.tags.items() if k.startswith("batchinfer.")} == tags
    assert got.info.status == "FINISHED"
    (dataset,) = got.inputs.dataset_inputs
    assert (dataset.dataset.name, dataset.dataset.digest) == ("job-input-2026-01-31", "ab" * 16)
    assert [(t.key, t.value) for t in dataset.tags] == [("mlflow.data.context", "inference")]
    assert [a.path for a in client.list_artifacts(run)] == ["report.html"]
