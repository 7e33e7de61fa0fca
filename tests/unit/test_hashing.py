"""Tests for batchinfer.rows.hashing: the stable per-row input hash (docs/hashing.md).

The reference implementation below follows docs/hashing.md with plain Python integers, one
value at a time, reading values through pyarrow scalars rather than buffers. It shares no
code with the module under test, so the two can only agree if both follow the document.
"""
from __future__ import annotations

import decimal
import hashlib
import math
import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.rows import hashing
from batchinfer.rows.hashing import HASH_ALGORITHM, row_hashes, row_hashes_uint64

# --- Reference implementation of batchinfer-rowhash/1 (docs/hashing.md) ----------------------

MASK64 = (1 << 64) - 1


def _seed(label: str) -> int:
    digest = hashlib.blake2b(f"batchinfer-rowhash/1:{label}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


ROW_SEED = _seed("row")
ELEMENT_SEED = _seed("element")
POSITION_SEED = _seed("position")
LENGTH_SEED = _seed("length")
NULL_WORD = 0x7FF06E756C6C0001
CANONICAL_NAN = 0x7FF8000000000000


def ref_fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return x


def ref_weight(i: int) -> int:
    return ref_fmix64((POSITION_SEED + i) & MASK64) | 1


def ref_key(name: str, type_string: str) -> int:
    digest = hashlib.blake2b((name + "\x00" + type_string).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def ref_sequence(words: list[int]) -> int:
    total = 0
    for i, word in enumerate(words):
        total = (total + ref_weight(i) * ref_fmix64(word ^ ELEMENT_SEED)) & MASK64
    return ref_fmix64(total ^ ref_fmix64((LENGTH_SEED + len(words)) & MASK64))


def ref_combine(cells: list[tuple[str, str, int]]) -> int:
    """Row (or struct) hash of (name, type string, value word) cells."""
    total = 0
    for j, (name, type_string, word) in enumerate(sorted(cells)):
        total = (total + ref_weight(j) * ref_fmix64(ref_key(name, type_string) ^ word)) & MASK64
    return ref_fmix64(total ^ ROW_SEED)


def ref_type_string(t: pa.DataType) -> str:
    if isinstance(t, pa.BaseExtensionType):
        return "extension<" + t.extension_name + ">(" + ref_type_string(t.storage_type) + ")"
    if pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        return ref_type_string(t.value_type)
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return ("int" if pa.types.is_signed_integer(t) else "uint") + str(t.bit_width)
    if pa.types.is_floating(t):
        return "float" + str(t.bit_width)
    if pa.types.is_date32(t):
        return "date32"
    if pa.types.is_date64(t):
        return "date64"
    if pa.types.is_time(t):
        return "time" + str(t.bit_width) + "[" + t.unit + "]"
    if pa.types.is_timestamp(t):
        return "timestamp[" + t.unit + ("" if t.tz is None else ", tz=" + t.tz) + "]"
    if pa.types.is_duration(t):
        return "duration[" + t.unit + "]"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "utf8"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    if pa.types.is_decimal(t):
        return "decimal(" + str(t.precision) + ", " + str(t.scale) + ")"
    if pa.types.is_fixed_size_binary(t):
        return "fixed_size_binary[" + str(t.byte_width) + "]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list<" + ref_type_string(t.value_type) + ">"
    if pa.types.is_fixed_size_list(t):
        return "fixed_size_list<" + ref_type_string(t.value_type) + ">[" + str(t.list_size) + "]"
    if pa.types.is_map(t):
        return "map<" + ref_type_string(t.key_type) + ", " + ref_type_string(t.item_type) + ">"
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        parts = [f.name + ": " + ref_type_string(f.type) for f in fields]
        return "struct<" + ", ".join(parts) + ">"
    raise AssertionError(f"reference does not know {t}")


def ref_float_word(value: float) -> int:
    if math.isnan(value):
        return CANONICAL_NAN
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def ref_decimal_word(value: decimal.Decimal, scale: int) -> int:
    sign, digits, exponent = value.as_tuple()
    unscaled = int("".join(map(str, digits)) or "0") * 10 ** (exponent + scale)
    unscaled = -unscaled if sign else unscaled
    return ref_sequence([(unscaled >> (64 * k)) & MASK64 for k in range(4)])


def ref_words(array: pa.Array) -> list[int]:
    """Value words of every element, one Python scalar at a time."""
    t = array.type
    if isinstance(t, pa.BaseExtensionType):
        return ref_words(array.storage)
    if pa.types.is_dictionary(t):
        dictionary = ref_words(array.dictionary)
        indices = array.indices.to_pylist()
        return [NULL_WORD if i is None else dictionary[i] for i in indices]
    if pa.types.is_run_end_encoded(t):
        values, run_ends = ref_words(array.values), array.run_ends.to_pylist()
        out = []
        for logical in range(array.offset, array.offset + len(array)):
            run = 0
            while run_ends[run] <= logical:
                run += 1
            out.append(values[run])
        return out
    if pa.types.is_struct(t):
        names = [t.field(k).name for k in range(t.num_fields)]
        types = [ref_type_string(t.field(k).type) for k in range(t.num_fields)]
        fields = [ref_words(array.field(k)) for k in range(t.num_fields)]
        return [
            ref_combine([(names[k], types[k], fields[k][i]) for k in range(len(names))])
            if array[i].is_valid
            else NULL_WORD
            for i in range(len(array))
        ]
    out = []
    for scalar in array:
        if not scalar.is_valid:
            out.append(NULL_WORD)
        elif pa.types.is_null(t):
            out.append(NULL_WORD)
        elif pa.types.is_boolean(t):
            out.append(1 if scalar.as_py() else 0)
        elif pa.types.is_integer(t):
            out.append(scalar.as_py() & MASK64)
        elif pa.types.is_floating(t):
            out.append(ref_float_word(float(scalar.as_py())))
        elif pa.types.is_temporal(t):
            out.append(scalar.value & MASK64)
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            out.append(ref_sequence(list(scalar.as_py().encode("utf-8"))))
        elif pa.types.is_decimal(t):
            out.append(ref_decimal_word(scalar.as_py(), t.scale))
        elif (
            pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or pa.types.is_binary_view(t)
            or pa.types.is_fixed_size_binary(t)
        ):
            out.append(ref_sequence(list(scalar.as_py())))
        elif pa.types.is_map(t):
            entries = scalar.values
            keys, items = ref_words(entries.field(0)), ref_words(entries.field(1))
            key_type, item_type = ref_type_string(t.key_type), ref_type_string(t.item_type)
            out.append(
                ref_sequence(
                    [
                        ref_combine([("key", key_type, k), ("value", item_type, v)])
                        for k, v in zip(keys, items)
                    ]
                )
            )
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            out.append(ref_sequence(ref_words(scalar.values)))
        else:
            raise AssertionError(f"reference does not know {t}")
    return out


def ref_row_hashes(data: pa.Table | pa.RecordBatch, columns=None) -> list[int]:
    names = data.schema.names if columns is None else list(columns)
    per_column = []
    for name in names:
        column = data.column(name)
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        words = [word for chunk in chunks for word in ref_words(chunk)]
        per_column.append((name, ref_type_string(column.type), words))
    return [
        ref_combine([(name, type_string, words[i]) for name, type_string, words in per_column])
        for i in range(data.num_rows)
    ]


def hex_of(values: list[int]) -> list[str]:
    return [f"{v:016x}" for v in values]


# --- A table covering every supported type ---------------------------------------------------

LONG_TEXT = "ab€𝄞" * 2500  # 10,000 characters, 1-, 3- and 4-byte UTF-8


def _bits_to_float64(bits: list[int]) -> np.ndarray:
    return np.array(bits, dtype="<u8").view("<f8")


def _decimals(texts: list[str | None], arrow_type: pa.DataType) -> pa.Array:
    return pa.array([None if t is None else decimal.Decimal(t) for t in texts], arrow_type)


def every_type_table() -> pa.Table:
    """Six rows; every column has a null and the awkward values of its type."""
    nan_bits = [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001,
                0xFFFFFFFFFFFFFFFF, 0x7FF06E756C6C0001, 0x0]
    floats = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.5]
    f_mask = np.array([False, False, False, False, False, True])
    nines_36, nines_70 = "9" * 36, "9" * 70
    point = pa.struct([("b", pa.int64()), ("a", pa.string())])
    nested = pa.struct([("p", pa.struct([("q", pa.list_(pa.float32()))])), ("r", pa.bool_())])
    columns = {
        "null": pa.nulls(6),
        "bool": pa.array([True, False, None, True, False, True]),
        "int8": pa.array([-128, 127, 0, -1, None, 5], pa.int8()),
        "int16": pa.array([-32768, 32767, 0, -1, None, 5], pa.int16()),
        "int32": pa.array([-(2**31), 2**31 - 1, 0, -1, None, 5], pa.int32()),
        "int64": pa.array([-(2**63), 2**63 - 1, 0, -1, None, 5], pa.int64()),
        "uint8": pa.array([0, 255, 1, None, 2, 3], pa.uint8()),
        "uint16": pa.array([0, 65535, 1, None, 2, 3], pa.uint16()),
        "uint32": pa.array([0, 2**32 - 1, 1, None, 2, 3], pa.uint32()),
        "uint64": pa.array([0, 2**64 - 1, 2**63, None, NULL_WORD, 3], pa.uint64()),
        "float16": pa.array(np.array(floats, dtype=np.float16), mask=f_mask),
        "float32": pa.array(np.array(floats, dtype=np.float32), mask=f_mask),
        "float64": pa.array(np.array(floats, dtype=np.float64), mask=f_mask),
        "nan_payloads": pa.array(_bits_to_float64(nan_bits)),
        "date32": pa.array([0, -1, 19000, None, 2**31 - 1, 1], pa.date32()),
        "date64": pa.array([0, -86400000, 86400000, None, 2, 1], pa.date64()),
        "time32s": pa.array([0, 1, 86399, None, 5, 6], pa.time32("s")),
        "time32ms": pa.array([0, 1, 86399999, None, 5, 6], pa.time32("ms")),
        "time64us": pa.array([0, 1, 86399999999, None, 5, 6], pa.time64("us")),
        "time64ns": pa.array([0, 1, 86399999999999, None, 5, 6], pa.time64("ns")),
        "ts_ns": pa.array([0, -1, 2**62, None, 5, 6], pa.timestamp("ns")),
        "ts_us_utc": pa.array([0, -1, 2**62, None, 5, 6], pa.timestamp("us", tz="UTC")),
        "ts_s_paris": pa.array([0, -1, 2**40, None, 5, 6], pa.timestamp("s", tz="Europe/Paris")),
        "duration": pa.array([0, -1, 2**62, None, 5, 6], pa.duration("ms")),
        "string": pa.array(["", "a", "héllo wörld", None, LONG_TEXT, "日本語"]),
        "large_string": pa.array(["", "a", "ab", None, LONG_TEXT, "\x00"], pa.large_string()),
        "string_view": pa.array(
            ["", "a", "a much longer string than twelve bytes", None, "x", ""], pa.string_view()
        ),
        "binary": pa.array([b"", b"\x00", b"\xff\x00\x01", None, bytes(range(256)), b"a"]),
        "large_binary": pa.array(
            [b"", b"\x00", b"z", None, b"long" * 3000, b"a"], pa.large_binary()
        ),
        "binary_view": pa.array([b"", b"\x00", b"z" * 40, None, b"q", b"a"], pa.binary_view()),
        "fixed_binary": pa.array(
            [b"abc", b"\x00\x00\x00", b"\xff\xfe\xfd", None, b"abd", b"   "], pa.binary(3)
        ),
        "fixed_binary0": pa.array([b"", b"", None, b"", b"", b""], pa.binary(0)),
        "decimal32": _decimals(
            ["0", "-1.25", "999.99", None, "-999.99", "0.01"], pa.decimal32(5, 2)
        ),
        "decimal64": _decimals(
            ["0", "-1.25", "99999999.99", None, "-0.01", "0.01"], pa.decimal64(10, 2)
        ),
        "decimal128": _decimals(
            ["0", "-1.25", nines_36 + ".99", None, "-" + nines_36 + ".99", "1E+2"],
            pa.decimal128(38, 2),
        ),
        "decimal256": _decimals(
            ["0", "-1.25", nines_70 + ".99", None, "-" + "1" * 70 + ".5", "0.01"],
            pa.decimal256(76, 2),
        ),
        "list_int": pa.array(
            [[], [1, None, 3], None, [0], [-1] * 70, [2, 1]], pa.list_(pa.int32())
        ),
        "large_list_str": pa.array(
            [[""], [], ["a", None], None, ["x", LONG_TEXT], ["ab"]], pa.large_list(pa.string())
        ),
        "list_list": pa.array(
            [[[1], []], [], None, [None, [2, 3]], [[]], [[1, 2]]], pa.list_(pa.list_(pa.int64()))
        ),
        "fixed_list": pa.array(
            [[1.0, -0.0], [math.nan, None], None, [0.0, 0.0], [1e300, -1e-300], [2, 3]],
            pa.list_(pa.float64(), 2),
        ),
        "struct": pa.array(
            [{"b": 1, "a": "x"}, {"b": None, "a": None}, None, {"b": 0, "a": ""},
             {"b": -5, "a": "z"}, {"b": 2, "a": "é"}],
            point,
        ),
        "struct_nested": pa.array(
            [{"p": {"q": [1.0]}, "r": True}, None, {"p": None, "r": None},
             {"p": {"q": None}, "r": False}, {"p": {"q": []}, "r": True},
             {"p": {"q": [math.nan]}, "r": True}],
            nested,
        ),
        "map": pa.array(
            [[("a", 1)], [], None, [("a", None), ("b", 2)], [("b", 2), ("a", None)], [("", 0)]],
            pa.map_(pa.string(), pa.int64()),
        ),
        "dict_str": pa.array(["x", None, "y", "x", "", "y"]).dictionary_encode(),
        "dict_float": pa.DictionaryArray.from_arrays(
            pa.array([0, 1, None, 2, 0, 1], pa.int8()),
            pa.array([1.5, math.nan, None], pa.float32()),
        ),
        "ree": pc.run_end_encode(pa.array([1, 1, None, None, 7, 1], pa.int16())),
        "uuid": pa.array(
            [bytes(range(16)), b"\x00" * 16, None, b"\xff" * 16, b"0123456789abcdef",
             bytes(range(16))],
            pa.binary(16),
        ).cast(pa.uuid()),
        "json": pa.array(['{"a": 1}', "null", None, "[]", "", "1"]).cast(pa.json_()),
    }
    return pa.table(columns)


# --- (a) vectorised == reference --------------------------------------------------------------


def test_every_type_matches_reference():
    table = every_type_table()
    expected = ref_row_hashes(table)
    assert row_hashes_uint64(table).tolist() == expected
    assert row_hashes(table).to_pylist() == hex_of(expected)


@pytest.mark.parametrize("name", every_type_table().schema.names)
def test_each_column_alone_matches_reference(name):
    # One column at a time, so a failure names the type that disagrees.
    table = every_type_table().select([name])
    assert row_hashes_uint64(table).tolist() == ref_row_hashes(table)


@pytest.mark.parametrize("name", every_type_table().schema.names)
def test_each_column_sliced_matches_reference(name):
    column = every_type_table().column(name).combine_chunks()
    for start in range(1, 6):
        for length in (0, 1, 6 - start):
            piece = pa.table({name: column.slice(start, length)})
            assert row_hashes_uint64(piece).tolist() == ref_row_hashes(piece), (start, length)


def test_long_sequences_are_hashed_window_by_window(monkeypatch):
    # Tiny chunks and position table force the windowed path for long rows, the many-rows
    # path with chunk boundaries everywhere, and computed (not looked-up) position weights.
    table = every_type_table()
    expected = row_hashes_uint64(table).tolist()
    monkeypatch.setattr(hashing, "_SEQUENCE_CHUNK_ELEMENTS", 7)
    monkeypatch.setattr(hashing, "_POSITION_TABLE_SIZE", 5)
    assert row_hashes_uint64(table).tolist() == expected == ref_row_hashes(table)


def test_block_boundaries_do_not_matter(monkeypatch):
    table = every_type_table()
    expected = row_hashes_uint64(table).tolist()
    monkeypatch.setattr(hashing, "_BLOCK_ROWS", 4)
    assert row_hashes_uint64(table).tolist() == expected


def test_large_dictionary_and_long_string_against_reference():
    # A dictionary larger than the batch (decoded, not hashed whole) and a 100k-byte string
    # (longer than one sequence chunk).
    dictionary = pa.array([f"v{i}" for i in range(3000)])
    table = pa.table({
        "d": pa.DictionaryArray.from_arrays(pa.array([2999, 0, None, 17], pa.int32()), dictionary),
        "s": pa.array(["é" * 50_000, "", None, "x" * 65_537]),
    })
    assert row_hashes_uint64(table).tolist() == ref_row_hashes(table)


def test_dictionary_index_under_a_null_may_be_garbage():
    # Writers may leave any value in the index slot of a null, even one out of range.
    validity = pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes())
    data = pa.py_buffer(np.array([1, 99_999, 0], dtype="<i4").tobytes())
    indices = pa.Array.from_buffers(pa.int32(), 3, [validity, data], null_count=1)
    array = pa.DictionaryArray.from_arrays(indices, pa.array(["a", "b"]))
    table = pa.table({"x": array})
    assert row_hashes(table).equals(row_hashes(pa.table({"x": pa.array(["b", None, "a"])})))


