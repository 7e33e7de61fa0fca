"""The commands' words for what to do about an error: each :class:`~batchinfer.errors.Remedy`
said as the flag or command that does it (``--overwrite``, ``batchinfer stamp``).

Errors below the commands carry their remedies as values (``batchinfer/errors.py``); only here
do they become a command line's words, so a flag renamed is renamed once, and a caller of the
Python API never reads a flag it cannot pass.
"""
from __future__ import annotations

from ..errors import Action, BatchInferError, Remedy


def said(remedy: Remedy) -> str:
    """``remedy`` as the command line that does it, with what it achieves."""
    purpose = f" {remedy.purpose}" if remedy.purpose else ""
    if remedy.action is Action.OVERWRITE:
        return f"pass --overwrite{purpose}"
    if remedy.action is Action.UPDATE:
        return f"pass --update{purpose}"
    if remedy.action is Action.UNPIN:
        return f"drop the pin with --overwrite --set input.version={remedy.subject or 'N'}{purpose}"
    if remedy.subject:
        return f"run `batchinfer stamp {remedy.subject} --job JOB.yaml`{purpose}"
    return f"re-stamp the model with `batchinfer stamp`{purpose}"


def alternatives(remedies: tuple[Remedy, ...]) -> str:
    """Remedies one after the other ("pass --update …, or --overwrite …": one "pass" for flags
    in a row)."""
    words: list[str] = []
    for remedy in remedies:
        text = said(remedy)
        if words and text.startswith("pass --") and words[-1].startswith(("pass --", "--")):
            text = text.removeprefix("pass ")
        words.append(text)
    return ", or ".join(words)


def error_line(error: BatchInferError) -> str:
    """The error's line as the CLI prints it: what was wrong, then what to do."""
    if not error.remedies:
        return error.what
    return f"{error.what}: {alternatives(error.remedies)}"
