"""What an export writes, and how: ``--out`` checked before any work (:func:`_check_out`), written
to a scratch name beside it and renamed into place once parity holds, records first
(:func:`_publish`); the :class:`ExportReport` of what was written, and the digests its records
hold."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..errors import SpecError

if TYPE_CHECKING:
    from .int8_gate import GateFigures


@dataclass
class ExportReport:
    out: Path
    inputs: dict[str, tuple]       # ONNX input name → shape (symbolic dims as strings)
    outputs: dict[str, tuple]
    sample: str                    # where the sample inputs came from
    rows: int
    max_abs_diff: dict[str, float]
    kl: dict[str, float] | None = None   # --fp16: each output's KL divergence from FP32
    reference: str = "torch"             # what the export was compared with
    gate: GateFigures | None = None      # --quantize: the gate's figures (as declared)


def _check_out(model: Path, out: Path) -> None:
    """Refuse (exit 2, before any work) an ``--out`` that is not the export's to replace: the
    model being exported (it would be replaced by its own conversion, the FP32 original lost), a
    stamped model (its declaration beside it vouches for the bytes there; a run would find
    others), a declaration or a record that sits beside a model, or a folder. Symlinks, ``..``
    and hard links name the same file: compared resolved, by inode where both exist."""
    from ..handlers.onnx import QUANTIZATION_SUFFIX
    from ..handlers.tensorrt import BUILD_SUFFIX
    from ..triple.contract import SIDECAR_SUFFIX

    resolved = out.resolve()
    records = {SIDECAR_SUFFIX: "a declaration", QUANTIZATION_SUFFIX: "a quantization record",
               BUILD_SUFFIX: "a build record"}
    record = next((what for suffix, what in records.items()
                   if out.name.endswith(suffix) or resolved.name.endswith(suffix)), None)
    declared = next((d for d in (Path(f"{resolved}{SIDECAR_SUFFIX}"), Path(f"{out}{SIDECAR_SUFFIX}"))
                     if d.exists()), None)
    todo = "choose another --out"
    if _same_file(out, model):
        why = "the model being exported (the export would replace its own source)"
    elif record is not None:
        why = f"{record} (batchinfer's file beside a model, not a model)"
    elif out.is_dir():
        why, todo = "a folder", f"name a file in it (e.g. {out / model.name})"
    elif declared is not None:
        why = f"a stamped model (its declaration {declared.name} is beside it)"
        todo += ", or remove the model and its declaration first to replace it"
    else:
        return
    raise SpecError(f"--out {out} resolves to {resolved}, {why}: {todo}")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: one inode where both exist (a hard link, a
    symlink, another spelling on a case-insensitive disk), else one resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _scratch(target: Path, suffix: str = "") -> str:
    """A new empty hidden file beside ``target``: in its folder, so that renaming it onto
    ``target`` is one atomic step on the same disk."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(handle)
    return scratch


def _publish(scratch: str, target: Path) -> None:
    """Rename ``scratch`` onto ``target``: ``target`` then holds either what it held or all of
    the new file, never part of one. mkstemp made ``scratch`` private (0600); it takes the
    permissions a plain write would have given it (0666 less the umask), so the model is as
    readable as one copied there."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(scratch, 0o666 & ~umask)
    os.replace(scratch, target)


def _shapes(metas) -> dict[str, tuple]:
    return {m.name: tuple(m.shape) for m in metas}


def _arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over each array's name, dtype, shape and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name} {a.dtype.str} {list(a.shape)}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
