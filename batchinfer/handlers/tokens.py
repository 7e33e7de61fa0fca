"""Model calls sized by tokens, not rows (``batch.tokens``); pure, no I/O.

A transformer's call costs about rows × the call's longest sequence: every row is padded to it.
Row-count batching pads a short document to the longest one that happens to share its batch;
on a realistic length mix most of the compute is then spent on padding. With ``batch.tokens``
the handler sorts a batch's rows by length (the batch of ``batch.rows`` rows is the bounded
window: memory stays what it was) and cuts the sorted rows into calls of at most ``tokens``
padded tokens, each call trimmed to its own longest row (the calls are planned by
handlers/calls.py, as calls sized by rows are). Results go back to the rows' places
before anything leaves the handler, so output order and accounting do not change.

Sequence inputs are right-padded (real tokens first, then padding), as every tokenizer pads by
default; a row's length is the position after its last non-zero entry in the lengths input
(``attention_mask`` unless ``batch.lengths_from`` names another). Which inputs are sequences —
cut to each call's longest row — is told by the model's declared shapes, never by an array's
width, which a dense input can share by chance (:func:`sequence_inputs`).

:class:`TokenOrder` is the policy as the handler's scoring (handlers/scorer.py) composes it:
the job's ``batch.tokens``, ``batch.lengths_from`` and ``batch.sequence_inputs``, checked
against a batch's inputs, the rows put longest first and back again.
"""
from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from ..errors import PreprocessError, SpecError


def sequence_lengths(mask: np.ndarray) -> np.ndarray:
    """Each row's length: one past its last non-zero position (0 for an all-zero row).

    Args:
        mask: ``[rows, padded length]``, non-zero on real tokens.
    """
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"a lengths input must be [rows, length], not {list(mask.shape)}")
    if mask.shape[1] == 0:
        return np.zeros(mask.shape[0], np.int64)
    nonzero = mask != 0
    last = mask.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0).astype(np.int64)


def longest_first(lengths: np.ndarray) -> np.ndarray:
    """The order to score rows in: longest first (the first call, which also warms the model
    up, is the largest; stable, so equal lengths keep their order)."""
    return np.argsort(-np.asarray(lengths), kind="stable")


def sequence_inputs(lengths_from: str, names: Sequence[str], shapes: Mapping[str, tuple],
                    listed: Sequence[str] | None = None) -> frozenset[str]:
    """The inputs a call cuts to its longest row: the lengths input, and either those
    ``listed`` (``batch.sequence_inputs``) or the inputs whose declared axis 1 is dynamic and
    the lengths input's own — the same dim name (ONNX ``dim_param``, a torch.export symbol), or
    any dynamic dim where the model names none (TensorRT). A fixed axis 1 is never cut.

    Args:
        lengths_from: the lengths input (``batch.lengths_from``).
        names: the model's inputs.
        shapes: each input's declared shape past the rows (``BatchModelHandler.input_shapes``).
        listed: the inputs the job names, or None to tell them from ``shapes``.

    Example: ``input_ids [N, L]``, ``attention_mask [N, L]``, ``dense [N, 64]`` →
    ``{"input_ids", "attention_mask"}``, whatever width the batch is padded to.

    Raises:
        ValueError: the lengths input's length is fixed or not its only axis past the rows, a
            listed input is not the model's or has a fixed axis 1, or nothing is listed and the
            model declares no shape for the lengths input.
    """
    declared = shapes.get(lengths_from)
    if declared is not None:
        if len(declared) != 1:
            raise ValueError(f"the model declares its lengths input {lengths_from!r} as "
                             f"{shape_text(declared)}, not [rows, length]")
        if isinstance(declared[0], int):
            raise ValueError(f"the model fixes the length of {lengths_from!r} at {declared[0]}, so "
                             f"calls cannot be cut to their longest row: size them by batch.rows")
    if listed is not None:
        unknown = [n for n in listed if n not in names]
        if unknown:
            raise ValueError(f"batch.sequence_inputs names {unknown}, which the model does not "
                             f"take (its inputs: {list(names)})")
        fixed = [n for n in listed if shapes.get(n) and isinstance(shapes[n][0], int)]
        if fixed:
            raise ValueError(f"batch.sequence_inputs names {fixed}, whose length the model fixes "
                             f"({', '.join(f'{n} {shape_text(shapes[n])}' for n in fixed)}): a call "
                             f"cannot cut them")
        return frozenset([lengths_from, *listed])
    if declared is None:
        raise ValueError(f"the model declares no shape for {lengths_from!r}, so which inputs are "
                         f"sequences cannot be told: list them in batch.sequence_inputs")
    length = declared[0]
    found = {lengths_from}
    for name in names:
        shape = shapes.get(name)
        if shape and not isinstance(shape[0], int) and (length is None or shape[0] == length):
            found.add(name)
    return frozenset(found)


