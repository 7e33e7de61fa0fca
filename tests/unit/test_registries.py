"""The backend and runner registries (batchinfer/registry.py): entries in one place, a read-only
view, a guard against taking a name twice, and entries from installed distributions through
entry points — found for real, from a distribution written into a folder on ``sys.path``."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from batchinfer import backends, runners
from batchinfer.backends import Backend
from batchinfer.errors import RuntimeFailure, SpecError
from batchinfer.registry import Registry
from batchinfer.runners import Runner
from factories import DS, numeric_project, one_line_error, run_cli

FN_API = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"


def fresh(registry: Registry) -> Registry:
    """A registry of the same kind with batchinfer's own entries only, its entry points not yet read."""
    builtin = backends.BUILTIN if registry.entry_type is Backend else runners.BUILTIN
    return Registry(kind=registry.kind, entry_type=registry.entry_type, group=registry.group,
                    builtin=builtin)


# -- the registry itself ------------------------------------------------------------------------

def test_the_view_is_read_only_and_shows_later_registrations():
    registry = fresh(runners._REGISTRY)
    view = registry.entries()
    with pytest.raises(TypeError):
        view["mine"] = Runner(name="mine", beam_runner=FN_API)  # type: ignore[index]
    registry.register(Runner(name="mine", beam_runner=FN_API))
    assert view["mine"].beam_runner == FN_API
    assert registry.names()[:5] == ("direct", "portable", "flink", "dataflow", "dask")
    assert registry.names()[-1] == "mine"


def test_a_taken_name_is_refused_unless_clobbered_and_batchinfers_own_never_replaced():
    registry = fresh(backends._REGISTRY)
    onnx = registry.entries()["onnxruntime"]
    other = Backend(name="onnxruntime", suffixes=(".onnx",), implementation="mine:Handler")
    for clobber in (False, True):
        with pytest.raises(ValueError, match=r"backend 'onnxruntime' is already registered \(by "
                                             r"batchinfer\), whose entries cannot be replaced"):
            registry.register(other, clobber=clobber)
    assert registry.entries()["onnxruntime"] is onnx
    registry.register(onnx)  # the same entry again is no clash
    assert registry.provenance("onnxruntime").builtin
    # An entry that register() added is the program's own: replaced when told to.
    mine = Backend(name="mine", suffixes=(".m",), implementation="mine:Handler")
    registry.register(mine)
    with pytest.raises(ValueError, match=r"backend 'mine' is already registered \(by register\(\) "
                                         r"in test_registries\): pass clobber=True"):
        registry.register(Backend(name="mine", suffixes=(".n",)))
    registry.register(Backend(name="mine", suffixes=(".n",)), clobber=True)
    assert registry.entries()["mine"].suffixes == (".n",)
    where = registry.provenance("mine")
    assert not where.builtin and where.distribution is None   # a test module: no distribution


def test_an_entry_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="a runner entry must be a Runner, not Backend"):
        fresh(runners._REGISTRY).register(backends.get("torch"))  # type: ignore[arg-type]


def test_entries_are_frozen_keyword_only_records():
    with pytest.raises(TypeError):
        Runner("direct", FN_API)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        runners.get("dask").builds_job = True  # type: ignore[misc]


# -- the runner entries: what the tables they replace said --------------------------------------

def test_the_runner_entries_say_what_the_tables_said():
    assert {name: r.beam_runner for name, r in runners.entries().items()} == {
        "direct": FN_API, "portable": "PortableRunner", "flink": "FlinkRunner",
        "dataflow": "DataflowRunner", "dask": "batchinfer.pipeline.dask.DaskRunner"}
    assert {name: r.required for name, r in runners.entries().items() if r.required} == {
        "flink": ("flink_master",), "portable": ("job_endpoint",),
        "dataflow": ("project", "region", "temp_location")}
    assert {name: (r.needs, r.install) for name, r in runners.entries().items() if r.needs} == {
        "dataflow": ("apache_beam.runners.dataflow.internal.apiclient", "pip install 'batchinfer[dataflow]'"),
        "dask": ("dask.distributed", "pip install 'batchinfer[dask]'")}
    assert [name for name, r in runners.entries().items() if r.builds_job] == ["dataflow"]
    assert {name for name, r in runners.entries().items() if r.job_service} == {"portable", "flink"}
    assert runners.option_owners() == {
        "DirectOptions": ("direct", "portable"), "DaskOptions": ("dask",),
        "FlinkRunnerOptions": ("flink", "portable"), "SparkRunnerOptions": ("portable",),
        "PrismRunnerOptions": ("portable",), "KafkaStreamsRunnerOptions": ("portable",)}
    # A runner batchinfer changes from Beam's says how.
    assert all(r.fixes for r in runners.entries().values() if "." in r.beam_runner)


