"""One Arrow type per logical type, for the input columns batchinfer writes (pure, Arrow only).

Shards of one partition may store the same column in different physical types: Spark and
pyarrow write ``string``, polars ``large_string`` (or ``string_view``), pandas a dictionary for a
categorical. Copied into prediction files as they are, one partition's files would disagree on a
column's type and not read as one table. So the id columns (the only input columns copied) are
written in their plain type: ``string`` for every string kind, ``binary`` for every binary kind,
``list`` for every list kind, dictionaries and run-end encodings decoded, recursively inside
lists, structs and maps. Values are unchanged, and so is ``_input_hash``: docs/hashing.md gives
these kinds one type string.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def plain_type(arrow_type: pa.DataType) -> pa.DataType:
    """The one type batchinfer writes for values of ``arrow_type``.

    Example:
        >>> plain_type(pa.large_list(pa.string_view()))
        ListType(list<item: string>)
    """
    t = arrow_type
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return plain_type(t.value_type)
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t)):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(plain_type(t.key_type)),
                       t.item_field.with_type(plain_type(t.item_type)), t.keys_sorted)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(plain_type(f.type)) for f in t])
    return t


def plain_array(array: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``array`` in its :func:`plain_type` (itself when it is already plain)."""
    wanted = plain_type(array.type)
    if wanted == array.type:
        return array
    if pa.types.is_run_end_encoded(array.type):  # Arrow casts no run-end encoding: decode it
        array = pc.run_end_decode(array)
    return array.cast(wanted)
