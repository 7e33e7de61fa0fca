"""Tests for batchinfer.spec: loading, validation, --set, templating, hashing, paths (contract §3)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batchinfer.errors import SpecError
from batchinfer.spec import Job, apply_override, load_job
from factories import DS, numeric_project, one_line_error, run_cli, write_job

SECRET = "s3cr3t-t0ken-value"


def _job_file(folder: Path, **sections) -> Path:
    return write_job(folder, **sections)


def _raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _rewrite(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _one_line_spec_error(excinfo) -> str:
    err = excinfo.value
    assert isinstance(err, SpecError)
    assert err.exit_code == 2
    message = str(err)
    assert "\n" not in message
    return message


# -- loading -----------------------------------------------------------------------------------

def test_load_minimal_job_fills_defaults(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS)
    spec = job.spec
    assert isinstance(job, Job)
    assert job.ds == DS
    assert job.path == (tmp_path / "job.yaml").resolve()
    assert job.folder == tmp_path.resolve()
    assert spec.name == "testjob"
    assert spec.schema_ == "feats@1"
    assert spec.batch.rows == 65536
    assert spec.quarantine.max_bad_fraction == 0.01
    assert spec.quarantine.max_bad_shards == 0
    assert spec.runner.name == "direct"
    assert spec.model.backend == "onnxruntime"
    assert spec.output.id_columns == ["id"]
    assert spec.preprocess is None


def test_model_urls_are_kept_and_plain_paths_resolved_against_the_job_folder(tmp_path):
    """model.uri, a challenger's uri and monitor.baseline: a URL with a scheme is left as it
    is (the model cache fetches it); a plain relative path is the job folder's."""
    path = _job_file(tmp_path, extra={"model": {
        "uri": "s3://models/credit/model.onnx", "backend": "onnxruntime",
        "challengers": [{"name": "local", "uri": "models/v2.onnx", "backend": "onnxruntime"},
                        {"name": "file", "uri": "file:///srv/m.onnx", "backend": "onnxruntime"}]}},
        monitor={"baseline": "gs://profiles/base.json"})
    spec = load_job(path, ds=DS).spec
    assert spec.model.uri == "s3://models/credit/model.onnx"
    assert [c.uri for c in spec.model.challengers] == [str(tmp_path.resolve() / "models" / "v2.onnx"),
                                                       "file:///srv/m.onnx"]
    assert spec.monitor is not None and spec.monitor.baseline == "gs://profiles/base.json"


def test_default_tracking_experiment_is_job_name(tmp_path):
    path = _job_file(tmp_path, name="nightly_scores")
    data = _raw(path)
    del data["tracking"]
    _rewrite(path, data)
    job = load_job(path, ds=DS)
    assert job.spec.tracking.experiment == "nightly_scores"
    # and an explicit experiment is kept
    data["tracking"] = {"experiment": "other"}
    job = load_job(_rewrite(path, data), ds=DS)
    assert job.spec.tracking.experiment == "other"


