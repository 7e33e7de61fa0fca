"""Command line: parse, call the library, print, map errors to exit codes (contract §2).

Heavy libraries (Beam, MLflow, onnxruntime) are imported only by the commands that need them.
Every failure prints one line — what was wrong and what to do — and exits with its code;
``--debug`` adds the traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import __version__
from .errors import BatchInferError, ContractError, UsageError, one_line
from .redaction import redact

if TYPE_CHECKING:
    from .io.records import Manifest


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job spec (YAML)")
    _spec_options(p, "partition date YYYY-MM-DD, replaces {ds}")


def _spec_options(p: argparse.ArgumentParser, ds_help: str,
                  set_help: str = "override one spec key by dotted path; value parsed as YAML "
                                  "(repeatable)") -> None:
    """``--ds`` and ``--set``, as every command that reads a job spec takes them (contract §2)."""
    p.add_argument("--ds", help=ds_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=set_help)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error (contract §2), with where to look."""

    def error(self, message: str):
        _record_error(2, "UsageError", f"{message} (see {self.prog} --help)")
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="batchinfer", description="Audited, versioned batch inference.")
    parser.add_argument("--version", action="version", version=f"batchinfer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="score one partition")
    _job_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace a partition committed under another triple")
    p.add_argument("--update", action="store_true",
                   help="on a committed partition whose shards changed: score only the new and "
                        "rewritten shards, keep the others, drop the removed ones")
    p.add_argument("--dry-run", action="store_true", help="check everything, score nothing")
    p.add_argument("--quiet", action="store_true", help="no progress display while scoring")

    p = sub.add_parser("backfill", help="score each partition in a date range, skipping committed ones")
    p.add_argument("job", help="job spec (YAML)")
    p.add_argument("--start", help="first date YYYY-MM-DD")
    p.add_argument("--end", help="last date YYYY-MM-DD (included)")
    _spec_options(p, "one date: the same as --start DS --end DS")
    p.add_argument("--overwrite", action="store_true", help="replace partitions committed under another triple")
    p.add_argument("--update", action="store_true",
                   help="committed partitions whose shards changed (late data): score only the "
                        "new and rewritten shards")
    p.add_argument("--dry-run", action="store_true", help="check every date, score nothing")
    p.add_argument("--keep-going", action="store_true", help="after a failing date, score the remaining ones")
    p.add_argument("--quiet", action="store_true", help="no progress display while scoring")

    p = sub.add_parser("profile", help="write the baseline profile of a committed partition (monitor.baseline)")
    _job_args(p)
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")

    p = sub.add_parser("report", help="(re)build report.html of a committed output")
    p.add_argument("output")

    p = sub.add_parser("validate", help="check the input against the schema and the preprocessing")
    _job_args(p)

    p = sub.add_parser("plan", help="resolve shards, triple and contract; write nothing")
    _job_args(p)

    p = sub.add_parser("inspect", help="summarise a committed output")
    p.add_argument("output")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")

    p = sub.add_parser("diff", help="compare two committed outputs of the same partition, or an "
                                    "output's champion with one of its challengers")
    p.add_argument("output_a")
    p.add_argument("output_b", nargs="?", help="the other output (not with --challenger)")
    p.add_argument("--challenger", metavar="NAME",
                   help="compare OUTPUT_A's champion (A) with its challenger NAME (B)")
    p.add_argument("--top", type=int, default=10, metavar="N",
                   help="top movers to list per score column (default 10)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("export", help="convert a model (.pt2 to ONNX, ONNX to TensorRT) and check parity")
    p.add_argument("model", help="a torch.export program (.pt2), or an ONNX model for --to tensorrt")
    p.add_argument("--to", required=True, metavar="onnx|tensorrt")
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--fp16", action="store_true", help="TensorRT: build an FP16 engine")
    p.add_argument("--sample", metavar="JOB.yaml", help="check parity on rows of this job's input")
    p.add_argument("--quantize", choices=("int8",),
                   help="--to onnx of an ONNX model: INT8 quantization calibrated on --sample's "
                        "rows, written only when the parity gate passes")
    p.add_argument("--method", choices=("auto", "static", "dynamic"),
                   help="--quantize: static QDQ (numeric inputs) or dynamic (token ids); default auto")
    p.add_argument("--max-flip-rate", type=float, metavar="F",
                   help="--quantize: refuse when more than F of a score's decisions flip "
                        "(default: reported, not judged)")
    p.add_argument("--threshold", type=float, metavar="T",
                   help="--quantize: the decision threshold of a score (default 0.5)")
    p.add_argument("--min-cosine", type=float, metavar="C",
                   help="--quantize: an embedding's rows keep cosine >= C with FP32 (default 0.99)")
    p.add_argument("--embedding", action="append", default=[], metavar="OUTPUT",
                   help="--quantize: judge this [N, K] output by cosine (outputs named *embed* are)")
    p.add_argument("--keep-fp32", action="append", default=[], metavar="REGEX",
                   help="--quantize: the nodes whose names match stay FP32 (repeatable)")
    p.add_argument("--smooth", type=float, metavar="ALPHA",
                   help="--quantize: SmoothQuant the MatMuls' inputs first, calibrated on the "
                        "sample (alpha in (0, 1); 0.7 for MiniLM)")
    _spec_options(p, "with --sample: the partition date",
                  "with --sample: override one spec key (repeatable)")

    p = sub.add_parser("stamp", help="write a model's declaration (version triple)")
    p.add_argument("model", help="model file or models:/name/version")
    p.add_argument("--job", required=True, help="the job whose schema and preprocessing to declare")
    p.add_argument("--model-version", help="e.g. credit_risk:3 (default: the job's model.version)")
    p.add_argument("--challenger", metavar="NAME",
                   help="stamp MODEL as the job's challenger NAME (its backend, options, version)")
    p.add_argument("--baseline", metavar="PROFILE",
                   help="declare this profile (batchinfer profile) as the model's drift baseline")
    p.add_argument("--packages", choices=("warn", "refuse"), default="warn",
                   help="when the installed packages the preprocessing imports differ from the "
                        "stamped versions, a run warns (default) or exits 3")
    _spec_options(p, "the partition date, if the spec's paths need one")

    p = sub.add_parser("schema", help="publish a schema version into lock.json, or verify the lock")
    actions = p.add_subparsers(dest="schema_action", required=True, metavar="ACTION")
    publish = actions.add_parser("publish", help="add NAME@N's source hash to <root>/lock.json")
    publish.add_argument("ref", metavar="NAME@N")
    verify = actions.add_parser("verify", help="list published versions whose file is missing or changed")
    for q in (publish, verify):
        where = q.add_mutually_exclusive_group(required=True)
        where.add_argument("--root", help="the schemas folder (where lock.json is)")
        where.add_argument("--job", help="a job spec: its schemas.root")
        _spec_options(q, "with --job: the partition date, if the spec needs one",
                      "with --job: override one spec key (repeatable)")

    p = sub.add_parser("track", help="upload metrics that MLflow missed at run time")
    p.add_argument("output")
    p.add_argument("--tracking-uri", help="upload here instead of the job's tracking.uri")

    p = sub.add_parser("demo", help="write and score the credit-risk demo under ./demo/")
    p.add_argument("--dir", default="demo", help="where to write it (default: ./demo)")
    p.add_argument("--rows", type=int, default=120_000, help="rows in all, a multiple of 6 (6 shards)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.debug)
    try:
        return COMMANDS[args.command](args)
    except BatchInferError as exc:
        if args.debug:
            _print_traceback()
        print(f"batchinfer {args.command}: {redact(exc.message)}", file=sys.stderr)
        _record_error(exc.exit_code, type(exc).__name__, redact(exc.message))
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


def _record_error(exit_code: int, error: str, message: str) -> None:
    """The failure as JSON in the file ``$BATCHINFER_ERROR_FILE`` names, when it is set, for a
    caller that acts on which error it was, not only on the exit code (contract §2: the nightly DAG
    retries a partition that has not arrived, not a mistake in the job)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"exit_code": exit_code, "error": error, "message": message}
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
    URLs and paths that may hold values from the environment)."""

    def format(self, record: logging.LogRecord) -> str:
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


def _load(args, **kwargs):
    from .spec import load_job

    return load_job(args.job, ds=args.ds, overrides=args.overrides, **kwargs)


def _update_or_overwrite(args) -> None:
    if args.update and args.overwrite:
        raise UsageError("give --update (score the new and rewritten shards of a committed "
                         "partition) or --overwrite (score it all again), not both")


def cmd_run(args) -> int:
    _update_or_overwrite(args)
    job = _load(args)
    tracking = None
    if not args.dry_run:  # MLflow's helper starts first: it takes longer than our own imports
        from .io.tracking import TrackingRun

        tracking = TrackingRun(job.spec.tracking.uri, job.spec.tracking.experiment)
    from .commands.run import run_job

    outcome = run_job(job, overwrite=args.overwrite, update=args.update, dry_run=args.dry_run,
                      progress=print,
                      tracking=tracking, watch=_watcher(args.quiet))
    print(outcome.message)
    if outcome.status == "committed" and outcome.manifest is not None:
        _print_totals(outcome.manifest)
        print(f"tracking: {outcome.tracking}")
        print(f"wall time: {outcome.timings['wall_s']:.1f} s")
    return 0


def cmd_backfill(args) -> int:
    from .commands.backfill import backfill, partition_dates

    _update_or_overwrite(args)
    if args.ds and (args.start or args.end):
        raise UsageError("give --ds or --start/--end, not both")
    start, end = (args.ds, args.ds) if args.ds else (args.start, args.end)
    if not start or not end:
        raise UsageError("give --start and --end (or --ds for one date)")
    dates = partition_dates(start, end)
    print(f"backfill {args.job}: {len(dates)} partition(s), {dates[0]} to {dates[-1]}", flush=True)

    def done(result) -> None:
        if result.status == "committed":
            t = result.manifest.totals
            line = (f"committed: {t.rows_in} rows in, {t.rows_scored} scored, "
                    f"{t.rows_quarantined} quarantined")
        elif result.status == "failed":
            line = f"failed (exit {result.exit_code}): {result.message}"
        else:
            line = result.message
        print(f"{result.ds}  {line}", flush=True)

    results = backfill(args.job, dates, overrides=args.overrides, overwrite=args.overwrite,
                       update=args.update, dry_run=args.dry_run, keep_going=args.keep_going,
                       progress=lambda line: print(f"            {line}", flush=True), done=done,
                       watch=_watcher(args.quiet))
    labels = {"committed": "committed", "noop": "already committed", "lost_race": "committed by another run",
              "dry_run": "checked", "failed": "failed"}
    counts = {label: sum(labels[r.status] == label for r in results) for label in labels.values()}
    print(f"{len(dates)} partition(s): " + ", ".join(f"{n} {label}" for label, n in counts.items() if n)
          + (f", {len(dates) - len(results)} not attempted" if len(results) < len(dates) else ""))
    failed = [r for r in results if r.status == "failed"]
    if not failed:
        return 0
    stopped = f"; stopped after {failed[0].ds}" if len(results) < len(dates) else ""
    print(f"batchinfer backfill: {len(failed)} of {len(dates)} partition(s) failed: "
          f"{', '.join(r.ds for r in failed)}{stopped}; rerun the same command to resume "
          f"(committed partitions are skipped)", file=sys.stderr)
    return failed[0].exit_code


def _watcher(quiet: bool):
    """Live progress for the pipeline: a bar on a terminal, plain lines otherwise, or nothing."""
    from .app.run_progress import choose_mode, watch

    mode = choose_mode(quiet)
    return lambda shards, live: watch(shards, mode, live=live)


def cmd_profile(args) -> int:
    from .commands.profile import profile_partition

    written = profile_partition(_load(args), args.out)
    print(f"profiled {written.rows} scored rows ({written.features} feature and {written.predictions} "
          f"prediction columns) into {args.out}")
    print("use it with: monitor: {baseline: " + args.out + "}")
    return 0


def cmd_report(args) -> int:
    from .app.job_report import rebuild_report

    print(f"wrote {rebuild_report(args.output)}")
    return 0


def cmd_diff(args) -> int:
    from .commands.diff import diff_outputs

    report = diff_outputs(args.output_a, args.output_b, challenger=args.challenger, top=args.top)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for side in ("a", "b"):
        about = report[side]
        t = about["totals"]
        dropped = "rejected" if "challenger" in about else "quarantined"
        print(f"{side.upper()}: {about['output']} (job {about['job']}, ds {about['ds']}, attempt "
              f"{about['attempt']}; {t['rows_in']} rows in, {t['rows_scored']} scored, "
              f"{t['rows_quarantined']} {dropped})")
    if not report["same_partition"]:
        print("note: the two outputs are of different jobs or dates")
    if report["triple_differs"]:
        print("triple: differs")
        for part, values in report["triple_differs"].items():
            print(f"  {part}: {values['a']} → {values['b']}")
    else:
        print("triple: same")
    shards = report["shards"]
    print(f"shards: {shards['both']} in both, {len(shards['only_a'])} only in A, "
          f"{len(shards['only_b'])} only in B, {len(shards['input_changed'])} with changed input bytes")
    for name in shards["input_changed"]:
        print(f"  input changed: {name}")
    rows = report["rows"]
    print(f"rows: {rows['scored_both']} scored in both, {rows['scored_only_a']} scored only in A, "
          f"{rows['scored_only_b']} scored only in B, {rows['quarantined_both']} quarantined in both; "
          f"{rows['input_hash_differs']} with a different _input_hash")
    for name, column in report["columns"].items():
        gap = (f", max |A - B| {column['max_abs_diff']:.6g}"
               if column["max_abs_diff"] is not None else "")
        types = (f" (types differ: A {column['types']['a']}, B {column['types']['b']})"
                 if "types" in column else "")
        print(f"column {name}: {column['differ']} row(s) differ{gap}{types}")
    _print_model_comparison(report)
    print(f"verdict: {'identical' if report['identical'] else 'different'}")
    return 0


def _print_model_comparison(report: dict) -> None:
    """Scores: rank correlation, |A - B| quantiles, top movers; labels: agreement."""
    def number(value) -> str:
        return "-" if value is None else f"{value:.6g}"

    for name, score in report["scores"].items():
        gap = score["abs_diff"]
        print(f"score {name}: spearman {number(score['spearman'])}; |A - B| p50 {number(gap['p50'])}, "
              f"p90 {number(gap['p90'])}, p99 {number(gap['p99'])}, max {number(gap['max'])} "
              f"({score['rows']} rows)")
        for mover in report["top_movers"].get(name, []):
            keys = ", ".join(f"{k}={v}" for k, v in mover.items()
                             if k not in ("a", "b", "abs_diff", "_source_shard", "_source_row"))
            print(f"  moved {number(mover['abs_diff'])}: A {number(mover['a'])} → B "
                  f"{number(mover['b'])}  ({keys + '; ' if keys else ''}"
                  f"{mover['_source_shard']} row {mover['_source_row']})")
    for name, label in report["labels"].items():
        print(f"label {name}: agreement {number(label['agreement'])} ({label['rows']} rows)")
    explained = report.get("explanations")
    if explained:
        print(f"explanations: top feature agrees {number(explained['top1_agreement'])}, top-k "
              f"overlap {number(explained['top_k_overlap'])}, spearman of mean |attribution| "
              f"{number(explained['spearman'])} ({explained['rows']} rows); top A "
              f"{', '.join(explained['top_features_a'][:5])}; top B "
              f"{', '.join(explained['top_features_b'][:5])}")


def cmd_export(args) -> int:
    from .convert.export import export_model

    sample = None
    if args.sample:
        from .spec import load_job

        sample = load_job(args.sample, ds=args.ds, overrides=args.overrides)
    # None: not given (a flag given at its default value is still given, and still refused)
    gate_flags = [flag for flag, given in (
        ("--method", args.method is not None), ("--max-flip-rate", args.max_flip_rate is not None),
        ("--threshold", args.threshold is not None), ("--min-cosine", args.min_cosine is not None),
        ("--embedding", bool(args.embedding)), ("--keep-fp32", bool(args.keep_fp32)),
        ("--smooth", args.smooth is not None)) if given]
    if gate_flags and not args.quantize:
        raise UsageError(f"{', '.join(gate_flags)} go with --quantize int8")
    if args.quantize:
        from .convert.int8_gate import Gate
        from .convert.quantize import quantize_model

        if args.to != "onnx" or args.fp16:
            raise UsageError("--quantize int8 goes with --to onnx (an ONNX model in, its INT8 "
                            "version out), not with --to tensorrt or --fp16")
        gate = Gate(max_flip_rate=args.max_flip_rate, min_cosine=args.min_cosine,
                    threshold=args.threshold, embeddings=tuple(args.embedding))
        report = quantize_model(args.model, args.out, sample, method=args.method or "auto", gate=gate,
                                keep_fp32=tuple(args.keep_fp32), smooth=args.smooth)
    else:
        report = export_model(args.model, args.to, args.out, fp16=args.fp16, sample_job=sample)
    worst = max(report.max_abs_diff.values(), default=0.0)
    print(f"exported {args.model} → {report.out}")
    print(f"  inputs   {', '.join(f'{n} {list(s)}' for n, s in report.inputs.items())}")
    print(f"  outputs  {', '.join(f'{n} {list(s)}' for n, s in report.outputs.items())}")
    if report.gate is not None:
        g = report.gate
        cosine = (f", min cosine {g['parity_min_cosine']:.6g} (≥ {g['parity_min_cosine_bound']:g})"
                  if "embedding" in g["parity_outputs"] else "")
        scored = any(not kind.endswith(": embedding") for kind in g["parity_outputs"].split("; "))
        # KL and flips are the figures of scores and distributions: not printed for embeddings alone
        scores = (f"KL {g['parity_kl']:.3g} (≤ {g['parity_kl_limit']:g}), flip rate "
                  f"{g['parity_flip_rate']:.3g} at {g['parity_threshold']:g} (bound: "
                  f"{g['parity_max_flip_rate']})" if scored else "")
        figures = ", ".join(f for f in (scores, cosine.lstrip(", "), f"max |Δ| {worst:.3g}") if f)
        print(f"  parity   INT8 vs FP32 on {report.sample} ({g['parity_outputs']}): {figures}")
        print(f"  declared {report.out}.quantization.json (stamp copies it into the declaration)")
        print(f"  next     batchinfer stamp {report.out} --job JOB.yaml --model-version NAME:V "
              f"--set model.options.precision=int8")
        return 0
    if report.kl is not None:
        kl = max(report.kl.values(), default=0.0)
        pair = "QDQ ‖ INT8" if "QDQ" in report.reference else "FP32 ‖ FP16"
        print(f"  parity   KL({pair}) {kl:.3g} (≤ 0.01), max |Δ| {worst:.3g} on "
              f"{report.sample} ({report.rows} rows)")
    else:
        print(f"  parity   max |{report.reference} - {args.to}| {worst:.3g} on {report.sample} "
              f"({report.rows} rows)")
    print(f"  next     batchinfer stamp {report.out} --job JOB.yaml --model-version NAME:V")
    return 0


def cmd_validate(args) -> int:
    from .app.input_validation import validate_input

    job = _load(args)
    report = validate_input(job)
    q = job.spec.quarantine
    if report.table is not None:
        print(f"input: {report.table.format} table {job.display(report.table.table)}, "
              f"{_table_read(report.table, None)}")
    print(f"{report.shards} shards, {report.rows_in} rows, {report.rows_bad} bad "
          f"({report.bad_fraction:.2%}; max {q.max_bad_fraction:.2%}), "
          f"{len(report.unreadable)} unreadable (max {q.max_bad_shards})")
    raised = report.preprocess.raised
    for (column, check), n in sorted(report.by_reason.items(), key=lambda kv: -kv[1]):
        if check == "preprocess" and raised:   # by exception type: the reason is the error
            for kind, rows in sorted(raised.items(), key=lambda kv: -kv[1]):
                print(f"  {rows:>8}  (row): preprocess {kind} (first: {report.preprocess.first[kind]})")
            continue
        print(f"  {n:>8}  {column or '(row)'}: {check}")
    for name, reason in report.unreadable:
        print(f"  unreadable  {name}: {reason}")
    for name in report.ignored:
        print(f"  ignored     {name}: metadata (name starts with _ or .), not a shard")
    breach = report.breach(job)
    if breach:
        print(f"batchinfer validate: above the quarantine thresholds ({breach}): `run` would "
              f"exit 4", file=sys.stderr)
        return 4
    return 0


def _table_read(table, pinned: int | None) -> str:
    """``version 3 (pinned by the partition's manifest), filter dt='2026-01-31'``."""
    why = " (pinned by the partition's manifest)" if pinned is not None else ""
    where = ", ".join(f"{k}={v!r}" for k, v in table.filter.items())
    return f"version {table.version}{why}" + (f", filter {where}" if where else "")


def cmd_plan(args) -> int:
    from .app.resolve import partition_listing, partition_of, pinned_version, resolve, shown_partition
    from .commands.run import planned

    job = _load(args)
    spec = job.spec
    partition = partition_of(job)
    resolved = resolve(job, listing=partition_listing(job, partition))
    pinned = pinned_version(job, partition.committed()) if resolved.table is not None else None
    print(f"job:        {spec.name}  (spec sha256 {job.spec_sha256[:16]}…)")
    print(f"partition:  {job.ds or '-'}")
    ignored = f", {len(resolved.ignored)} metadata file(s) ignored" if resolved.ignored else ""
    print(f"input:      {job.display(spec.input.path)}  ({len(resolved.shards)} shards{ignored})")
    if resolved.table is not None:
        print(f"  {resolved.table.format} {_table_read(resolved.table, pinned)}")
    for name in resolved.shard_names():
        print(f"  {name}")
    for url in resolved.ignored:
        print(f"  ignored: {job.display(url)}  (metadata: name starts with _ or .)")
    print(f"schema:     {resolved.schema.ref}  ({len(resolved.features)} features)")
    print(f"preprocess: {spec.preprocess or 'default (FEATURES as float32)'}")
    if spec.preprocess:   # what its hash covers besides the module, and what it records
        print(f"  {'local modules':<16} {', '.join(resolved.preprocessor.local_modules) or 'none'}")
        print(f"  {'packages':<16} {' '.join(resolved.preprocessor.packages) or 'none'}")
    print(f"model:      {job.display(spec.model.uri)}  ({spec.model.backend}, device {spec.model.device})")
    for key, value in resolved.triple.as_dict().items():
        print(f"  {key:<16} {value}")
    for challenger in resolved.challengers:
        its = challenger.spec
        print(f"challenger: {challenger.name}  {job.display(its.uri)}  ({its.backend}, device "
              f"{its.device}; {challenger.triple.model_version}, digest "
              f"{challenger.triple.model_digest[:16]}…)")
    print("contract:   ok (declaration matches)" if not resolved.challengers
          else "contract:   ok (declarations match)")
    print(f"output:     {shown_partition(job)}")
    print(f"  {'a run would':<16} {planned(job, resolved)}")
    print(f"runner:     {spec.runner.name}")
    return 0


def cmd_inspect(args) -> int:
    from .commands.inspect import inspect_output

    manifest = inspect_output(args.output)
    if args.json:
        print(json.dumps(manifest.to_dict(), indent=2))
        return 0
    print(f"{args.output}: job {manifest.job}, ds {manifest.ds}, attempt {manifest.attempt}")
    for key, value in manifest.triple.items():
        print(f"  {key:<16} {value}")
    print(f"runner {manifest.runner}, device {manifest.device}, "
          f"{manifest.started_at} → {manifest.finished_at}, MLflow run {manifest.mlflow_run_id}")
    _print_totals(manifest)
    by_status: dict[str, int] = {}
    for shard in manifest.shards:
        by_status[shard.status] = by_status.get(shard.status, 0) + 1
    print("shards by status: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
    for shard in manifest.shards:
        if shard.status != "scored":
            print(f"  {shard.status:<12} {shard.path}: {shard.reason or ''}")
    files = [f for s in manifest.shards for f in s.files]
    print(f"files: {len(files)} ({sum(f.rows for f in files)} rows)")
    reused = manifest.reused()
    if reused:   # a resumed or updated run (contract §5.3 "Resume", "Update"): who scored what
        by: dict[str, int] = {}
        for shard in reused:
            by[manifest.scored_by(shard)] = by.get(manifest.scored_by(shard), 0) + 1
        print(f"reused: {len(reused)} of {len(manifest.shards)} shards "
              f"({sum(s.rows_in or 0 for s in reused)} rows) scored by earlier attempt(s) "
              + ", ".join(f"{a} ({n})" for a, n in sorted(by.items()))
              + f"; {len(manifest.shards) - len(reused)} scored by {manifest.attempt}")
    for c in manifest.challengers:
        print(f"challenger {c.name}: {c.triple.get('model_version')} ({c.backend}, {c.device}): "
              f"{c.rows_scored} rows scored, {c.rows_rejected} rejected, "
              f"{sum(len(s.files) for s in c.shards)} files; compare with `batchinfer diff "
              f"{args.output} --challenger {c.name}`")
    return 0


def cmd_stamp(args) -> int:
    from .commands.stamp import stamp

    job = _load(args, require_ds=False)
    triple, where = stamp(job, args.model, args.model_version, args.challenger, args.baseline,
                          args.packages)
    print(f"declared {args.model} in {where}:")
    for key, value in triple.as_dict().items():
        print(f"  {key:<16} {value}")
    return 0


def cmd_schema(args) -> int:
    from .commands.schema import lock_path, publish_schema, verify_schemas

    root = args.root if args.root else _load(args, require_ds=False).spec.schemas.root
    if args.schema_action == "publish":
        digest, added = publish_schema(root, args.ref)
        print(f"published {args.ref} in {lock_path(root)} (sha256 {digest})" if added else
              f"{args.ref} is already published in {lock_path(root)} (sha256 {digest}); nothing to do")
        return 0
    locked, problems = verify_schemas(root)
    for line in problems:
        print(line)
    if problems:
        raise ContractError(f"{len(problems)} of {locked} published schema version(s) in "
                            f"{lock_path(root)} are missing or changed: restore them from version "
                            f"control (a change is published as a new version)")
    print(f"{locked} published schema version(s) in {lock_path(root)}: every file matches")
    return 0


def cmd_track(args) -> int:
    from .commands.inspect import upload_tracking

    run_id = upload_tracking(args.output, args.tracking_uri)
    print(f"uploaded to MLflow run {run_id}")
    return 0


def cmd_demo(args) -> int:
    from .demo.run import run_demo

    if args.rows < 6 or args.rows % 6:
        raise UsageError(f"--rows {args.rows}: the demo writes 6 equal shards, so give a positive "
                         f"multiple of 6 (e.g. {max(6, args.rows - args.rows % 6)})")
    return run_demo(Path(args.dir), rows=args.rows)


def _print_totals(manifest: "Manifest") -> None:
    t = manifest.totals
    print(f"rows: {t.rows_in} in, {t.rows_scored} scored, {t.rows_quarantined} quarantined; "
          f"shards: {t.shards} ({t.shards_unreadable} unreadable)")


COMMANDS = {"run": cmd_run, "backfill": cmd_backfill, "diff": cmd_diff, "export": cmd_export,
            "validate": cmd_validate, "plan": cmd_plan, "inspect": cmd_inspect,
            "stamp": cmd_stamp, "track": cmd_track, "demo": cmd_demo, "profile": cmd_profile,
            "report": cmd_report, "schema": cmd_schema}


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
