"""Tests for batchinfer.triple.schemas: the name@N registry and the lock of published versions."""
from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from batchinfer.errors import ContractError, SpecError, UnknownSchemaError, UsageError
from batchinfer.triple.schemas import (
    LOCK_FILE,
    known_versions,
    lock_schemas,
    parse_ref,
    read_lock,
    resolve_schema,
    verify_lock,
)
from factories import REPO, write_schema


def _module(root: Path, name: str, version: int, body: str) -> Path:
    path = root / name / f"v{version}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


NO_FEATURES = """\
    import pandera.polars as pa
    import polars as pl

    SCHEMA = pa.DataFrameSchema({
        "key": pa.Column(pl.Int64),
        "b": pa.Column(pl.Float64),
        "a": pa.Column(pl.Float64),
        "c": pa.Column(pl.Float64),
    })
    """


# -- lookup --------------------------------------------------------------------------------------

def test_resolve_finds_name_at_version(tmp_path):
    write_schema(tmp_path, "feats", 1, n_features=2)
    write_schema(tmp_path, "feats", 2, n_features=3)
    v1 = resolve_schema(tmp_path, "feats@1")
    v2 = resolve_schema(tmp_path, "feats@2")
    assert v1.ref == "feats@1"
    assert v1.columns == ("id", "f0", "f1")
    assert v2.columns == ("id", "f0", "f1", "f2")
    assert v2.features == ("f0", "f1", "f2")
    assert v1.source.sha256 == hashlib.sha256((tmp_path / "feats/v1.py").read_bytes()).hexdigest()
    assert Path(v1.source.filename) == tmp_path / "feats" / "v1.py"


def test_resolve_accepts_string_root(tmp_path):
    write_schema(tmp_path)
    assert resolve_schema(str(tmp_path), "feats@1").columns[0] == "id"


def test_unknown_version_lists_known_versions(tmp_path):
    write_schema(tmp_path, "feats", 1)
    write_schema(tmp_path, "feats", 2)
    write_schema(tmp_path, "other", 7)
    with pytest.raises(UnknownSchemaError) as excinfo:
        resolve_schema(tmp_path, "feats@3")
    err = excinfo.value
    assert err.exit_code == 2
    message = str(err)
    assert "feats@3" in message
    assert "feats@1, feats@2, other@7" in message


def test_unknown_name_under_empty_root_says_none(tmp_path):
    with pytest.raises(UnknownSchemaError) as excinfo:
        resolve_schema(tmp_path / "missing", "feats@1")
    assert "known: none" in str(excinfo.value)


def test_known_versions_sorted_numerically_and_ignores_other_files(tmp_path):
    for version in (10, 2, 1):
        write_schema(tmp_path, "feats", version)
    (tmp_path / "feats" / "helpers.py").write_text("")
    (tmp_path / "feats" / "v3.txt").write_text("")
    (tmp_path / "README.md").write_text("")
    write_schema(tmp_path, "abc", 1)
    assert known_versions(tmp_path) == ["abc@1", "feats@1", "feats@2", "feats@10"]


@pytest.mark.parametrize("ref", ["feats", "feats@", "feats@v1", "@1", "feats@1@2", "fe ats@1"])
def test_bad_ref_format(tmp_path, ref):
    with pytest.raises(SpecError) as excinfo:
        resolve_schema(tmp_path, ref)
    assert excinfo.value.exit_code == 2
    assert "name@N" in str(excinfo.value)


def test_parse_ref():
    assert parse_ref("credit_features@12") == ("credit_features", 12)


def test_a_ref_or_version_file_with_a_final_newline_is_not_one(tmp_path):
    """``$`` matches before a final newline: ``feats@1\n`` read as feats@1, and a file
    ``v2.py\n`` listed as version 2 (the patterns are fullmatched now)."""
    with pytest.raises(SpecError, match="name@N"):
        parse_ref("feats@1\n")
    write_schema(tmp_path, "feats", 1)
    (tmp_path / "feats" / "v2.py\n").write_text("")
    assert known_versions(tmp_path) == ["feats@1"]


