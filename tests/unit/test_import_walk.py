"""The preprocessing's imports (batchinfer.triple.import_walk) and running them from the hashed
text (batchinfer.triple.sources): which modules are local and hashed, which are installed and
recorded by version, and that what runs is what was hashed — even after the files change, or
where the job's folder does not exist (a remote worker)."""
from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.triple.contract import check_declared_code, package_differences, preprocess_hash
from batchinfer.triple.import_walk import walk_imports
from batchinfer.triple.preprocess import load_preprocessor
from batchinfer.triple.sources import ModuleSource
from factories import REPO

_names = itertools.count()
NUMPY = f"numpy=={version('numpy')}"
PYARROW = f"pyarrow=={version('pyarrow')}"


def unique(prefix: str) -> str:
    # Modules are registered in sys.modules by name: keep names per test.
    return f"{prefix}_{os.getpid()}_{next(_names)}"


def write(folder: Path, relative: str, body: str) -> Path:
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def walk(folder: Path, name: str):
    path = folder / (name.replace(".", "/") + ".py")
    return walk_imports(ModuleSource.read(name, path, (str(folder),)), folder)


def names(imports) -> list[str]:
    return [m.name for m in imports.local]


BATCH = pa.record_batch({"x": [1.0, 2.0]})


# -- what the walk finds -------------------------------------------------------------------------

def test_helpers_imported_every_way_are_found_and_stdlib_and_installed_packages_are_not(tmp_path):
    a, b, c, d = (unique(n) for n in "abcd")
    write(tmp_path, f"{a}.py", "A = 1\n")
    write(tmp_path, f"{b}.py", "B = 2\n")
    write(tmp_path, f"{c}.py", "C = 3\n")
    write(tmp_path, f"{d}.py", "D = 4\n")
    entry = unique("prep")
    write(tmp_path, f"{entry}.py", f"""\
        import json, os.path
        from collections import OrderedDict
        import numpy as np
        import pyarrow.compute as pc
        import {a}
        from {b} import B

        def transform(batch):
            import {c}                      # imports inside functions count too
            import importlib
            helper = importlib.import_module("{d}")
            return np.zeros((batch.num_rows, 1))
        """)
    found = walk(tmp_path, entry)
    assert names(found) == sorted([a, b, c, d])
    assert found.packages == tuple(sorted([NUMPY, PYARROW]))   # by distribution and version


def test_relative_imports_inside_a_package_and_the_package_itself(tmp_path):
    pkg = unique("pkg")
    write(tmp_path, f"{pkg}/__init__.py", "from .shared import S\n")
    write(tmp_path, f"{pkg}/shared.py", "S = 1\n")
    write(tmp_path, f"{pkg}/sub/__init__.py", "")
    write(tmp_path, f"{pkg}/sub/deep.py", "from .. import shared\nfrom ..shared import S\n")
    write(tmp_path, f"{pkg}/prep.py", """\
        from . import shared
        from .sub import deep
        from .shared import S as _s, not_a_module
        """)
    found = walk(tmp_path, f"{pkg}.prep")
    assert names(found) == [pkg, f"{pkg}.shared", f"{pkg}.sub", f"{pkg}.sub.deep"]
    assert found.packages == ()


def test_a_helper_package_a_namespace_package_and_a_cycle(tmp_path):
    lib, ns, one, two = (unique(n) for n in ("lib", "ns", "one", "two"))
    write(tmp_path, f"{lib}/__init__.py", "")
    write(tmp_path, f"{lib}/core.py", f"import {lib}.extra\n")
    write(tmp_path, f"{lib}/extra.py", "import numpy\n")     # installed, through a helper
    write(tmp_path, f"{ns}/inner/mod.py", "M = 1\n")          # no __init__.py anywhere
    write(tmp_path, f"{one}.py", f"import {two}\n")
    write(tmp_path, f"{two}.py", f"import {one}\n")           # a cycle
    entry = unique("prep")
    write(tmp_path, f"{entry}.py", f"import {lib}.core\nfrom {ns}.inner import mod\nimport {one}\n")
    found = walk(tmp_path, entry)
    assert names(found) == sorted([lib, f"{lib}.core", f"{lib}.extra", f"{ns}.inner.mod", one, two])
    assert found.packages == (NUMPY,)


def test_a_module_importing_the_entry_back_does_not_repeat_it(tmp_path):
    entry, helper = unique("prep"), unique("helper")
    write(tmp_path, f"{entry}.py", f"import {helper}\n")
    write(tmp_path, f"{helper}.py", f"import {entry}\n")
    assert names(walk(tmp_path, entry)) == [helper]