# --- (b) fixed test vectors (also in docs/hashing.md) -----------------------------------------


def vector_table() -> pa.Table:
    return pa.table({
        "id": pa.array([1, 2, None, -1], pa.int64()),
        "score": pa.array([0.5, -0.0, math.nan, math.inf], pa.float32()),
        "name": pa.array(["a", "", "héllo", None], pa.string()),
        "flag": pa.array([True, False, None, True], pa.bool_()),
    })


VECTOR_ROWS = [
    "26ad49b539ec169b",
    "5a15fdb3afa6ab62",
    "862b6e4622dc3f5b",
    "77abd4bbb35e7422",
]
VECTOR_ROWS_ID_ONLY = [
    "58427b8cb7daf250",
    "150adca84dfff1e8",
    "b07f8f91aac9dffc",
    "3b0d2da1be5d54fc",
]

# (description, one-column table with column "x" and one row, expected hex)
CELL_VECTORS = [
    ("int64 0", pa.array([0], pa.int64()), "c3be2ca84aa88999"),
    ("int32 0", pa.array([0], pa.int32()), "7f426f694e647d32"),
    ("int64 null", pa.array([None], pa.int64()), "e83723f81a6d6cb1"),
    ("float64 0.0", pa.array([0.0], pa.float64()), "f3d5006292ea591c"),
    ("float64 -0.0", pa.array([-0.0], pa.float64()), "c7dfb883af6ef3b7"),
    ("float64 NaN", pa.array([math.nan], pa.float64()), "507de727031eeaf1"),
    ("float32 1.5", pa.array([1.5], pa.float32()), "ebfe8c2323c88be8"),
    ("bool true", pa.array([True], pa.bool_()), "f67431dd7115e505"),
    ("utf8 empty", pa.array([""], pa.string()), "71452b793315512c"),
    ("utf8 abc", pa.array(["abc"], pa.string()), "53fa45fe97baa477"),
    ("binary abc", pa.array([b"abc"], pa.binary()), "75b6896d3308eae1"),
    ("date32 1970-01-01", pa.array([0], pa.date32()), "17a87d5ef5865bbc"),
    ("timestamp[us, tz=UTC] 0", pa.array([0], pa.timestamp("us", tz="UTC")), "a8ece9f4e200ca3d"),
    ("decimal(10, 2) 1.25", _decimals(["1.25"], pa.decimal128(10, 2)), "92a271f5f4bb8d0a"),
    ("list<int64> [1, 2]", pa.array([[1, 2]], pa.list_(pa.int64())), "b87ee70b82480fae"),
    ("struct<a: int64> {a: 1}",
     pa.array([{"a": 1}], pa.struct([("a", pa.int64())])), "f1a23fc8e5885a58"),
    ("map<utf8, int64> {a: 1}",
     pa.array([[("a", 1)]], pa.map_(pa.string(), pa.int64())), "0428b94f28cab193"),
]


