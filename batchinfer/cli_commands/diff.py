"""``batchinfer diff OUTPUT_A [OUTPUT_B | --challenger NAME]``: compare two committed outputs of
the same partition, or an output's champion with one of its challengers (the work:
:mod:`batchinfer.commands.diff`, whose :class:`~batchinfer.commands.diff.DiffReport` this prints)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .results import Result

if TYPE_CHECKING:
    from ..commands.diff import DiffReport

HELP = ("compare two committed outputs of the same partition, or an output's champion with one "
        "of its challengers")
NOT_KEYS = ("a", "b", "abs_diff", "_source_shard", "_source_row")   # a mover's values, not its keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..commands.diff import TOP_MOVERS

    p.add_argument("output_a")
    p.add_argument("output_b", nargs="?", help="the other output (not with --challenger)")
    p.add_argument("--challenger", metavar="NAME",
                   help="compare OUTPUT_A's champion (A) with its challenger NAME (B)")
    p.add_argument("--top", type=int, default=TOP_MOVERS, metavar="N",
                   help=f"top movers to list per score column (default {TOP_MOVERS})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


@dataclass(frozen=True)
class Diffed(Result):
    report: DiffReport
    as_json: bool

    def render(self, out: TextIO, err: TextIO) -> None:
        lines = [json.dumps(self.report, indent=2)] if self.as_json else self.outputs() + self.models()
        for line in lines:
            print(line, file=out)

    def outputs(self) -> list[str]:
        """The two sides, their triples, shards, rows and columns."""
        report, lines = self.report, []
        for name, about in (("A", report["a"]), ("B", report["b"])):
            t = about["totals"]
            dropped = "rejected" if "challenger" in about else "quarantined"
            lines.append(f"{name}: {about['output']} (job {about['job']}, ds {about['ds']}, attempt "
                         f"{about['attempt']}; {t['rows_in']} rows in, {t['rows_scored']} scored, "
                         f"{t['rows_quarantined']} {dropped})")
        if not report["same_partition"]:
            lines.append("note: the two outputs are of different jobs or dates")
        lines.append("triple: differs" if report["triple_differs"] else "triple: same")
        lines += [f"  {part}: {values['a']} → {values['b']}" for part, values in report["triple_differs"].items()]
        shards = report["shards"]
        lines.append(f"shards: {shards['both']} in both, {len(shards['only_a'])} only in A, "
                     f"{len(shards['only_b'])} only in B, {len(shards['input_changed'])} with changed input bytes")
        lines += [f"  input changed: {name}" for name in shards["input_changed"]]
        rows = report["rows"]
        lines.append(f"rows: {rows['scored_both']} scored in both, {rows['scored_only_a']} scored only in A, "
                     f"{rows['scored_only_b']} scored only in B, {rows['quarantined_both']} quarantined in both; "
                     f"{rows['input_hash_differs']} with a different _input_hash")
        for name, column in report["columns"].items():
            gap = f", max |A - B| {column['max_abs_diff']:.6g}" if column["max_abs_diff"] is not None else ""
            types = column.get("types")
            differ = f" (types differ: A {types['a']}, B {types['b']})" if types is not None else ""
            lines.append(f"column {name}: {column['differ']} row(s) differ{gap}{differ}")
        return lines

    def models(self) -> list[str]:
        """Scores: rank correlation, |A - B| quantiles, top movers; labels: agreement; the verdict."""
        report, lines = self.report, []
        for name, score in report["scores"].items():
            gap = score["abs_diff"]
            lines.append(f"score {name}: spearman {number(score['spearman'])}; |A - B| p50 {number(gap['p50'])}, "
                         f"p90 {number(gap['p90'])}, p99 {number(gap['p99'])}, max {number(gap['max'])} "
                         f"({score['rows']} rows)")
            for mover in report["top_movers"].get(name, []):
                keys = ", ".join(f"{k}={v}" for k, v in mover.items() if k not in NOT_KEYS)
                lines.append(f"  moved {number(mover['abs_diff'])}: A {number(mover['a'])} → B "
                             f"{number(mover['b'])}  ({keys + '; ' if keys else ''}"
                             f"{mover['_source_shard']} row {mover['_source_row']})")
        for name, label in report["labels"].items():
            lines.append(f"label {name}: agreement {number(label['agreement'])} ({label['rows']} rows)")
        explained = report.get("explanations")
        if explained:
            lines.append(f"explanations: top feature agrees {number(explained['top1_agreement'])}, top-k "
                         f"overlap {number(explained['top_k_overlap'])}, spearman of mean |attribution| "
                         f"{number(explained['spearman'])} ({explained['rows']} rows); top A "
                         f"{', '.join(explained['top_features_a'][:5])}; top B "
                         f"{', '.join(explained['top_features_b'][:5])}")
        lines.append(f"verdict: {'identical' if report['identical'] else 'different'}")
        return lines


def execute(args: argparse.Namespace) -> Diffed:
    from ..commands.diff import diff_outputs

    report = diff_outputs(args.output_a, args.output_b, challenger=args.challenger, top=args.top)
    return Diffed(report, args.json)
