"""The command line's shape (issue 33): ``cli.py`` parses, dispatches and prints; each command is
a module of ``batchinfer/cli_commands/`` that declares its help line and arguments and returns a
typed result that renders itself; parsing imports none of the heavy libraries; no function of
the package is over 80 lines but the demo's data generator. Read from the source with ``ast``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from batchinfer import cli
from batchinfer.cli_commands.results import Result

PACKAGE = Path(__file__).resolve().parents[2] / "batchinfer"
LONGEST = 80
EXEMPT = {PACKAGE / "demo" / "train.py"}   # the demo's data generator


def test_cli_py_is_at_most_250_lines():
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines <= 250, f"batchinfer/cli.py has {lines} lines"


def test_no_function_is_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in EXEMPT or "files" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONGEST:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 80 lines: " + "; ".join(long)


def test_every_command_module_has_no_other():
    modules = {p.stem for p in (PACKAGE / "cli_commands").glob("*.py")} - {"__init__", "arguments", "results"}
    assert modules == set(cli.COMMANDS)


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_a_command_declares_its_arguments_and_returns_a_result(name):
    module = cli.command(name)
    assert isinstance(module.HELP, str) and module.HELP
    assert callable(module.add_arguments)
    tree = ast.parse(Path(module.__file__).read_text())
    execute = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "execute")
    assert execute.returns is not None, f"{name}.execute says what it returns"
    for returned in ast.unparse(execute.returns).split("|"):
        result = getattr(module, returned.strip())
        assert issubclass(result, Result) and result.render is not Result.render, returned


def test_parsing_imports_no_heavy_library():
    """``batchinfer --help`` and building the parser import only the command line itself."""
    code = ("import sys, batchinfer.cli as cli; cli.build_parser().parse_args(['inspect', 'x']); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'pyarrow', 'pydantic', "
            "'apache_beam', 'fsspec') or m in ('batchinfer.spec', 'batchinfer.commands')); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]", out


def test_a_commands_arguments_are_declared_when_it_is_parsed():
    args = cli.build_parser().parse_args(["export", "m.onnx", "--to", "onnx", "--out", "o.onnx"])
    # not given: None, whatever the default the converter applies
    assert (args.method, args.threshold, args.min_cosine, args.embedding, args.keep_fp32) == (None,) * 5
    args = cli.build_parser().parse_args(["diff", "a", "b"])
    from batchinfer.commands.diff import TOP_MOVERS

    assert args.top == TOP_MOVERS