def test_vector_table():
    assert row_hashes(vector_table()).to_pylist() == VECTOR_ROWS
    assert row_hashes(vector_table(), ["id"]).to_pylist() == VECTOR_ROWS_ID_ONLY
    assert hex_of(ref_row_hashes(vector_table())) == VECTOR_ROWS


@pytest.mark.parametrize(
    "description, array, expected", CELL_VECTORS, ids=[c[0] for c in CELL_VECTORS]
)
def test_cell_vectors(description, array, expected):
    table = pa.table({"x": array})
    assert row_hashes(table).to_pylist() == [expected]
    assert hex_of(ref_row_hashes(table)) == [expected]


def test_absent_optional_column_vector():
    """docs/hashing.md "Optional columns a shard lacks": a column the schema declares optional
    that a shard lacks is hashed as a null of the schema's type, as if the shard held it null."""
    import pandera.polars as pap
    import polars as pl

    from batchinfer.rows.validation import compile_schema, validate_batch

    held = pa.table({"id": pa.array([1], pa.int64()), "weight": pa.nulls(1, pa.float32())})
    assert row_hashes(held).to_pylist() == ["16e8c0c3f39b2833"]
    assert hex_of(ref_row_hashes(held)) == ["16e8c0c3f39b2833"]
    for declared, expected in ((pl.Float32, "16e8c0c3f39b2833"), (pl.Float64, "a2d5067636c0da65"),
                               (None, "b3ed98984fe466ed")):
        schema = compile_schema(pap.DataFrameSchema({
            "id": pap.Column(pl.Int64), "weight": pap.Column(declared, required=False, nullable=True)}))
        lacking = pa.record_batch({"id": pa.array([1], pa.int64())})
        valid = validate_batch(lacking, schema, source_shard="s").valid
        assert row_hashes(valid, schema.columns).to_pylist() == [expected], declared


