"""Command line: parse, dispatch to the command, print its result, map errors to exit codes
(contract §2).

Each command is a module of :mod:`batchinfer.cli_commands` that declares its arguments
(``add_arguments``), does its work (``execute``) and returns a typed result that renders itself.
A command's arguments are declared only when that command runs (or shows its help), and heavy
libraries (Beam, MLflow, onnxruntime) are imported only by the commands that need them. Every
failure prints one line — what was wrong and what to do — and exits with its code; ``--debug``
adds the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from . import __version__
from .cli_commands.results import error_line
from .errors import BatchInferError, one_line
from .redaction import redact

# Each command's module in batchinfer.cli_commands, named as the command, in the order of
# `batchinfer --help`. Its HELP is that line; its add_arguments, execute and result do the rest.
COMMANDS = ("run", "backfill", "profile", "report", "history", "validate", "plan", "inspect", "diff", "export",
            "stamp", "schema", "track", "demo")


def command(name: str) -> Any:
    """The module of command ``name``: ``HELP``, ``add_arguments(parser)`` and ``execute(args)``,
    which returns a :class:`~batchinfer.cli_commands.results.Result`."""
    return importlib.import_module(f"{__package__}.cli_commands.{name}")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error (contract §2), with where to look. A
    command's parser declares its arguments (``declare``) when it is first used."""

    def __init__(self, *args: Any, declare: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._declare = declare

    def parse_known_args(self, args=None, namespace=None):
        if self._declare is not None:
            declare, self._declare = self._declare, None
            declare(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        _record_error(2, "UsageError", f"{message} (see {self.prog} --help)")
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="batchinfer", description="Audited, versioned batch inference.")
    parser.add_argument("--version", action="version", version=f"batchinfer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=command(name).HELP, declare=command(name).add_arguments)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.debug)
    try:
        result = command(args.command).execute(args)
        result.render(sys.stdout, sys.stderr)
        if result.error is not None:   # after what it printed
            raise result.error
        return result.exit_code
    except BatchInferError as exc:
        if args.debug:
            _print_traceback()
        line = redact(error_line(exc))
        print(f"batchinfer {args.command}: {line}", file=sys.stderr)
        _record_error(exc.exit_code, type(exc).__name__, line, _fields(exc))
        return exc.exit_code
    except BrokenPipeError:
        # The reader of our output went away (`batchinfer inspect OUT | head`): as a pipe's
        # writer does, stop without a word (exit 128 + SIGPIPE). Nothing more reaches stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(f"batchinfer {args.command}: interrupted; nothing was committed by this run", file=sys.stderr)
        _record_error(130, "KeyboardInterrupt", "interrupted; nothing was committed by this run")
        return 130
    except Exception as exc:  # a failure of the system, not of the user's input
        if args.debug:
            _print_traceback()
        text = redact(one_line(exc))
        print(f"batchinfer {args.command}: unexpected {type(exc).__name__}: {text} "
              f"(rerun with --debug for the traceback)", file=sys.stderr)
        _record_error(5, type(exc).__name__, f"unexpected {type(exc).__name__}: {text}")
        return 5


ERROR_FILE_ENV = "BATCHINFER_ERROR_FILE"


def _fields(exc: BatchInferError) -> dict[str, object]:
    """An error's structured fields, where it has them, as the error file records them."""
    fields: dict[str, object] = {k: redact(v) for k, v in (("path", exc.path), ("field", exc.field)) if v}
    if exc.remedies:
        fields["remedies"] = [{"action": r.action.value, "purpose": r.purpose, "subject": r.subject}
                              for r in exc.remedies]
    return fields


def _record_error(exit_code: int, error: str, message: str,
                  fields: dict[str, object] | None = None) -> None:
    """The failure as JSON in the file ``$BATCHINFER_ERROR_FILE`` names, when it is set, for a
    caller that acts on which error it was, not only on the exit code (contract §2: the nightly DAG
    retries a partition that has not arrived, not a mistake in the job)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"exit_code": exit_code, "error": error, "message": message, **(fields or {})}
    try:
        Path(path).write_text(json.dumps(record) + "\n", encoding="utf-8")
    except OSError as exc:  # the exit code and the line on stderr still say what failed
        print(f"batchinfer: cannot write {ERROR_FILE_ENV} {path}: {exc.strerror or exc}", file=sys.stderr)


def _print_traceback() -> None:
    # A traceback quotes messages of library exceptions too (an OSError naming a bucket):
    # everything that leaves the process is redacted, not only our own messages.
    print(redact(traceback.format_exc()), end="", file=sys.stderr)


class _RedactingFormatter(logging.Formatter):
    """Log records pass through :func:`~batchinfer.redaction.redact` (library records quote
    URLs and paths that may hold values from the environment), and an error logged as an
    argument is said as the CLI says it, its remedies as flags."""

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple) and any(isinstance(a, BatchInferError) for a in record.args):
            record = logging.makeLogRecord({**record.__dict__, "args": tuple(
                error_line(a) if isinstance(a, BatchInferError) else a for a in record.args)})
        return redact(super().format(record))


def _not_beams_root_record(record: logging.LogRecord) -> bool:
    """False for a record that Beam made on the root logger: its portable runner relays the job
    service's messages through ``logging.log`` — a failed job's traceback at ERROR — and
    batchinfer reports that failure itself in one line (contract §2)."""
    return record.name != "root" or f"{os.sep}apache_beam{os.sep}" not in record.pathname


def _configure_logging(debug: bool) -> None:
    # Libraries (Beam especially) log warnings that say nothing to a user of a job; --debug shows all.
    handler = logging.StreamHandler()
    handler.setFormatter(_RedactingFormatter("%(levelname)s %(name)s: %(message)s"))
    if not debug:
        handler.addFilter(_not_beams_root_record)
    # force: a library imported earlier (Beam warns on import) may have configured the root logger.
    logging.basicConfig(level=logging.INFO if debug else logging.ERROR, handlers=[handler], force=True)
    logging.getLogger("batchinfer").setLevel(logging.DEBUG if debug else logging.WARNING)
    # Beam logs a failing DoFn at ERROR with its traceback before re-raising; batchinfer reports
    # that failure itself in one line (contract §2), so Beam's copy is only shown with --debug.
    logging.getLogger("apache_beam").setLevel(logging.INFO if debug else logging.CRITICAL)
    # torch's exporter logs notes about optional packages (torchvision) with its own handler.
    logging.getLogger("torch").setLevel(logging.INFO if debug else logging.ERROR)


def run() -> None:
    """Entry point of ``batchinfer`` and ``python -m batchinfer``: :func:`main`, then exit.

    Everything a command does is written and flushed before :func:`main` returns (files with
    one synchronous put each, the manifest last; a run's MLflow helper has answered its finish,
    and one kept for a next run is killed, see ``tracking.stop_kept_helper``). The interpreter's
    teardown after that — Beam's and gRPC's threads, module finalisers — took 0.6 s per run
    here, a sixth of a small job, and is skipped.
    """
    code = main()
    tracking = sys.modules.get("batchinfer.io.tracking")   # imported by the commands that track
    if tracking is not None:
        tracking.stop_kept_helper()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:   # the pipe's reader is gone: so is what was left to say
            code = code or 141
    os._exit(code)
