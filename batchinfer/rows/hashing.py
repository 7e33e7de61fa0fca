"""Stable per-row input hash: the ``_input_hash`` column (contract §4, §5 guarantee 4).

A row's hash depends only on the values and canonical types of the hashed columns. It does not
depend on the machine, the numpy or pyarrow version, batch boundaries, chunking, slice offsets
or the physical order of the columns. The algorithm is ``batchinfer-rowhash/1``, specified in
``docs/hashing.md`` with test vectors; this module is its vectorised implementation. What it
computes must never change: a different algorithm gets a different name.

In short: each column gets a 64-bit key from its name and canonical type string. Each cell
becomes one 64-bit value word. Strings, binaries, decimals, lists, maps and structs go through
a position-weighted sequence hash first. A null cell uses a reserved word. Each cell is mixed
with murmur3's ``fmix64``, weighted by the column's position in sorted-name order, summed
modulo 2**64 and mixed again. Every step is numpy uint64 arithmetic over whole columns; no
Python code runs per row.

Speed: 32 float32 columns + 1 int64 column, batches of 65,536 rows, on one core of the 2-core
development VM (AMD EPYC, numpy 2.4.6, pyarrow 25.0.1): about 7.3 M rows/s (about 9 ms per
batch). See "Measuring speed" in ``docs/hashing.md`` for the script.

Example:
    >>> import pyarrow as pa
    >>> batch = pa.record_batch({"id": pa.array([1, 2], pa.int64())})
    >>> row_hashes(batch).to_pylist()
    ['58427b8cb7daf250', '150adca84dfff1e8']
    >>> row_hashes(batch.select(["id"])).equals(row_hashes(batch, ["id"]))
    True
"""
from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["HASH_ALGORITHM", "row_hashes", "row_hashes_uint64"]

HASH_ALGORITHM = "batchinfer-rowhash/1"

# --- Constants of batchinfer-rowhash/1. Frozen: changing any of them changes every hash. -------
# The seeds are the first 8 bytes (little-endian) of BLAKE2b-512 over
# "batchinfer-rowhash/1:<label>". They are written out so that a reimplementation does not
# have to derive them, and a test checks the derivation.
_ROW_SEED = np.uint64(0x772694AA7257A326)  # label "row"
_ELEMENT_SEED = np.uint64(0xB199F113BF554313)  # label "element"
_POSITION_SEED = np.uint64(0x9F9BF9985779A131)  # label "position"
_LENGTH_SEED = np.uint64(0x8EC094632A883AD1)  # label "length"
# The value word of a null cell. It is a NaN with a payload that no float column can produce,
# because every float NaN is first canonicalised to _CANONICAL_NAN. So in float, bool and
# narrow integer columns a null can never look like a value.
_NULL_WORD = np.uint64(0x7FF06E756C6C0001)
_CANONICAL_NAN = np.uint64(0x7FF8000000000000)
# murmur3's fmix64: a well-studied bijective 64-bit finaliser (full avalanche).
_FMIX_M1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_FMIX_SHIFT = np.uint64(33)
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)

# --- Tuning knobs. They change speed and memory, never results. ------------------------------
# Rows are mixed in blocks so that the (columns x rows) uint64 working set stays in L2 cache.
# Measured best for the 33-column benchmark (1024 to 4096 are all within about 5%).
_BLOCK_ROWS = 2048
# Sequence elements (string bytes, list items) hashed per step. This bounds the temporary
# memory: a few dozen bytes per element. A longer row is hashed window by window.
_SEQUENCE_CHUNK_ELEMENTS = 1 << 16
# The position weights of the first elements of a sequence are looked up, not recomputed.
_POSITION_TABLE_SIZE = 1 << 16


