"""Model calls sized by tokens (``batch.tokens``, batchinfer/handlers/tokens.py and calls.py):
the pure planning functions, and ``BatchModelHandler.infer`` with a Python fake sequence model whose
per-row result is exact (integer sums), so that token batching must give bit for bit what row
batching gives, rows in their places, rejected rows isolated and named by their own index.
Rerun with ``.venv/bin/pytest tests/unit/test_token_batches.py -q``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.handlers import tokens as token_calls
from batchinfer.handlers.base import BatchModelHandler, Prepared
from batchinfer.handlers.calls import plan_calls
from batchinfer.handlers.protocol import ModelFacts

POISON = 666   # a token id the fake model rejects


def padded(lengths, pad_to=None, seed=0):
    """``input_ids`` / ``attention_mask`` right-padded to the longest row (or ``pad_to``)."""
    rng = np.random.default_rng(seed)
    width = pad_to or max(1, max(lengths, default=1))
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, 500, n)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


class _DeviceFull(RuntimeError):
    pass


class FakeEncoderBackend:
    """Per row: the sum of its real token ids and its length (exact in any batch), and the
    padded length it was given (so tests see the trimming). Rejects rows holding POISON; with
    ``capacity``, runs out of "device memory" above that many padded tokens a call. Its facts
    come from ``input_names``, ``output_names`` and ``input_shapes``, which tests replace."""

    warm_up = False

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.calls: list[tuple[int, int]] = []

    def load(self, path):
        return "model"

    def facts(self, model):
        return ModelFacts(inputs=self.input_names(model), outputs=self.output_names(model),
                          input_shapes=self.input_shapes(model))

    def input_names(self, model):
        return ["input_ids", "attention_mask"]

    def output_names(self, model):
        return ["total", "length"]

    def input_shapes(self, model):
        return {"input_ids": ("L",), "attention_mask": ("L",)}   # as an ONNX export declares

    def is_out_of_memory(self, exc):
        return isinstance(exc, _DeviceFull)

    def predict(self, model, inputs):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        self.calls.append(ids.shape)
        if self.capacity is not None and ids.size > self.capacity:
            raise _DeviceFull(f"{ids.size} tokens")
        if (ids == POISON).any():
            raise ValueError("token 666 is not in the vocabulary")
        return {"total": (ids * mask).sum(1).astype(np.float32),
                "length": mask.sum(1).astype(np.float32)}


def FakeEncoder(*, tokens=None, chunk_rows=None, capacity=None, backend=None):
    """The handler a run wraps the fake encoder in (``handler.model_backend.calls``: its calls)."""
    return BatchModelHandler(backend or FakeEncoderBackend(capacity), "fake.model",
                             digest=f"fake-{capacity}",
                             options={"chunk_rows": chunk_rows} if chunk_rows else {}, tokens=tokens)


def infer(handler, features):
    rows = len(features["input_ids"])
    return handler.infer(handler.load_model(), Prepared((0, 0), rows, features))


# -- the pure functions ------------------------------------------------------------------------

def test_sequence_lengths_are_one_past_the_last_real_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    assert token_calls.sequence_lengths(mask).tolist() == [3, 1, 0, 4, 3]
    assert token_calls.sequence_lengths(np.zeros((3, 0))).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="must be"):
        token_calls.sequence_lengths(np.ones(4))


def test_calls_hold_at_most_the_budget_and_cover_every_row_once():
    lengths = np.array([300, 120, 100, 64, 64, 30, 8, 8, 8, 2, 0])
    calls = plan_calls(0, len(lengths), rows=None, lengths=lengths, tokens=256)
    assert calls[0] == (0, 1, 300)                    # longer than the budget: a call of its own
    assert [lo for lo, _, _ in calls] == [0] + [hi for _, hi, _ in calls[:-1]]
    assert calls[-1][1] == len(lengths)
    for lo, hi, width in calls:
        assert width == max(1, lengths[lo])           # cut to the call's longest row
        assert (hi - lo) * width <= 256 or hi - lo == 1
    assert plan_calls(5, 9, rows=None, lengths=lengths, tokens=256) == [(5, 9, 30)]
    assert plan_calls(5, 9, rows=3, lengths=lengths, tokens=256) == [(5, 8, 30), (8, 9, 8)]


# -- the handler -------------------------------------------------------------------------------

def test_token_batches_give_bit_for_bit_what_row_batches_give():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.exp(rng.normal(3, 1, 500)), 1, 256).astype(int).tolist()
    features = padded(lengths)
    by_rows = infer(FakeEncoder(chunk_rows=32), features)
    by_tokens = infer(FakeEncoder(tokens=1024), features)
    assert by_tokens.ok_rows.tolist() == by_rows.ok_rows.tolist() == list(range(500))
    for name in ("total", "length"):
        assert np.array_equal(by_tokens.outputs[name], by_rows.outputs[name])
    assert by_tokens.outputs["length"].tolist() == lengths          # each row in its place
    assert by_rows.tokens == by_tokens.tokens == sum(lengths)
    width = features["input_ids"].shape[1]
    assert by_rows.padded_tokens == 500 * width                     # every call at full width
    assert sum(lengths) <= by_tokens.padded_tokens < 1.2 * sum(lengths)
    assert by_tokens.chunk_rows == 0 and by_rows.chunk_rows == 32


def test_token_calls_are_capped_and_trimmed():
    lengths = [5, 200, 17, 17, 90, 3, 64, 250, 1, 40] * 20
    handler = FakeEncoder(tokens=600)
    infer(handler, padded(lengths, pad_to=256))                     # padded past every row
    longest_first = sorted(lengths, reverse=True)
    position = 0
    for rows, width in handler.model_backend.calls:
        assert width == longest_first[position]                     # cut to its longest row
        assert rows * width <= 600
        position += rows
    assert position == len(lengths)


def test_chunk_rows_still_caps_a_token_call():
    handler = FakeEncoder(tokens=10_000, chunk_rows=8)
    infer(handler, padded([3] * 50))
    assert [rows for rows, _ in handler.model_backend.calls] == [8] * 6 + [2]


def test_rejected_rows_are_isolated_and_named_by_their_own_row():
    lengths = [12, 3, 40, 7, 7, 90, 2, 33] * 10
    features = padded(lengths, seed=5)
    poisoned = [3, 41, 77]
    for row in poisoned:
        features["input_ids"][row, 0] = POISON
    result = infer(FakeEncoder(tokens=256), features)
    assert [row for row, _ in result.failed] == poisoned
    assert "not in the vocabulary" in result.failed[0][1]
    good = [r for r in range(len(lengths)) if r not in poisoned]
    assert result.ok_rows.tolist() == good                          # ascending, in place
    expected = (features["input_ids"] * features["attention_mask"]).sum(1)[good]
    assert np.array_equal(result.outputs["total"], expected.astype(np.float32))


def test_out_of_memory_halves_the_call_and_keeps_every_row_in_place():
    lengths = [50] * 40 + [10] * 100
    features = padded(lengths)
    handler = FakeEncoder(tokens=2000, capacity=600)
    result = infer(handler, features)
    assert result.failed == [] and result.oom_backoffs >= 1
    assert result.outputs["length"].tolist() == lengths
    assert handler.model_backend.calls[:2] == [(40, 50), (20, 50)]                # 2000 tokens, then half
    # the smaller budget is kept: the next batch does not run out of memory again
    handler.model_backend.calls.clear()
    second = infer(handler, features)
    assert second.oom_backoffs == 0 and second.outputs["length"].tolist() == lengths
    assert all(rows * width <= 600 for rows, width in handler.model_backend.calls)


def test_without_a_lengths_input_calls_are_sized_by_rows():
    handler = FakeEncoder(tokens=100)
    handler.scorer.tokens.lengths_from = "not_an_input"
    result = infer(handler, padded([4, 9, 2]))
    assert handler.model_backend.calls == [(3, 9)] and result.tokens == 0 and result.padded_tokens == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=80), st.integers(1, 300),
       st.sets(st.integers(0, 79), max_size=4))
def test_any_lengths_any_budget_same_results_as_rows(lengths, budget, poison):
    features = padded(lengths, seed=len(lengths))
    poison = sorted(p for p in poison if p < len(lengths) and lengths[p] > 0)
    for row in poison:
        features["input_ids"][row, 0] = POISON
    by_rows = infer(FakeEncoder(chunk_rows=7), features)
    by_tokens = infer(FakeEncoder(tokens=budget), features)
    assert [r for r, _ in by_tokens.failed] == [r for r, _ in by_rows.failed] == poison
    assert by_tokens.ok_rows.tolist() == by_rows.ok_rows.tolist()
    for name in ("total", "length"):
        assert np.array_equal(by_tokens.outputs.get(name, []), by_rows.outputs.get(name, []))


def test_a_lengths_input_that_is_not_rows_by_length_is_refused():
    """``batch.tokens`` with a lengths input of another rank is a usage error (exit 2), not
    quietly sized by rows; without ``batch.tokens`` such an input is just another input."""
    from batchinfer.errors import PreprocessError

    features = padded([4, 9, 2])
    features["attention_mask"] = features["attention_mask"].sum(1)      # [rows]: counts
    with pytest.raises(PreprocessError, match=r"'attention_mask' of shape \[N\]; .* takes \[N, L\]"):
        infer(FakeEncoder(tokens=100), features)                        # as the model declares it
    undeclared = FakeEncoder(tokens=100)
    undeclared.model_backend.input_shapes = lambda model: {}
    with pytest.raises(PreprocessError, match=r"'attention_mask'.*\[3\], not \[rows, length\]"):
        infer(undeclared, features)                                     # whatever it declares
    assert PreprocessError("x").exit_code == 2
    handler = FakeEncoder(chunk_rows=8)
    handler.model_backend.input_shapes = lambda model: {}
    handler.model_backend.predict = lambda model, inputs: {"total": inputs["input_ids"].sum(1),
                                                           "length": inputs["attention_mask"]}
    result = infer(handler, features)
    assert result.tokens == 0 and result.outputs["length"].tolist() == [4, 9, 2]


# -- which inputs a call cuts: the model's declared shapes, never an array's width -------------

class DenseFakeEncoderBackend(FakeEncoderBackend):
    """FakeEncoder with a fixed-width ``dense`` input ``[N, width]`` beside its sequences; its
    ``dense_total`` sums all of a row's dense values (exact), whatever width it is given, as a
    model that broadcasts would: cutting it would change predictions without an error."""

    def __init__(self, width, capacity=None):
        super().__init__(capacity)
        self.width = width

    def input_names(self, model):
        return ["input_ids", "attention_mask", "dense"]

    def output_names(self, model):
        return ["total", "length", "dense_total"]

    def input_shapes(self, model):
        return {**super().input_shapes(model), "dense": (self.width,)}

    def predict(self, model, inputs):
        out = super().predict(model, {k: inputs[k] for k in ("input_ids", "attention_mask")})
        return {**out, "dense_total": inputs["dense"].sum(1).astype(np.float32)}


def DenseFakeEncoder(width, **kwargs):
    return FakeEncoder(backend=DenseFakeEncoderBackend(width, kwargs.pop("capacity", None)), **kwargs)


def test_a_dense_input_as_wide_as_the_padded_batch_is_not_cut():
    """``dense`` is exactly as wide as the batch's padded length (40), so an array's width
    cannot tell it from a sequence: the model's declared shape ([N, 40], fixed) does."""
    rng = np.random.default_rng(11)
    lengths = [40] + rng.integers(1, 40, 299).tolist()
    features = padded(lengths, seed=2)
    assert features["input_ids"].shape[1] == 40
    features["dense"] = rng.integers(0, 9, (300, 40)).astype(np.float32)
    by_rows = infer(DenseFakeEncoder(40, chunk_rows=32), features)
    tokens = DenseFakeEncoder(40, tokens=256)
    by_tokens = infer(tokens, features)
    assert any(width < 40 for _, width in tokens.model_backend.calls)                 # the sequences were cut
    for name in ("total", "length", "dense_total"):
        assert np.array_equal(by_tokens.outputs[name], by_rows.outputs[name]), name
    assert by_tokens.outputs["dense_total"].tolist() == features["dense"].sum(1).tolist()


