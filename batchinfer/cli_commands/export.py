"""``batchinfer export MODEL --to onnx|tensorrt --out FILE``: convert a model and check parity;
``--quantize int8``: its INT8 version, written only when the gate passes (the work:
:mod:`batchinfer.convert`, whose defaults the help names)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..errors import UsageError
from .arguments import spec_options
from .results import Result

if TYPE_CHECKING:
    from ..convert.written import ExportReport

HELP = "convert a model (.pt2 to ONNX, ONNX to TensorRT) and check parity"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..convert.int8_gate import MIN_COSINE, THRESHOLD
    from ..convert.quantize import METHODS, QUANTIZE_ROWS
    from ..convert.samples import SAMPLE_ROWS, SAMPLE_SEED

    p.add_argument("model", help="a torch.export program (.pt2), or an ONNX model for --to tensorrt")
    p.add_argument("--to", required=True, metavar="onnx|tensorrt")
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--fp16", action="store_true", help="TensorRT: build an FP16 engine")
    p.add_argument("--sample", metavar="JOB.yaml", help="check parity on rows of this job's input")
    p.add_argument("--sample-rows", type=_sample_rows, metavar="N",
                   help=f"with --sample: valid rows drawn from every shard of the input, in "
                        f"proportion to its rows (default {QUANTIZE_ROWS} with --quantize, else "
                        f"{SAMPLE_ROWS})")
    p.add_argument("--sample-seed", type=_sample_seed, metavar="S",
                   help=f"with --sample: the seed the sample's rows are drawn with (default {SAMPLE_SEED})")
    p.add_argument("--quantize", choices=("int8",),
                   help="--to onnx of an ONNX model: INT8 quantization calibrated on --sample's "
                        "rows, written only when the parity gate passes")
    # The gate's options default to None: not given (one given at its default value is still
    # given, and refused without --quantize); the defaults are the converters'.
    p.add_argument("--method", choices=METHODS,
                   help=f"--quantize: static QDQ (numeric inputs) or dynamic (token ids); default {METHODS[0]}")
    p.add_argument("--max-flip-rate", type=float, metavar="F",
                   help="--quantize: refuse when more than F of a score's decisions flip "
                        "(default: reported, not judged)")
    p.add_argument("--threshold", type=float, metavar="T",
                   help=f"--quantize: the decision threshold of a score (default {THRESHOLD:g})")
    p.add_argument("--min-cosine", type=float, metavar="C",
                   help=f"--quantize: an embedding's rows keep cosine >= C with FP32 (default {MIN_COSINE:g})")
    p.add_argument("--embedding", action="append", metavar="OUTPUT",
                   help="--quantize: judge this [N, K] output by cosine (outputs named *embed* are)")
    p.add_argument("--keep-fp32", action="append", metavar="REGEX",
                   help="--quantize: the nodes whose names match stay FP32 (repeatable)")
    p.add_argument("--smooth", type=float, metavar="ALPHA",
                   help="--quantize: SmoothQuant the MatMuls' inputs first, calibrated on the "
                        "sample (alpha in (0, 1); 0.7 for MiniLM)")
    spec_options(p, "with --sample: the partition date",
                 "with --sample: override one spec key (repeatable)")


def _sample_rows(value: str) -> int:
    try:
        rows = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of rows") from None
    if rows < 1:
        raise argparse.ArgumentTypeError(f"{rows}: give at least 1 row")
    return rows


def _sample_seed(value: str) -> int:
    # a seed numpy takes and every reader of the record's JSON reads as one integer
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if not 0 <= seed <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"{seed}: choose a seed from 0 to 2**63 - 1")
    return seed


GATE_FLAGS = {"--method": "method", "--max-flip-rate": "max_flip_rate", "--threshold": "threshold",
              "--min-cosine": "min_cosine", "--embedding": "embedding", "--keep-fp32": "keep_fp32",
              "--smooth": "smooth"}


@dataclass(frozen=True)
class Exported(Result):
    model: str
    to: str
    report: ExportReport

    def render(self, out: TextIO, err: TextIO) -> None:
        for line in self.lines():
            print(line, file=out)

    def lines(self) -> list[str]:
        report = self.report
        worst = max(report.max_abs_diff.values(), default=0.0)
        lines = [f"exported {self.model} → {report.out}",
                 f"  inputs   {', '.join(f'{n} {list(s)}' for n, s in report.inputs.items())}",
                 f"  outputs  {', '.join(f'{n} {list(s)}' for n, s in report.outputs.items())}"]
        g = report.gate
        if g is not None:
            cosine = (f", min cosine {g['parity_min_cosine']:.6g} (≥ {g['parity_min_cosine_bound']:g})"
                      if "embedding" in g["parity_outputs"] else "")
            scored = any(not kind.endswith(": embedding") for kind in g["parity_outputs"].split("; "))
            # KL and flips are the figures of scores and distributions: not printed for embeddings alone
            scores = (f"KL {g['parity_kl']:.3g} (≤ {g['parity_kl_limit']:g}), flip rate "
                      f"{g['parity_flip_rate']:.3g} at {g['parity_threshold']:g} (bound: "
                      f"{g['parity_max_flip_rate']})" if scored else "")
            figures = ", ".join(f for f in (scores, cosine.lstrip(", "), f"max |Δ| {worst:.3g}") if f)
            return lines + [
                f"  parity   INT8 vs FP32 on {report.sample} ({g['parity_outputs']}): {figures}",
                f"  declared {report.out}.quantization.json (stamp copies it into the declaration)",
                f"  next     batchinfer stamp {report.out} --job JOB.yaml --model-version NAME:V "
                f"--set model.options.precision=int8"]
        if report.kl is not None:
            kl = max(report.kl.values(), default=0.0)
            pair = "QDQ ‖ INT8" if "QDQ" in report.reference else "FP32 ‖ FP16"
            lines.append(f"  parity   KL({pair}) {kl:.3g} (≤ 0.01), max |Δ| {worst:.3g} on "
                         f"{report.sample} ({report.rows} rows)")
        else:
            lines.append(f"  parity   max |{report.reference} - {self.to}| {worst:.3g} on {report.sample} "
                         f"({report.rows} rows)")
        return lines + [f"  next     batchinfer stamp {report.out} --job JOB.yaml --model-version NAME:V"]


def execute(args: argparse.Namespace) -> Exported:
    sample = None
    if args.sample:
        from ..spec import load_job

        sample = load_job(args.sample, ds=args.ds, overrides=args.overrides)
    given = [flag for flag, dest in GATE_FLAGS.items() if getattr(args, dest) is not None]
    if given and not args.quantize:
        raise UsageError(f"{', '.join(given)} go with --quantize int8")
    sampling = [flag for flag, value in (("--sample-rows", args.sample_rows),
                                         ("--sample-seed", args.sample_seed)) if value is not None]
    if sampling and sample is None:
        raise UsageError(f"{', '.join(sampling)} go{'es' if len(sampling) == 1 else ''} with "
                         f"--sample JOB.yaml (the job whose input is sampled)")
    from ..convert.quantize import QUANTIZE_ROWS
    from ..convert.samples import SAMPLE_ROWS, SAMPLE_SEED, SampleSize

    size = SampleSize(args.sample_rows or (QUANTIZE_ROWS if args.quantize else SAMPLE_ROWS),
                      SAMPLE_SEED if args.sample_seed is None else args.sample_seed)
    if not args.quantize:
        from ..convert.export import export_model

        return Exported(args.model, args.to, export_model(args.model, args.to, args.out, fp16=args.fp16,
                                                          sample_job=sample, sample=size))
    from ..convert.int8_gate import Gate
    from ..convert.quantize import METHODS, quantize_model

    if args.to != "onnx" or args.fp16:
        raise UsageError("--quantize int8 goes with --to onnx (an ONNX model in, its INT8 "
                         "version out), not with --to tensorrt or --fp16")
    gate = Gate(max_flip_rate=args.max_flip_rate, min_cosine=args.min_cosine,
                threshold=args.threshold, embeddings=tuple(args.embedding or ()))
    report = quantize_model(args.model, args.out, sample, method=args.method or METHODS[0], gate=gate,
                            keep_fp32=tuple(args.keep_fp32 or ()), smooth=args.smooth, sample=size)
    return Exported(args.model, args.to, report)