def test_zero_columns_vector():
    # No columns: every row hashes to fmix64(ROW_SEED).
    table = pa.table({"x": [1, 2]})
    assert row_hashes(table, []).to_pylist() == ["c6570f43d337b5d7"] * 2
    assert f"{ref_fmix64(ROW_SEED):016x}" == "c6570f43d337b5d7"


def test_intermediate_vectors():
    # The building blocks of docs/hashing.md, so a reimplementation can be checked step by step.
    assert f"{ref_fmix64(1):016x}" == "b456bcfc34c2cb2c"  # murmur3's published fmix64(1)
    assert f"{ref_weight(0):016x}" == "546ecb081418e1cf"
    assert f"{ref_weight(1):016x}" == "b6036263d3dbfe4f"
    assert f"{ref_key('x', 'int64'):016x}" == "a61baf98425996ea"
    assert f"{ref_sequence([]):016x}" == "bd60fdfde895b176"
    assert f"{ref_sequence(list(b'abc')):016x}" == "af1494245fd5ed5f"
    # ...and the module's own building blocks give the same numbers.
    with np.errstate(over="ignore"):
        assert int(hashing._fmix64(np.array([1], np.uint64))[0]) == 0xB456BCFC34C2CB2C
        assert int(hashing._column_key("x", "int64")) == 0xA61BAF98425996EA