def test_defaults_are_added_unless_the_options_say_the_same_another_way():
    dask = runners.get("dask")
    assert dask.with_defaults({"a": 1}) == {"dask_partition_size": 1, "a": 1}
    assert dask.with_defaults({"dask_partition_size": 4}) == {"dask_partition_size": 4}
    assert dask.with_defaults({"dask_npartitions": 4}) == {"dask_npartitions": 4}
    assert runners.get("direct").with_defaults({"a": 1}) == {"a": 1}


def test_an_unknown_runner_is_a_spec_error_naming_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown runner.name 'spark' \(known: direct, portable, "
                                        r"flink, dataflow, dask\)"):
        runners.get("spark")


# -- entry points, for real ---------------------------------------------------------------------

PLUGIN = '''
    from batchinfer.backends import Backend
    from batchinfer.runners import Runner

    BACKEND = Backend(name="echo", suffixes=(".echo",), options={"scale": float},
                      implementation="echo_plugin:EchoHandler", install="pip install echo-plugin")
    # Beam's FnApiRunner under another name, which needs a job name.
    RUNNER = Runner(name="inline", beam_runner="apache_beam.runners.portability.fn_api_runner.FnApiRunner",
                    required=("job_name",))
    # ONNX Runtime's handler under another name (its module imported only when a job uses it).
    ONNX_ECHO = Backend(name="onnx-echo", suffixes=(".onnx",), options={"precision": ("fp32",)},
                        implementation="echo_handlers:EchoOnnx", declared={"precision": "fp32"},
                        implied={"precision": "fp32"})
'''
ECHO_HANDLERS = '''
from batchinfer.handlers.onnx import OnnxBackend


class EchoOnnx(OnnxBackend):
    name = "onnx-echo"
'''


def distribution(folder: Path, name: str, module: str, entry_points: str) -> Path:
    """An installed distribution as pip leaves one: ``<name>-1.0.dist-info`` (METADATA and
    entry_points.txt) and its module, in ``folder`` (a folder for ``sys.path``)."""
    info = folder / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (info / "RECORD").write_text("")
    (folder / f"{name.replace('-', '_')}.py").write_text(textwrap.dedent(module))
    return folder


def echo_plugin(folder: Path) -> Path:
    (folder / "echo_handlers.py").parent.mkdir(parents=True, exist_ok=True)
    (folder / "echo_handlers.py").write_text(ECHO_HANDLERS)
    return distribution(folder, "echo-plugin", PLUGIN, """\
        [batchinfer.backends]
        echo = echo_plugin:BACKEND
        onnx-echo = echo_plugin:ONNX_ECHO

        [batchinfer.runners]
        inline = echo_plugin:RUNNER
        """)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The registries as a new process has them (nothing read from entry points yet), with
    ``tmp_path/site`` on sys.path for distributions."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(backends, "_REGISTRY", fresh(backends._REGISTRY))
    monkeypatch.setattr(runners, "_REGISTRY", fresh(runners._REGISTRY))
    yield site
    for module in ("echo_plugin", "clash_plugin", "broken_plugin", "evil_plugin", "ghost_plugin"):
        sys.modules.pop(module, None)


def job_data(**sections) -> dict:
    return {"name": "j", "input": {"path": "data/*.parquet"}, "schema": "feats@1",
            "model": {"uri": "m.onnx"}, "output": {"path": "out"}, **sections}


def test_a_distributions_backend_and_runner_are_found_and_the_spec_takes_them(installed):
    from batchinfer.spec import parse_spec

    echo_plugin(installed)
    assert "echo" in backends.names() and backends.get("echo").implementation == "echo_plugin:EchoHandler"
    assert runners.names()[-1] == "inline" and runners.get("inline").beam_runner == FN_API
    spec = parse_spec(job_data(model={"uri": "m.echo", "backend": "echo", "options": {"scale": 2.0}},
                               runner={"name": "inline", "options": {"job_name": "nightly"}}))
    assert (spec.model.backend, spec.runner.name) == ("echo", "inline")
    with pytest.raises(SpecError, match=r"model.options.scale: expected float, got 'x'"):
        parse_spec(job_data(model={"uri": "m.echo", "backend": "echo", "options": {"scale": "x"}}))
    with pytest.raises(SpecError, match=r"runner inline needs runner.options.job_name"):
        parse_spec(job_data(runner={"name": "inline"}))
    with pytest.raises(SpecError, match=r"Input should be 'direct', 'portable', 'flink', "
                                        r"'dataflow', 'dask' or 'inline' \(got 'spark'\)"):
        parse_spec(job_data(runner={"name": "spark"}))