def test_missing_job_file_is_spec_error(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(tmp_path / "nope.yaml", ds=DS)
    assert "nope.yaml" in _one_line_spec_error(excinfo)


def test_invalid_yaml_is_spec_error(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert "YAML" in _one_line_spec_error(excinfo)


def test_non_mapping_yaml_is_spec_error(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert "mapping" in _one_line_spec_error(excinfo)


# -- validation errors --------------------------------------------------------------------------

def test_unknown_top_level_key_is_named(tmp_path):
    path = _job_file(tmp_path, extra={"colour": "blue"})
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert "unknown key 'colour'" in _one_line_spec_error(excinfo)


def test_unknown_nested_key_is_named_by_dotted_path(tmp_path):
    path = _job_file(tmp_path, batch={"rows": 10, "row": 5})
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert "unknown key 'batch.row'" in _one_line_spec_error(excinfo)


@pytest.mark.parametrize("sections, overrides, expected", [
    ({"quarantine": {"max_bad_fractoin": 0.05}}, [],
     "unknown key 'quarantine.max_bad_fractoin' (did you mean 'max_bad_fraction'?)"),
    ({"monitor": {"warn": {"pis": 0.1}}}, [], "unknown key 'monitor.warn.pis' (did you mean 'psi'?)"),
    ({"extra": {"model": {"uri": "m.onnx", "challengers": [{"uri": "c.onnx", "nmae": "c"}]}}}, [],
     "unknown key 'model.challengers.0.nmae' (did you mean 'name'?)"),
    ({}, ["quarantine.max_bad_fractoin=0.05"], "(did you mean 'max_bad_fraction'?)"),
    ({}, ["quarntine.max_bad_fraction=0.05"], "unknown key 'quarntine' (did you mean 'quarantine'?)"),
    ({}, ["runner.optoins.direct_num_workers=2"], "unknown key 'runner.optoins' (did you mean 'options'?)"),
])
def test_an_unknown_key_suggests_the_known_key_closest_to_it(tmp_path, sections, overrides, expected):
    """From the keys of the mapping it is in (its model's fields), in the file or a --set path."""
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path, **sections), ds=DS, overrides=overrides)
    assert expected in _one_line_spec_error(excinfo)


def test_a_misspelt_top_level_key_is_suggested_beside_the_missing_one(tmp_path):
    data = _raw(_job_file(tmp_path))
    data["modle"] = data.pop("model")
    with pytest.raises(SpecError) as excinfo:
        load_job(_rewrite(tmp_path / "job.yaml", data), ds=DS)
    message = _one_line_spec_error(excinfo)
    assert "missing required key 'model'" in message
    assert "unknown key 'modle' (did you mean 'model'?)" in message


def test_an_unknown_key_like_no_known_one_lists_the_known_keys(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path, batch={"rows": 10, "colour": "blue"}), ds=DS)
    assert ("unknown key 'batch.colour' (known keys of batch: rows, tokens, lengths_from, sequence_inputs)"
            in _one_line_spec_error(excinfo))


@pytest.mark.parametrize("key", ["name", "input", "schema", "model", "output"])
def test_missing_required_key_is_named(tmp_path, key):
    path = _job_file(tmp_path)
    data = _raw(path)
    del data[key]
    _rewrite(path, data)
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert f"missing required key '{key}'" in _one_line_spec_error(excinfo)


def test_missing_nested_required_key_is_named(tmp_path):
    path = _job_file(tmp_path, extra={"model": {"backend": "onnxruntime"}})
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    assert "missing required key 'model.uri'" in _one_line_spec_error(excinfo)


@pytest.mark.parametrize("section, value, key", [
    ("batch", {"rows": 0}, "batch.rows"),
    ("batch", {"rows": "many"}, "batch.rows"),
    ("quarantine", {"max_bad_fraction": 1.5}, "quarantine.max_bad_fraction"),
    ("quarantine", {"max_bad_shards": -1}, "quarantine.max_bad_shards"),
    ("runner", {"name": "spark"}, "runner.name"),
    ("schema", "feats-1", "schema"),
    ("preprocess", "no_function_here", "preprocess"),
])
def test_bad_value_names_the_key(tmp_path, section, value, key):
    path = _job_file(tmp_path, extra={section: value})
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    message = _one_line_spec_error(excinfo)
    assert message.startswith("job.yaml: ")
    assert f"{key}:" in message


def test_bad_backend_names_the_key(tmp_path):
    path = _job_file(tmp_path, extra={"model": {"uri": "m.onnx", "backend": "sklearn"}})
    with pytest.raises(SpecError) as excinfo:
        load_job(path, ds=DS)
    message = _one_line_spec_error(excinfo)
    assert "model.backend" in message
    assert "sklearn" in message


# -- --set overrides -----------------------------------------------------------------------------

def test_set_nested_value_parsed_as_yaml_int(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS, overrides=["batch.rows=8192"])
    assert job.spec.batch.rows == 8192
    assert isinstance(job.spec.batch.rows, int)


def test_set_list_value_parsed_as_yaml(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS, overrides=["output.id_columns=[id, other]"])
    assert job.spec.output.id_columns == ["id", "other"]


