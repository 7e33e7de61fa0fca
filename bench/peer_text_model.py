"""The text peers' scorer: all-MiniLM-L6-v2 as the batchinfer text job's ONNX file, under
ONNX Runtime, tokenized with the job's own tokenizer file (imported by ``peer_daft.py --text``
and ``peer_ray_text.py``; not a program of its own).

The model file is the job's (``pipelines/text_embeddings/model/all-MiniLM-L6-v2.onnx``, or the
INT8 file ``embeddings.py`` exports): mean pooling over the attention mask and L2 normalisation
are inside its graph (``pipelines/text_embeddings/prepare.py``), so a peer feeds token ids and
mask and takes ``sentence_embedding`` as it comes, exactly as the job does. Tokenization is the
job's (``embed_preprocess.py``): special tokens added, truncated at 256 tokens, ``[PAD]`` = 0.

Batching is sentence-transformers' ``encode`` recipe, which a user of a data framework without
a length-aware batcher copies: the framework's batch is sorted by token count and scored
``chunk_rows`` (32, encode's default) documents a call, each call padded to its longest
document. Without the sort, a call of log-normal documents is mostly padding (bench/README.md:
padding 2.97 for unsorted 256-row batches).
"""
from __future__ import annotations

import numpy as np

MAX_LENGTH = 256      # embed_preprocess.MAX_LENGTH: the model's window, special tokens included
PAD_ID = 0
OUTPUT = "sentence_embedding"
CHUNK_ROWS = 32       # sentence-transformers' default batch size


class MiniLM:
    """One ONNX Runtime session and the job's tokenizer; ``embed`` takes a framework's batch.

    Args:
        model: the ONNX file (FP32 or INT8).
        tokenizer: the job's ``tokenizer.json``.
        threads: ONNX Runtime's intra-op threads; 0 lets it choose (one per core).
        chunk_rows: documents per model call, after sorting by length.
    """

    def __init__(self, model: str, tokenizer: str, threads: int = 0, chunk_rows: int = CHUNK_ROWS):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(tokenizer)
        self.tokenizer.enable_truncation(max_length=MAX_LENGTH)
        self.tokenizer.no_padding()   # each call is padded to its own longest document, below
        self.chunk_rows = chunk_rows
        self.tokens_fed = 0
        self.tokens_real = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        """``float32 [len(texts), 384]`` in the order of ``texts``."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        out = np.empty((len(texts), 384), dtype=np.float32)
        for lo in range(0, len(order), self.chunk_rows):
            rows = order[lo:lo + self.chunk_rows]
            width = int(lengths[rows].max())
            ids = np.full((len(rows), width), PAD_ID, dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for i, row in enumerate(rows):
                n = lengths[row]
                ids[i, :n] = encodings[row].ids
                mask[i, :n] = 1
            out[rows] = self.session.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})[0]
            self.tokens_fed += ids.size
            self.tokens_real += int(lengths[rows].sum())
        return out


def fixed_size_list(values: np.ndarray):
    """``[n, d]`` float32 as a pyarrow ``fixed_size_list<float>[d]`` array (Parquet-ready)."""
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
