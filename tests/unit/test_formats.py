"""The format registry (batchinfer/io/formats.py): ``output.format`` and ``input.format`` as
entries like backends and runners — batchinfer's own never replaced, a third one installed from
outside (a distribution written into a folder on ``sys.path``) that a job commits through and
our readers read back with no change to the package; no format name tested outside the
registry; and checking a spec imports no table library."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from test_layers import MODULES
from test_registries import distribution, plugin_path

from batchinfer.errors import RuntimeFailure, SpecError
from batchinfer.io import formats
from batchinfer.io.formats import Format
from batchinfer.registry import Registry
from batchinfer.spec import parse_spec
from factories import DS, numeric_project, one_line_error, run_cli

BUILTIN_NAMES = tuple(f.name for f in formats.BUILTIN)


@pytest.fixture
def registry(monkeypatch) -> Registry[Format]:
    """The format registry as a new process has it (batchinfer's own formats, nothing read from
    entry points yet)."""
    fresh: Registry[Format] = Registry(kind="format", entry_type=Format, group="batchinfer.formats",
                                       builtin=formats.BUILTIN)
    monkeypatch.setattr(formats, "_REGISTRY", fresh)
    return fresh


def job(**output) -> dict:
    return {"name": "j", "input": {"path": "data/*.parquet"}, "schema": "feats@1",
            "model": {"uri": "m.onnx"}, "output": {"path": "tables", **output}}


def refusal(data: dict) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert caught.value.exit_code == 2
    return caught.value.message


# -- the entries -------------------------------------------------------------------------------

def test_the_format_entries_say_what_the_tables_said():
    """What io/sinks.FORMATS and EXTRAS, and the `== "iceberg"` tests, said before."""
    entries = formats.entries()
    assert BUILTIN_NAMES == ("files", "delta", "iceberg") == formats.names()[:3]
    assert {n: f.tables for n, f in entries.items() if n in BUILTIN_NAMES} == {
        "files": None, "delta": "batchinfer.io.delta_tables:DeltaTables",
        "iceberg": "batchinfer.io.iceberg_tables:IcebergTables"}
    assert {n: (f.needs, f.install) for n, f in entries.items() if f.needs and n in BUILTIN_NAMES} == {
        "delta": ("deltalake", "pip install 'batchinfer[delta]'"),
        "iceberg": ("pyiceberg", "pip install 'batchinfer[iceberg]'")}
    assert [n for n in BUILTIN_NAMES if entries[n].catalog] == ["iceberg"]
    assert [n for n in BUILTIN_NAMES if entries[n].partition_in_files] == ["iceberg"]
    assert [n for n in BUILTIN_NAMES if not entries[n].arrow_schema] == ["iceberg"]
    assert {n: entries[n].shown for n in BUILTIN_NAMES} == {
        "files": "files", "delta": "Delta", "iceberg": "Iceberg"}
    assert formats.table_inputs()[:2] == ("delta", "iceberg")
    assert all(entries[n].inputs for n in BUILTIN_NAMES)


def test_batchinfers_own_formats_are_never_replaced(registry):
    mine = Format(name="delta", tables="mine:Tables")
    for clobber in (False, True):
        with pytest.raises(ValueError, match=r"format 'delta' is already registered \(by "
                                             r"batchinfer\), whose entries cannot be replaced"):
            formats.register(mine, clobber=clobber)
    assert formats.get("delta").tables == "batchinfer.io.delta_tables:DeltaTables"
    with pytest.raises(SpecError, match=r"unknown format 'hudi' \(known: files, delta, iceberg\)"):
        formats.get("hudi")


def test_a_registered_format_is_checked_by_its_entry(registry):
    """The spec's checks read the entry: a new table format is accepted, listed among the
    known ones, refused as an input without an input side, and held to what a table format is
    held to (no date in its root, no catalog keys without a catalog)."""
    formats.register(Format(name="ledger", title="Ledger", tables="ledger_format:LedgerTables"))
    assert parse_spec(job(format="ledger")).output.table_partition == "dt"
    assert parse_spec(job()).output.table_partition is None
    assert refusal(job(format="hudi")) == ("job spec: output.format: Input should be 'files', "
                                           "'delta', 'iceberg' or 'ledger' (got 'hudi')")
    assert refusal(job(format="ledger", table="a.b")) == (
        "job spec: output.table and output.catalog are for output.format iceberg")
    data = job()
    data["input"] = {"path": "tables", "format": "ledger"}
    assert refusal(data) == ("job spec: input.format ledger cannot be read: the format has no input "
                             "side (input formats: files, delta, iceberg)")
    data["input"] = {"path": "data", "format": "files", "version": 3}
    assert "set input.format (delta, iceberg)" in refusal(data)


def test_a_missing_library_or_a_broken_module_is_one_line_exit_5(registry, tmp_path, monkeypatch):
    absent = Format(name="absent", tables="absent_mod:Tables", needs="absent_lib",
                    install="pip install absent")
    with pytest.raises(RuntimeFailure, match=r"^output.format absent needs absent_lib, which is "
                                             r"not installed: pip install absent$") as caught:
        formats.load(absent, absent.tables or "", "output.format")
    assert caught.value.exit_code == 5
    (tmp_path / "half_mod.py").write_text("import missing_dependency\n")
    (tmp_path / "empty_mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    half = Format(name="half", tables="half_mod:Tables")
    with pytest.raises(RuntimeFailure, match=r"^input.format half needs a package that is not "
                                             r"installed \(missing_dependency\)"):
        formats.load(half, "half_mod:Tables", "input.format")
    with pytest.raises(RuntimeFailure, match=r"names empty_mod:Tables, which empty_mod does not define"):
        formats.load(half, "empty_mod:Tables", "output.format")


# -- no format name outside the registry -------------------------------------------------------

def format_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each test of a value against a built-in format's name: a comparison
    (``==``, ``!=``, ``in``), a dict keyed by the names (a lookup table), a ``match`` case."""
    names = set(BUILTIN_NAMES)

    def named(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            found.append((node.lineno, "a comparison"))
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            found.append((node.lineno, "a dict keyed by format names"))
        elif isinstance(node, ast.MatchValue) and named(node.value):
            found.append((node.lineno, "a match case"))
    return found


def literal_names(tree: ast.AST) -> list[int]:
    """Lines of a ``Literal[...]`` that lists a built-in format's name."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal"
            and any(isinstance(e, ast.Constant) and e.value in BUILTIN_NAMES
                    for e in ast.walk(node.slice))]


def test_no_format_name_is_tested_outside_the_registry():
    """A format is what its entry says: no module but io/formats.py (which declares the
    entries) asks whether a format is called ``delta``; the demo's job files are data."""
    wrong = [f"{MODULES[module].name}:{line}: {what}"
             for module in sorted(MODULES) if module != "batchinfer.io.formats"
             for line, what in format_tests(ast.parse(MODULES[module].read_text()))]
    assert not wrong, wrong


def restricting_records() -> list[str]:
    """``module:line`` of each ``Literal`` of built-in format names in the package."""
    return [f"{MODULES[module].name}:{line}" for module in sorted(MODULES)
            for line in literal_names(ast.parse(MODULES[module].read_text()))]


def test_no_record_restricts_a_format_to_the_builtin_names():
    wrong = restricting_records()
    assert not wrong, wrong


def test_the_name_checks_see_what_they_look_for():
    code = textwrap.dedent('''
        a = fmt == "delta"
        b = fmt not in ("files", "x")
        c = {"iceberg": 1}.get(fmt)
        match fmt:
            case "files":
                pass
        d: Literal["delta", "iceberg"]
        e = fmt == "parquet"
    ''')
    tree = ast.parse(code)
    assert sorted(line for line, _ in format_tests(tree)) == [2, 3, 4, 6]
    assert literal_names(tree) == [8]


# -- a spec check imports no table library -----------------------------------------------------

def test_checking_a_spec_or_naming_its_tables_imports_no_table_library(tmp_path):
    """The spec check (as the Airflow DAG parse runs it) reads the entries only: neither
    deltalake nor pyiceberg, nor pyarrow, is imported; nor is a table library by the sink a run
    would build and the messages that name its tables."""
    code = textwrap.dedent(f'''
        import pathlib, sys
        import yaml
        from batchinfer.spec import load_job, parse_spec
        base = {job()!r}
        specs = [dict(base, output={{"path": "t", "format": f}}) for f in ("files", "delta", "iceberg")]
        specs.append(dict(base, input={{"path": "a.b", "format": "iceberg", "catalog": {{"uri": "sqlite:///c.db"}}}}))
        specs.append(dict(base, input={{"path": "t", "format": "delta", "filter": {{"dt": "{{ds}}"}}}}))
        for spec in specs:
            parse_spec(spec)
        heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"deltalake", "pyiceberg", "pyarrow"}})
        from batchinfer.app.resolve import output_format, sink_of
        folder = pathlib.Path({str(tmp_path)!r})
        (folder / "job.yaml").write_text(yaml.safe_dump(specs[2]))
        job = load_job(folder / "job.yaml", ds="{DS}")
        shown = (output_format(job), sink_of(job).partition, sink_of(job).is_table)
        tables = sorted({{m.split(".")[0] for m in sys.modules}} & {{"deltalake", "pyiceberg"}})
        print(heavy, tables, shown)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[] [] ('Iceberg', 'dt={DS}', True)"


# -- a third format, installed from outside ----------------------------------------------------

LEDGER = '''
    """A toy table format: each table keeps a JSON log of its commits (its ``_ledger.json``),
    one entry per commit naming the partition, its generation, the attempt and its files."""
    import json
    import os

    from batchinfer.io.formats import Format
    from batchinfer.io.sinks import LostRace

    FORMAT = Format(name="ledger", title="Ledger", tables="ledger_format:LedgerTables")


    class LedgerTables:
        def __init__(self, url, sink):
            self.url, self.sink = url.rstrip("/"), sink

        def _log(self, kind):
            folder = self.sink.layout(self.url, "").table(kind)
            return os.path.join(self.url, folder, "_ledger.json") if folder else \\
                os.path.join(self.url, "_ledger.json")

        def _read(self, kind):
            try:
                with open(self._log(kind)) as f:
                    return json.load(f)
            except FileNotFoundError:
                return []

        def _mine(self, log):
            return [e for e in log if e["partition"] == self.sink.partition]

        def generation(self):
            mine = self._mine(self._read("predictions"))
            return (mine[-1]["generation"], mine[-1]["attempt"]) if mine else (0, None)

        def commit(self, layout, kind, files, *, generation, attempt, summary):
            log = self._read(kind)
            mine = self._mine(log)
            if mine and mine[-1]["generation"] >= generation:
                if (mine[-1]["generation"], mine[-1]["attempt"]) == (generation, attempt):
                    return mine[-1]["version"]   # a retry: already committed
                raise LostRace(f"generation {generation} of {self.sink.partition}")
            if not log and not files:
                return None
            log.append({"version": len(log), "partition": self.sink.partition,
                        "generation": generation, "attempt": attempt,
                        "files": [f.path for f in files], "job": summary.get("batchinfer.job")})
            path = self._log(kind)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(log, f)
            os.replace(path + ".tmp", path)
            return len(log) - 1

        def describe(self, kind):
            return self.sink.layout(self.url, "").table(kind)
'''


def ledger_plugin(folder: Path) -> Path:
    return distribution(folder, "ledger-format", LEDGER, """\
        [batchinfer.formats]
        ledger = ledger_format:FORMAT
        """)


@pytest.mark.slow
def test_a_job_commits_through_a_distributions_format_and_our_readers_read_it_back(tmp_path):
    """A plain interpreter, as a user starts one, finds the format on its own sys.path
    (PYTHONPATH): the run commits the partition to its tables (the ledger's log names the
    manifest's files), a rerun is a no-op and an --overwrite the next generation; inspect and
    diff read the partition through the manifest; the format, which has no input side, is
    refused as an input.format (exit 2)."""
    site = ledger_plugin(tmp_path / "site")
    env = plugin_path(site)
    numeric_project(tmp_path, shards=2, rows=50)   # stamped by a process without the plugin
    spec = yaml.safe_load((tmp_path / "job.yaml").read_text())
    spec["output"] = {"path": "tables", "format": "ledger", "id_columns": ["id"]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    def run(*args: str):
        return run_cli("run", "job.yaml", "--ds", DS, *args, cwd=tmp_path, env=env, fresh=True)

    def ledger() -> list[dict]:
        return json.loads((tmp_path / "tables" / "_ledger.json").read_text())

    first = run()
    assert first.returncode == 0, first.stderr
    records = tmp_path / "tables" / "_batchinfer" / f"dt={DS}"
    manifest = json.loads((records / "_manifest.json").read_text())
    assert manifest["table"] == {"format": "ledger", "partition": {"dt": DS}, "generation": 1,
                                 "tables": [{"kind": "predictions", "table": "", "version": 0}]}
    files = sorted(f["path"] for shard in manifest["shards"] for f in shard["files"])
    assert [sorted(e["files"]) for e in ledger()] == [files] and len(files) == 2
    assert all(path.startswith(f"dt={DS}/") for path in files)
    assert ledger()[0]["attempt"] == manifest["attempt"]

    assert run().returncode == 0 and len(ledger()) == 1   # a rerun: a no-op
    again = run("--overwrite")
    assert again.returncode == 0, again.stderr
    replaced = json.loads((records / "_manifest.json").read_text())
    assert [(e["generation"], e["attempt"]) for e in ledger()] == [
        (1, manifest["attempt"]), (2, replaced["attempt"])]

    shown = run_cli("inspect", f"tables/dt={DS}", cwd=tmp_path, env=env, fresh=True)
    assert shown.returncode == 0, shown.stderr
    assert replaced["attempt"] in shown.stdout
    as_files = run("--set", "output.format=files", "--set", "output.path=files/dt={ds}")
    assert as_files.returncode == 0, as_files.stderr
    diffed = run_cli("diff", f"tables/dt={DS}", f"files/dt={DS}", "--json", cwd=tmp_path, env=env,
                     fresh=True)
    assert diffed.returncode == 0, diffed.stdout + diffed.stderr
    assert json.loads(diffed.stdout)["rows"]["scored_both"] == 100

    read = run("--set", "input.format=ledger", "--set", "input.path=tables",
               "--set", "output.path=again")
    assert read.returncode == 2, read.stderr
    assert one_line_error(read).endswith("input.format ledger cannot be read: the format has no "
                                         "input side (input formats: files, delta, iceberg)")