def test_module_that_fails_to_import_is_usage_error(tmp_path):
    _module(tmp_path, "broken", 1, "import pandera.polars as pa\nraise ValueError('boom in schema')\n")
    with pytest.raises(UsageError) as excinfo:
        resolve_schema(tmp_path, "broken@1")
    err = excinfo.value
    assert err.exit_code == 2
    assert not isinstance(err, ContractError)
    assert "broken@1" in str(err)
    assert "ValueError: boom in schema" in str(err)
    assert "\n" not in str(err)


def test_module_with_syntax_error_is_usage_error(tmp_path):
    _module(tmp_path, "broken", 1, "SCHEMA = (\n")
    with pytest.raises(UsageError) as excinfo:
        resolve_schema(tmp_path, "broken@1")
    assert "SyntaxError" in str(excinfo.value)


def test_module_without_schema_is_usage_error(tmp_path):
    _module(tmp_path, "empty", 1, "FEATURES = ['a']\n")
    with pytest.raises(UsageError) as excinfo:
        resolve_schema(tmp_path, "empty@1")
    assert excinfo.value.exit_code == 2
    assert "defines no SCHEMA" in str(excinfo.value)


def test_dataframe_model_class_is_converted(tmp_path):
    _module(tmp_path, "modelled", 1, """\
        import pandera.polars as pa
        import polars as pl

        class Features(pa.DataFrameModel):
            key: pl.Int64
            x: pl.Float64 = pa.Field(ge=0)
            y: pl.Float32

        SCHEMA = Features
        """)
    version = resolve_schema(tmp_path, "modelled@1")
    import pandera.polars as pap

    assert isinstance(version.schema.schema, pap.DataFrameSchema)
    assert version.columns == ("key", "x", "y")
    assert version.features is None
    assert version.features_for(["key"]) == ("x", "y")


def test_features_default_is_columns_minus_ids_in_schema_order(tmp_path):
    _module(tmp_path, "plain", 1, NO_FEATURES)
    version = resolve_schema(tmp_path, "plain@1")
    assert version.features is None
    assert version.columns == ("key", "b", "a", "c")
    assert version.features_for(["key"]) == ("b", "a", "c")
    assert version.features_for([]) == ("key", "b", "a", "c")
    assert version.features_for(["key", "a"]) == ("b", "c")


def test_explicit_features_kept_in_their_order_and_win_over_ids(tmp_path):
    _module(tmp_path, "plain", 1, NO_FEATURES + "FEATURES = ['c', 'a']\n")
    version = resolve_schema(tmp_path, "plain@1")
    assert version.features == ("c", "a")
    assert version.features_for(["key"]) == ("c", "a")
    assert version.features_for(["a"]) == ("c", "a")


def test_features_naming_unknown_columns(tmp_path):
    _module(tmp_path, "plain", 1, NO_FEATURES + "FEATURES = ['a', 'zzz', 'c']\n")
    with pytest.raises(UsageError) as excinfo:
        resolve_schema(tmp_path, "plain@1")
    assert excinfo.value.exit_code == 2
    assert "zzz" in str(excinfo.value)
    assert "'a'" not in str(excinfo.value)


# -- the lock ------------------------------------------------------------------------------------

def _sha_lf(path: Path) -> str:
    return hashlib.sha256(path.read_bytes().replace(b"\r\n", b"\n")).hexdigest()


def test_lock_schemas_adds_every_version(tmp_path):
    a = write_schema(tmp_path, "feats", 1)
    b = write_schema(tmp_path, "other", 3)
    added = lock_schemas(tmp_path)
    assert added == {"feats@1": _sha_lf(a), "other@3": _sha_lf(b)}
    assert read_lock(tmp_path) == added
    body = json.loads((tmp_path / LOCK_FILE).read_text())
    assert body["versions"] == added
    # nothing new: nothing added, file unchanged
    before = (tmp_path / LOCK_FILE).read_bytes()
    assert lock_schemas(tmp_path) == {}
    assert (tmp_path / LOCK_FILE).read_bytes() == before


