"""A run's monitoring at the edge: the baseline it is compared with (read and checked before any
work), and the drift gate and verdict made for this job from it.

The statistics and the gate are pure (:mod:`batchinfer.rows.profile`, :mod:`batchinfer.rows.drift`);
the pipeline's writer stage counts every scored batch into the baseline's cuts and each shard's
result carries the merged counts (:func:`batchinfer.pipeline.records.fold_shard`), so nothing here
reads data. What a verdict becomes — metrics, ``_profile.json``, the drift report — is
:mod:`batchinfer.commands.record`'s.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ..errors import SpecError
from ..io import readback
from ..io.records import ShardResult
from ..io.storage import url_to_fs
from ..rows.drift import DriftGate, DriftVerdict, listed, observe
from ..rows.profile import ColumnProfile
from ..spec import Job

log = logging.getLogger("batchinfer")


@dataclass(frozen=True)
class Baseline:
    """A baseline profile as ``batchinfer profile`` wrote it.

    Attributes:
        path: its URL. shown: as messages show it. what: what named it (``monitor.baseline``,
            or the model's declaration).
    """

    path: str
    columns: dict[str, ColumnProfile]
    about: dict[str, Any] = field(default_factory=dict)
    shown: str = ""
    what: str = "monitor.baseline"

    def cuts(self) -> dict[str, tuple[float, ...]]:
        return {name: col.cuts for name, col in self.columns.items() if col.cuts}

    def for_run(self, columns: Sequence[str]) -> "Baseline":
        """The baseline restricted to what a run of ``columns`` (its features and prediction
        columns) can be compared on — before any work. A baseline column the run does not
        have, or one without values (no histogram) in the baseline, is named in a warning.

        Raises:
            SpecError: no column left (exit 2): the drift gate would check nothing.
        """
        run = set(columns)
        kept = {n: c for n, c in self.columns.items() if n in run and c.cuts}
        absent = sorted(set(self.columns) - run)
        empty = sorted(n for n, c in self.columns.items() if n in run and not c.cuts)
        if not kept:
            raise SpecError(f"{self.what} {self.shown} shares no column with this run (baseline: "
                            f"{listed(self.columns)}; run: {listed(columns)}"
                            f"{'; without values in the baseline: ' + listed(empty) if empty else ''}"
                            f"): profile a partition of this job (batchinfer profile JOB.yaml --ds D "
                            f"--out {self.shown})")
        if absent:
            log.warning("drift: %s %s has column(s) this run does not have, not compared: %s",
                        self.what, self.shown, listed(absent))
        if empty:
            log.warning("drift: %s %s has no values (no histogram) of column(s) %s, not compared",
                        self.what, self.shown, listed(empty))
        return replace(self, columns=kept)


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
    checked = readback.check(readback.ProfileModel, data, f"{what} {shown}", SpecError, redo)
    if not checked.columns:
        raise SpecError(f"{what} {shown}: columns: empty: a baseline needs at least one column: {redo}")
    columns = {name: ColumnProfile.from_dict(col.model_dump()) for name, col in checked.columns.items()}
    about = {k: v for k, v in json.loads(data).items() if k != "columns"}
    return Baseline(url, columns, about, shown, what)


def load_baseline(job: Job, declaration: Mapping[str, str] | None = None) -> Baseline | None:
    """The job's baseline: ``monitor.baseline``, else the one the model's declaration names.

    Raises:
        SpecError: ``monitor`` without a baseline anywhere, or one that cannot be read (exit 2).
    """
    monitor = job.spec.monitor
    if monitor is None:
        return None
    if monitor.baseline:
        return read_profile(monitor.baseline, job.display(monitor.baseline))
    url = (declaration or {}).get("baseline")
    if not url:
        raise SpecError("monitor has no baseline: set monitor.baseline, or stamp the model with "
                        "`batchinfer stamp MODEL --job JOB.yaml --baseline PROFILE`")
    return read_profile(url, url, "the model's declared baseline")


def monitor(job: Job, results: Sequence[ShardResult], features: Sequence[str],
            baseline: Baseline | None) -> DriftVerdict:
    """The verdict on a run's shard results: its columns, and their drift against ``baseline``
    by the job's ``monitor`` limits (the commit step's gate judged the same)."""
    spec = job.spec.monitor
    profiles = [r.profile for r in results]
    if baseline is None or spec is None:
        return observe(profiles, features, None, {}, {})
    return observe(profiles, features, baseline.columns, spec.warn.as_dict(), spec.fail.as_dict())


def drift_gate(job: Job, features: Sequence[str], baseline: Baseline) -> DriftGate:
    """The commit step's drift gate for ``job`` against ``baseline`` (a pure, picklable value)."""
    spec = job.spec.monitor
    assert spec is not None, "a baseline comes from the job's monitor"
    return DriftGate(features=tuple(features), baseline=baseline.columns,
                     warn=spec.warn.as_dict(), fail=spec.fail.as_dict(), accept=accept(job, baseline))


def accept(job: Job, baseline: Baseline) -> str:
    """How to accept a drift: a new baseline from a trusted partition, or other limits."""
    shown = job.display(str(job.path))
    if baseline.what == "monitor.baseline":
        profile = f"`batchinfer profile {shown} --ds D --out {baseline.shown}`"
    else:  # the model's declared baseline: declare the new one
        profile = (f"`batchinfer profile {shown} --ds D --out PROFILE` and `batchinfer stamp "
                   f"MODEL --job {shown} --baseline PROFILE`")
    return (f"to accept this drift, profile a baseline from a partition you trust ({profile}) "
            f"or raise the monitor.fail limits")