def test_set_float_and_string_values(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS,
                   overrides=["quarantine.max_bad_fraction=0.25", "name=renamed_job",
                              "model.version=m:3"])
    assert job.spec.quarantine.max_bad_fraction == 0.25
    assert job.spec.name == "renamed_job"
    assert job.spec.model.version == "m:3"


def test_set_later_override_wins(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS, overrides=["batch.rows=10", "batch.rows=20"])
    assert job.spec.batch.rows == 20


def test_set_creates_missing_optional_section(tmp_path):
    path = _job_file(tmp_path)
    assert "runner" not in _raw(path)
    job = load_job(path, ds=DS, overrides=["runner.options.direct_num_workers=4"])
    assert job.spec.runner.options == {"direct_num_workers": 4}


def test_set_cannot_add_unknown_key(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=["batch.size=10"])
    assert "unknown key 'batch.size'" in _one_line_spec_error(excinfo)


def test_set_cannot_add_unknown_top_level_key(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=["extra=1"])
    assert "unknown key 'extra'" in _one_line_spec_error(excinfo)


def test_set_value_is_validated(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=["batch.rows=-5"])
    assert "batch.rows" in _one_line_spec_error(excinfo)


@pytest.mark.parametrize("item", ["batch.rows", "=5", "batch..rows=5", ".rows=5", "batch.=5"])
def test_set_bad_syntax(tmp_path, item):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=[item])
    assert "--set" in _one_line_spec_error(excinfo)


def test_set_invalid_yaml_value(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=["output.id_columns=[a, b"])
    message = _one_line_spec_error(excinfo)
    assert "output.id_columns" in message
    assert "YAML" in message


def test_set_through_scalar_is_error(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=DS, overrides=["name.first=x"])
    assert "name is not a mapping" in _one_line_spec_error(excinfo)


def test_apply_override_in_place():
    data = {"a": {"b": 1}}
    apply_override(data, "a.c.d=[1, 2]")
    apply_override(data, "a.b=true")
    apply_override(data, "e=")
    assert data == {"a": {"b": True, "c": {"d": [1, 2]}}, "e": ""}


# -- {ds} templating ------------------------------------------------------------------------------

def test_ds_is_substituted_everywhere(tmp_path):
    job = load_job(_job_file(tmp_path, extra={"runner": {"name": "direct",
                                                         "options": {"tag": "run-{ds}"}}}),
                   ds=DS)
    assert job.spec.input.path.endswith(f"data/dt={DS}/*.parquet")
    assert job.spec.output.path.endswith(f"out/dt={DS}")
    assert job.spec.runner.options == {"tag": f"run-{DS}"}
    assert "{ds}" not in job.spec.model_dump_json()


def test_ds_missing_is_error_naming_key(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path))
    message = _one_line_spec_error(excinfo)
    assert "{ds}" in message
    assert "--ds" in message
    assert "input.path" in message


def test_ds_not_required_when_unused(tmp_path):
    path = _job_file(tmp_path, input={"path": "data/*.parquet"}, output={"path": "out"})
    job = load_job(path)
    assert job.ds is None
    assert job.spec.input.path == str((tmp_path / "data/*.parquet").resolve())


def test_ds_left_as_is_when_not_required(tmp_path):
    job = load_job(_job_file(tmp_path), require_ds=False)
    assert job.ds is None
    assert job.spec.input.path.endswith("data/dt={ds}/*.parquet")
    assert job.spec.output.path.endswith("out/dt={ds}")


def test_ds_substituted_even_when_not_required(tmp_path):
    job = load_job(_job_file(tmp_path), ds=DS, require_ds=False)
    assert job.spec.output.path.endswith(f"out/dt={DS}")


@pytest.mark.parametrize("bad", ["2026-1-15", "20260115", "2026/01/15", "yesterday", "2026-01-15 "])
def test_bad_ds_format(tmp_path, bad):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=bad)
    message = _one_line_spec_error(excinfo)
    assert "YYYY-MM-DD" in message