def row_hashes_uint64(
    data: pa.RecordBatch | pa.Table, columns: Sequence[str] | None = None
) -> np.ndarray:
    """Hashes every row of ``data`` to a stable 64-bit integer (``batchinfer-rowhash/1``).

    Args:
        data: The rows to hash. A table may be chunked in any way; the result is the same.
        columns: Names of the columns to hash, in any order; default: all of them. They are
            always combined in sorted-name order, so the physical column order does not matter.

    Returns:
        A ``numpy.uint64`` array with one hash per row.

    Raises:
        TypeError: ``data`` is not a RecordBatch or Table, ``columns`` is a bare string, or a
            column has a type that the algorithm does not cover (union, interval, list view).
        ValueError: A named column is missing, or a hashed name (column or struct field)
            occurs more than once.
        NotImplementedError: The host is big-endian (Arrow buffers would be read wrongly).
    """
    if sys.byteorder != "little":
        raise NotImplementedError(f"{HASH_ALGORITHM} reads Arrow buffers as little-endian")
    selected = _select_columns(data, columns)
    # uint64 arithmetic wraps on purpose; widening a signalling NaN raises "invalid".
    with np.errstate(over="ignore", invalid="ignore"):
        hashed = [_make_column(name, column) for name, column in selected]
        return _combine(hashed, data.num_rows)


def row_hashes(
    data: pa.RecordBatch | pa.Table, columns: Sequence[str] | None = None
) -> pa.StringArray:
    """Hashes every row of ``data`` and formats each hash as 16 lowercase hex digits.

    The text is the uint64 from :func:`row_hashes_uint64`, written big-endian and zero-padded
    (Python's ``f"{h:016x}"``). This is the ``_input_hash`` column of the predictions.

    Args:
        data: The rows to hash, as for :func:`row_hashes_uint64`.
        columns: The columns to hash, as for :func:`row_hashes_uint64`.

    Returns:
        A ``pyarrow.StringArray`` with no nulls and one 16-character string per row.

    Raises:
        TypeError, ValueError, NotImplementedError: As for :func:`row_hashes_uint64`.
        ValueError: More than 2**27 - 1 rows (a StringArray uses 32-bit offsets).
    """
    hashes = row_hashes_uint64(data, columns)
    count = len(hashes)
    if count * 16 > np.iinfo(np.int32).max:
        raise ValueError(f"{count} rows is too many for one StringArray of hashes; hash in batches")
    # Build the text with numpy, not a per-row f-string: each byte of the big-endian hash
    # becomes its two hex digits by one lookup in a 256-entry table of digit pairs.
    hash_bytes = hashes.astype(">u8").view(np.uint8)
    text = np.take(_HEX_PAIRS, hash_bytes)  # np.take: about 2x faster than [] here
    offsets = np.arange(0, 16 * (count + 1), 16, dtype="<i4")
    return pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(text))


# Entry b is the two ASCII hex digits of byte b packed into one uint16, so that one np.take
# writes both digits.
_HEX_PAIRS = np.frombuffer(
    b"".join(f"{b:02x}".encode("ascii") for b in range(256)), dtype="<u2"
).copy()
_HEX_PAIRS.flags.writeable = False


# --- Selecting and describing columns --------------------------------------------------------


def _select_columns(
    data: pa.RecordBatch | pa.Table, columns: Sequence[str] | None
) -> list[tuple[str, pa.Array | pa.ChunkedArray]]:
    """Returns the (name, column) pairs to hash, sorted by name."""
    if not isinstance(data, (pa.RecordBatch, pa.Table)):
        raise TypeError(f"expected a pyarrow RecordBatch or Table, got {type(data).__name__}")
    if isinstance(columns, str):
        # A bare string is a Sequence[str] of characters: almost certainly a mistake.
        raise TypeError("columns must be a sequence of column names, not a single string")
    names = list(data.schema.names) if columns is None else list(columns)
    _reject_duplicates(names, "column")
    selected = []
    for name in names:
        index = data.schema.get_field_index(name)
        if index < 0:
            known = ", ".join(repr(n) for n in data.schema.names)
            if name in data.schema.names:
                raise ValueError(f"column {name!r} occurs more than once in the data")
            raise ValueError(f"no column named {name!r} to hash; the data has: {known}")
        selected.append((name, data.column(index)))
    # Code-point order, which is also the byte order of the names' UTF-8 encodings.
    selected.sort(key=lambda pair: pair[0])
    return selected


