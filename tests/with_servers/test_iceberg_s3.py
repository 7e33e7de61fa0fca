"""``output.format: iceberg`` with its tables on S3 (moto in server mode) and the catalog named by
``output.catalog`` (a sqlite SQL catalog in a local file): the job reaches the store only
through the standard ``AWS_*`` variables, which batchinfer passes to pyiceberg's FileIO
(``s3.endpoint``); the table's data files are the run's objects, where it wrote them; an
``--overwrite`` replaces the partition and time travel gives the previous rows. Without
``output.catalog`` an S3 output is refused before any work (exit 2)."""
from __future__ import annotations

import json

import pytest
from pyiceberg.catalog import load_catalog
from pyiceberg.expressions import EqualTo

from factories import DS, numeric_project, one_line_error, run_cli

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_iceberg_tables_on_s3(tmp_path, s3_server):
    bucket = s3_server.make_bucket()
    numeric_project(tmp_path, shards=2, rows=300)
    url = f"s3://{bucket}/tables"
    database = tmp_path / "catalog" / "iceberg.db"
    run = ("run", "job.yaml", "--ds", DS, "--set", "output.format=iceberg", "--set", f"output.path={url}")
    with_catalog = (*run, "--set", f'output.catalog={{uri: "sqlite:///{database}"}}')

    refused = run_cli(*run, cwd=tmp_path, env=s3_server.env)
    assert refused.returncode == 2
    assert "needs output.catalog" in one_line_error(refused)

    first = run_cli(*with_catalog, cwd=tmp_path, env=s3_server.env)
    assert first.returncode == 0, first.stderr
    again = run_cli(*with_catalog, "--overwrite", cwd=tmp_path, env=s3_server.env)
    assert again.returncode == 0, again.stderr

    fs = s3_server.s3fs()
    manifest = json.loads(fs.cat_file(f"{bucket}/tables/_batchinfer/dt={DS}/_manifest.json"))
    assert manifest["table"]["generation"] == 2
    catalog = load_catalog("batchinfer", type="sql", uri=f"sqlite:///{database}",
                           **{"s3.endpoint": s3_server.endpoint, "s3.region": "us-east-1",
                              "s3.access-key-id": "testing", "s3.secret-access-key": "testing"})
    table = catalog.load_table("batchinfer.testjob")
    assert table.location() == url
    planned = {t.file.file_path for t in table.scan(row_filter=EqualTo("dt", DS)).plan_files()}
    assert planned == {f"{url}/{f['path']}" for s in manifest["shards"] for f in s["files"]}
    rows = table.scan(row_filter=EqualTo("dt", DS)).to_arrow()
    assert rows.num_rows == manifest["totals"]["rows_scored"] == 600
    (previous,) = [s for s in table.snapshots()
                   if s.summary.additional_properties.get("batchinfer.generation") == "1"]
    then = table.scan(row_filter=EqualTo("dt", DS), snapshot_id=previous.snapshot_id).to_arrow()
    assert then.num_rows == 600
    assert not set(then["_inference_id"].to_pylist()) & set(rows["_inference_id"].to_pylist())
