"""The whole job against a real S3-compatible server (moto in server mode), contract §4, §5.1–5.3.

Shards live in ``s3://BUCKET/data/dt=DS/``; ``input.path`` and ``output.path`` are s3:// URLs;
the schema, model and job file are local. Jobs reach the server only through the standard
``AWS_*`` variables. Faults are injected by a proxy in front of the server (tests/servers.py).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from factories import DS, mlp_reference, read_partition, run_cli
from servers import copy_project, env_for, finish_all, start_cli

pytestmark = [pytest.mark.server, pytest.mark.slow]

SHARDS, ROWS = 3, 1000


def s3_project(template: Path, dest: Path, bucket: str, fs) -> Path:
    """Copy the stamped template to ``dest``, upload its shards to the bucket, point the job at S3."""
    for shard in sorted((template / "data" / f"dt={DS}").glob("*.parquet")):
        fs.pipe_file(f"{bucket}/data/dt={DS}/{shard.name}", shard.read_bytes())
    return copy_project(template, dest,
                        input={"path": f"s3://{bucket}/data/dt={{ds}}/*.parquet"},
                        output={"path": f"s3://{bucket}/out/dt={{ds}}", "id_columns": ["id"]})


def out_root(bucket: str) -> str:
    return f"{bucket}/out/dt={DS}"


def keys_under(fs, root: str) -> set[str]:
    """Every object under ``root``, relative to it."""
    fs.invalidate_cache()
    return {k[len(root) + 1:] for k in fs.find(root)}


def assert_committed_partition(fs, bucket: str, template: Path) -> dict:
    """Read the partition back through s3fs following the manifest; check contract §5.1 and §4."""
    root = out_root(bucket)
    preds, quar, manifest = read_partition(root, fs=fs)
    totals = manifest["totals"]
    assert totals == {"shards": SHARDS, "rows_in": SHARDS * ROWS, "rows_scored": SHARDS * ROWS,
                      "rows_quarantined": 0, "shards_unreadable": 0}
    expected_shards = [f"s3://{bucket}/data/dt={DS}/part-{s:05d}.parquet" for s in range(SHARDS)]
    assert [s["path"] for s in manifest["shards"]] == expected_shards
    for shard in manifest["shards"]:
        assert shard["rows_in"] == shard["rows_scored"] + shard["rows_quarantined"] == ROWS
        assert shard["status"] == "scored"
        for f in shard["files"]:  # the recorded sha256 is of the bytes in the store
            import hashlib

            assert hashlib.sha256(fs.cat_file(f"{root}/{f['path']}")).hexdigest() == f["sha256"]
    assert quar.num_rows == 0
    assert preds.num_rows == SHARDS * ROWS
    pairs = set(zip(preds.column("_source_shard").to_pylist(), preds.column("_source_row").to_pylist()))
    assert len(pairs) == preds.num_rows  # unique
    assert pairs == {(url, i) for url in expected_shards for i in range(ROWS)}  # covers every row
    # The predictions are the model's, row by row (joined on id with the local copy of the input).
    local = {}
    for s in range(SHARDS):
        table = pq.read_table(template / "data" / f"dt={DS}" / f"part-{s:05d}.parquet")
        x = np.stack([table.column(f"f{i}").to_numpy() for i in range(4)], axis=1)
        local.update(zip(table.column("id").to_pylist(), mlp_reference(x)))
    ids = preds.column("id").to_pylist()
    np.testing.assert_allclose(preds.column("y").to_numpy(), [local[i] for i in ids], atol=1e-5)
    # The partition is exactly what the manifest lists: no debris, no scratch.
    listed = {f["path"] for s in manifest["shards"] for f in s["files"]}
    present = keys_under(fs, root)
    data_files = {k for k in present if k.startswith(("predictions/", "quarantine/"))}
    assert data_files == listed
    assert not any(k.startswith("_tmp/") for k in present), present
    assert present - data_files <= {"_manifest.json", "_metrics.json", "_profile.json", "report.html"}
    return manifest


def test_run_commits_to_s3_and_rerun_is_a_noop(tmp_path, s3_server, new_bucket, stamped_template):
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert result.returncode == 0, result.stderr
    assert f"committed s3://{new_bucket}/out/dt={DS}" in result.stdout
    manifest = assert_committed_partition(fs, new_bucket, stamped_template)
    assert re.search(rf"attempt {manifest['attempt']}", result.stdout)

    before = {k: fs.cat_file(f"{out_root(new_bucket)}/{k}") for k in keys_under(fs, out_root(new_bucket))}
    again = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert again.returncode == 0, again.stderr
    assert "already committed" in again.stdout
    after = {k: fs.cat_file(f"{out_root(new_bucket)}/{k}") for k in keys_under(fs, out_root(new_bucket))}
    assert after == before  # the no-op changed nothing, byte for byte


def test_killed_run_resumes_from_what_it_finished_on_s3(tmp_path, s3_server, new_bucket,
                                                       stamped_template):
    """kill -9 right after a shard is finished, then rerun: the rerun adopts the finished
    shards where they are in the bucket (their files hashed again there) and scores the rest
    (contract §5.3 "Resume"); the cleanup keeps every listed file."""
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    root = out_root(new_bucket)
    killed = run_cli("run", str(job), "--ds", DS, cwd=tmp_path,
                     env={**s3_server.env, "BATCHINFER_FAULT": "shard_done"})
    assert killed.returncode == -9, killed.stderr
    finished = {k.split("/")[1] for k in keys_under(fs, root) if "/shards/" in k}
    assert len(finished) == 1, "one attempt, killed"
    results = [k for k in keys_under(fs, root) if "/shards/" in k]
    assert 1 <= len(results) < SHARDS
    rerun = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert rerun.returncode == 0, rerun.stderr
    assert f"reusing {len(results)} of {SHARDS} shards" in rerun.stdout + rerun.stderr
    fs.invalidate_cache()   # listed before the commit
    manifest = assert_committed_partition(fs, new_bucket, stamped_template)
    by = [s["scored_by"] for s in manifest["shards"]]
    assert sorted(set(by)) == sorted({manifest["attempt"], *finished})
    assert by.count(manifest["attempt"]) == SHARDS - len(results)


def test_update_on_s3_scores_the_late_shard_and_keeps_the_others_where_they_are(
        tmp_path, s3_server, s3_proxy, new_bucket, stamped_template):
    """A shard arrives late in the bucket and one goes: ``run --update`` (through the proxy,
    which logs every request) scores the late one only, writes no object of the kept shards
    (no PUT, no copy: the new manifest lists them where they are), drops the gone one's files,
    and commits what a clean run of the bucket as it is now commits (contract §5.3 "Update")."""
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    root, data = out_root(new_bucket), f"{new_bucket}/data/dt={DS}"
    first = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert first.returncode == 0, first.stderr
    fs.invalidate_cache()
    old = read_partition(root, fs=fs)[2]
    kept = {f["path"]: fs.info(f"{root}/{f['path']}")["ETag"] for s in old["shards"][:2] for f in s["files"]}
    gone = {f["path"] for f in old["shards"][2]["files"]}
    fs.pipe_file(f"{data}/part-{SHARDS:05d}.parquet", fs.cat_file(f"{data}/part-00000.parquet"))
    fs.rm(f"{data}/part-00002.parquet")
    update = run_cli("run", str(job), "--ds", DS, "--update", cwd=tmp_path, env=env_for(s3_proxy.url))
    assert update.returncode == 0, update.stderr
    assert "updating: keeping 2 of 3 shards (2,000 rows)" in update.stdout
    assert "scoring 1 (1 new, 0 rewritten); dropping 1 no longer listed" in update.stdout
    fs.invalidate_cache()
    preds, _, manifest = read_partition(root, fs=fs)
    assert [s["scored_by"] for s in manifest["shards"]] == [old["attempt"]] * 2 + [manifest["attempt"]]
    assert manifest["shards"][-1]["path"] == f"s3://{data}/part-{SHARDS:05d}.parquet"
    assert {k: fs.info(f"{root}/{k}")["ETag"] for k in kept} == kept
    written = [target for _, target, _ in s3_proxy.requests("PUT") + s3_proxy.requests("POST")]
    assert not [t for t in written if old["attempt"] in t], written   # nothing rewritten or copied
    present = keys_under(fs, root)
    assert not gone & present and not any(k.startswith("_tmp/") for k in present)
    assert {k for k in present if k.startswith(("predictions/", "quarantine/"))} == {
        f["path"] for s in manifest["shards"] for f in s["files"]}
    # The clean run's rows and predictions, bit for bit, for the shards as listed now.
    ref = run_cli("run", str(job), "--ds", DS, "--set", f"output.path=s3://{new_bucket}/ref",
                  cwd=tmp_path, env=s3_server.env)
    assert ref.returncode == 0, ref.stderr
    want = read_partition(f"{new_bucket}/ref", fs=fs)[0]
    keep = ["_source_shard", "_source_row", "_input_hash", "id", "y"]
    order = [("_source_shard", "ascending"), ("_source_row", "ascending")]
    assert preds.select(keep).sort_by(order).equals(want.select(keep).sort_by(order))


def test_two_concurrent_runs_commit_exactly_once(tmp_path, s3_server, s3_proxy, new_bucket,
                                                 stamped_template):
    """Both runs start at once through the (fault-free) proxy, which sees every manifest PUT."""
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    env = env_for(s3_proxy.url)
    procs = [start_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env) for _ in range(2)]
    results = finish_all(procs)
    for rc, _out, err in results:
        assert rc == 0, err
    committed = [out for _, out, _ in results if re.search(r"^committed s3://", out, re.M)]
    others = [out for _, out, _ in results if "already committed" in out]
    assert len(committed) == 1 and len(others) == 1, results
    manifest = assert_committed_partition(fs, new_bucket, stamped_template)
    assert f"attempt {manifest['attempt']}" in committed[0]
    # Exactly one conditional PUT of the manifest succeeded; any other was refused (412).
    puts = [status for _, _, status in s3_proxy.requests("PUT", "/_manifest.json")]
    assert puts.count(200) == 1, puts
    print(f"manifest PUTs {puts}; loser: {[line for line in others[0].splitlines() if 'already' in line]}")
    assert all(status in (200, 412) for status in puts), puts
    # The loser removed its own attempt: only the committed attempt's files remain.
    attempts = {k.split("/")[1] for k in keys_under(fs, out_root(new_bucket))
                if k.startswith(("predictions/", "quarantine/"))}
    assert attempts == {manifest["attempt"]}


def test_transient_faults_are_retried_and_the_run_commits(tmp_path, s3_server, s3_proxy, new_bucket,
                                                         stamped_template):
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    shard_gets = s3_proxy.add(method="GET", contains="/data/dt=", status=503, times=2)
    stall = s3_proxy.add(method="GET", contains="part-00002.parquet", stall_s=5, times=1)
    output_puts = s3_proxy.add(method="PUT", contains="/predictions/", status=503, times=2)
    scratch_put = s3_proxy.add(method="PUT", contains="/_tmp/", status=500, times=1)
    # The stall outlasts the client's read timeout (lowered through fsspec's standard config
    # variable so the test does not wait s3fs's default 15 s).
    env = {**env_for(s3_proxy.url), "FSSPEC_S3": '{"config_kwargs": {"read_timeout": 2}}'}
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^committed s3://", result.stdout, re.M)
    for rule in (shard_gets, stall, output_puts, scratch_put):
        assert rule.matched == rule.times, rule  # every fault was injected ...
    log = s3_proxy.requests()
    faulted = [(i, m, t) for i, (m, t, status) in enumerate(log) if status in (500, 503, "stall")]
    assert len(faulted) == 6, log
    for i, method, target in faulted:  # ... and the same request then went through
        assert (method, target, 200) in log[i + 1:], (method, target)
    assert_committed_partition(fs, new_bucket, stamped_template)


def test_persistent_put_failure_exits_5_without_commit(tmp_path, s3_server, s3_proxy, new_bucket,
                                                       stamped_template):
    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    s3_proxy.add(method="PUT", contains="", status=503, times=None)
    # Two attempts a request, not botocore's five with back-off (~15 s of waiting): a PUT that
    # always fails is still retried, and the run still gives up.
    result = run_cli("run", str(job), "--ds", DS, cwd=tmp_path,
                     env={**env_for(s3_proxy.url), "AWS_MAX_ATTEMPTS": "2"})
    assert result.returncode == 5, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("batchinfer run:") and "Traceback" not in result.stderr
    assert "committed" not in result.stdout.replace("nothing was committed", "")
    fs.invalidate_cache()
    assert not fs.exists(f"{out_root(new_bucket)}/_manifest.json")
    assert fs.find(f"{new_bucket}/out") == []  # every PUT failed: nothing was written at all
    # The failing PUT was retried before the run gave up.
    puts = s3_proxy.requests("PUT")
    targets = [t for _, t, _ in puts]
    assert any(targets.count(t) >= 2 for t in set(targets)), puts


def test_fault_proxy_forwards_faithfully(s3_server, s3_proxy, new_bucket):
    """The proxy the fault tests rely on: bodies, conditional puts (If-None-Match) and faults."""
    fs = s3_server.s3fs(s3_proxy.url)
    body = bytes(range(256)) * 5000  # 1.28 MB, over botocore's Expect: 100-continue threshold
    fs.pipe_file(f"{new_bucket}/p/x.bin", body, mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{new_bucket}/p/x.bin", b"other", mode="create")
    assert [s for _, _, s in s3_proxy.requests("PUT", "/p/x.bin")] == [200, 412]
    rule = s3_proxy.add(method="GET", contains="/p/x.bin", status=500, times=1)
    assert s3_server.s3fs(s3_proxy.url).cat_file(f"{new_bucket}/p/x.bin") == body
    assert rule.matched == 1
    assert s3_server.s3fs().cat_file(f"{new_bucket}/p/x.bin") == body  # stored as sent


def test_a_delta_output_on_s3_commits_replaces_and_reads_back_with_polars(
        tmp_path, s3_server, new_bucket, stamped_template):
    """``output.format: delta`` on the object store (contract §4 "Tables"): the log's commits
    are conditional puts (no lock table); a rerun is a no-op, ``--overwrite`` replaces the
    partition (never appends) and the previous version still reads."""
    import polars as pl
    from deltalake import DeltaTable

    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    tables = f"s3://{new_bucket}/tables"
    run = ("run", str(job), "--ds", DS, "--set", "output.format=delta", "--set", f"output.path={tables}")
    first = run_cli(*run, cwd=tmp_path, env=s3_server.env)
    assert first.returncode == 0, first.stderr
    again = run_cli(*run, cwd=tmp_path, env=s3_server.env)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
    replaced = run_cli(*run, "--overwrite", cwd=tmp_path, env=s3_server.env)
    assert replaced.returncode == 0, replaced.stderr
    options = {"endpoint_url": s3_server.env["AWS_ENDPOINT_URL"], "allow_http": "true",
               "aws_access_key_id": s3_server.env["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": s3_server.env["AWS_SECRET_ACCESS_KEY"],
               "aws_region": s3_server.env["AWS_DEFAULT_REGION"]}
    table = DeltaTable(tables, storage_options=options)
    assert table.version() == 1 and table.transaction_version(f"batchinfer:dt={DS}") == 2
    now = pl.read_delta(tables, storage_options=options)
    before = pl.read_delta(tables, version=0, storage_options=options)
    assert now.height == before.height == SHARDS * ROWS
    assert set(now["_inference_id"]).isdisjoint(set(before["_inference_id"]))
    manifest = fs.cat_file(f"{new_bucket}/tables/_batchinfer/dt={DS}/_manifest.json")
    assert b'"generation": 2' in manifest


def test_a_delta_table_input_on_s3_is_scored_at_the_version_it_pins(
        tmp_path, s3_server, new_bucket, stamped_template):
    """``input.format: delta`` on the object store: the table's files at one version are the
    shards (read through s3fs), the manifest names the version, a new table version leaves the
    committed partition as it is (a rerun is a no-op)."""
    import pyarrow as pa
    from deltalake import write_deltalake

    options = {"endpoint_url": s3_server.env["AWS_ENDPOINT_URL"], "allow_http": "true",
               "aws_access_key_id": s3_server.env["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": s3_server.env["AWS_SECRET_ACCESS_KEY"],
               "aws_region": s3_server.env["AWS_DEFAULT_REGION"], "conditional_put": "etag"}
    features = f"s3://{new_bucket}/features"
    shards = sorted((stamped_template / "data" / f"dt={DS}").glob("*.parquet"))
    for shard in shards:
        table = pq.read_table(shard)
        write_deltalake(features, table.append_column("dt", pa.array([DS] * table.num_rows)),
                        mode="append", partition_by=["dt"], storage_options=options)
    job = copy_project(stamped_template, tmp_path, input={"path": features, "format": "delta",
                                                          "filter": {"dt": "{ds}"}},
                       output={"path": f"s3://{new_bucket}/out/dt={{ds}}", "id_columns": ["id"]})
    first = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert first.returncode == 0, first.stderr
    fs = s3_server.s3fs()
    preds, _, manifest = read_partition(out_root(new_bucket), fs=fs)
    assert manifest["input_table"]["version"] == len(shards) - 1
    assert preds.num_rows == SHARDS * ROWS
    assert all(s["path"].startswith(f"{features}/dt={DS}/") for s in manifest["shards"])
    write_deltalake(features, pq.read_table(shards[0]).append_column("dt", pa.array([DS] * ROWS)),
                    mode="append", partition_by=["dt"], storage_options=options)
    again = run_cli("run", str(job), "--ds", DS, cwd=tmp_path, env=s3_server.env)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr


def test_history_of_a_delta_output_on_s3(tmp_path, s3_server, new_bucket, stamped_template):
    """``batchinfer history`` reads a table output's records on the object store, from the job
    and from the tables' root, and writes its page there beside the last date's report."""
    import json

    fs = s3_server.s3fs()
    job = s3_project(stamped_template, tmp_path, new_bucket, fs)
    tables = f"s3://{new_bucket}/tables"
    table_output = ("--set", "output.format=delta", "--set", f"output.path={tables}")
    scored = run_cli("run", str(job), "--ds", DS, *table_output, cwd=tmp_path, env=s3_server.env)
    assert scored.returncode == 0, scored.stderr
    before = "2026-01-14"
    by_job = run_cli("history", str(job), "--start", before, "--end", DS, *table_output, cwd=tmp_path,
                     env=s3_server.env)
    assert by_job.returncode == 0, by_job.stderr
    page = fs.cat_file(f"{new_bucket}/tables/_batchinfer/dt={DS}/history.html").decode()
    assert f"<td>{before}</td>" in page and f"<td>{DS}</td>" in page
    by_root = run_cli("history", tables, "--start", before, "--end", DS, "--json", cwd=tmp_path,
                      env=s3_server.env)
    assert by_root.returncode == 0, by_root.stderr
    data = json.loads(by_root.stdout)
    assert data["states"] == ["missing", "committed"] and data["rows"]["in"] == [None, SHARDS * ROWS]
    assert data["notes"] == {} and data["attempts"][1] in page
