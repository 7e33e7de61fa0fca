"""The run's clock, passed in rather than read: ``run_job`` takes a :data:`Clock` and hands it to
the pipeline's commit step (``CommitPlan.clock``), so one clock stamps a run's ``started_at`` and
``finished_at`` (contract §4: RFC 3339, UTC)."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The default clock. A module-level function, so a commit plan that holds it pickles."""
    return datetime.now(timezone.utc)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