def test_constants_are_derived_as_documented():
    assert HASH_ALGORITHM == "batchinfer-rowhash/1"
    assert int(hashing._ROW_SEED) == ROW_SEED
    assert int(hashing._ELEMENT_SEED) == ELEMENT_SEED
    assert int(hashing._POSITION_SEED) == POSITION_SEED
    assert int(hashing._LENGTH_SEED) == LENGTH_SEED
    assert int(hashing._NULL_WORD) == NULL_WORD
    assert int(hashing._CANONICAL_NAN) == CANONICAL_NAN


# --- (c) invariance: slices, chunks, batches, column order, physical encodings ----------------


def _fresh_row(table: pa.Table, i: int) -> pa.Table:
    """Row i copied into new buffers with offset 0 (take), whatever the column type."""
    columns = []
    for column in table.columns:
        t = column.type
        if pa.types.is_string_view(t) or pa.types.is_binary_view(t):  # no take kernel
            wide = pa.large_string() if pa.types.is_string_view(t) else pa.large_binary()
            columns.append(column.cast(wide).take([i]).cast(t))
        elif pa.types.is_run_end_encoded(t):  # no take kernel either
            columns.append(pc.run_end_encode(pa.array([column[i].as_py()], t.value_type)))
        else:
            columns.append(column.take([i]))
    fresh = pa.table(columns, names=table.schema.names)
    assert all(chunk.offset == 0 for column in fresh.columns for chunk in column.chunks)
    return fresh