def call_inputs(inputs: Mapping[str, np.ndarray], lo: int, hi: int, sequences: Collection[str],
                width: int) -> dict[str, np.ndarray]:
    """Rows ``[lo, hi)`` of ``inputs``, each of the ``sequences`` inputs cut to ``width``: the
    rest of it is padding for these rows."""
    return {name: value[lo:hi, :width] if name in sequences else value[lo:hi]
            for name, value in inputs.items()}


def shape_text(dims: Sequence) -> str:
    """A declared shape past the rows, written whole: ``(8,)`` → ``[N, 8]``, ``("L",)`` →
    ``[N, L]``, a dynamic dim without a name ``?``."""
    return "[" + ", ".join(["N", *("?" if d is None else str(d) for d in dims)]) + "]"



class TokenOrder:
    """The job's token sizing (``batch.tokens``), as one handler applies it to its batches.

    Args:
        tokens: padded tokens per model call; None sizes calls by rows (the rows are then left
            in their order, and only counted).
        lengths_from: the input whose non-zero entries mark a row's real tokens.
        listed: the inputs cut to each call's longest row (``batch.sequence_inputs``); None:
            the lengths input and the inputs the model declares alike (:func:`sequence_inputs`).
    """

    def __init__(self, tokens: Optional[int] = None, lengths_from: str = "attention_mask",
                 listed: Optional[Sequence[str]] = None):
        self.tokens = tokens
        self.lengths_from = lengths_from
        self.listed = tuple(listed) if listed is not None else None
        self._sequences: Optional[frozenset[str]] = None   # asked of the model once

    def lengths(self, inputs: Mapping[str, np.ndarray]) -> Optional[np.ndarray]:
        """Each row's real tokens, if the model takes the lengths input (else None).

        Raises:
            PreprocessError: calls are sized by tokens and the lengths input is not
                ``[rows, length]`` (sizing them by rows instead would not be what was asked).
        """
        mask = inputs.get(self.lengths_from)
        if mask is None:
            return None
        if np.ndim(mask) != 2:
            if self.tokens:
                raise PreprocessError(
                    f"batch.tokens sizes model calls by the lengths in model input "
                    f"{self.lengths_from!r}, which the preprocessing returned as "
                    f"{list(np.shape(mask))}, not [rows, length]; nothing committed")
            return None
        return sequence_lengths(mask)

    def sequences(self, names: Sequence[str], shapes: Mapping[str, tuple]) -> frozenset[str]:
        """The inputs that ``batch.tokens`` cuts to each call's longest row, for the model of
        inputs ``names`` and declared ``shapes`` (asked once).

        Raises:
            SpecError: the choice cannot be made or made safely (:func:`sequence_inputs`).
        """
        if self._sequences is None:
            try:
                self._sequences = sequence_inputs(self.lengths_from, names, shapes, self.listed)
            except ValueError as exc:
                raise SpecError(f"batch.tokens: {exc}") from None
        return self._sequences

    def checked_sequences(self, inputs: Mapping[str, np.ndarray], names: Sequence[str],
                          shapes: Mapping[str, tuple]) -> frozenset[str]:
        """The sequence inputs, each padded to the lengths input's length: a call cuts them all
        to one width, which must mean the same positions in each.

        Raises:
            PreprocessError: a sequence input padded to another length.
        """
        padded = np.shape(inputs[self.lengths_from])[1]
        sequences = self.sequences(names, shapes)
        for name in sorted(sequences):
            shape = np.shape(inputs[name])
            if len(shape) < 2 or shape[1] != padded:
                raise PreprocessError(
                    f"batch.tokens cuts sequence input {name!r} like {self.lengths_from!r}, but the "
                    f"preprocessing returned it as {list(shape)} beside {self.lengths_from!r} "
                    f"padded to {padded}: pad every sequence input to the same length (or leave "
                    f"{name!r} out of batch.sequence_inputs); nothing committed")
        return sequences

    @staticmethod
    def put_back(order: np.ndarray, ok_rows: np.ndarray, outputs: dict[str, np.ndarray],
                 failed: list[tuple[int, str]]
                 ) -> tuple[np.ndarray, dict[str, np.ndarray], list[tuple[int, str]]]:
        """Rows scored in ``order`` (indices into it) back in their places: the scored rows
        ascending with their outputs, the failed ones by their own index."""
        ok_rows = order[ok_rows]
        back = np.argsort(ok_rows, kind="stable")
        return (ok_rows[back], {k: v[back] for k, v in outputs.items()},
                sorted((int(order[row]), error) for row, error in failed))
