"""What a command returns: a typed result that renders itself (:class:`Result`), and the lines
that more than one command's result prints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ..errors import BatchInferError
    from ..io.records import InputTable, Manifest


def error_line(error: "BatchInferError") -> str:
    """The error's line as the CLI prints it, its remedies said as flags
    (:func:`batchinfer.commands.remedies.error_line`, imported only when an error is printed)."""
    from ..commands.remedies import error_line as said

    return said(error)


class Result:
    """A command's result. ``render`` prints it; then the command exits with ``exit_code``, or,
    where ``error`` is set, fails with it (printed lines first, as with ``schema verify``)."""

    exit_code: int = 0
    error: Exception | None = None

    def render(self, out: TextIO, err: TextIO) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Lines(Result):
    """A result that is lines of text on stdout."""

    lines: tuple[str, ...]

    def render(self, out: TextIO, err: TextIO) -> None:
        for line in self.lines:
            print(line, file=out)


def totals_line(manifest: Manifest) -> str:
    t = manifest.totals
    return (f"rows: {t.rows_in} in, {t.rows_scored} scored, {t.rows_quarantined} quarantined; "
            f"shards: {t.shards} ({t.shards_unreadable} unreadable)")


def table_read(table: InputTable, pinned: int | None) -> str:
    """``version 3 (pinned by the partition's manifest), filter dt='2026-01-31'``."""
    why = " (pinned by the partition's manifest)" if pinned is not None else ""
    where = ", ".join(f"{k}={v!r}" for k, v in table.filter.items())
    return f"version {table.version}{why}" + (f", filter {where}" if where else "")