@pytest.mark.parametrize("challenger", [{"uri": "models/c.onnx", "name": "c\n"},
                                        {"uri": "models:/credit/4\n"}])
def test_a_challenger_name_with_a_final_newline_is_refused(tmp_path, challenger):
    """``re.match`` with ``$`` took ``c\\n`` for a safe folder name (and the challenger
    committed under challengers/c\\n/); so did the name taken from ``models:/credit/4\\n``."""
    model = {"uri": "models/model.onnx", "challengers": [challenger]}
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path, extra={"model": model}), ds=DS)
    assert "is not a safe folder name" in _one_line_spec_error(excinfo)


@pytest.mark.parametrize("key, value", [("name", "testjob\n"), ("schema", "feats@1\n"),
                                        ("preprocess", "prep:transform\n")])
def test_pydantic_patterns_refuse_a_final_newline(tmp_path, key, value):
    """pydantic-core matches ``pattern=`` with Rust's regex, whose ``$`` is the end of the
    text only: pinned here, as Python's ``re`` would let these through."""
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path, extra={key: value}), ds=DS)
    assert f"{key}: String should match pattern" in _one_line_spec_error(excinfo)


@pytest.mark.parametrize("ds, expected", [
    ("2026-02-30", "--ds '2026-02-30' is not a date: 2026-02-30 is not a day of February 2026 (it has 28 days)"),
    ("2025-02-29", "is not a day of February 2025 (it has 28 days)"),
    ("2026-04-31", "is not a day of April 2026 (it has 30 days)"),
    ("2026-01-00", "is not a day of January 2026"),
    ("2026-13-01", "--ds '2026-13-01' is not a date: there is no month 13 (01-12)"),
])
def test_a_well_formed_date_that_is_not_on_the_calendar_says_so(tmp_path, ds, expected):
    """Not "use YYYY-MM-DD": the user did."""
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path), ds=ds)
    message = _one_line_spec_error(excinfo)
    assert expected in message and "use YYYY-MM-DD" not in message


def test_a_leap_day_is_a_date(tmp_path):
    assert load_job(_job_file(tmp_path), ds="2024-02-29").ds == "2024-02-29"