def _reject_duplicates(names: Sequence[str], what: str) -> None:
    # With two equal names "sorted by name" would not say which value goes first.
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what} name {name!r} occurs more than once; names must be unique")
        seen.add(name)


def _type_string(arrow_type: pa.DataType) -> str:
    """Returns the canonical type string of ``batchinfer-rowhash/1`` for ``arrow_type``.

    Never ``str(arrow_type)``: pyarrow may change how it prints types, and several physical
    types are deliberately one logical type here (string / large_string / string_view,
    dictionary-encoded vs plain). Nullability, field metadata and the names of list items and
    map entries are ignored, since Parquet round trips may change them.
    """
    t = arrow_type
    if isinstance(t, pa.BaseExtensionType):
        return f"extension<{t.extension_name}>({_type_string(t.storage_type)})"
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return _type_string(t.value_type)
    simple = _SIMPLE_TYPE_STRINGS.get(t.id)
    if simple is not None:
        return simple
    if pa.types.is_time32(t) or pa.types.is_time64(t):
        return f"time{t.bit_width}[{t.unit}]"
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}]" if t.tz is None else f"timestamp[{t.unit}, tz={t.tz}]"
    if pa.types.is_duration(t):
        return f"duration[{t.unit}]"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision}, {t.scale})"
    if pa.types.is_fixed_size_binary(t):
        return f"fixed_size_binary[{t.byte_width}]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type_string(t.value_type)}>"
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{_type_string(t.value_type)}>[{t.list_size}]"
    if pa.types.is_map(t):
        return f"map<{_type_string(t.key_type)}, {_type_string(t.item_type)}>"
    if pa.types.is_struct(t):
        fields = (t.field(i) for i in range(t.num_fields))
        return "struct<" + ", ".join(f"{f.name}: {_type_string(f.type)}" for f in fields) + ">"
    raise TypeError(f"type {t} is not covered by {HASH_ALGORITHM}; cast the column first")


_SIMPLE_TYPE_STRINGS = {
    pa.null().id: "null",
    pa.bool_().id: "bool",
    pa.int8().id: "int8",
    pa.int16().id: "int16",
    pa.int32().id: "int32",
    pa.int64().id: "int64",
    pa.uint8().id: "uint8",
    pa.uint16().id: "uint16",
    pa.uint32().id: "uint32",
    pa.uint64().id: "uint64",
    pa.float16().id: "float16",
    pa.float32().id: "float32",
    pa.float64().id: "float64",
    pa.date32().id: "date32",
    pa.date64().id: "date64",
    pa.string().id: "utf8",
    pa.large_string().id: "utf8",
    pa.string_view().id: "utf8",
    pa.binary().id: "binary",
    pa.large_binary().id: "binary",
    pa.binary_view().id: "binary",
}


@functools.lru_cache(maxsize=4096)
def _column_key(name: str, type_string: str) -> np.uint64:
    """First 8 bytes (little-endian) of BLAKE2b-512 over ``name + "\\x00" + type_string``."""
    digest = hashlib.blake2b((name + "\x00" + type_string).encode("utf-8")).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


# --- Mixing primitives -----------------------------------------------------------------------


