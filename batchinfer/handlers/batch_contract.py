"""The batch contract on a model's outputs: one entry per input row, and the same shape past the
rows and the same dtype on every call.

Neither is a row's fault. A model that sums over the batch would "fit" at one row per call if
its rows were isolated, and commit meaningless scores; an output whose width changes between
calls would give a partition whose files disagree on the column's type. So the run fails
(exit 5) on the first call that shows it.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import ModelError

Signature = tuple[tuple, str]   # an output's shape past the rows, and its dtype (``dtype.str``)


class BatchContract:
    """Checks every call's outputs; remembers each output's signature from the first call."""

    def __init__(self) -> None:
        self.signatures: dict[str, Signature] = {}

    def check(self, out: Mapping[str, Any], rows: int) -> None:
        """``out``, the outputs of one call on ``rows`` rows.

        Raises:
            ModelError: an output without one entry per row, or of another shape past the rows
                or another dtype than on the first call.
        """
        for name, value in out.items():
            shape = np.shape(value)
            if shape[:1] != (rows,):
                raise ModelError(
                    f"the model breaks the batch contract: output {name!r} has shape "
                    f"{list(shape)} for {rows} input rows (its first dimension must be the "
                    f"number of rows); nothing committed")
            signature = (shape[1:], np.asarray(value).dtype.str)
            first = self.signatures.setdefault(name, signature)
            if first != signature:
                raise ModelError(
                    f"the model breaks the batch contract: output {name!r} was "
                    f"{_describe(first)} per row and is now {_describe(signature)}; every call "
                    f"must give the same shape and type; nothing committed")


def _describe(signature: Signature) -> str:
    shape, dtype = signature
    return f"{np.dtype(dtype).name} {list(shape)}"
