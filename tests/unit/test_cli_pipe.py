"""A reader of batchinfer's output that goes away (``batchinfer inspect OUT --json | head``):
the command stops quietly with 141, as a pipe's writer killed by SIGPIPE would, instead of an
"unexpected BrokenPipeError" line (seen in the demo's folder)."""
from __future__ import annotations

import os
import sys

from batchinfer import cli
from batchinfer.io.manifest import create_manifest
from batchinfer.io.outputs import Layout
from batchinfer.io.records import Manifest, Totals


def test_a_closed_pipe_stops_a_command_quietly(tmp_path, monkeypatch, capsys):
    manifest = Manifest(job="j", ds="2026-01-15", attempt="20260115T000000Z-0000000a",
                        triple={"model_version": "m:1"}, job_spec_sha256="x", runner="direct",
                        device="cpu", started_at="t", finished_at="t", mlflow_run_id=None,
                        totals=Totals(shards=0, rows_in=0, rows_scored=0, rows_quarantined=0,
                                      shards_unreadable=0), shards=())
    assert create_manifest(Layout.for_url(str(tmp_path), manifest.attempt), manifest)
    read, write = os.pipe()
    os.close(read)                                   # the reader is gone before we write
    saved = os.dup(1)
    try:
        with os.fdopen(write, "w", buffering=1) as closed:   # line-buffered, as on a terminal
            monkeypatch.setattr(sys, "stdout", closed)
            code = cli.main(["inspect", str(tmp_path), "--json"])
            monkeypatch.undo()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert code == 141
    assert "BrokenPipe" not in capsys.readouterr().err
