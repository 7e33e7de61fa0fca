"""Preprocessing for the text_embeddings job: documents@1 rows -> all-MiniLM-L6-v2 token ids.

``transform(batch)`` tokenizes the ``text`` column with the model's own tokenizer
(``model/tokenizer.json``, written by ``python -m pipelines.text_embeddings.prepare`` from the
package that ships the model) and returns the model's inputs by name, ``int64``
``[rows, longest sequence in the batch]`` each:

* ``input_ids``: ``[CLS] tokens… [SEP]`` then ``[PAD]`` (id 0) up to the batch's longest row;
* ``attention_mask``: 1 on real tokens, 0 on padding (the model ignores padding: attention is
  masked and the mean pooling is weighted by this mask, so a row's embedding does not depend on
  what else is in its batch beyond float rounding).

Texts longer than ``MAX_LENGTH`` tokens (special tokens included) are truncated to their first
``MAX_LENGTH`` tokens, as sentence-transformers does for this model (``max_seq_length`` 256 in
its sentence_bert_config.json). The tokenizer file's own settings (truncation at 128, padding to
a fixed 128) are replaced by these, so the result does not depend on how the file was saved.

Tokenization is deterministic: the same text gives the same ids in any batch. The tokenizer
file's bytes are in ``ASSETS`` and so in the job's preprocess hash: a changed tokenizer needs a
re-stamped model.
"""
from pathlib import Path

import numpy as np

ASSETS = ["model/tokenizer.json"]
MAX_LENGTH = 256
PAD_ID = 0
PAD_TOKEN = "[PAD]"

_TOKENIZER = None  # loaded once per process, on the first batch


def tokenizer():
    """The model's tokenizer, set to truncate at MAX_LENGTH and pad to the batch's longest row."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_file(str(Path(__file__).parent / ASSETS[0]))
        loaded.enable_truncation(max_length=MAX_LENGTH)
        loaded.enable_padding(pad_id=PAD_ID, pad_token=PAD_TOKEN)  # no length: the longest row
        _TOKENIZER = loaded
    return _TOKENIZER


def transform(batch):
    """Tokenizes a batch of documents@1 rows.

    Args:
        batch: a ``pyarrow.RecordBatch`` (or ``Table``) with a non-null ``text`` column.

    Returns:
        ``{"input_ids": int64 [rows, L], "attention_mask": int64 [rows, L]}``, L the longest
        row's token count (at most MAX_LENGTH).
    """
    texts = batch.column("text").to_pylist()
    encodings = tokenizer().encode_batch(texts, add_special_tokens=True)
    if not encodings:
        return {"input_ids": np.zeros((0, 0), np.int64), "attention_mask": np.zeros((0, 0), np.int64)}
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": mask}