@pytest.mark.parametrize("args, expected", [
    (["--ds", "2026-02-30"], "batchinfer plan: --ds '2026-02-30' is not a date: 2026-02-30 is not a "
                             "day of February 2026 (it has 28 days)"),
    (["--ds", DS, "--set", "quarantine.max_bad_fractoin=0.05"],
     "unknown key 'quarantine.max_bad_fractoin' (did you mean 'max_bad_fraction'?)"),
])
def test_the_cli_says_what_was_meant(tmp_path, args, expected):
    numeric_project(tmp_path, shards=1, rows=10, stamp=False)
    result = run_cli("plan", "job.yaml", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in one_line_error(result, "plan")


# -- ${NAME} interpolation -----------------------------------------------------------------------

def _env_job(tmp_path):
    return _job_file(tmp_path,
                     output={"path": "s3://bucket/${BUCKET_PREFIX}/dt={ds}", "id_columns": ["id"]},
                     tracking={"uri": "https://user:${TOKEN}@mlflow.example.com"})


def test_env_interpolation_from_given_environ(tmp_path):
    job = load_job(_env_job(tmp_path), ds=DS,
                   environ={"TOKEN": SECRET, "BUCKET_PREFIX": "team-a"})
    assert job.spec.tracking.uri == f"https://user:{SECRET}@mlflow.example.com"
    assert job.spec.output.path == f"s3://bucket/team-a/dt={DS}"
    # only a secret is masked (TOKEN is named like one); the bucket prefix is a plain value
    assert job.secrets == {"TOKEN": SECRET}
    assert job.templated == {"TOKEN": SECRET, "BUCKET_PREFIX": "team-a"}


def test_env_interpolation_ignores_process_environment_when_environ_given(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKEN", "from-process-env")
    monkeypatch.setenv("BUCKET_PREFIX", "from-process-env")
    with pytest.raises(SpecError):
        load_job(_env_job(tmp_path), ds=DS, environ={"BUCKET_PREFIX": "x"})


def test_env_interpolation_defaults_to_os_environ(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKEN", SECRET)
    monkeypatch.setenv("BUCKET_PREFIX", "team-b")
    job = load_job(_env_job(tmp_path), ds=DS)
    assert SECRET in job.spec.tracking.uri


def test_env_missing_variable_is_error_naming_key_and_variable(tmp_path):
    with pytest.raises(SpecError) as excinfo:
        load_job(_env_job(tmp_path), ds=DS, environ={"BUCKET_PREFIX": "team-a"})
    message = _one_line_spec_error(excinfo)
    assert "${TOKEN}" in message
    assert "tracking.uri" in message


def test_display_puts_secret_name_back_and_keeps_plain_values(tmp_path):
    job = load_job(_env_job(tmp_path), ds=DS,
                   environ={"TOKEN": SECRET, "BUCKET_PREFIX": "team-a"})
    shown = job.display(f"tracking at {job.spec.tracking.uri}; spec {job.spec.model_dump_json()}")
    assert SECRET not in shown
    assert "https://user:${TOKEN}@mlflow.example.com" in shown
    assert f"s3://bucket/team-a/dt={DS}" in shown   # a path says where the data is
    # text without secrets is unchanged
    assert job.display("nothing secret here") == "nothing secret here"


def test_display_replaces_longest_secret_first(tmp_path):
    path = _job_file(tmp_path, tracking={"uri": "https://h/${LONG_KEY}/${SHORT_KEY}"})
    job = load_job(path, ds=DS, environ={"SHORT_KEY": "abcd", "LONG_KEY": "abcdefgh"})
    assert job.display("https://h/abcdefgh/abcd") == "https://h/${LONG_KEY}/${SHORT_KEY}"


@pytest.mark.parametrize("name, secret", [
    ("DB_PASSWORD", True), ("MLFLOW_TRACKING_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("api_key", True), ("GCP_CREDENTIALS", True), ("BASIC_AUTH", True), ("SMTP_PASSWD", True),
    ("FEATURES", False), ("PWD", False), ("SCORES_URL", False), ("BI_MLFLOW_PORT", False),
])
def test_secret_names(name, secret):
    from batchinfer.redaction import is_secret_name

    assert is_secret_name(name) is secret


def test_listed_secrets_are_masked_whatever_their_name(tmp_path):
    path = _job_file(tmp_path, output={"path": "s3://bucket/${TEAM_BUCKET}/dt={ds}", "id_columns": ["id"]},
                     secrets=["TEAM_BUCKET"])
    job = load_job(path, ds=DS, environ={"TEAM_BUCKET": "private-team-x"})
    assert job.spec.secrets == ["TEAM_BUCKET"]
    assert job.secrets == {"TEAM_BUCKET": "private-team-x"}
    assert job.display(job.spec.output.path) == f"s3://bucket/${{TEAM_BUCKET}}/dt={DS}"


def _team_job(folder: Path) -> Path:
    return _job_file(folder, output={"path": "s3://bucket/${TEAM_BUCKET}/dt={ds}", "id_columns": ["id"]},
                     secrets=["TEAM_BUCKET"])


def test_a_second_job_does_not_hide_the_first_jobs_secrets(tmp_path):
    """A job's values are hidden while its redaction scope is open — in errors made then too —
    and forgotten when it closes: the next job in the process shows them as they are."""
    import uuid

    from batchinfer import redaction
    from batchinfer.redaction import redact

    path = _team_job(tmp_path)
    first, second = f"first-{uuid.uuid4().hex}", f"second-{uuid.uuid4().hex}"
    with redaction.scope():
        load_job(path, ds=DS, environ={"TEAM_BUCKET": first})
        assert redact(f"cannot open s3://bucket/{first}") == "cannot open s3://bucket/${TEAM_BUCKET}"
        assert SpecError(f"no shard in {first}").message == "no shard in ${TEAM_BUCKET}"
    with redaction.scope():
        load_job(path, ds=DS, environ={"TEAM_BUCKET": second})
        assert redact(f"{first} {second}") == f"{first} ${{TEAM_BUCKET}}"
    assert redact(f"{first} {second}") == f"{first} {second}"


def test_a_job_keeps_its_secrets_hidden_while_other_jobs_come_and_go(tmp_path):
    """Two jobs at once in one process (threads): each scope hides its own values, from any
    thread (a runner's worker thread makes errors too), and closing one forgets only its own —
    also when both hold the same value, or different values under one name."""
    import threading
    import uuid

    from batchinfer import redaction
    from batchinfer.redaction import redact

    path = _team_job(tmp_path)
    mine, shared, theirs = (f"{what}-{uuid.uuid4().hex}" for what in ("mine", "shared", "theirs"))
    opened, release = threading.Event(), threading.Event()

    def other_job(value: str) -> None:
        with redaction.scope():
            load_job(path, ds=DS, environ={"TEAM_BUCKET": value})
            opened.set()
            release.wait(30)

    with redaction.scope():
        load_job(path, ds=DS, environ={"TEAM_BUCKET": mine})
        load_job(path, ds=DS, environ={"TEAM_BUCKET": shared})
        other = threading.Thread(target=other_job, args=(theirs,))
        other.start()
        assert opened.wait(30)
        assert redact(f"{mine} {theirs}") == "${TEAM_BUCKET} ${TEAM_BUCKET}"
        release.set()
        other.join()
        assert redact(f"{mine} {theirs}") == f"${{TEAM_BUCKET}} {theirs}"
        opened.clear()
        release.clear()
        other = threading.Thread(target=other_job, args=(shared,))
        other.start()
        assert opened.wait(30)
        release.set()
        other.join()
        made: list[str] = []
        worker = threading.Thread(target=lambda: made.append(SpecError(f"bad {shared}").message))
        worker.start()
        worker.join()
        assert made == ["bad ${TEAM_BUCKET}"] and redact(mine) == "${TEAM_BUCKET}"
    assert redact(f"{mine} {shared}") == f"{mine} {shared}"


def test_values_registered_outside_any_scope_stay_for_the_process(tmp_path):
    """The CLI runs one job per process and opens no scope: its values are hidden up to the
    last line it prints, as before scopes existed."""
    import uuid

    from batchinfer import redaction
    from batchinfer.redaction import redact

    value = f"process-{uuid.uuid4().hex}"
    load_job(_team_job(tmp_path), ds=DS, environ={"TEAM_BUCKET": value})
    with redaction.scope():
        pass
    assert redact(value) == "${TEAM_BUCKET}"


@pytest.mark.parametrize("listed", [["not-a-name"], ["${X}"], "X"])
def test_bad_secrets_list_exit_2(tmp_path, listed):
    with pytest.raises(SpecError) as excinfo:
        load_job(_job_file(tmp_path, secrets=listed), ds=DS)
    assert "secrets" in _one_line_spec_error(excinfo)


def test_url_credentials_are_hidden_whatever_variable_they_came_from(tmp_path):
    from batchinfer.redaction import redact

    path = _job_file(tmp_path, tracking={"uri": "https://ci:${MLFLOW_PW}@mlflow.example.com"},
                     input={"path": "https://files.example.com/dt={ds}/x.parquet?sig=${SAS}&sp=r"})
    job = load_job(path, ds=DS, environ={"MLFLOW_PW": "hunter2-pw", "SAS": "c2lnbmF0dXJl"})
    assert job.secrets == {}   # neither name says secret ...
    shown = job.display(f"{job.spec.tracking.uri} {job.spec.input.path}")
    assert shown == ("https://ci:***@mlflow.example.com "   # ... but a URL's credentials do
                     f"https://files.example.com/dt={DS}/x.parquet?sig=***&sp=r")
    assert redact(f"OSError: cannot open '{job.spec.input.path}'") == (
        f"OSError: cannot open 'https://files.example.com/dt={DS}/x.parquet?sig=***&sp=r'")


@pytest.mark.parametrize("text, shown", [
    ("s3://ak:pw@minio:9000/b/x.parquet?versionId=3&X-Amz-Signature=ab12&X-Amz-Credential=AK%2F1",
     "s3://ak:***@minio:9000/b/x.parquet?versionId=3&X-Amz-Signature=***&X-Amz-Credential=***"),
    ("git+https://ghp_t0ken@github.com/o/r", "git+https://***@github.com/o/r"),
    ("postgresql://u:p@ss@db:5432/x", "postgresql://u:***@db:5432/x"),
    ("http://batchinfer:${BI_TOKEN}@127.0.0.1:5000", "http://batchinfer:${BI_TOKEN}@127.0.0.1:5000"),
    ("s3://bucket/dt=2026-01-15/part@2x.parquet", "s3://bucket/dt=2026-01-15/part@2x.parquet"),
    ("sqlite:////tmp/mlflow.db and models:/credit/4", "sqlite:////tmp/mlflow.db and models:/credit/4"),
    ("gs://b/x?X-Goog-Signature=abc#frag", "gs://b/x?X-Goog-Signature=***#frag"),
])
def test_mask_urls(text, shown):
    from batchinfer.redaction import mask_urls

    assert mask_urls(text) == shown


# -- job_spec_sha256 -----------------------------------------------------------------------------

def test_spec_sha_same_for_two_ds_values(tmp_path):
    path = _job_file(tmp_path)
    a = load_job(path, ds="2026-01-15")
    b = load_job(path, ds="2026-01-16")
    assert a.spec.output.path != b.spec.output.path
    assert a.spec_sha256 == b.spec_sha256
    assert len(a.spec_sha256) == 64


def test_spec_sha_same_for_two_env_values(tmp_path):
    path = _env_job(tmp_path)
    a = load_job(path, ds=DS, environ={"TOKEN": "first-secret", "BUCKET_PREFIX": "p"})
    b = load_job(path, ds=DS, environ={"TOKEN": "second-secret", "BUCKET_PREFIX": "p"})
    assert a.spec.tracking.uri != b.spec.tracking.uri
    assert a.spec_sha256 == b.spec_sha256


def test_spec_sha_changes_with_set(tmp_path):
    path = _job_file(tmp_path)
    plain = load_job(path, ds=DS)
    overridden = load_job(path, ds=DS, overrides=["batch.rows=8192"])
    other = load_job(path, ds=DS, overrides=["batch.rows=4096"])
    assert len({plain.spec_sha256, overridden.spec_sha256, other.spec_sha256}) == 3


def test_spec_sha_equals_file_with_same_content(tmp_path):
    # --set batch.rows=8192 gives the same hash as a file that says batch.rows: 8192
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    via_set = load_job(_job_file(a_dir), ds=DS, overrides=["batch.rows=8192"])
    via_file = load_job(_job_file(b_dir, batch={"rows": 8192}), ds=DS)
    assert via_set.spec_sha256 == via_file.spec_sha256


def test_spec_sha_ignores_key_order_and_formatting(tmp_path):
    path = _job_file(tmp_path)
    first = load_job(path, ds=DS).spec_sha256
    data = _raw(path)
    reordered = dict(reversed(list(data.items())))
    path.write_text("# a comment\n" + yaml.safe_dump(reordered, sort_keys=False, indent=4))
    assert load_job(path, ds=DS).spec_sha256 == first


def test_spec_sha_never_covers_secret(tmp_path):
    import hashlib
    import json

    path = _env_job(tmp_path)
    job = load_job(path, ds=DS, environ={"TOKEN": SECRET, "BUCKET_PREFIX": "p"})
    expected = hashlib.sha256(json.dumps(_raw(path), sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False).encode()).hexdigest()
    assert job.spec_sha256 == expected


# -- path resolution ---------------------------------------------------------------------------

def test_relative_paths_resolve_against_job_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = load_job(_job_file(folder), ds=DS)
    base = folder.resolve()
    assert job.spec.input.path == str(base / f"data/dt={DS}/*.parquet")
    assert job.spec.output.path == str(base / f"out/dt={DS}")
    assert job.spec.schemas.root == str(base / "schemas")
    assert job.spec.model.uri == str(base / "models/model.onnx")


def test_relative_job_path_is_resolved(tmp_path, monkeypatch):
    _job_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    job = load_job("job.yaml", ds=DS)
    assert job.path == (tmp_path / "job.yaml").resolve()
    assert job.spec.schemas.root == str(tmp_path.resolve() / "schemas")


def test_parent_relative_paths_are_normalised(tmp_path):
    folder = tmp_path / "jobs"
    folder.mkdir()
    job = load_job(_job_file(folder, schemas={"root": "../shared/schemas"}), ds=DS)
    assert job.spec.schemas.root == str(tmp_path.resolve() / "shared" / "schemas")


def test_urls_and_absolute_paths_untouched(tmp_path):
    absolute = str(tmp_path / "abs" / "model.onnx")
    path = _job_file(tmp_path, model="models:/credit_risk/3",
                     input={"path": "s3://bucket/data/dt={ds}/*.parquet"},
                     output={"path": "gs://bucket/out/dt={ds}", "id_columns": ["id"]},
                     schemas={"root": absolute})
    job = load_job(path, ds=DS)
    assert job.spec.model.uri == "models:/credit_risk/3"
    assert job.spec.input.path == f"s3://bucket/data/dt={DS}/*.parquet"
    assert job.spec.output.path == f"gs://bucket/out/dt={DS}"
    assert job.spec.schemas.root == absolute


def test_memory_url_untouched(tmp_path):
    path = _job_file(tmp_path, output={"path": "memory://out/dt={ds}", "id_columns": ["id"]})
    assert load_job(path, ds=DS).spec.output.path == f"memory://out/dt={DS}"


def test_sqlite_tracking_uri_made_absolute_relative_to_job_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "project"
    folder.mkdir()
    job = load_job(_job_file(folder), ds=DS)
    assert job.spec.tracking.uri == "sqlite:///" + str(folder.resolve() / "mlflow.db")
    assert job.spec.tracking.uri.startswith("sqlite:////")


def test_sqlite_tracking_uri_nested_relative(tmp_path):
    job = load_job(_job_file(tmp_path, tracking={"uri": "sqlite:///track/db.sqlite"}), ds=DS)
    assert job.spec.tracking.uri == "sqlite:///" + str(tmp_path.resolve() / "track" / "db.sqlite")


def test_a_relative_file_tracking_uri_is_the_job_folders(tmp_path, monkeypatch):
    monkeypatch.chdir("/")   # not where the store would land without it
    job = load_job(_job_file(tmp_path, tracking={"uri": "file:mlruns"}), ds=DS)
    assert job.spec.tracking.uri == "file://" + str(tmp_path.resolve() / "mlruns")
    job = load_job(_job_file(tmp_path, tracking={"uri": "file:///var/mlruns"}), ds=DS)
    assert job.spec.tracking.uri == "file:///var/mlruns"


def test_absolute_sqlite_and_http_tracking_uris_untouched(tmp_path):
    job = load_job(_job_file(tmp_path, tracking={"uri": "sqlite:////var/db/mlflow.db"}), ds=DS)
    assert job.spec.tracking.uri == "sqlite:////var/db/mlflow.db"
    job = load_job(_job_file(tmp_path, tracking={"uri": "http://mlflow:5000"}), ds=DS)
    assert job.spec.tracking.uri == "http://mlflow:5000"


def test_plain_tracking_path_resolved(tmp_path):
    job = load_job(_job_file(tmp_path, tracking={"uri": "mlruns"}), ds=DS)
    assert job.spec.tracking.uri == str(tmp_path.resolve() / "mlruns")


@pytest.mark.parametrize("backend, key, value", [
    ("torch", "precision", "fp8"),
    ("onnxruntime", "graph_optimization_level", "max"),
])
def test_an_option_with_choices_takes_only_those(backend, key, value):
    from batchinfer.backends import check_options
    from batchinfer.errors import SpecError

    with pytest.raises(SpecError, match=f"model.options.{key}: '{value}' is not one of"):
        check_options(backend, {key: value})
    check_options("torch", {"precision": "bf16"})
