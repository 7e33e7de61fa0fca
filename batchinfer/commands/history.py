"""``batchinfer history``: read each date's committed partition of a job (or of an output) over a
range of dates, and write the history page or its JSON (docs/contract.md "History").

The I/O at the edge of :mod:`batchinfer.app.job_history` (the History, pure) and
:mod:`batchinfer.app.history_page` (its page, pure): where each date's partition is
(:func:`job_partitions`, :func:`output_partitions`), what is found there (:func:`read_date`:
the manifest, ``_metrics.json`` and ``_profile.json``, each checked as it is read; or why
nothing is committed), and writing the page. A date that cannot be read is a note on that date,
never the command's failure: a history is read to see what went wrong.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..app.history_page import render_history
from ..app.job_history import MAX_DATES, DateRecords, History, build_history
from ..app.resolve import records_url
from ..errors import BatchInferError, SpecError, UsageError, one_line
from ..io.outputs import DRIFT, HISTORY, MANIFEST, METRICS, PROFILE, RECORDS, TMP, put_file
from ..io.partitions import open_partition
from ..io.readback import check
from ..io.records import MetricsRecord
from ..io.storage import url_to_fs
from ..profile_records import RunProfile
from ..spec import load_job
from .backfill import partition_dates

THREADS = 8   # dates read at once (object stores: latency-bound)
_PARTITION = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True)
class Partitions:
    """Where each date's partition (its records folder) is, and how messages name it."""

    job: str
    source: str
    urls: tuple[str, ...]
    shown: tuple[str, ...]


def history_dates(start: str, end: str) -> list[str]:
    """Every date from ``start`` to ``end``, both included.

    Raises:
        SpecError: a date that is not YYYY-MM-DD, or ``end`` before ``start`` (exit 2).
        UsageError: more than :data:`MAX_DATES` dates (exit 2).
    """
    dates = partition_dates(start, end)
    if len(dates) > MAX_DATES:
        raise UsageError(f"--start {start} to --end {end} is {len(dates)} dates: a history reads "
                         f"at most {MAX_DATES}; give a shorter range")
    return dates


def is_job_spec(source: str) -> bool:
    return source.endswith((".yaml", ".yml")) and Path(source).is_file()


def job_partitions(job_path: str, dates: Sequence[str], overrides: Sequence[str] = ()) -> Partitions:
    """Each date's partition of the job: its records folder (``output.path``, or for tables
    ``<output.path>/_batchinfer/<column>=<ds>``), as ``run`` would commit it.

    Raises:
        SpecError: the job spec is wrong (exit 2).
    """
    jobs = [load_job(job_path, ds=ds, overrides=overrides) for ds in dates]
    urls = tuple(records_url(job) for job in jobs)
    return Partitions(jobs[0].spec.name, job_path, urls,
                      tuple(job.display(url) for job, url in zip(jobs, urls)))


def output_partitions(output: str, dates: Sequence[str]) -> Partitions:
    """Each date's partition under ``output``: a path with ``{ds}`` (``out/dt={ds}``), the root
    of a job's tables (``<root>/_batchinfer/<column>=<ds>``) or a folder of files partitions
    (``<folder>/<column>=<ds>``); the column is the one its folders are named by (``dt`` when
    none is there yet).

    Raises:
        UsageError: ``output`` is one partition, not the folder of the job's partitions (exit 2).
        StorageError: it cannot be listed.
    """
    root = output.rstrip("/")
    if "{ds}" in output:
        urls = tuple(output.replace("{ds}", ds) for ds in dates)
        return Partitions("", output, urls, urls)
    fs, path = url_to_fs(root)
    if fs.exists(f"{path}/{MANIFEST}"):
        raise UsageError(f"{output} is one partition: give the folder of the job's partitions, "
                         f"the tables' root, or a path with {{ds}} (such as out/dt={{ds}})")
    records = f"{path}/{RECORDS}"
    table = fs.isdir(records)
    column = _partition_column(fs, records if table else path)
    top = f"{root}/{RECORDS}" if table else root
    urls = tuple(f"{top}/{column}={ds}" for ds in dates)
    return Partitions("", output, urls, urls)


