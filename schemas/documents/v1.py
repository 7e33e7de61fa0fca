"""documents, version 1: one row per text to embed (pipelines/text_embeddings).

Published schema versions are immutable. To change a column, a type or a check, copy this
file to ``v2.py``, edit the copy and point jobs (and a newly stamped model) at
``documents@2``.

``text`` is any UTF-8 string. A null text is bad input (there is nothing to embed and no way to
tell it from a lost value): the row is quarantined with pandera's ``not_nullable`` reason. An
empty or whitespace-only text is a real document and is embedded (the tokenizer gives it just
its [CLS] and [SEP] tokens). Texts longer than the model's window are embedded from their first
tokens (the preprocessing truncates; see pipelines/text_embeddings/embed_preprocess.py).
"""
import pandera.polars as pa
import polars as pl

SCHEMA = pa.DataFrameSchema(
    {
        # The caller's id for the document, copied to the output unchanged.
        "doc_id": pa.Column(pl.Utf8, nullable=False),
        "text": pa.Column(pl.Utf8, nullable=False),
    },
    strict=True,
    name="documents@1",
)

# The model's input column: the preprocessing tokenizes it.
FEATURES = ["text"]
