"""Tests for batchinfer.triple.contract (the triple, digests, declarations) and batchinfer.triple.preprocess."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchinfer.errors import ContractError, ModelFileError, PreprocessError, SpecError
from batchinfer.triple.contract import (
    PARTS,
    Triple,
    check_contract,
    declaration_from_tags,
    declaration_tags,
    default_preprocess_hash,
    model_digest,
    model_files,
    preprocess_hash,
    read_sidecar,
    refuse_pickle,
    sidecar_path,
    write_sidecar,
)
from batchinfer.triple.preprocess import Preprocessor, load_preprocessor, stack_float32
from factories import make_mlp_onnx, point_external_data

_names = itertools.count()


def _unique(prefix: str) -> str:
    # Modules loaded from source are registered in sys.modules by name: keep names per test.
    return f"{prefix}_{os.getpid()}_{next(_names)}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- preprocess hash ---------------------------------------------------------------------------

SOURCE = "import numpy as np\n\ndef transform(batch):\n    return np.zeros((batch.num_rows, 1))\n"


def test_preprocess_hash_is_the_literal_formula():
    expected = _sha(b"batchinfer-preprocess/1\npipelines.credit.preprocess:transform\n"
                    + SOURCE.encode())
    assert preprocess_hash("pipelines.credit.preprocess", "transform", SOURCE) == expected


def test_preprocess_hash_crlf_equals_lf():
    crlf = SOURCE.replace("\n", "\r\n")
    assert crlf != SOURCE
    assert preprocess_hash("m", "f", crlf) == preprocess_hash("m", "f", SOURCE)


def test_preprocess_hash_depends_on_module_function_and_source():
    base = preprocess_hash("m", "f", SOURCE)
    assert preprocess_hash("m2", "f", SOURCE) != base
    assert preprocess_hash("m", "g", SOURCE) != base
    assert preprocess_hash("m", "f", SOURCE + "# comment\n") != base


def test_preprocess_hash_covers_assets_in_order():
    base = preprocess_hash("m", "f", SOURCE)
    one = preprocess_hash("m", "f", SOURCE, [("vocab.txt", b"abc")])
    assert one != base
    assert preprocess_hash("m", "f", SOURCE, [("vocab.txt", b"abd")]) != one
    assert preprocess_hash("m", "f", SOURCE, [("other.txt", b"abc")]) != one
    both = preprocess_hash("m", "f", SOURCE, [("a", b"1"), ("b", b"2")])
    assert preprocess_hash("m", "f", SOURCE, [("b", b"2"), ("a", b"1")]) != both
    expected = _sha(b"batchinfer-preprocess/1\nm:f\n" + SOURCE.encode()
                    + b"\nasset vocab.txt 3\nabc")
    assert one == expected


def test_default_preprocess_hash_formula():
    expected = _sha(b"batchinfer-preprocess/1\ndefault-float32\nf0,f1,f2")
    assert default_preprocess_hash(["f0", "f1", "f2"]) == expected
    assert default_preprocess_hash(("f0", "f1", "f2")) == expected
    assert default_preprocess_hash(["f1", "f0", "f2"]) != expected
    assert default_preprocess_hash([]) == _sha(b"batchinfer-preprocess/1\ndefault-float32\n")


# -- model digest --------------------------------------------------------------------------------

def test_model_digest_is_sha256_of_file_bytes(tmp_path):
    model = make_mlp_onnx(tmp_path / "model.onnx")
    assert model_files(model) == [model]
    assert model_digest(model) == _sha(model.read_bytes())


def test_model_digest_of_non_onnx_file(tmp_path):
    path = tmp_path / "model.pt2"
    path.write_bytes(b"\x00not onnx\x01")
    assert model_digest(path) == _sha(b"\x00not onnx\x01")


def test_model_digest_missing_file_is_the_users_mistake(tmp_path):
    with pytest.raises(ModelFileError) as excinfo:
        model_digest(tmp_path / "absent.onnx")
    assert excinfo.value.exit_code == 2   # a retry cannot make it appear


def _external_model(folder: Path, location: str = "weights.bin") -> tuple[Path, Path]:
    import onnx

    source = make_mlp_onnx(folder / "source" / "model.onnx")
    proto = onnx.load(str(source))
    target = folder / "model.onnx"
    onnx.save_model(proto, str(target), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=location, size_threshold=0)
    return target, folder / location


def test_model_digest_covers_external_data(tmp_path):
    model, weights = _external_model(tmp_path)
    assert weights.is_file() and weights.stat().st_size > 0
    assert model_files(model) == [model, weights]
    digest = model_digest(model)
    assert digest == _sha(model.read_bytes() + weights.read_bytes())
    assert digest != _sha(model.read_bytes())
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_digest(model) != digest
    assert model_digest(model) == _sha(model.read_bytes() + bytes(data))


def test_model_digest_external_files_in_name_order(tmp_path):
    import onnx

    source = make_mlp_onnx(tmp_path / "source" / "model.onnx")
    proto = onnx.load(str(source))
    target = tmp_path / "model.onnx"
    onnx.save_model(proto, str(target), save_as_external_data=True,
                    all_tensors_to_one_file=False, size_threshold=0)
    files = model_files(target)
    externals = [p.name for p in files[1:]]
    assert files[0] == target
    assert sorted(externals) == externals
    assert set(externals) == {"w1", "b1", "w2", "b2"}
    assert model_digest(target) == _sha(b"".join(p.read_bytes() for p in files))


def test_model_digest_missing_external_file_is_the_users_mistake(tmp_path):
    model, weights = _external_model(tmp_path)
    weights.unlink()
    with pytest.raises(ModelFileError):
        model_digest(model)


def test_external_data_outside_folder_via_dotdot_is_refused(tmp_path):
    folder = tmp_path / "models"
    model, weights = _external_model(folder)
    outside = tmp_path / "weights.bin"
    weights.rename(outside)
    point_external_data(model, "../weights.bin")
    with pytest.raises(ContractError) as excinfo:
        model_digest(model)
    assert excinfo.value.exit_code == 3
    assert "../weights.bin" in str(excinfo.value)


def test_external_data_absolute_path_is_refused(tmp_path):
    folder = tmp_path / "models"
    model, weights = _external_model(folder)
    point_external_data(model, str(weights.resolve()))  # inside, but absolute
    with pytest.raises(ContractError):
        model_digest(model)


def test_external_data_symlink_pointing_outside_is_refused(tmp_path):
    folder = tmp_path / "models"
    model, weights = _external_model(folder)
    outside = tmp_path / "elsewhere" / "weights.bin"
    outside.parent.mkdir()
    weights.rename(outside)
    weights.symlink_to(outside)
    assert weights.is_file()
    with pytest.raises(ContractError) as excinfo:
        model_files(model)
    assert "leaves the model's folder" in str(excinfo.value)


def test_external_data_in_subfolder_is_allowed(tmp_path):
    folder = tmp_path / "models"
    (folder / "data").mkdir(parents=True)
    model, weights = _external_model(folder, location="data/weights.bin")
    assert model_files(model) == [model, weights]


def test_unreadable_onnx_is_the_users_mistake(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff\xfe not a protobuf \x00" * 10)
    with pytest.raises(ModelFileError) as excinfo:
        model_digest(path)
    assert excinfo.value.exit_code == 2   # the same bytes fail on every retry


@pytest.mark.parametrize("name", ["model.pkl", "model.pickle", "model.pt", "model.PTH",
                                  "model.joblib", "model.ckpt", "pytorch_model.bin"])
def test_pickle_formats_refused(name):
    with pytest.raises(ContractError) as excinfo:
        refuse_pickle(f"/models/{name}")
    assert excinfo.value.exit_code == 3
    assert "pickle" in str(excinfo.value)


def test_pickle_allowed_on_opt_in_and_safe_formats_pass():
    refuse_pickle("/models/model.pkl", allow_pickle=True)
    refuse_pickle("/models/model.onnx")
    refuse_pickle("/models/model.pt2")
    refuse_pickle("/models/model.engine")


# -- declarations --------------------------------------------------------------------------------

TRIPLE = Triple(model_version="credit_risk:3", model_digest="d" * 64,
                schema_version="credit_features@1", preprocess_hash="p" * 64)


def test_a_registry_uri_with_a_final_newline_is_not_one():
    """``$`` matched before the final newline: ``models:/credit/4\\n`` was read as version 4."""
    from batchinfer.triple.models import registry_ref, resolve_model

    assert registry_ref("models:/credit/4") == ("credit", "4")
    assert registry_ref("models:/credit/4\n") is None
    with pytest.raises(SpecError, match="use models:/<name>/<version>") as excinfo:
        resolve_model("models:/credit/4\n", "onnxruntime", "sqlite:///unused.db")
    assert "\n" not in str(excinfo.value)   # one line: the URI is quoted


def test_sidecar_write_read_roundtrip(tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"model bytes")
    assert read_sidecar(model) is None
    path = write_sidecar(model, TRIPLE)
    assert path == sidecar_path(model) == tmp_path / "model.onnx.batchinfer.json"
    assert json.loads(path.read_text()) == TRIPLE.as_dict()
    assert read_sidecar(model) == TRIPLE.as_dict()
    assert model.read_bytes() == b"model bytes"  # stamping never touches the model
    assert not (tmp_path / "model.onnx.batchinfer.json.tmp").exists()


def test_sidecar_overwrite(tmp_path):
    model = tmp_path / "model.onnx"
    write_sidecar(model, TRIPLE)
    other = Triple("credit_risk:4", "e" * 64, "credit_features@2", "q" * 64)
    write_sidecar(model, other)
    assert read_sidecar(model) == other.as_dict()


def test_corrupt_sidecar_is_contract_error(tmp_path):
    model = tmp_path / "model.onnx"
    sidecar_path(model).write_text("{oops")
    with pytest.raises(ContractError):
        read_sidecar(model)


def test_sidecar_keeps_what_the_backend_declares_and_extra_keys_change_nothing(tmp_path):
    model = tmp_path / "model.pt2"
    sidecar_path(model).write_text(json.dumps({**TRIPLE.as_dict(), "precision": "bf16", "note": "x"}))
    declared = read_sidecar(model)
    assert declared == {**TRIPLE.as_dict(), "precision": "bf16", "note": "x"}
    check_contract("m.pt2", declared, TRIPLE, options={"precision": "bf16"})   # "note" is nobody's
    with pytest.raises(ContractError, match="model.options.precision is fp32 but the model was stamped for bf16"):
        check_contract("m.pt2", declared, TRIPLE, options={"precision": "fp32"})
    with pytest.raises(ContractError, match=r"stamped for \(not declared\)"):
        check_contract("m.pt2", TRIPLE.as_dict(), TRIPLE, options={"precision": "fp32"})


def test_tags_roundtrip():
    tags = declaration_tags(TRIPLE)
    assert tags == {f"batchinfer.{k}": v for k, v in TRIPLE.as_dict().items()}
    assert declaration_from_tags({**tags, "other": "x"}) == TRIPLE.as_dict()
    assert declaration_from_tags({"other": "x"}) is None


# -- check_contract ------------------------------------------------------------------------------

def test_check_contract_all_matching_passes():
    check_contract("m.onnx", TRIPLE.as_dict(), TRIPLE)
    check_contract("m.onnx", TRIPLE.as_dict(), TRIPLE, spec_version="credit_risk:3")


def test_check_contract_missing_declaration():
    with pytest.raises(ContractError) as excinfo:
        check_contract("/models/m.onnx", None, TRIPLE)
    err = excinfo.value
    assert err.exit_code == 3
    assert "no declaration" in str(err)
    assert "m.onnx.batchinfer.json" in str(err)
    from batchinfer.commands.remedies import error_line
    from batchinfer.errors import Action, Remedy

    assert err.remedies == (Remedy(Action.STAMP, subject="/models/m.onnx"),)
    assert "batchinfer stamp" not in str(err)   # the remedy is a value below the CLI
    assert error_line(err).endswith(": run `batchinfer stamp /models/m.onnx --job JOB.yaml`")


def test_check_contract_incomplete_declaration():
    declared = TRIPLE.as_dict()
    del declared["preprocess_hash"]
    with pytest.raises(ContractError) as excinfo:
        check_contract("m.onnx", declared, TRIPLE)
    assert "preprocess_hash" in str(excinfo.value)


@pytest.mark.parametrize("part", [p for p in PARTS if p != "model_version"])
def test_check_contract_each_part_mismatching(part):
    declared = TRIPLE.as_dict()
    declared[part] = "declared-" + part
    with pytest.raises(ContractError) as excinfo:
        check_contract("m.onnx", declared, TRIPLE)
    message = str(excinfo.value)
    assert excinfo.value.exit_code == 3
    assert "\n" not in message
    assert f"{part} declared declared-{part} found {getattr(TRIPLE, part)}" in message
    for other in PARTS:
        assert other in message  # every part is named, matching or not


def test_check_contract_every_part_mismatching_names_all():
    declared = {k: f"old-{k}" for k in PARTS}
    found = Triple(*(f"new-{k}" for k in PARTS))
    with pytest.raises(ContractError) as excinfo:
        check_contract("m.onnx", declared, found, spec_version="new-model_version")
    message = str(excinfo.value)
    for k in PARTS:
        assert f"old-{k}" in message and f"new-{k}" in message
    assert "changed since it was stamped" in message


def test_check_contract_spec_model_version_mismatch():
    with pytest.raises(ContractError) as excinfo:
        check_contract("m.onnx", TRIPLE.as_dict(), TRIPLE, spec_version="credit_risk:4")
    message = str(excinfo.value)
    assert "model_version declared credit_risk:3 found credit_risk:4" in message


# -- load_preprocessor ---------------------------------------------------------------------------

def _write_module(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


TRANSFORM = """\
    import numpy as np

    def transform(batch):
        return np.full((batch.num_rows, 2), 7.0, dtype=np.float32)
    """


def test_load_preprocessor_from_job_folder(tmp_path):
    name = _unique("prep")
    path = _write_module(tmp_path, name, TRANSFORM)
    pre = load_preprocessor(f"{name}:transform", tmp_path, ["a"])
    assert isinstance(pre, Preprocessor)
    assert pre.ref == f"{name}:transform"
    assert Path(pre.source.filename).resolve() == path.resolve()
    assert pre.hash == _sha(f"batchinfer-preprocess/1\n{name}:transform\n".encode()
                            + path.read_bytes())
    out = pre(pa.record_batch({"a": [1.0, 2.0, 3.0]}))
    assert out.shape == (3, 2) and (out == 7.0).all()


def test_load_preprocessor_crlf_source_same_hash(tmp_path):
    name = _unique("prep")
    lf_dir, crlf_dir = tmp_path / "lf", tmp_path / "crlf"
    path = _write_module(lf_dir, name, TRANSFORM)
    crlf = _write_module(crlf_dir, name, "")
    crlf.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    lf_hash = load_preprocessor(f"{name}:transform", lf_dir, []).hash
    name2 = _unique("prep")
    crlf.rename(crlf_dir / f"{name2}.py")
    (lf_dir / f"{name}.py").rename(lf_dir / f"{name2}.py")
    crlf_hash = load_preprocessor(f"{name2}:transform", crlf_dir, []).hash
    lf_hash2 = load_preprocessor(f"{name2}:transform", lf_dir, []).hash
    assert crlf_hash == lf_hash2
    assert lf_hash != lf_hash2  # the module name is part of the hash


def test_load_preprocessor_assets_change_hash(tmp_path):
    name = _unique("prep")
    _write_module(tmp_path, name, TRANSFORM + 'ASSETS = ["vocab.txt"]\n')
    vocab = tmp_path / "vocab.txt"
    vocab.write_bytes(b"alpha\nbeta\n")
    first = load_preprocessor(f"{name}:transform", tmp_path, [])
    source = first.source.text
    assert first.hash == preprocess_hash(name, "transform", source, [("vocab.txt", b"alpha\nbeta\n")])
    assert first.hash != preprocess_hash(name, "transform", source)
    vocab.write_bytes(b"alpha\ngamma\n")
    name2 = _unique("prep")
    (tmp_path / f"{name}.py").rename(tmp_path / f"{name2}.py")
    second = load_preprocessor(f"{name2}:transform", tmp_path, [])
    assert second.hash == preprocess_hash(name2, "transform", source,
                                          [("vocab.txt", b"alpha\ngamma\n")])


def test_load_preprocessor_missing_asset(tmp_path):
    name = _unique("prep")
    _write_module(tmp_path, name, TRANSFORM + 'ASSETS = ["missing.bin"]\n')
    with pytest.raises(PreprocessError) as excinfo:
        load_preprocessor(f"{name}:transform", tmp_path, [])
    assert "missing.bin" in str(excinfo.value)


def test_load_preprocessor_package_module(tmp_path):
    pkg = _unique("pipelines")
    _write_module(tmp_path / pkg, "__init__", "")
    path = _write_module(tmp_path / pkg, "credit", TRANSFORM)
    pre = load_preprocessor(f"{pkg}.credit:transform", tmp_path, [])
    assert Path(pre.source.filename).resolve() == path.resolve()
    assert pre.hash == preprocess_hash(f"{pkg}.credit", "transform", path.read_text())


def test_load_preprocessor_same_module_name_in_two_job_folders(tmp_path):
    # Two jobs in one process, each with its own `features.py`: each must get its own file.
    name = _unique("features")
    a = _write_module(tmp_path / "a", name, TRANSFORM)
    b = _write_module(tmp_path / "b", name, TRANSFORM.replace("7.0", "8.0"))
    pre_a = load_preprocessor(f"{name}:transform", tmp_path / "a", [])
    pre_b = load_preprocessor(f"{name}:transform", tmp_path / "b", [])
    assert Path(pre_a.source.filename).resolve() == a.resolve()
    assert Path(pre_b.source.filename).resolve() == b.resolve()
    assert pre_a.hash != pre_b.hash
    batch = pa.record_batch({"x": [0.0]})
    assert pre_a(batch)[0, 0] == 7.0 and pre_b(batch)[0, 0] == 8.0


def test_load_preprocessor_missing_module(tmp_path):
    name = _unique("absent")
    with pytest.raises(PreprocessError) as excinfo:
        load_preprocessor(f"{name}:transform", tmp_path, [])
    assert excinfo.value.exit_code == 2
    assert name in str(excinfo.value)
    with pytest.raises(PreprocessError):
        load_preprocessor(f"{name}.sub:transform", tmp_path, [])


def test_load_preprocessor_module_raising_on_import(tmp_path):
    name = _unique("prep")
    _write_module(tmp_path, name, "raise RuntimeError('cannot start')\n")
    with pytest.raises(PreprocessError) as excinfo:
        load_preprocessor(f"{name}:transform", tmp_path, [])
    err = excinfo.value
    assert err.exit_code == 2
    assert "RuntimeError: cannot start" in str(err)


def test_load_preprocessor_module_with_bad_import(tmp_path):
    name = _unique("prep")
    _write_module(tmp_path, name, "import no_such_package_xyz\n")
    with pytest.raises(PreprocessError) as excinfo:
        load_preprocessor(f"{name}:transform", tmp_path, [])
    assert "no_such_package_xyz" in str(excinfo.value)


@pytest.mark.parametrize("body", ["def other(batch):\n    return batch\n", "transform = 3\n"])
def test_load_preprocessor_missing_function(tmp_path, body):
    name = _unique("prep")
    _write_module(tmp_path, name, body)
    with pytest.raises(PreprocessError) as excinfo:
        load_preprocessor(f"{name}:transform", tmp_path, [])
    assert excinfo.value.exit_code == 2
    assert "'transform'" in str(excinfo.value)


def test_default_preprocessor():
    pre = load_preprocessor(None, Path("."), ["b", "a"])
    assert pre.ref is None and pre.source is None
    assert pre.hash == default_preprocess_hash(["b", "a"])
    out = pre(pa.record_batch({"a": [1.0, 2.0], "b": [3, 4], "c": ["x", "y"]}))
    np.testing.assert_array_equal(out, np.array([[3, 1], [4, 2]], dtype=np.float32))


def test_preprocessor_survives_pickling(tmp_path):
    import pickle

    name = _unique("prep")
    _write_module(tmp_path, name, TRANSFORM)
    pre = load_preprocessor(f"{name}:transform", tmp_path, [])
    copy = pickle.loads(pickle.dumps(pre))
    assert copy.hash == pre.hash
    assert copy(pa.record_batch({"x": [1, 2]})).shape == (2, 2)


# -- stack_float32 -------------------------------------------------------------------------------

def test_stack_float32_dtype_order_contiguity():
    batch = pa.record_batch({"i": pa.array([1, 2, 3], pa.int64()),
                             "f": pa.array([0.5, 1.5, 2.5], pa.float64()),
                             "g": pa.array([9, 8, 7], pa.float32()),
                             "unused": ["a", "b", "c"]})
    out = stack_float32(batch, ["g", "i", "f"])
    assert out.dtype == np.float32
    assert out.shape == (3, 3)
    assert out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, np.array([[9, 1, 0.5], [8, 2, 1.5], [7, 3, 2.5]],
                                                dtype=np.float32))


def test_stack_float32_nulls_become_nan():
    batch = pa.record_batch({"i": pa.array([1, None, 3], pa.int64()),
                             "f": pa.array([None, 2.0, None], pa.float32())})
    out = stack_float32(batch, ["i", "f"])
    assert out.dtype == np.float32
    assert out.flags["C_CONTIGUOUS"]
    assert np.isnan(out[1, 0]) and np.isnan(out[0, 1]) and np.isnan(out[2, 1])
    assert out[0, 0] == 1 and out[2, 0] == 3 and out[1, 1] == 2
    assert int(np.isnan(out).sum()) == 3


def test_stack_float32_empty_batch():
    batch = pa.record_batch({"a": pa.array([], pa.float64())})
    out = stack_float32(batch, ["a"])
    assert out.shape == (0, 1) and out.dtype == np.float32


def test_a_model_without_external_data_is_told_so_without_onnx_and_anything_else_is_left_to_it(tmp_path):
    """The fast path (no ``onnx`` import) answers only for a file that reads as a ModelProto with
    a graph and holds no ``location`` key; every other file goes to onnx, which reads or refuses
    it as before."""
    from batchinfer.triple.contract import _refers_to_no_external_data, onnx_external_locations

    plain = make_mlp_onnx(tmp_path / "plain" / "model.onnx")
    external, _ = _external_model(tmp_path / "ext")
    assert _refers_to_no_external_data(plain) and onnx_external_locations(plain) == []
    assert not _refers_to_no_external_data(external)            # holds "location": onnx reads it
    assert onnx_external_locations(external) != []
    for name, data in [("text.onnx", b"not a model\n"), ("empty.onnx", b""),
                       ("cut.onnx", plain.read_bytes()[:-3]), ("no-graph.onnx", b"\x08\x07")]:
        bad = tmp_path / name
        bad.write_bytes(data)
        assert not _refers_to_no_external_data(bad), name      # left to onnx
    with pytest.raises(ModelFileError, match="is not a readable ONNX model"):
        onnx_external_locations(tmp_path / "text.onnx")