def _partition_column(fs, folder: str) -> str:
    try:
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return "dt"
    found = sorted({m.group(1) for m in map(_PARTITION.fullmatch, names) if m})
    return found[0] if found else "dt"


def read_date(ds: str, url: str, shown: str) -> DateRecords:
    """What is at ``url`` for date ``ds``: a committed partition's records, or why there is none."""
    try:
        partition = open_partition(url)
    except BatchInferError as exc:   # a malformed manifest, a store that cannot be read
        return DateRecords(ds, "unreadable", notes=(one_line(exc),))
    if partition is None:
        return _not_committed(ds, url, shown)
    fs = partition.layout.fs
    found: dict[str, dict] = {}
    notes = []
    for name, schema in ((METRICS, MetricsRecord), (PROFILE, RunProfile)):
        path = partition.record(name)
        try:
            data = fs.cat_file(path)
            check(schema, data, f"{shown}/{name}", SpecError)
        except FileNotFoundError:
            notes.append(f"no {name} (the run could not write it)")
            continue
        except (OSError, SpecError) as exc:
            notes.append(f"{name} left out: {one_line(exc)}")
            continue
        found[name] = json.loads(data)   # as the run wrote it
    return DateRecords(ds, "committed", partition.manifest,
                       (found.get(METRICS) or {}).get("metrics") or {}, found.get(PROFILE) or {},
                       tuple(notes))


def _not_committed(ds: str, url: str, shown: str) -> DateRecords:
    """A date without a manifest: ``missing`` when nothing is there, else ``uncommitted`` with
    what is (a drift report a stopped run kept, a run's scratch)."""
    fs, path = url_to_fs(url)
    try:
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        names = set()
    except OSError as exc:
        return DateRecords(ds, "unreadable", notes=(f"cannot list {shown}: {one_line(exc)}",))
    if not names:
        return DateRecords(ds)
    notes = []
    if DRIFT in names:
        kept = sorted(p for p in fs.ls(f"{path}/{DRIFT}", detail=False) if str(p).endswith(".json"))
        if kept:
            notes.append(f"stopped by drift: report kept in {shown}/{DRIFT}/{str(kept[-1]).rsplit('/', 1)[-1]}")
    if TMP in names:
        notes.append(f"a run's scratch is in {shown}/{TMP} (it failed, was killed or is running; "
                     f"`batchinfer run` resumes it)")
    return DateRecords(ds, "uncommitted",
                       notes=tuple(notes) or (f"{shown} holds no {MANIFEST}: nothing committed",))


def read_history(partitions: Partitions, dates: Sequence[str]) -> History:
    """Every date read (:data:`THREADS` at once) and built into its :class:`History`."""
    with ThreadPoolExecutor(THREADS) as pool:
        days = list(pool.map(read_date, dates, partitions.urls, partitions.shown))
    return build_history(days, job=partitions.job, source=partitions.source)


def write_page(history: History, partitions: Partitions, out: str | None) -> str:
    """Write the page to ``out`` (a path or URL), by default ``history.html`` in the last date's
    records folder; return where it went.

    Raises:
        UsageError: no ``out``, and the last date is not committed (exit 2).
        StorageError: it cannot be written.
    """
    if out is None:
        if history.states[-1] != "committed":
            raise UsageError(f"the last date {history.dates[-1]} has no committed partition to "
                             f"keep the page beside: give --out FILE")
        out, shown = f"{partitions.urls[-1]}/{HISTORY}", f"{partitions.shown[-1]}/{HISTORY}"
    else:
        shown = out
    fs, path = url_to_fs(out)
    put_file(fs, path, render_history(history).encode())
    return shown