def test_modules_on_pythonpath_are_local(tmp_path, monkeypatch):
    elsewhere = tmp_path / "lib"
    helper = unique("onpath")
    write(elsewhere, f"{helper}.py", "H = 1\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    entry = unique("prep")
    write(tmp_path / "job", f"{entry}.py", f"from {helper} import H\n")
    found = walk(tmp_path / "job", entry)
    assert names(found) == [helper]
    assert found.local[0].filename == str(elsewhere / f"{helper}.py")


def test_a_virtual_environment_inside_the_job_folder_is_installed_packages(tmp_path, monkeypatch):
    site_packages = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    fake = unique("fakepkg")
    write(site_packages, f"{fake}/__init__.py", "import numpy\n")
    monkeypatch.syspath_prepend(str(site_packages))
    entry = unique("prep")
    write(tmp_path, f"{entry}.py", f"import {fake}\n")
    found = walk(tmp_path, entry)
    assert found.local == ()                        # not hashed, not walked
    assert found.packages == (f"{fake}==unknown",)  # no distribution metadata to name it


def test_batchinfer_itself_is_recorded_like_an_installed_package(tmp_path):
    import batchinfer.errors

    before = sys.modules["batchinfer.errors"]
    entry = unique("prep")
    write(tmp_path, f"{entry}.py", """\
        import numpy as np
        from batchinfer.errors import PreprocessError

        def transform(batch):
            return np.zeros((batch.num_rows, 1), dtype=np.float32)
        """)
    pre = load_preprocessor(f"{entry}:transform", tmp_path, [])
    assert pre.local_modules == ()
    assert pre.packages == (f"batchinfer=={batchinfer.__version__}", NUMPY)
    assert sys.modules["batchinfer.errors"] is before   # the framework's own modules stay


def test_names_that_resolve_nowhere_and_attributes_are_ignored(tmp_path):
    entry = unique("prep")
    write(tmp_path, f"{entry}.py", """\
        try:
            import no_such_module_anywhere
        except ImportError:
            pass
        from os import path
        from . import nothing_above_the_top
        """)
    found = walk(tmp_path, entry)
    assert found.local == () and found.packages == ()


# -- the hash --------------------------------------------------------------------------------------

def test_a_module_without_local_imports_hashes_exactly_as_the_contract_says(tmp_path):
    entry = unique("prep")
    path = write(tmp_path, f"{entry}.py", """\
        import json
        import numpy as np

        def transform(batch):
            return np.zeros((batch.num_rows, 1), dtype=np.float32)
        """)
    pre = load_preprocessor(f"{entry}:transform", tmp_path, [])
    expected = hashlib.sha256(f"batchinfer-preprocess/1\n{entry}:transform\n".encode()
                              + path.read_bytes()).hexdigest()
    assert pre.hash == expected
    assert pre.packages == (NUMPY,) and pre.local_modules == ()


def test_local_modules_add_to_the_hash_in_name_order_after_the_assets(tmp_path):
    entry, zed, alpha = unique("prep"), unique("zed"), unique("alpha")
    source = f"""\
        import numpy as np
        from {zed} import Z
        from {alpha} import A
        ASSETS = ["vocab.txt"]

        def transform(batch):
            return np.full((batch.num_rows, 1), A + Z, dtype=np.float32)
        """
    path = write(tmp_path, f"{entry}.py", source)
    write(tmp_path, f"{zed}.py", "Z = 1.0  # é\n")
    write(tmp_path, f"{alpha}.py", "A = 2.0\r\n")   # CRLF: hashed (and run) as LF
    (tmp_path / "vocab.txt").write_bytes(b"v")
    pre = load_preprocessor(f"{entry}:transform", tmp_path, [])
    h = hashlib.sha256(f"batchinfer-preprocess/1\n{entry}:transform\n".encode() + path.read_bytes())
    h.update(b"\nasset vocab.txt 1\nv")
    for name, text in sorted([(zed, "Z = 1.0  # é\n"), (alpha, "A = 2.0\n")]):
        h.update(f"\nmodule {name} {len(text.encode())}\n".encode() + text.encode())
    assert pre.hash == h.hexdigest()
    assert pre.hash == preprocess_hash(entry, "transform", path.read_text(), [("vocab.txt", b"v")],
                                       [(zed, "Z = 1.0  # é\n"), (alpha, "A = 2.0\n")])
    assert pre(BATCH)[0, 0] == 3.0


# -- what runs is what was hashed ----------------------------------------------------------------

HELPER_USER = textwrap.dedent("""\
    import numpy as np
    import {helper}

    def transform(batch):
        import {late}                      # imported when the function first runs
        return np.full((batch.num_rows, 1), {helper}.K + {late}.L, dtype=np.float32)
    """)


def test_helpers_run_from_the_hashed_text_after_the_files_change(tmp_path):
    entry, helper, late = unique("prep"), unique("helper"), unique("late")
    write(tmp_path, f"{entry}.py", HELPER_USER.format(helper=helper, late=late))
    write(tmp_path, f"{helper}.py", "K = 1.0\n")
    write(tmp_path, f"{late}.py", "L = 10.0\n")
    pre = load_preprocessor(f"{entry}:transform", tmp_path, [])
    write(tmp_path, f"{helper}.py", "K = 100.0\n")
    write(tmp_path, f"{late}.py", "L = 1000.0\n")
    assert pre(BATCH)[0, 0] == 11.0            # not 1100: the text that was hashed
    copy = pickle.loads(pickle.dumps(pre))     # a worker's copy loads it again
    assert copy(BATCH)[0, 0] == 11.0


def test_a_pickled_preprocessor_runs_where_the_job_folder_does_not_exist(tmp_path):
    """No path of the job's folder travels; the assets do, and the worker's copy reads the bytes
    that were hashed from beside its ``__file__`` (the code cache)."""
    job = tmp_path / f"job-{unique('folder')}"
    entry, helper, late, pkg = unique("prep"), unique("helper"), unique("late"), unique("pkg")
    write(job, f"{entry}.py", HELPER_USER.format(helper=helper, late=late)
          + f"\nfrom {pkg}.inner import tool\nfrom pathlib import Path\n"
          + 'ASSETS = ["assets/k.txt", "../up.txt"]\n'
          + "KS = [float((Path(__file__).parent / a).read_text()) for a in ASSETS]\n")
    write(job, f"{helper}.py", "K = 1.0\n")
    write(job, f"{late}.py", "L = 10.0\n")
    write(job, f"{pkg}/inner/tool.py", "T = 1\n")    # namespace packages on the way
    write(job, "assets/k.txt", "100")
    write(tmp_path, "up.txt", "1000")
    pre = load_preprocessor(f"{entry}:transform", job, [])
    data = pickle.dumps(pre)
    assert job.name.encode() not in data and str(tmp_path).encode() not in data
    (tmp_path / "pre.pkl").write_bytes(data)
    job.rename(tmp_path / "gone")                    # nothing left to import or read from
    (tmp_path / "up.txt").unlink()
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    code = ("import pickle, sys, pyarrow as pa\n"
            f"pre = pickle.loads(open({str(tmp_path / 'pre.pkl')!r}, 'rb').read())\n"
            "print(pre(pa.record_batch({'x': [1.0]}))[0, 0], sys.modules[pre.ref.split(':')[0]].KS)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHINFER_CODE_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["11.0", "[100.0,", "1000.0]"]
    [copy] = (tmp_path / "cache").iterdir()      # one folder, named by the files' digest
    assert (copy / "_" / f"{entry}.py").is_file() and (copy / "up.txt").read_text() == "1000"


def test_two_jobs_with_a_helper_of_the_same_name_each_run_their_own(tmp_path):
    entry, helper, late = unique("prep"), unique("helper"), unique("late")
    for folder, k in (("a", 1.0), ("b", 2.0)):
        write(tmp_path / folder, f"{entry}.py", HELPER_USER.format(helper=helper, late=late))
        write(tmp_path / folder, f"{helper}.py", f"K = {k}\n")
        write(tmp_path / folder, f"{late}.py", "L = 10.0\n")
    pre_a = load_preprocessor(f"{entry}:transform", tmp_path / "a", [])
    pre_b = load_preprocessor(f"{entry}:transform", tmp_path / "b", [])
    assert pre_a.hash != pre_b.hash
    assert pre_b(BATCH)[0, 0] == 12.0
    assert pre_a(BATCH)[0, 0] == 11.0


# -- the declaration's checks ---------------------------------------------------------------------

def test_package_differences():
    assert package_differences("numpy==1 pyarrow==2", "numpy==1 pyarrow==2") == []
    assert package_differences("numpy==1 pyarrow==2", "numpy==3 tokenizers==4") == [
        "numpy stamped 1, installed 3", "pyarrow stamped 2, installed (not found)",
        "tokenizers stamped (none), installed 4"]


@pytest.mark.parametrize("declared, warns", [
    ({"schema_sha256": "s" * 64, "preprocess_packages": "numpy==1"}, 0),
    ({"schema_sha256": "s" * 64}, 0),                                  # older: packages unchecked
    ({"preprocess_packages": "numpy==1"}, 1),                          # older: no schema hash
    ({"schema_sha256": "s" * 64, "preprocess_packages": "numpy==2"}, 1),
])
def test_check_declared_code_warnings(declared, warns):
    lines = check_declared_code("m.onnx", declared, "feats@1", "s" * 64, "feats@2", "numpy==1")
    assert len(lines) == warns


def test_check_declared_code_refusals():
    from batchinfer.errors import ContractError

    with pytest.raises(ContractError, match="schema feats@1 changed.*ssssssssssss.*tttttttttttt"):
        check_declared_code("m.onnx", {"schema_sha256": "t" * 64}, "feats@1", "s" * 64, "feats@2", "")
    with pytest.raises(ContractError, match="numpy stamped 1, installed 2"):
        check_declared_code("m.onnx", {"schema_sha256": "s" * 64, "preprocess_packages": "numpy==1",
                                       "preprocess_packages_policy": "refuse"},
                            "feats@1", "s" * 64, "feats@2", "numpy==2")
    with pytest.raises(ContractError, match="preprocess_packages_policy"):
        check_declared_code("m.onnx", {"schema_sha256": "s" * 64, "preprocess_packages": "",
                                       "preprocess_packages_policy": "maybe"},
                            "feats@1", "s" * 64, "feats@2", "")
