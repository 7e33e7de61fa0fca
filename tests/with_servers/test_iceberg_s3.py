"""``output.format: iceberg`` with its tables on S3 (moto in server mode) and the catalog named by
``output.catalog`` (a sqlite SQL catalog in a local file): the job reaches the store only
through the standard ``AWS_*`` variables, which batchinfer passes to pyiceberg's FileIO
(``s3.endpoint``); the table's data files are the run's objects, where it wrote them; an
``--overwrite`` replaces the partition and time travel gives the previous rows; a commit killed
between its tables and its manifest is finished by ``inspect`` of the partition. Without
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

    # A third commit killed between its predictions table and its manifest: our reader of the
    # object store finishes it from the scratch the run left there (contract §4 "Exactly once").
    killed = run_cli(*with_catalog, "--overwrite", cwd=tmp_path,
                     env={**s3_server.env, "BATCHINFER_FAULT": "after_table_commit"})
    assert killed.returncode < 0, killed.stderr
    (pending,) = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/tables/_batchinfer/dt={DS}/_tmp")]
    shown = run_cli("inspect", f"{url}/dt={DS}", cwd=tmp_path, env=s3_server.env)
    assert shown.returncode == 0 and f"attempt {pending}" in shown.stdout, shown.stdout + shown.stderr
    fs.invalidate_cache()
    finished = json.loads(fs.cat_file(f"{bucket}/tables/_batchinfer/dt={DS}/_manifest.json"))
    assert (finished["attempt"], finished["table"]["generation"]) == (pending, 3)


def test_an_iceberg_table_input_on_s3_is_read_through_the_catalog(tmp_path, s3_server):
    """``input.format: iceberg`` with the table's files on S3: pyiceberg's FileIO gets the
    endpoint from ``AWS_ENDPOINT_URL`` (as the output does); the shards are the snapshot's files,
    read through s3fs, and the manifest names the snapshot."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = s3_server.make_bucket()
    numeric_project(tmp_path, shards=2, rows=300)
    database = tmp_path / "catalog" / "features.db"
    database.parent.mkdir()
    catalog = load_catalog("features", type="sql", uri=f"sqlite:///{database}",
                           warehouse=f"s3://{bucket}/warehouse",
                           **{"s3.endpoint": s3_server.endpoint, "s3.region": "us-east-1",
                              "s3.access-key-id": "testing", "s3.secret-access-key": "testing"})
    catalog.create_namespace("feats")
    data = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "data" / f"dt={DS}").glob("*.parquet"))])
    # Unpartitioned: the job's schema is strict, and an Iceberg file holds its partition columns.
    table = catalog.create_table("feats.raw", schema=data.schema)
    table.append(data)
    snapshot = catalog.load_table("feats.raw").current_snapshot().snapshot_id
    run = ("run", "job.yaml", "--ds", DS, "--set",
           f'input={{format: iceberg, path: feats.raw, '
           f'catalog: {{name: features, uri: "sqlite:///{database}"}}}}')
    done = run_cli(*run, cwd=tmp_path, env=s3_server.env)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert manifest["input_table"]["version"] == snapshot
    assert manifest["totals"]["rows_scored"] == 600
    assert all(s["path"].startswith(f"s3://{bucket}/warehouse/") for s in manifest["shards"])
