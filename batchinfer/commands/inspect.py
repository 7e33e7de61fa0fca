"""``batchinfer inspect`` and ``batchinfer track``: read a committed partition, upload its
metrics when MLflow missed them at run time (contract §2, §5.7)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

from ..errors import SpecError
from ..io.outputs import METRICS, REPORT, write_json
from ..io.partitions import Committed, open_partition
from ..io.readback import check
from ..io.records import Manifest, MetricsRecord


def committed_at(url: str) -> Committed:
    """The committed partition ``url`` names (io/partitions.py).

    Raises:
        SpecError: nothing is committed there (exit 2).
    """
    found = open_partition(url)
    if found is None:
        raise SpecError(f"{url} holds no committed partition (no _manifest.json)")
    return found


def inspect_output(url: str) -> Manifest:
    """The committed manifest of ``url``.

    Raises:
        SpecError: nothing is committed there (exit 2).
    """
    return committed_at(url).manifest


def upload_tracking(url: str, tracking_uri: str | None = None) -> str:
    """Upload the ``_metrics.json`` of a committed output that MLflow missed; return the run id."""
    from ..io.tracking import upload_pending

    partition = committed_at(url)
    fs, manifest = partition.layout.fs, partition.manifest
    path = partition.record(METRICS)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise SpecError(f"{url} has no {METRICS} to upload") from None
    checked = check(MetricsRecord, data, path, SpecError,
                    "not a record batchinfer wrote (edited?): nothing uploaded")
    if checked.uploaded:
        return checked.mlflow_run_id or ""
    record = {**checked.to_dict(), "manifest_text": json.dumps(manifest.to_dict(), indent=2)}
    try:  # the job report goes with it, as at run time
        record["report_text"] = fs.cat_file(partition.record(REPORT)).decode()
    except FileNotFoundError:
        pass
    # The record shows ${NAME} in place of environment values (contract §3): expand them again.
    uri = tracking_uri or os.path.expandvars(checked.tracking_uri)
    run_id = upload_pending(uri, checked.experiment, record)
    write_json(fs, path, replace(checked, uploaded=True, mlflow_run_id=run_id, error=None).to_dict())
    return run_id
