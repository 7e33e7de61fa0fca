"""``batchinfer demo``: write the credit-risk example, stamp its model, score it, summarise."""
from __future__ import annotations

import time
from pathlib import Path

from . import DEMO_DS, DEMO_ROWS, write_demo


def run_demo(folder: Path, *, rows: int = DEMO_ROWS) -> int:
    from ..commands.run import run_job
    from ..commands.stamp import stamp
    from ..spec import load_job
    from ..triple.schemas import lock_schemas
    from .nightly import prepare_nightly

    t0 = time.perf_counter()
    folder = folder.resolve()
    print(f"writing the credit-risk demo under {folder} …")
    paths = write_demo(folder, rows=rows)
    lock_schemas(folder / "schemas")  # credit_features@1 is "published" in the demo's registry
    job = load_job(paths["job"], ds=DEMO_DS)
    triple, where = stamp(job, None, None)
    print(f"stamped {paths['model'].relative_to(folder)} → {Path(where).name}")
    outcome = run_job(job, progress=print)
    print(outcome.message)
    env_file = prepare_nightly(folder, job, paths["data"])
    manifest = outcome.manifest
    assert manifest is not None  # a new demo folder is always scored and committed
    totals = manifest.totals
    out = Path(outcome.output)
    quarantine_files = [f.path for s in manifest.shards for f in s.files
                        if f.path.startswith("quarantine/")]
    print()
    print("─" * 72)
    print(f"batchinfer demo: {totals.rows_in:,} rows in {totals.shards} shards → "
          f"{totals.rows_scored:,} scored, {totals.rows_quarantined:,} quarantined")
    print(f"  triple       {triple.model_version} · {triple.schema_version} · "
          f"preprocess {triple.preprocess_hash[:12]} · model {triple.model_digest[:12]}")
    print(f"  predictions  {out / 'predictions' / manifest.attempt}/")
    print(f"  quarantine   {len(quarantine_files)} file(s) under {out / 'quarantine' / manifest.attempt}/")
    print(f"  manifest     {out / '_manifest.json'}  (the commit; readers follow it)")
    why = _top_features(out)
    if why:
        print(f"  why          {why}  (mean |attribution|; per row: _explanation)")
    if outcome.tracking:
        print(f"  tracking     {outcome.tracking}")
    print(f"  next         batchinfer inspect {out}")
    print(f"               batchinfer run {paths['job']} --ds {DEMO_DS}   # a rerun is a no-op")
    print(f"  nightly      . {env_file}   # then README's \"Nightly with Airflow\"")
    print(f"  total time   {time.perf_counter() - t0:.1f} s")
    return 0


def _top_features(out: Path, n: int = 5) -> str:
    """The partition's top features by mean |attribution| from its ``_metrics.json`` ("" when it
    has none: a job without explain)."""
    import json

    try:
        metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return ""
    found = sorted(((k.split(".", 1)[1], v) for k, v in metrics.items()
                    if k.startswith("explain_mean_abs.")), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{name} {value:.3f}" for name, value in found[:n])