def test_sequence_inputs_are_told_by_declared_dims():
    names = ["input_ids", "attention_mask", "token_type_ids", "dense", "chars"]
    shapes = {"input_ids": ("L",), "attention_mask": ("L",), "token_type_ids": ("L",),
              "dense": (64,), "chars": ("C",)}
    found = token_calls.sequence_inputs("attention_mask", names, shapes)
    assert found == {"input_ids", "attention_mask", "token_type_ids"}  # not the fixed, not "C"
    unnamed = {"input_ids": (None,), "attention_mask": (None,), "dense": (64,)}  # TensorRT's -1
    assert token_calls.sequence_inputs("attention_mask", names[:2] + ["dense"], unnamed) == \
        {"input_ids", "attention_mask"}
    assert token_calls.sequence_inputs("attention_mask", names, shapes, ["chars"]) == \
        {"chars", "attention_mask"}                                       # as the job lists them


@pytest.mark.parametrize("shapes, listed, said", [
    ({"attention_mask": (128,)}, None, "fixes the length of 'attention_mask' at 128"),
    ({"attention_mask": ("L", 4)}, None, "[N, L, 4], not [rows, length]"),
    ({}, None, "list them in batch.sequence_inputs"),
    ({"attention_mask": ("L",)}, ["ids"], "names ['ids'], which the model does not take"),
    ({"attention_mask": ("L",), "dense": (64,)}, ["dense"], "dense [N, 64]"),
])
def test_sequence_inputs_that_cannot_be_told_or_cut_are_refused(shapes, listed, said):
    with pytest.raises(ValueError) as info:
        token_calls.sequence_inputs("attention_mask", ["attention_mask", "dense"], shapes, listed)
    assert said in str(info.value)


def test_sequence_inputs_padded_to_another_length_are_refused():
    from batchinfer.errors import PreprocessError

    features = padded([4, 9, 2])
    features["input_ids"] = np.pad(features["input_ids"], [(0, 0), (0, 3)])
    handler = FakeEncoder(tokens=100)
    handler.model_backend.input_shapes = lambda model: {"input_ids": (None,), "attention_mask": (None,)}
    with pytest.raises(PreprocessError, match=r"'input_ids'.*\[3, 12\] beside 'attention_mask' padded to 9"):
        infer(handler, features)
    assert handler.model_backend.calls == []


def test_an_input_of_another_width_than_the_model_declares_fails_before_any_call():
    """One column too few fails every row alike: found on the batch, without a model call, not
    after isolating every row by calling the model on it alone."""
    from batchinfer.errors import PreprocessError

    handler = DenseFakeEncoder(8, chunk_rows=16)
    features = {**padded([3] * 500), "dense": np.zeros((500, 7), np.float32)}
    with pytest.raises(PreprocessError) as info:
        infer(handler, features)
    assert "'dense' of shape [N, 7]; the model fake.model takes [N, 8]" in str(info.value)
    assert info.value.exit_code == 2 and handler.model_backend.calls == []