def test_lock_schemas_adds_new_versions_and_never_changes_an_entry(tmp_path):
    v1 = write_schema(tmp_path, "feats", 1)
    lock_schemas(tmp_path)
    original = read_lock(tmp_path)["feats@1"]
    v1.write_text(v1.read_text() + "# edited after publishing\n")
    v2 = write_schema(tmp_path, "feats", 2)
    added = lock_schemas(tmp_path)
    assert added == {"feats@2": _sha_lf(v2)}
    lock = read_lock(tmp_path)
    assert lock["feats@1"] == original
    assert lock["feats@1"] != _sha_lf(v1)
    assert lock["feats@2"] == _sha_lf(v2)


def test_resolve_refuses_edited_locked_version(tmp_path):
    path = write_schema(tmp_path, "feats", 1)
    write_schema(tmp_path, "feats", 2)
    lock_schemas(tmp_path)
    resolve_schema(tmp_path, "feats@1")  # fine before the edit
    path.write_text(path.read_text().replace("-10", "-11"))
    with pytest.raises(ContractError) as excinfo:
        resolve_schema(tmp_path, "feats@1")
    err = excinfo.value
    assert err.exit_code == 3
    assert "feats@1" in str(err)
    assert "feats@3" in str(err)  # the way forward: the next version
    # an unlocked draft can still be edited freely
    write_schema(tmp_path, "feats", 3)
    draft = tmp_path / "feats" / "v3.py"
    draft.write_text(draft.read_text() + "# still a draft\n")
    assert resolve_schema(tmp_path, "feats@3").ref == "feats@3"


def test_crlf_only_change_does_not_count(tmp_path):
    path = write_schema(tmp_path, "feats", 1)
    lock_schemas(tmp_path)
    lf = path.read_bytes()
    assert b"\r\n" not in lf
    path.write_bytes(lf.replace(b"\n", b"\r\n"))
    assert path.read_bytes() != lf
    assert resolve_schema(tmp_path, "feats@1").ref == "feats@1"
    assert verify_lock(tmp_path) == []


def test_lock_of_crlf_file_matches_lf_hash(tmp_path):
    path = write_schema(tmp_path, "feats", 1)
    lf_hash = hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert lock_schemas(tmp_path) == {"feats@1": lf_hash}


def test_verify_lock_reports_edited_and_missing(tmp_path):
    a = write_schema(tmp_path, "feats", 1)
    b = write_schema(tmp_path, "feats", 2)
    write_schema(tmp_path, "other", 1)
    lock_schemas(tmp_path)
    assert verify_lock(tmp_path) == []
    a.write_text(a.read_text() + "X = 1\n")
    b.unlink()
    problems = verify_lock(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("feats@1:") and "changed" in problems[0]
    assert problems[1].startswith("feats@2:") and "missing" in problems[1]


def test_verify_lock_without_lock_is_empty(tmp_path):
    write_schema(tmp_path)
    assert verify_lock(tmp_path) == []
    assert read_lock(tmp_path) == {}


def test_corrupt_lock_is_contract_error(tmp_path):
    write_schema(tmp_path)
    (tmp_path / LOCK_FILE).write_text("{not json")
    with pytest.raises(ContractError):
        resolve_schema(tmp_path, "feats@1")


# -- the repository's own published schemas -----------------------------------------------------

def test_repository_lock_matches_published_schemas():
    root = REPO / "schemas"
    assert (root / LOCK_FILE).is_file(), "schemas/lock.json is missing: run lock_schemas"
    assert verify_lock(root) == []


def test_every_repository_schema_version_is_locked():
    root = REPO / "schemas"
    versions = known_versions(root)
    assert "credit_features@1" in versions
    missing = sorted(set(versions) - set(read_lock(root)))
    assert missing == [], f"publish these with lock_schemas('schemas'): {missing}"
