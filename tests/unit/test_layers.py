"""The package's layering, as docs/architecture.md states it: which part of batchinfer may import
which. Read from the source with ``ast`` (every import, including those inside functions and
``TYPE_CHECKING`` blocks), so a new upward import fails here, naming the module and the line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "batchinfer"
CORE = {"errors", "codec", "profile_records", "redaction", "faults", "imports", "backends", "runners",
        "registry", "parity", "clock", "__init__"}
# unit → the units it may import (besides itself). A unit is a subpackage, or a top-level module.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "beam_compat": {"core"},
    "rows": {"core"},
    "io": {"core"},
    "spec": {"core", "rows", "io"},
    "triple": {"core", "rows", "io"},
    "handlers": {"core", "beam_compat", "rows"},
    "pipeline": {"core", "beam_compat", "rows", "io", "triple", "handlers"},
    "testing": {"core", "handlers"},   # the conformance kit: imported by test suites only
    "app": {"core", "beam_compat", "rows", "io", "spec", "triple", "handlers", "pipeline"},
    "convert": {"core", "beam_compat", "rows", "io", "spec", "triple", "handlers", "pipeline", "app"},
    "commands": {"core", "beam_compat", "rows", "io", "spec", "triple", "handlers", "pipeline", "app",
                 "convert"},
    "demo": {"core", "commands", "spec", "triple"},
    "cli_commands": {"core", "beam_compat", "rows", "io", "spec", "triple", "handlers", "pipeline", "app",
                     "convert", "commands", "demo"},
    "cli": {"core", "cli_commands"},
    "__main__": {"cli"},
}
NO_IO = ("apache_beam", "fsspec")   # what pure row work (and what it imports) never imports


def unit_of(module: str) -> str:
    """``batchinfer.rows.validation`` → ``rows``; ``batchinfer.errors`` → ``core``."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return "core" if top in CORE else top


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "files" in path.relative_to(PACKAGE).parts:   # the demo's job files, not the package
            continue
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            if node.level and not node.module:  # from . import x: x may be a module
                found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


MODULES = modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    mine = unit_of(module)
    allowed = ALLOWED[mine] | {mine}
    wrong = []
    for target, line in imports_of(module, MODULES[module]):
        if target == "batchinfer" or not target.startswith("batchinfer."):
            continue
        if target not in MODULES and target.rpartition(".")[0] in MODULES:
            target = target.rpartition(".")[0]   # `from .x import name`: name is not a module
        if unit_of(target) not in allowed:
            wrong.append(f"{MODULES[module].name}:{line} imports {target} ({unit_of(target)})")
    assert not wrong, f"{module} ({mine}) may import {sorted(allowed)}: " + "; ".join(wrong)


def test_row_work_never_reaches_beam_or_fsspec():
    """Not directly, and not through anything it imports from batchinfer."""
    def closure(module: str, seen: set[str]) -> set[str]:
        for target, _ in imports_of(module, MODULES[module]):
            name = target if target in MODULES else target.rpartition(".")[0]
            if name in MODULES and name not in seen:
                seen.add(name)
                closure(name, seen)
        return seen

    for module in (m for m in MODULES if unit_of(m) == "rows"):
        for reached in {module} | closure(module, set()):
            for target, line in imports_of(reached, MODULES[reached]):
                assert not target.startswith(NO_IO), \
                    f"{module} reaches {target} through {reached}:{line}"


def test_every_package_says_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        if "files" in init.relative_to(PACKAGE).parts or init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init} has no docstring naming what it may import"


def test_the_rules_cover_every_unit():
    assert {unit_of(m) for m in MODULES} <= set(ALLOWED)


def test_one_meaning_per_module_name():
    """A module's name says what it is, once in the package: two modules share a name only where
    they are the two faces of one command (``cli_commands/X`` declares the arguments and result of
    the work in ``commands/X``, or of the converter ``convert/X`` for ``export``)."""
    by_name: dict[str, list[str]] = {}
    for module in modules():
        parts = module.split(".")
        if parts[-1] in {"batchinfer", "__main__"} or len(parts) < 2:
            continue
        by_name.setdefault(parts[-1], []).append(".".join(parts[1:-1]))
    shared = {name: sorted(units) for name, units in by_name.items() if len(units) > 1}
    faces = {name: units for name, units in shared.items()
             if units in (["cli_commands", "commands"], ["cli_commands", "convert"])
             or (name == "demo" and units == ["", "cli_commands"])}   # the demo and its command
    assert shared == faces, {n: u for n, u in shared.items() if n not in faces}


def test_every_package_docstring_names_all_its_modules():
    """A package's docstring is its table of contents: it names each of its modules and
    subpackages (as ``name``), so a reader finds every part from the top."""
    missing = []
    for init in PACKAGE.rglob("__init__.py"):
        if "files" in init.relative_to(PACKAGE).parts or init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        parts = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
        parts += [d.name for d in init.parent.iterdir() if (d / "__init__.py").is_file()]
        missing += [f"{init.parent.name}/{name}" for name in sorted(parts)
                    if f"``{name}``" not in doc and f"{name}.py" not in doc and f"`{name}`" not in doc
                    and f"demo.{name}" not in doc]
    assert missing == []