def _fmix64(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """Applies murmur3's fmix64 to a uint64 array in place (mod 2**64) and returns it."""
    if scratch is None:
        scratch = np.empty_like(x)
    np.right_shift(x, _FMIX_SHIFT, out=scratch)
    x ^= scratch
    x *= _FMIX_M1
    np.right_shift(x, _FMIX_SHIFT, out=scratch)
    x ^= scratch
    x *= _FMIX_M2
    np.right_shift(x, _FMIX_SHIFT, out=scratch)
    x ^= scratch
    return x


def _position_weights(positions: np.ndarray) -> np.ndarray:
    """Returns ``fmix64(POSITION_SEED + i) | 1`` for each position ``i``.

    Odd weights are invertible mod 2**64, so changing one element (or one column) of a sum
    of weighted terms always changes the sum.
    """
    weights = positions.astype(np.uint64) + _POSITION_SEED
    _fmix64(weights)
    weights |= np.uint64(1)
    return weights


@functools.lru_cache(maxsize=1)
def _position_table() -> np.ndarray:
    table = _position_weights(np.arange(_POSITION_TABLE_SIZE))
    table.flags.writeable = False  # shared between calls
    return table


def _weights_at(positions: np.ndarray, largest: int) -> np.ndarray:
    if largest < _POSITION_TABLE_SIZE:
        return _position_table()[positions]
    return _position_weights(positions)


# Element term of byte b: fmix64(b ^ ELEMENT_SEED), looked up instead of computed per byte.
with np.errstate(over="ignore"):
    _BYTE_TERMS = _fmix64(np.arange(256, dtype=np.uint64) ^ _ELEMENT_SEED)
_BYTE_TERMS.flags.writeable = False


def _element_terms(words: np.ndarray) -> np.ndarray:
    return _fmix64(words ^ _ELEMENT_SEED)


def _sequence_words(
    offsets: np.ndarray, element_terms: Callable[[int, int], np.ndarray]
) -> np.ndarray:
    """Hashes n sequences that share one flat element buffer.

    Sequence ``r`` is the elements ``offsets[r]:offsets[r + 1]``. Its word is
    ``fmix64(S ^ fmix64(LENGTH_SEED + L))``, where ``S`` is the sum mod 2**64 of
    ``weight(i) * element_term(i)`` over its ``L`` elements. ``i`` is the position within the
    sequence, not within the buffer, so a slice offset cannot change the result.

    Args:
        offsets: int64 array of n + 1 non-decreasing positions into the element buffer.
        element_terms: ``(lo, hi) -> uint64 array`` of ``fmix64(e ^ ELEMENT_SEED)`` for the
            elements ``lo:hi``. It is called only on bounded windows, so string bytes are
            expanded to 8-byte terms a chunk at a time.

    Returns:
        uint64 words, one per sequence.
    """
    count = len(offsets) - 1
    lengths = np.diff(offsets)
    sums = np.zeros(count, dtype=np.uint64)
    chunk = _SEQUENCE_CHUNK_ELEMENTS
    row = 0
    while row < count:
        lo = int(offsets[row])
        end = int(np.searchsorted(offsets, lo + chunk, side="right")) - 1
        end = min(max(end, row + 1), count)
        hi = int(offsets[end])
        if hi - lo > chunk:
            # One sequence longer than a chunk. Summing it window by window bounds memory,
            # and addition mod 2**64 does not care how the sum is split.
            total = 0
            for start in range(lo, hi, chunk):
                stop = min(hi, start + chunk)
                positions = np.arange(start - lo, stop - lo)
                weighted = element_terms(start, stop) * _weights_at(positions, stop - lo - 1)
                total = (total + int(weighted.sum(dtype=np.uint64))) & 0xFFFFFFFFFFFFFFFF
            sums[row] = total
        else:
            # Many sequences at once: weight every element by its position in its own
            # sequence, then take the per-sequence sums as differences of one prefix sum.
            # Unlike np.add.reduceat, this needs no special case for empty sequences.
            positions = np.arange(hi - lo, dtype=np.int64)
            positions -= np.repeat(offsets[row:end] - lo, lengths[row:end])
            weighted = element_terms(lo, hi) * _weights_at(positions, hi - lo - 1)
            prefix = np.zeros(hi - lo + 1, dtype=np.uint64)
            np.cumsum(weighted, out=prefix[1:])
            sums[row:end] = prefix[offsets[row + 1 : end + 1] - lo] - prefix[offsets[row:end] - lo]
        row = end
    length_words = lengths.astype(np.uint64) + _LENGTH_SEED
    sums ^= _fmix64(length_words)
    return _fmix64(sums)


# --- From Arrow arrays to value words --------------------------------------------------------


@dataclass(frozen=True)
class _Column:
    """One column, ready to be mixed into the row hashes.

    ``kind`` says how ``values`` become value words. "f": floats (float64 bits, NaN made
    canonical); "i": signed integers (sign-extended); "u": unsigned integers or bools
    (zero-extended); "w": value words already computed, nulls included. ``invalid`` marks null
    rows for the first three kinds.
    """

    key: np.uint64
    kind: str
    values: np.ndarray
    invalid: np.ndarray | None


# Columns of these types skip the word array: their raw values are widened straight into the
# mixing block, which saves a full pass over the data for the common numeric case.
_PRIMITIVE_DTYPES = {
    pa.bool_().id: ("u", None),
    pa.int8().id: ("i", "<i1"),
    pa.int16().id: ("i", "<i2"),
    pa.int32().id: ("i", "<i4"),
    pa.int64().id: ("i", "<i8"),
    pa.uint8().id: ("u", "<u1"),
    pa.uint16().id: ("u", "<u2"),
    pa.uint32().id: ("u", "<u4"),
    pa.uint64().id: ("u", "<u8"),
    pa.float16().id: ("f", "<f2"),
    pa.float32().id: ("f", "<f4"),
    pa.float64().id: ("f", "<f8"),
    pa.date32().id: ("i", "<i4"),
    pa.date64().id: ("i", "<i8"),
    pa.time32("s").id: ("i", "<i4"),
    pa.time64("ns").id: ("i", "<i8"),
    pa.timestamp("s").id: ("i", "<i8"),
    pa.duration("s").id: ("i", "<i8"),
}


def _primitive_kind(arrow_type: pa.DataType) -> tuple[str, str | None] | None:
    if isinstance(arrow_type, pa.BaseExtensionType):
        return None
    return _PRIMITIVE_DTYPES.get(arrow_type.id)


def _primitive_values(array: pa.Array, dtype: str | None) -> np.ndarray:
    """Returns the values of a primitive array as numpy, zero-copy where possible.

    The data buffer is read directly, at the array's offset. ``to_numpy()`` would turn
    integers with nulls into floats, which loses precision. Slots under nulls hold whatever
    the writer left there; callers overwrite them.
    """
    count, offset = len(array), array.offset
    buffers = array.buffers()
    if dtype is None:  # bool: bit-packed, least significant bit first
        return _unpack_bits(buffers[1], offset, count)
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(buffers[1], dtype=dtype, count=offset + count)[offset:]


def _unpack_bits(buffer: pa.Buffer | None, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=np.uint8)
    first_byte = offset // 8
    assert buffer is not None  # Arrow always allocates the bitmap of a non-empty bool array
    packed = np.frombuffer(
        buffer, dtype=np.uint8, count=(offset + count + 7) // 8 - first_byte, offset=first_byte
    )
    skip = offset % 8
    return np.unpackbits(packed, count=skip + count, bitorder="little")[skip:]


def _invalid_mask(array: pa.Array) -> np.ndarray | None:
    """Returns a bool mask of the null rows, or None when there are none."""
    if array.null_count == 0:
        return None
    validity = array.buffers()[0]
    if validity is None:  # e.g. the null type: nulls without a bitmap
        return np.ones(len(array), dtype=bool)
    return _unpack_bits(validity, array.offset, len(array)) == 0


# A column's values become value words by assignment into a view of the uint64 words with
# this dtype: numpy's cast then does the widening. float16/32 -> float64 is exact, and
# int -> int64 sign-extends, which gives the two's complement words.
_WORD_VIEWS = {"f": np.float64, "i": np.int64, "u": np.uint64, "w": np.uint64}


def _fill(destination: np.ndarray, kind: str, values: np.ndarray) -> None:
    """Writes the value words of ``values`` into uint64 ``destination`` (NaN not canonical yet)."""
    destination.view(_WORD_VIEWS[kind])[...] = values


def _canonicalise_nan(words: np.ndarray) -> None:
    # Every NaN (any sign, any payload, quiet or signalling) gets one bit pattern.
    # Negative zero is left alone, so -0.0 and 0.0 hash differently (they are different bits).
    nan = np.isnan(words.view(np.float64))
    if nan.any():
        words[nan] = _CANONICAL_NAN


def _make_column(name: str, column: pa.Array | pa.ChunkedArray) -> _Column:
    """Prepares one (top-level column or struct field) array for :func:`_combine`."""
    key = _column_key(name, _type_string(column.type))
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    primitive = _primitive_kind(column.type)
    if primitive is None:
        words = [_array_words(chunk) for chunk in chunks]
        return _Column(key, "w", _concatenate(words, np.uint64), None)
    kind, dtype = primitive
    values = _concatenate([_primitive_values(chunk, dtype) for chunk in chunks], dtype or np.uint8)
    masks = [_invalid_mask(chunk) for chunk in chunks]
    if all(mask is None for mask in masks):
        return _Column(key, kind, values, None)
    filled = [np.zeros(len(c), dtype=bool) if m is None else m for c, m in zip(chunks, masks)]
    return _Column(key, kind, values, _concatenate(filled, bool))


def _concatenate(arrays: list[np.ndarray], dtype) -> np.ndarray:
    if len(arrays) == 1:
        return arrays[0]  # the common case: no copy
    if not arrays:
        return np.empty(0, dtype=dtype)
    return np.concatenate(arrays)


def _array_words(array: pa.Array) -> np.ndarray:
    """Returns the uint64 value word of every element of ``array``, with nulls as NULL_WORD."""
    t = array.type
    count = len(array)
    if isinstance(t, pa.BaseExtensionType):
        return _array_words(array.storage)
    if pa.types.is_dictionary(t):
        return _dictionary_words(array)
    if pa.types.is_run_end_encoded(t):
        return _run_end_encoded_words(array)
    primitive = _primitive_kind(t)
    if primitive is not None:
        kind, dtype = primitive
        words = np.empty(count, dtype=np.uint64)
        _fill(words, kind, _primitive_values(array, dtype))
        if kind == "f":
            _canonicalise_nan(words)
    elif pa.types.is_null(t):
        return np.full(count, _NULL_WORD, dtype=np.uint64)
    elif pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        # Views have no offsets buffer; the large variants hash identically and do.
        target = pa.large_string() if pa.types.is_string_view(t) else pa.large_binary()
        return _array_words(array.cast(target))
    elif pa.types.is_string(t) or pa.types.is_binary(t):
        words = _variable_binary_words(array, "<i4")
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        words = _variable_binary_words(array, "<i8")
    elif pa.types.is_decimal(t):
        words = _decimal_words(array)
    elif pa.types.is_fixed_size_binary(t):
        words = _fixed_binary_words(array)
    elif pa.types.is_map(t):
        words = _map_words(array)
    elif pa.types.is_list(t):
        words = _list_words(array, "<i4")
    elif pa.types.is_large_list(t):
        words = _list_words(array, "<i8")
    elif pa.types.is_fixed_size_list(t):
        words = _fixed_list_words(array)
    elif pa.types.is_struct(t):
        words = _struct_words(array)
    else:
        raise TypeError(f"type {t} is not covered by {HASH_ALGORITHM}; cast the column first")
    invalid = _invalid_mask(array)
    if invalid is not None:
        words[invalid] = _NULL_WORD
    return words


def _offsets(array: pa.Array, dtype: str) -> np.ndarray:
    count, offset = len(array), array.offset
    if count == 0:
        return np.zeros(1, dtype=np.int64)
    raw = np.frombuffer(array.buffers()[1], dtype=dtype, count=offset + count + 1)
    return raw[offset:].astype(np.int64)


def _byte_sequence_words(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return _sequence_words(offsets, lambda lo, hi: _BYTE_TERMS[data[lo:hi]])


def _variable_binary_words(array: pa.Array, offset_dtype: str) -> np.ndarray:
    offsets = _offsets(array, offset_dtype)
    data_buffer = array.buffers()[2]
    if data_buffer is None or offsets[-1] == offsets[0]:
        data = np.empty(0, dtype=np.uint8)
    else:
        data = np.frombuffer(data_buffer, dtype=np.uint8, count=int(offsets[-1]))
    return _byte_sequence_words(data, offsets)


def _fixed_binary_words(array: pa.Array) -> np.ndarray:
    width, count, offset = array.type.byte_width, len(array), array.offset
    if count == 0 or width == 0:
        data = np.empty(0, dtype=np.uint8)
    else:
        raw = np.frombuffer(array.buffers()[1], dtype=np.uint8, count=(offset + count) * width)
        data = raw[offset * width :]
    return _byte_sequence_words(data, np.arange(count + 1, dtype=np.int64) * width)


def _decimal_words(array: pa.Array) -> np.ndarray:
    """Decimals of any width: the unscaled integer as four 64-bit limbs, low limb first.

    Sign-extending every width to 256 bits makes decimal32/64/128/256 of one value hash the
    same, just as their type strings do (precision and scale are in the type string).
    """
    width, count, offset = array.type.byte_width, len(array), array.offset
    limbs = np.empty((count, 4), dtype=np.uint64)
    if count:
        if width <= 8:  # decimal32, decimal64: one signed integer
            values = np.frombuffer(array.buffers()[1], dtype=f"<i{width}", count=offset + count)
            stored = values[offset:].astype(np.int64).view(np.uint64)[:, None]
        else:  # decimal128, decimal256: 64-bit limbs, low first
            per_value = width // 8
            raw = np.frombuffer(array.buffers()[1], dtype="<u8", count=(offset + count) * per_value)
            stored = raw[offset * per_value :].reshape(count, per_value)
        used = stored.shape[1]
        limbs[:, :used] = stored
        negative = stored[:, -1].view(np.int64) < 0
        limbs[:, used:] = np.where(negative, _ALL_ONES, np.uint64(0))[:, None]
    terms = _element_terms(limbs.reshape(-1))
    return _sequence_words(np.arange(count + 1, dtype=np.int64) * 4, lambda lo, hi: terms[lo:hi])


def _child_sequence_words(child: pa.Array, offsets: np.ndarray) -> np.ndarray:
    # Only the part of the child that the (possibly sliced) parent refers to is hashed.
    first = int(offsets[0])
    terms = _element_terms(_array_words(child.slice(first, int(offsets[-1]) - first)))
    return _sequence_words(offsets - first, lambda lo, hi: terms[lo:hi])


def _list_words(array: pa.Array, offset_dtype: str) -> np.ndarray:
    return _child_sequence_words(array.values, _offsets(array, offset_dtype))


def _fixed_list_words(array: pa.Array) -> np.ndarray:
    # .values ignores the parent's slice offset, so the offsets start at offset * size.
    size = array.type.list_size
    offsets = (np.arange(len(array) + 1, dtype=np.int64) + array.offset) * size
    return _child_sequence_words(array.values, offsets)


def _map_words(array: pa.Array) -> np.ndarray:
    """A map is a sequence of entries; an entry hashes like a struct {key, value}.

    The entry's fields are always called "key" and "value", whatever the physical names,
    because Parquet writers disagree on them.
    """
    offsets = _offsets(array, "<i4")
    first = int(offsets[0])
    entries = array.values.slice(first, int(offsets[-1]) - first)
    entry_words = _combine(
        [_make_column("key", entries.field(0)), _make_column("value", entries.field(1))],
        len(entries),
    )
    terms = _element_terms(entry_words)
    return _sequence_words(offsets - first, lambda lo, hi: terms[lo:hi])


def _struct_words(array: pa.Array) -> np.ndarray:
    """A struct value hashes exactly like a row made of its fields (sorted by field name)."""
    t = array.type
    fields = [(t.field(i).name, array.field(i)) for i in range(t.num_fields)]
    _reject_duplicates([name for name, _ in fields], "struct field")
    fields.sort(key=lambda pair: pair[0])
    return _combine([_make_column(name, child) for name, child in fields], len(array))


def _dictionary_words(array: pa.DictionaryArray) -> np.ndarray:
    # Hash the dictionary once, then gather: same words as the decoded values, and far less
    # work when few distinct values repeat. A dictionary larger than the batch (one shared by
    # a whole Parquet row group, say) is cheaper to decode than to hash in full.
    indices = array.indices
    invalid = _invalid_mask(indices)
    count = len(array)
    if count == 0 or (invalid is not None and invalid.all()):
        return np.full(count, _NULL_WORD, dtype=np.uint64)
    if len(array.dictionary) > count:
        return _array_words(array.dictionary_decode())
    dictionary_words = _array_words(array.dictionary)
    positions = _primitive_values(indices, _PRIMITIVE_DTYPES[indices.type.id][1])
    if invalid is not None:
        # Index slots under nulls may hold anything, even out-of-range values.
        positions = np.where(invalid, 0, positions)
    words = dictionary_words[positions]
    if invalid is not None:
        words[invalid] = _NULL_WORD
    return words


def _run_end_encoded_words(array: pa.Array) -> np.ndarray:
    count = len(array)
    if count == 0:
        return np.empty(0, dtype=np.uint64)
    run_ends = array.run_ends
    run_ends = _primitive_values(run_ends, _PRIMITIVE_DTYPES[run_ends.type.id][1])
    logical = np.arange(array.offset, array.offset + count)
    runs = np.searchsorted(run_ends, logical, side="right")
    return _array_words(array.values)[runs]


# --- Combining columns into row hashes -------------------------------------------------------


def _combine(columns: Sequence[_Column], count: int) -> np.ndarray:
    """Row hash of ``count`` rows: ``fmix64(ROW_SEED ^ sum_j weight(j) * fmix64(key_j ^ v_j))``.

    ``columns`` must already be in sorted-name order; ``j`` is the position in that order.
    The work runs on a (columns x block rows) uint64 matrix, so each mixing step is one numpy
    call for all columns, on a block small enough to stay in cache.
    """
    hashes = np.zeros(count, dtype=np.uint64)
    width = len(columns)
    if width and count:
        # The matrix rows can be in any order as long as keys and weights follow them. Putting
        # the floats first lets one isnan call canonicalise NaN for all of them.
        order = sorted(range(width), key=lambda j: columns[j].kind != "f")
        keys = np.array([columns[j].key for j in order], dtype=np.uint64)[:, None]
        weights = _position_weights(np.array(order))[:, None]
        float_rows = sum(column.kind == "f" for column in columns)
        nullable: list[tuple[int, np.ndarray]] = [
            (row, invalid)
            for row, j in enumerate(order)
            if (invalid := columns[j].invalid) is not None
        ]
        block_rows = min(count, _BLOCK_ROWS)
        block = np.empty((width, block_rows), dtype=np.uint64)
        scratch = np.empty_like(block)
        # As in _fill, but with the views made once per call rather than once per block.
        views = {kind: block.view(dtype) for kind, dtype in _WORD_VIEWS.items()}
        fills = [(views[columns[j].kind], row, columns[j].values) for row, j in enumerate(order)]
        for start in range(0, count, block_rows):
            stop = min(count, start + block_rows)
            size = stop - start
            for target, row, values in fills:
                target[row, :size] = values[start:stop]
            words = block[:, :size]
            if float_rows:
                _canonicalise_nan(words[:float_rows])
            # After the NaN step: NULL_WORD is itself a NaN and must survive it.
            for row, invalid in nullable:
                words[row][invalid[start:stop]] = _NULL_WORD
            words ^= keys
            _fmix64(words, scratch[:, :size])
            words *= weights
            np.sum(words, axis=0, out=hashes[start:stop])
    hashes ^= _ROW_SEED
    return _fmix64(hashes)