def test_row_in_slice_equals_row_alone():
    table = every_type_table()
    whole = row_hashes_uint64(table).tolist()
    for i in range(table.num_rows):
        assert row_hashes_uint64(table.slice(i, 1)).tolist() == [whole[i]]
        assert row_hashes_uint64(_fresh_row(table, i)).tolist() == [whole[i]]
        assert row_hashes_uint64(table.slice(i)).tolist() == whole[i:]


def test_chunking_and_batches_do_not_matter():
    table = every_type_table()
    whole = row_hashes_uint64(table).tolist()
    pieces = [table.slice(0, 1), table.slice(1, 3), table.slice(4, 0), table.slice(4)]
    rechunked = pa.concat_tables(pieces)
    assert rechunked.column(0).num_chunks == 4
    assert row_hashes_uint64(rechunked).tolist() == whole
    # pyarrow cannot combine chunks of a dictionary whose values hold a null.
    combinable = rechunked.drop_columns(["dict_float"])
    combined = combinable.combine_chunks()
    assert row_hashes_uint64(combined).tolist() == row_hashes_uint64(combinable).tolist()
    per_batch = [h for batch in rechunked.to_batches() for h in row_hashes_uint64(batch).tolist()]
    assert per_batch == whole
    assert row_hashes_uint64(table.to_batches(max_chunksize=2)[1]).tolist() == whole[2:4]


def test_columns_chunked_differently_from_each_other():
    a = pa.chunked_array([[1, 2], [3], [4, 5, 6]], pa.int64())
    b = pa.chunked_array([["p"], ["q", "r", "s", None], ["t"]])
    c = pa.chunked_array([[0.5, None, 1.5, 2.5, 3.5, 4.5]], pa.float32())
    table = pa.table({"a": a, "b": b, "c": c})
    assert row_hashes_uint64(table).tolist() == row_hashes_uint64(table.combine_chunks()).tolist()
    assert row_hashes_uint64(table).tolist() == ref_row_hashes(table)


def test_column_order_does_not_matter():
    table = every_type_table()
    reordered = table.select(list(reversed(table.schema.names)))
    assert row_hashes(reordered).to_pylist() == row_hashes(table).to_pylist()
    names = table.schema.names
    assert (row_hashes(table, names[:5]).to_pylist()
            == row_hashes(table, list(reversed(names[:5]))).to_pylist()
            == row_hashes(table.select(names[:5])).to_pylist())


def test_record_batch_and_table_agree():
    table = every_type_table()
    batch = table.combine_chunks().to_batches()[0]
    assert row_hashes(batch).to_pylist() == row_hashes(table).to_pylist()


@pytest.mark.parametrize(
    "plain, other",
    [
        (pa.array(["a", "", None]), pa.array(["a", "", None], pa.large_string())),
        (pa.array(["a", "", None]), pa.array(["a", "", None], pa.string_view())),
        (pa.array(["a", "", None]), pa.array(["a", "", None]).dictionary_encode()),
        (pa.array([b"a", None]), pa.array([b"a", None], pa.large_binary())),
        (pa.array([b"a", None]), pa.array([b"a", None], pa.binary_view())),
        (pa.array([1.5, None]), pa.array([1.5, None]).dictionary_encode()),
        (pa.array([[1], None]), pa.array([[1], None], pa.large_list(pa.int64()))),
        (pa.array([3, 3, None]), pc.run_end_encode(pa.array([3, 3, None]))),
        (pa.array([decimal.Decimal("1.25")], pa.decimal128(9, 2)),
         pa.array([decimal.Decimal("1.25")], pa.decimal32(9, 2))),
        (pa.array([decimal.Decimal("-1.25")], pa.decimal64(9, 2)),
         pa.array([decimal.Decimal("-1.25")], pa.decimal256(9, 2))),
    ],
)
def test_physical_encodings_of_one_logical_type_agree(plain, other):
    assert row_hashes(pa.table({"x": plain})).equals(row_hashes(pa.table({"x": other})))


def test_list_item_names_and_nullability_are_ignored():
    a = pa.array([[1, 2]], pa.list_(pa.field("item", pa.int64())))
    b = pa.array([[1, 2]], pa.list_(pa.field("element", pa.int64(), nullable=False)))
    assert row_hashes(pa.table({"x": a})).equals(row_hashes(pa.table({"x": b})))


# --- (d) sensitivity -------------------------------------------------------------------------


INT_LIST = pa.list_(pa.int64())


def _hash_one(**columns) -> str:
    return row_hashes(pa.table(columns)).to_pylist()[0]


