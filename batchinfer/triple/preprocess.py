"""Preprocessing: the user's ``transform(batch) -> ndarray | Mapping[str, ndarray]``, or the
default (FEATURES stacked as float32).

The function is loaded from the module's exact source (see :mod:`batchinfer.triple.sources`) so that
what runs is what ``preprocess_hash`` covers. A module may list files it reads in ``ASSETS``
(paths relative to the module's folder); their bytes are part of the hash. So is the source of
every local module it imports (:mod:`batchinfer.triple.import_walk`), which runs from that text
too; the installed packages it imports are recorded by version (``packages``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from ..errors import PreprocessError
from .contract import default_preprocess_hash, preprocess_hash
from .import_walk import walk_imports
from .sources import ModuleSource, find_module_file


@dataclass(frozen=True)
class Preprocessor:
    """A picklable preprocessing step and its hash.

    Attributes:
        ref: ``module:function``, or None for the default.
        hash: the triple's ``preprocess_hash``.
        features: the FEATURES the default stacks (unused by a user function).
        source: the user module's source (with the local modules it imports), None for the
            default.
        packages: ``distribution==version`` of each installed package the module imports
            (directly or through its local modules), sorted; what the declaration records.
    """

    ref: str | None
    hash: str
    features: tuple[str, ...]
    source: ModuleSource | None = None
    packages: tuple[str, ...] = ()

    @property
    def local_modules(self) -> tuple[str, ...]:
        """The names of the local modules it imports (their source is in the hash)."""
        return tuple(m.name for m in self.source.local_modules) if self.source else ()

    def __call__(self, batch: pa.RecordBatch) -> Any:
        """The features for ``batch``: one array, or arrays by model input name; axis 0 is rows.

        Raises:
            PreprocessError: the function returned something else, or another number of rows
                (a fault of the function, not of a row: it is never isolated row by row).
            Exception: whatever the function raised (a row it rejects: isolated and quarantined).
        """
        if self.source is None:
            return stack_float32(batch, self.features)
        function = getattr(self.source.load(), str(self.ref).split(":")[1])
        features = function(batch)
        check_features(features, batch.num_rows, self.ref)
        return features


def load_preprocessor(ref: str | None, job_folder: Path, features: Sequence[str]) -> Preprocessor:
    """Resolve the job's ``preprocess`` setting.

    The job file's folder is put first on ``sys.path`` (contract §3), then the module is found as
    ``import`` would find it and read; the local modules it imports are found and read; the
    module is executed once from that text (to check it), and hashed with its ASSETS and those
    modules.

    Raises:
        PreprocessError: the module cannot be found or imported, or lacks the function.
    """
    features = tuple(features)
    if ref is None:
        return Preprocessor(ref=None, hash=default_preprocess_hash(features), features=features)
    module_name, function_name = ref.split(":")
    search = (str(job_folder),)
    path = find_module_file(module_name, search)
    if path is None:
        raise PreprocessError(
            f"preprocess {ref}: module {module_name!r} not found (looked in {job_folder} and "
            f"sys.path; it must be a .py file)")
    try:
        entry = ModuleSource.read(module_name, path, search)
        imports = walk_imports(entry, job_folder)
    except (OSError, UnicodeDecodeError) as exc:
        raise PreprocessError(f"preprocess {ref}: cannot read its code: {type(exc).__name__}: "
                              f"{exc}") from None
    source = entry.with_local_modules(imports.local)
    try:
        module = source.load()
    except Exception as exc:
        raise PreprocessError(f"preprocess {ref}: {path} failed to import: "
                              f"{type(exc).__name__}: {exc}") from None
    if not callable(getattr(module, function_name, None)):
        raise PreprocessError(f"preprocess {ref}: {path} defines no function {function_name!r}")
    assets = []
    for name in getattr(module, "ASSETS", ()) or ():
        asset = path.parent / name
        try:
            assets.append((str(name), asset.read_bytes()))
        except OSError as exc:
            raise PreprocessError(f"preprocess {ref}: asset {name!r} unreadable: {exc}") from None
    digest = preprocess_hash(module_name, function_name, source.text, assets,
                             [(m.name, m.text) for m in source.local_modules])
    # The assets travel with the code: a worker reads the bytes that were hashed.
    return Preprocessor(ref=ref, hash=digest, features=features, source=source.with_assets(assets),
                        packages=imports.packages)


def check_features(features: Any, rows: int, ref: str | None) -> None:
    """Raise PreprocessError unless ``features`` is an array, or a mapping of name to array,
    with ``rows`` rows each. Features of another length than the batch would pair each
    prediction with another row's ids."""
    arrays = features.items() if isinstance(features, Mapping) else [(None, features)]
    if isinstance(features, Mapping) and not features:
        raise PreprocessError(f"preprocess {ref} returned an empty mapping; nothing committed")
    for name, value in arrays:
        what = "" if name is None else f" input {name!r}:"
        if not isinstance(value, np.ndarray):
            raise PreprocessError(f"preprocess {ref} returned{what} {type(value).__name__}, not a "
                                  f"numpy array (or a mapping of input name to numpy array); "
                                  f"nothing committed")
        if value.shape[:1] != (rows,):
            raise PreprocessError(f"preprocess {ref} returned{what} shape {list(value.shape)} for "
                                  f"{rows} rows: axis 0 must be the rows, one per input row; "
                                  f"nothing committed")


def stack_float32(batch: pa.RecordBatch, features: Sequence[str]) -> np.ndarray:
    """The default preprocessing: FEATURES as a C-contiguous float32 [rows, features] matrix.

    Nulls become NaN (a schema that allows nulls in a feature should say how to fill them in a
    preprocess function instead).
    """
    # Each column is copied whole into a row of [features, rows], then the matrix is transposed
    # in one copy: writing the columns straight into [rows, features] strides every value by a
    # row's width, 2.7x slower (13.1 against 4.8 ms a 65,536 x 32 batch, bench/README.md).
    by_feature = np.empty((len(features), batch.num_rows), dtype=np.float32)
    for i, name in enumerate(features):
        column = batch.column(name)
        if column.null_count:
            column = column.cast(pa.float64()).fill_null(np.nan)
        by_feature[i] = column.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(by_feature.T)