def test_a_distributions_runner_takes_the_option_checks_of_every_runner(installed):
    from batchinfer.pipeline.runner_options import beam_args, check

    echo_plugin(installed)
    check("inline", {"job_name": "nightly"})
    assert beam_args("inline", {"job_name": "nightly"}) == [f"--runner={FN_API}", "--job_name=nightly"]
    with pytest.raises(SpecError, match="runner.options.direct_num_workers is an option of runner "
                                        "direct or portable .*, which runner inline ignores"):
        check("inline", {"job_name": "nightly", "direct_num_workers": 2})


def test_a_distribution_that_takes_a_name_is_refused(installed):
    from batchinfer.spec import parse_spec

    distribution(installed, "clash-plugin", '''
        from batchinfer.runners import Runner

        RUNNER = Runner(name="dask", beam_runner="DaskRunner")
    ''', """\
        [batchinfer.runners]
        dask = clash_plugin:RUNNER
        """)
    for _ in (1, 2):  # refused at every lookup, not once and then forgotten
        with pytest.raises(RuntimeFailure) as caught:
            parse_spec(job_data())
        assert caught.value.message == (
            "entry point dask = clash_plugin:RUNNER (group batchinfer.runners, distribution "
            "clash-plugin): runner 'dask' is already registered (by batchinfer): uninstall one "
            "of the two distributions"), caught.value.message
    # Nor by registering it in the program: batchinfer's runner stays.
    with pytest.raises(RuntimeFailure):
        runners.register(Runner(name="mine", beam_runner=FN_API))


def test_a_distribution_registered_once_refuses_a_second_registration(installed):
    echo_plugin(installed)
    with pytest.raises(ValueError, match=r"backend 'echo' is already registered \(by entry point "
                                         r"echo = echo_plugin:BACKEND"):
        backends.register(Backend(name="echo", suffixes=(".e",)))


def test_code_a_plugin_runs_cannot_replace_a_builtin_or_another_distributions_entry(installed):
    """A distribution whose module, on import, registers its own ``onnxruntime`` with
    clobber=True: refused at discovery (exit 5, naming it), batchinfer's entry stays; nor can it
    replace another distribution's entry."""
    echo_plugin(installed)
    distribution(installed, "evil-plugin", '''
        from batchinfer import backends
        from batchinfer.backends import Backend

        backends.register(Backend(name="onnxruntime", suffixes=(".onnx",), implementation="evil:Handler"),
                          clobber=True)
        BACKEND = Backend(name="evil", suffixes=(".evil",), implementation="evil:Handler")
    ''', """\
        [batchinfer.backends]
        evil = evil_plugin:BACKEND
        """)
    builtin = next(b for b in backends.BUILTIN if b.name == "onnxruntime")
    for _ in (1, 2):
        with pytest.raises(RuntimeFailure) as caught:
            backends.names()
        assert caught.value.message.startswith(
            "entry point evil = evil_plugin:BACKEND (group batchinfer.backends, distribution "
            "evil-plugin) cannot be loaded: ValueError: backend 'onnxruntime' is already "
            "registered (by batchinfer), whose entries cannot be replaced"), caught.value.message
        assert backends._REGISTRY._entries["onnxruntime"] is builtin
    sys.modules.pop("evil_plugin", None)
    (installed / "evil_plugin-1.0.dist-info" / "entry_points.txt").unlink()
    assert backends.get("echo").implementation == "echo_plugin:EchoHandler"
    with pytest.raises(ValueError, match=r"backend 'echo' is already registered \(by entry point "
                                         r"echo = .*distribution echo-plugin\)\), whose entries "
                                         r"cannot be replaced"):
        backends.register(Backend(name="echo", suffixes=(".e",)), clobber=True)
    where = backends.provenance("echo")
    assert (where.distribution, where.version, where.builtin) == ("echo-plugin", "1.0", False)