@pytest.mark.parametrize(
    "left, right",
    [
        ({"a": pa.array([5], pa.int64())}, {"a": pa.array([6], pa.int64())}),
        ({"a": pa.array([5], pa.int64())}, {"a": pa.array([5], pa.int32())}),
        ({"a": pa.array([5], pa.int64())}, {"a": pa.array([5], pa.uint64())}),
        ({"a": pa.array([5], pa.int64())}, {"b": pa.array([5], pa.int64())}),
        ({"a": pa.array([0], pa.int64())}, {"a": pa.array([None], pa.int64())}),
        ({"a": pa.array([0.0])}, {"a": pa.array([None], pa.float64())}),
        ({"a": pa.array([0.0])}, {"a": pa.array([-0.0])}),
        ({"a": pa.array([math.nan])}, {"a": pa.array([None], pa.float64())}),
        ({"a": pa.array([math.nan])}, {"a": pa.array([math.inf])}),
        ({"a": pa.array([1.5], pa.float32())}, {"a": pa.array([1.5], pa.float64())}),
        ({"a": pa.array([""])}, {"a": pa.array([None], pa.string())}),
        ({"a": pa.array([""])}, {"a": pa.array([b""])}),
        ({"a": pa.array(["ab"])}, {"a": pa.array(["ba"])}),
        ({"a": pa.array(["a"])}, {"a": pa.array(["a\x00"])}),
        ({"a": pa.array([False])}, {"a": pa.array([None], pa.bool_())}),
        ({"a": pa.array([False])}, {"a": pa.array([0], pa.uint8())}),
        ({"a": pa.array([[1, 2]])}, {"a": pa.array([[2, 1]])}),
        ({"a": pa.array([[]], INT_LIST)}, {"a": pa.array([None], INT_LIST)}),
        ({"a": pa.array([[None]], INT_LIST)}, {"a": pa.array([[]], INT_LIST)}),
        ({"a": pa.array([["ab"]])}, {"a": pa.array([["a", "b"]])}),
        ({"a": pa.array([0], pa.timestamp("us"))}, {"a": pa.array([0], pa.timestamp("ns"))}),
        ({"a": pa.array([0], pa.timestamp("us"))},
         {"a": pa.array([0], pa.timestamp("us", tz="UTC"))}),
        ({"a": pa.array([decimal.Decimal("1.25")], pa.decimal128(10, 2))},
         {"a": pa.array([decimal.Decimal("1.250")], pa.decimal128(10, 3))}),
        ({"a": pa.array([1], pa.int64()), "b": pa.array([2], pa.int64())},
         {"a": pa.array([2], pa.int64()), "b": pa.array([1], pa.int64())}),
        ({"a": pa.array([1], pa.int64()), "b": pa.array([None], pa.int64())},
         {"a": pa.array([1], pa.int64())}),
        ({"a": pa.array([{"p": 1, "q": 2}])}, {"a": pa.array([{"p": 2, "q": 1}])}),
        ({"a": pa.array([{"p": 1, "q": 2}])},
         {"a": pa.array([{"q": 2, "p": 1}], pa.struct([("q", pa.int64()), ("p", pa.int64())]))}),
    ],
)
def test_a_difference_changes_the_hash(left, right):
    assert _hash_one(**left) != _hash_one(**right)


def test_null_is_not_the_null_word_value():
    # The null word is a NaN payload: a float that carries it is a NaN, hashed canonically.
    payload = pa.array(_bits_to_float64([NULL_WORD]))
    assert _hash_one(a=payload) == _hash_one(a=pa.array([math.nan]))
    assert _hash_one(a=payload) != _hash_one(a=pa.array([None], pa.float64()))


def test_every_nan_is_one_nan():
    bits = [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF]
    hashes = row_hashes(pa.table({"a": pa.array(_bits_to_float64(bits))})).to_pylist()
    assert len(set(hashes)) == 1
    float32_nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001], dtype="<u4").view("<f4")
    assert len(set(row_hashes(pa.table({"a": pa.array(float32_nans)})).to_pylist())) == 1


def test_single_changes_in_many_rows_all_differ():
    rng = np.random.default_rng(7)
    base = {f"c{i}": rng.standard_normal(2000).astype(np.float32) for i in range(8)}
    base["id"] = np.arange(2000)
    hashes = row_hashes_uint64(pa.table(base))
    assert len(set(hashes.tolist())) == 2000
    # Flipping the lowest mantissa bit of one cell changes about half the hash bits.
    changed = dict(base)
    changed["c3"] = (base["c3"].view(np.uint32) ^ 1).view(np.float32)
    flipped = np.unpackbits((hashes ^ row_hashes_uint64(pa.table(changed))).view(np.uint8))
    assert 0.45 < flipped.mean() < 0.55


# --- (e) property test: vectorised == reference on random small tables -----------------------

_FLOAT_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(-0.0))


