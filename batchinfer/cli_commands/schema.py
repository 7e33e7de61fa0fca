"""``batchinfer schema publish|verify``: the lock of published schema versions (the work:
:mod:`batchinfer.commands.schema`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..errors import ContractError
from .arguments import load, spec_options
from .results import Result

HELP = "publish a schema version into lock.json, or verify the lock"


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="schema_action", required=True, metavar="ACTION")
    publish = actions.add_parser("publish", help="add NAME@N's source hash to <root>/lock.json")
    publish.add_argument("ref", metavar="NAME@N")
    verify = actions.add_parser("verify", help="list published versions whose file is missing or changed")
    for q in (publish, verify):
        where = q.add_mutually_exclusive_group(required=True)
        where.add_argument("--root", help="the schemas folder (where lock.json is)")
        where.add_argument("--job", help="a job spec: its schemas.root")
        spec_options(q, "with --job: the partition date, if the spec needs one",
                     "with --job: override one spec key (repeatable)")


@dataclass(frozen=True)
class Published(Result):
    ref: str
    lock: Path
    digest: str
    added: bool

    def render(self, out: TextIO, err: TextIO) -> None:
        print(f"published {self.ref} in {self.lock} (sha256 {self.digest})" if self.added else
              f"{self.ref} is already published in {self.lock} (sha256 {self.digest}); nothing to do",
              file=out)


@dataclass(frozen=True)
class Verified(Result):
    lock: Path
    locked: int
    problems: tuple[str, ...]
    error: Exception | None = None   # a published version's file missing or changed (exit 3)

    def render(self, out: TextIO, err: TextIO) -> None:
        for line in self.problems:
            print(line, file=out)
        if not self.problems:
            print(f"{self.locked} published schema version(s) in {self.lock}: every file matches", file=out)


def execute(args: argparse.Namespace) -> Published | Verified:
    from ..commands.schema import lock_path, publish_schema, verify_schemas

    root = args.root if args.root else load(args, require_ds=False).spec.schemas.root
    if args.schema_action == "publish":
        digest, added = publish_schema(root, args.ref)
        return Published(args.ref, lock_path(root), digest, added)
    locked, problems = verify_schemas(root)
    lock = lock_path(root)
    error = ContractError(f"{len(problems)} of {locked} published schema version(s) in {lock} are "
                          f"missing or changed: restore them from version control (a change is "
                          f"published as a new version)") if problems else None
    return Verified(lock, locked, tuple(problems), error)