@pytest.mark.parametrize("module, message", [
    ("raise ImportError('no echo here')", "cannot be loaded: ImportError: no echo here"),
    ("from batchinfer.runners import Runner\nRUNNER = Runner(name='other', beam_runner='X')",
     "is not a Runner named 'broken': fix the distribution's entry point"),
])
def test_a_broken_entry_point_says_which_distribution(installed, module, message):
    distribution(installed, "broken-plugin", module, """\
        [batchinfer.runners]
        broken = broken_plugin:RUNNER
        """)
    with pytest.raises(RuntimeFailure) as caught:
        runners.names()
    assert caught.value.message.startswith(
        "entry point broken = broken_plugin:RUNNER (group batchinfer.runners, distribution "
        "broken-plugin)") and caught.value.message.endswith(message), caught.value.message


def plugin_path(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.slow
def test_a_job_runs_on_a_distributions_runner_and_backend_and_its_manifest_names_them(tmp_path):
    """A plain interpreter, as a user starts one: the distribution is found on its own sys.path
    (PYTHONPATH), its runner and backend validated, checked, run, and named in the manifest
    with the distribution that holds them."""
    site = echo_plugin(tmp_path / "site")
    numeric_project(tmp_path, shards=2, rows=50)
    result = run_cli("run", "job.yaml", "--ds", DS, "--set", "runner.name=inline",
                     "--set", "runner.options.job_name=nightly", "--set", "model.backend=onnx-echo",
                     cwd=tmp_path, env=plugin_path(site), fresh=True)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / f"dt={DS}" / "_manifest.json").read_text())
    assert (manifest["runner"], manifest["backend"], manifest["totals"]["rows_scored"]) == (
        "inline", "onnx-echo", 100)
    assert manifest["plugins"] == [
        {"kind": "backend", "name": "onnx-echo", "distribution": "echo-plugin", "version": "1.0"},
        {"kind": "runner", "name": "inline", "distribution": "echo-plugin", "version": "1.0"}]


@pytest.mark.slow
def test_a_plugin_that_replaces_a_builtin_or_a_runner_that_is_not_there_is_one_line(tmp_path):
    """Two distributions as a user installs them, each met by an ordinary job in a plain
    interpreter: one whose module takes over ``onnxruntime`` as it is imported (exit 5 naming
    it; nothing scored under batchinfer's name), one whose runner's Beam runner is not
    installed (exit 5 naming the runner, its distribution and what to install)."""
    numeric_project(tmp_path, shards=1, rows=20)
    evil = distribution(tmp_path / "evil", "evil-plugin", '''
        from batchinfer import backends
        from batchinfer.backends import Backend

        backends.register(Backend(name="onnxruntime", suffixes=(".onnx",), implementation="evil:Handler"),
                          clobber=True)
        BACKEND = Backend(name="evil", suffixes=(".evil",), implementation="evil:Handler")
    ''', """\
        [batchinfer.backends]
        evil = evil_plugin:BACKEND
        """)
    taken = run_cli("run", "job.yaml", "--ds", DS, cwd=tmp_path, env=plugin_path(evil), fresh=True)
    assert taken.returncode == 5, taken.stderr
    line = one_line_error(taken)
    assert "distribution evil-plugin" in line and "'onnxruntime'" in line, line
    assert "cannot be replaced" in line, line
    assert not (tmp_path / "out").exists()

    ghost = distribution(tmp_path / "ghost", "ghost-plugin", '''
        from batchinfer.runners import Runner

        RUNNER = Runner(name="ghost", beam_runner="ghost_beam.runner.GhostRunner",
                        install="pip install ghost-beam")
    ''', """\
        [batchinfer.runners]
        ghost = ghost_plugin:RUNNER
        """)
    missing = run_cli("run", "job.yaml", "--ds", DS, "--set", "runner.name=ghost", cwd=tmp_path,
                      env=plugin_path(ghost), fresh=True)
    assert missing.returncode == 5, missing.stderr
    line = one_line_error(missing)
    assert line.startswith("batchinfer run: runner ghost (distribution ghost-plugin 1.0) names the "
                           "Beam runner ghost_beam.runner.GhostRunner, which cannot be loaded "
                           "(no module ghost_beam)"), line
    assert line.endswith("pip install ghost-beam"), line
    assert "unexpected" not in line and not (tmp_path / "out").exists()