def _values_and_type(draw, type_name, rows):
    def values(strategy):
        return draw(st.lists(st.one_of(st.none(), strategy), min_size=rows, max_size=rows))

    if type_name in ("int8", "int16", "int32", "int64"):
        bits = int(type_name[3:])
        limit = 2 ** (bits - 1)
        return values(st.integers(-limit, limit - 1)), getattr(pa, type_name)()
    if type_name in ("uint8", "uint64"):
        return values(st.integers(0, 2 ** int(type_name[4:]) - 1)), getattr(pa, type_name)()
    if type_name == "bool":
        return values(st.booleans()), pa.bool_()
    if type_name in ("float32", "float64"):
        return values(_FLOAT_VALUES), getattr(pa, type_name)()
    if type_name == "string":
        return values(st.text(max_size=12)), draw(st.sampled_from([pa.string(), pa.large_string()]))
    if type_name == "binary":
        return values(st.binary(max_size=12)), pa.binary()
    if type_name == "timestamp":
        return values(st.integers(-(2**63), 2**63 - 1)), pa.timestamp("ns", tz="UTC")
    if type_name == "date32":
        return values(st.integers(-(2**31), 2**31 - 1)), pa.date32()
    if type_name == "decimal":
        digits = st.decimals(min_value=-10**7, max_value=10**7, places=2, allow_nan=False)
        return values(digits), pa.decimal128(12, 2)
    if type_name == "list":
        items = st.lists(st.one_of(st.none(), st.integers(-5, 5)), max_size=4)
        return values(items), pa.list_(pa.int16())
    if type_name == "list_str":
        items = st.lists(st.one_of(st.none(), st.text(max_size=3)), max_size=3)
        return values(items), pa.list_(pa.string())
    if type_name == "struct":
        record = st.fixed_dictionaries({"z": st.one_of(st.none(), st.integers(-3, 3)),
                                        "y": st.one_of(st.none(), st.text(max_size=3))})
        return values(record), pa.struct([("z", pa.int64()), ("y", pa.string())])
    if type_name == "map":
        entry = st.tuples(st.text(max_size=2), st.one_of(st.none(), st.floats()))
        entries = st.lists(entry, max_size=3)
        return values(entries), pa.map_(pa.string(), pa.float64())
    raise AssertionError(type_name)


_TYPE_NAMES = [
    "int8", "int16", "int32", "int64", "uint8", "uint64", "bool", "float32", "float64", "string",
    "binary", "timestamp", "date32", "decimal", "list", "list_str", "struct", "map",
]


@st.composite
def random_tables(draw):
    rows = draw(st.integers(0, 7))
    names = draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=4, unique=True))
    columns = {}
    for name in names:
        values, arrow_type = _values_and_type(draw, draw(st.sampled_from(_TYPE_NAMES)), rows)
        array = pa.array(values, arrow_type)
        if draw(st.booleans()):
            array = array.dictionary_encode() if not pa.types.is_nested(arrow_type) else array
        columns[name] = array
    table = pa.table(columns)
    # Random chunking and slicing, so offsets and chunk boundaries vary too.
    if rows and draw(st.booleans()):
        cut = draw(st.integers(0, rows))
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    start = draw(st.integers(0, rows))
    return table.slice(start, draw(st.integers(0, rows - start)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_tables())
def test_random_tables_match_reference(table):
    expected = ref_row_hashes(table)
    assert row_hashes_uint64(table).tolist() == expected
    assert row_hashes(table).to_pylist() == hex_of(expected)


# --- API edges ---------------------------------------------------------------------------------


def test_empty_table():
    table = every_type_table().slice(0, 0)
    assert row_hashes_uint64(table).dtype == np.uint64
    assert len(row_hashes_uint64(table)) == 0
    assert row_hashes(table).type == pa.string() and len(row_hashes(table)) == 0
    no_chunks = pa.Table.from_batches([], schema=table.schema)
    assert no_chunks.column(0).num_chunks == 0
    assert len(row_hashes_uint64(no_chunks)) == 0


def test_output_types_and_format():
    table = every_type_table()
    hashes = row_hashes_uint64(table)
    text = row_hashes(table)
    assert hashes.dtype == np.uint64 and hashes.shape == (table.num_rows,)
    assert isinstance(text, pa.StringArray) and text.null_count == 0
    assert text.to_pylist() == [f"{int(h):016x}" for h in hashes]


def test_errors():
    table = pa.table({"a": [1], "b": [2]})
    with pytest.raises(ValueError, match="'c'"):
        row_hashes(table, ["a", "c"])
    with pytest.raises(ValueError, match="more than once"):
        row_hashes(table, ["a", "a"])
    with pytest.raises(ValueError, match="more than once"):
        row_hashes(pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"]))
    with pytest.raises(ValueError, match="more than once"):
        twice = pa.StructArray.from_arrays([pa.array([1]), pa.array([2])], names=["p", "p"])
        row_hashes(pa.table({"s": twice}))
    with pytest.raises(TypeError, match="single string"):
        row_hashes(table, "ab")
    with pytest.raises(TypeError, match="RecordBatch or Table"):
        row_hashes({"a": [1]})
    union = pa.UnionArray.from_sparse(pa.array([0], pa.int8()), [pa.array([1]), pa.array(["x"])])
    with pytest.raises(TypeError, match="not covered"):
        row_hashes(pa.table({"u": union}))
    with pytest.raises(TypeError, match="not covered"):
        interval = pa.array([pa.MonthDayNano([1, 2, 3])], pa.month_day_nano_interval())
        row_hashes(pa.table({"i": interval}))


def test_duplicate_names_outside_the_selection_are_fine():
    arrays = [pa.array([1]), pa.array([2]), pa.array([3])]
    table = pa.Table.from_arrays(arrays, names=["a", "a", "b"])
    assert row_hashes(table, ["b"]).equals(row_hashes(pa.table({"b": [3]})))
