"""Errors carry what, where and the remedy as values (batchinfer/errors.py); only the commands'
layer says a remedy as a flag or command (batchinfer/commands/remedies.py)."""
from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

import batchinfer
from batchinfer.commands.remedies import alternatives, error_line, said
from batchinfer.errors import Action, ContractError, DataQualityError, ModelError, Remedy, TableVersionGone

PACKAGE = Path(batchinfer.__file__).parent
BELOW_THE_CLI = ("io", "triple", "rows", "pipeline", "handlers")
CLI_WORDS = ("--overwrite", "--update", "batchinfer stamp")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_no_layer_below_the_cli_words_a_remedy():
    """A message below the commands names no flag or command of the CLI: a flag renamed is
    renamed in commands/remedies.py alone (docstrings may say which flag does what)."""
    spoken = []
    for unit in BELOW_THE_CLI:
        for path in sorted((PACKAGE / unit).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and id(node) not in docs and any(w in node.value for w in CLI_WORDS):
                    spoken.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value[:60]!r}")
    assert spoken == []


def test_an_error_keeps_its_fields_across_pickling_and_rewording():
    """Beam's workers pickle errors; a challenger's error is re-worded with its name."""
    error = TableVersionGone("the version is gone", path="s3://t", field="input.version",
                             remedies=[Remedy(Action.UPDATE, "to score the latest"),
                                       Remedy(Action.UNPIN, subject="4")])
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is TableVersionGone and back.exit_code == 3
    assert (back.what, back.path, back.field, back.remedies) == (
        error.what, error.path, error.field, error.remedies)
    within = back.within("challenger v2")
    assert type(within) is TableVersionGone and within.what == "challenger v2: the version is gone"
    assert within.remedies == error.remedies and within.field == "input.version"


def test_str_says_the_remedy_plainly_and_the_cli_says_it_as_flags():
    error = ContractError("out is committed under another triple",
                          remedies=[Remedy(Action.OVERWRITE, "to replace it")])
    assert str(error) == "out is committed under another triple: overwrite to replace it"
    assert error_line(error) == "out is committed under another triple: pass --overwrite to replace it"
    assert error_line(ModelError("the model does not load")) == "the model does not load"


@pytest.mark.parametrize("remedy, words", [
    (Remedy(Action.OVERWRITE, "to replace it"), "pass --overwrite to replace it"),
    (Remedy(Action.UPDATE), "pass --update"),
    (Remedy(Action.UNPIN, subject="3"), "drop the pin with --overwrite --set input.version=3"),
    (Remedy(Action.STAMP, subject="m.onnx"), "run `batchinfer stamp m.onnx --job JOB.yaml`"),
    (Remedy(Action.STAMP, "for this one"), "re-stamp the model with `batchinfer stamp` for this one"),
])
def test_each_action_is_said_as_the_command_line_that_does_it(remedy, words):
    assert said(remedy) == words


def test_alternatives_share_one_pass():
    assert alternatives((Remedy(Action.UPDATE, "to score the new shards"),
                         Remedy(Action.OVERWRITE, "to score them all"))) == \
        "pass --update to score the new shards, or --overwrite to score them all"
    assert DataQualityError("x").remedies == ()


def test_a_refusal_on_a_worker_reaches_the_launcher_with_its_class():
    """The commit step records the class of its refusal in the outcome; the launcher raises
    that class (a 5 is not always a ModelError). An outcome written before the class was
    recorded reads as its code meant then."""
    import json

    from batchinfer.commands.run import _refusal
    from batchinfer.errors import PreprocessError, StorageError
    from batchinfer.io.commit import CommitOutcome

    refused = CommitOutcome("refused", None, 5, "the output store failed", error="StorageError")
    back = CommitOutcome.read(json.dumps(refused.to_dict()))
    assert back.error == "StorageError"
    assert type(_refusal(back)) is StorageError
    older = {k: v for k, v in refused.to_dict().items() if k != "error"}
    assert type(_refusal(CommitOutcome.read(json.dumps(older)))) is ModelError
    assert type(_refusal(CommitOutcome("refused", None, 2, "x", error="PreprocessError"))) is PreprocessError
    assert type(_refusal(CommitOutcome("refused", None, 4, "x"))) is DataQualityError
    # A name that is no error of ours, or of another code, is not trusted.
    assert type(_refusal(CommitOutcome("refused", None, 5, "x", error="SystemExit"))) is ModelError
    assert "error" not in CommitOutcome("committed").to_dict()   # as outcomes were written before
