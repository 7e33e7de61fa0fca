"""A run's monitoring at the edge: the baseline it is compared with, read and checked before any
work, with the job's ``monitor`` limits.

Everything after is pure (:mod:`batchinfer.rows.drift`: the baseline matched with the run's
columns, the commit step's gate, the verdict); what a verdict becomes — metrics,
``_profile.json``, the drift report — is :mod:`batchinfer.app.run_record`'s.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Mapping

from ..errors import SpecError
from ..io import readback
from ..io.storage import url_to_fs
from ..profile_records import Profile
from ..rows.column_profiles import ColumnProfile
from ..rows.drift import Baseline
from ..spec import Job


def read_profile(url: str, shown: str, what: str = "monitor.baseline") -> Baseline:
    """Read a baseline profile (as ``batchinfer profile`` writes it), checked at the edge
    (:mod:`batchinfer.io.readback`): every column's histogram fits its cuts, and there is at
    least one column.

    Raises:
        SpecError: missing, unreadable, malformed or not a batchinfer profile (exit 2, before
            any work), as ``<what> <file>: <field>: <what is wrong>``.
    """
    redo = f"write one with `batchinfer profile JOB.yaml --ds D --out {shown}`"
    try:
        fs, path = url_to_fs(url)
        data = fs.cat_file(path)
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} {shown} cannot be read ({type(exc).__name__}: "
                        f"{str(exc)[:160]}): {redo}") from None
    checked = readback.check(Profile, data, f"{what} {shown}", SpecError, redo)
    if not checked.columns:
        raise SpecError(f"{what} {shown}: columns: empty: a baseline needs at least one column: {redo}")
    columns = {name: ColumnProfile.of_record(col) for name, col in checked.columns.items()}
    about = {k: v for k, v in json.loads(data).items() if k != "columns"}
    return Baseline(url, columns, about, shown, what)


def load_baseline(job: Job, declaration: Mapping[str, str] | None = None) -> Baseline | None:
    """The job's baseline: ``monitor.baseline``, else the one the model's declaration names,
    with the job's ``warn`` and ``fail`` limits and how to accept a drift against it.

    Raises:
        SpecError: ``monitor`` without a baseline anywhere, or one that cannot be read (exit 2).
    """
    monitor = job.spec.monitor
    if monitor is None:
        return None
    if monitor.baseline:
        baseline = read_profile(monitor.baseline, job.display(monitor.baseline))
    else:
        url = (declaration or {}).get("baseline")
        if not url:
            raise SpecError("monitor has no baseline: set monitor.baseline, or stamp the model "
                            "with `batchinfer stamp MODEL --job JOB.yaml --baseline PROFILE`")
        baseline = read_profile(url, url, "the model's declared baseline")
    return replace(baseline, warn=monitor.warn.as_dict(), fail=monitor.fail.as_dict(),
                   accept=_accept(job, baseline))


def _accept(job: Job, baseline: Baseline) -> str:
    """How to accept a drift: a new baseline from a trusted partition, or other limits."""
    shown = job.display(str(job.path))
    if baseline.what == "monitor.baseline":
        profile = f"`batchinfer profile {shown} --ds D --out {baseline.shown}`"
    else:  # the model's declared baseline: declare the new one
        profile = (f"`batchinfer profile {shown} --ds D --out PROFILE` and `batchinfer stamp "
                   f"MODEL --job {shown} --baseline PROFILE`")
    return (f"to accept this drift, profile a baseline from a partition you trust ({profile}) "
            f"or raise the monitor.fail limits")
