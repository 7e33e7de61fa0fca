"""What README's "Nightly with Airflow" needs, made from the demo (``batchinfer demo`` calls
:func:`prepare_nightly` once the demo partition is scored).

The repository's nightly job, ``pipelines/credit_risk/job.yaml``, is the demo's job pointed at
production (tests/unit/test_demo_files.py): features under ``${CREDIT_FEATURES_URL}/dt={ds}/``,
scores under ``${CREDIT_SCORES_URL}/dt={ds}``, the model ``models:/credit_risk/1`` in the MLflow
registry at ``${CREDIT_TRACKING_URI}``, and a DAG that waits for ``_SUCCESS`` in each input
partition (its ``nightly.yaml``). Under the demo's folder this writes all of it:

- ``features/dt=D/`` for each date of :data:`NIGHTLY_DATES`: the demo partition's shards, then
  ``_SUCCESS`` (last: the marker says the partition is complete);
- ``registry/credit_risk/``: the demo's model, registered as ``credit_risk`` version 1 in the
  demo's own MLflow store (``mlflow.db``, already made by the demo's run) and stamped. It is
  stamped with the demo's job, whose schema and preprocessing are the nightly job's very files,
  so the declaration is the one ``batchinfer stamp`` would write for the nightly job;
- ``nightly.env``: those variables, and ``AIRFLOW_HOME`` under the demo, for
  ``. demo/nightly.env``. Which DAG folder and jobs folder Airflow reads is the repository's
  business, not the demo's (the demo also runs from an installed wheel): README sets them.

Everything is rewritten on every ``demo`` (the same bytes), and a version already registered
from ``registry/credit_risk/`` is reused, so a second ``demo`` is a no-op here too.
"""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from ..commands.stamp import stamp
from ..errors import UsageError
from ..spec import Job
from ..triple.models import register_model

NIGHTLY_DATES = ("2026-01-15", "2026-01-16", "2026-01-17")
NIGHTLY_MODEL = "models:/credit_risk/1"
MARKER = "_SUCCESS"
ENV_FILE = "nightly.env"


def prepare_nightly(folder: Path, job: Job, data: Path) -> Path:
    """Lay out the nightly job's features, registry model and variables under ``folder``.

    Args:
        folder: the demo's folder (absolute).
        job: the demo's job, its model already stamped (its tracking store exists).
        data: the demo's scored partition, copied to each of :data:`NIGHTLY_DATES`.

    Returns:
        The env file.

    Raises:
        UsageError: the demo's store already holds another ``credit_risk`` version 1.
    """
    features = folder / "features"
    for ds in NIGHTLY_DATES:
        partition = features / f"dt={ds}"
        partition.mkdir(parents=True, exist_ok=True)
        for shard in sorted(data.glob("*.parquet")):
            shutil.copyfile(shard, partition / shard.name)
        (partition / MARKER).write_text("")

    registry = folder / "registry" / "credit_risk"
    registry.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(job.spec.model.uri, registry / Path(job.spec.model.uri).name)
    tracking_uri = job.spec.tracking.uri
    uri = register_model(registry, "credit_risk", tracking_uri)
    if uri != NIGHTLY_MODEL:
        raise UsageError(f"{tracking_uri} already holds a credit_risk version 1 that is not the "
                         f"demo's: remove {folder} and run the demo again")
    stamp(job, uri, None)

    variables = {
        "CREDIT_FEATURES_URL": str(features),
        "CREDIT_SCORES_URL": str(folder / "scores"),
        "CREDIT_TRACKING_URI": tracking_uri,
        "AIRFLOW_HOME": str(folder / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    env_file = folder / ENV_FILE
    env_file.write_text(
        "# Written by `batchinfer demo` for README's \"Nightly with Airflow\": `. demo/nightly.env`.\n"
        f"# Features for {', '.join(NIGHTLY_DATES)} (each with {MARKER}); {NIGHTLY_MODEL} is "
        "registered and stamped in the demo's MLflow store.\n"
        + "".join(f"export {name}={shlex.quote(value)}\n" for name, value in variables.items()),
        encoding="utf-8")
    return env_file
