"""The checks of the conformance kit (see the package docstring), and the suite that runs them.

:func:`check_protocol` checks a backend against the model protocol itself
(handlers/protocol.py: ``load``, ``facts``, ``predict``). Every other check takes handlers —
a backend wrapped in the one :class:`~batchinfer.handlers.base.BatchModelHandler`
(:func:`handler_of`, or ``handler_for`` for a registered backend) — as a run uses them: loaded
with ``load_model()``, fed a :class:`~batchinfer.handlers.base.Prepared` batch. Each fails with
an ``AssertionError`` that names what is wrong (the output, the fact), so the same checks serve
a pytest suite and a script. Inputs are dicts of arrays by input name (axis 0 rows); a
single-input model is fed its one array, as the pipeline feeds it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pytest

from .. import faults, parity
from ..handlers.base import BatchModelHandler, Inference, Prepared
from ..handlers.loaded import LoadedModel
from ..handlers.protocol import ModelFacts

Arrays = dict[str, np.ndarray]
SIZES = (1, 7, 4097)   # one row, an odd size, more rows than a CPU call takes (4,096)


PROTOCOL = ("load(path) → model, facts(model) → ModelFacts, predict(model, inputs) → outputs "
            "(batchinfer/handlers/protocol.py)")


def handler_of(backend: Any, path: str = "model", *, chunk_rows: Optional[int] = None,
               digest: Optional[str] = None, **kwargs: Any) -> BatchModelHandler:
    """``backend`` (any object with the protocol's three methods) in the one handler a run wraps
    every backend in, for model file ``path``; ``chunk_rows`` (None: the model's default) sets
    the rows per model call, ``kwargs`` as ``BatchModelHandler`` takes them."""
    options = {"chunk_rows": chunk_rows} if chunk_rows else {}
    return BatchModelHandler(backend, path, digest=digest or f"{type(backend).__name__}-{id(backend)}",
                             options=options, **kwargs)


def check_protocol(backend: Any, path: str = "model",
                   inputs: Optional[Mapping[str, np.ndarray]] = None) -> ModelFacts:
    """``backend`` implements the model protocol: its three methods, facts of the declared
    types (names, shapes of the inputs named, a device, a positive call size or None), and, given
    ``inputs``, a ``predict`` that answers every declared output, one entry per row. Its facts."""
    name = type(backend).__name__
    for method in ("load", "facts", "predict"):
        assert callable(getattr(backend, method, None)), \
            f"{name} has no method {method!r}: a model backend implements {PROTOCOL}"
    model = backend.load(path)
    facts = backend.facts(model)
    assert isinstance(facts, ModelFacts), \
        f"{name}.facts returned {type(facts).__name__}, not a ModelFacts: {PROTOCOL}"
    for what in ("inputs", "outputs"):
        names = getattr(facts, what)
        assert isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names), \
            f"{name}.facts: {what} must be a non-empty list of names, not {names!r}"
        assert len(set(names)) == len(names), f"{name}.facts: {what} {list(names)} repeat a name"
    unknown = sorted(set(facts.input_shapes) - set(facts.inputs))
    assert not unknown, f"{name}.facts: input_shapes names {unknown}, which are not inputs {list(facts.inputs)}"
    for key, shape in facts.input_shapes.items():
        assert isinstance(shape, tuple) and all(d is None or isinstance(d, (int, str)) for d in shape), \
            f"{name}.facts: input_shapes[{key!r}] must be a tuple of int | str | None, not {shape!r}"
    assert isinstance(facts.device, str) and facts.device, f"{name}.facts: device must be a str, not {facts.device!r}"
    chunk = facts.default_chunk_rows
    assert chunk is None or (isinstance(chunk, int) and chunk > 0), \
        f"{name}.facts: default_chunk_rows must be a positive int or None, not {chunk!r}"
    if inputs is not None:
        rows = len(next(iter(inputs.values())))
        out = backend.predict(model, {k: inputs[k] for k in facts.inputs})
        assert isinstance(out, Mapping) and list(out) == list(facts.outputs), \
            f"{name}.predict answered {list(out) if isinstance(out, Mapping) else type(out).__name__}, " \
            f"not the declared outputs {list(facts.outputs)}"
        for key, value in out.items():
            assert np.shape(value)[:1] == (rows,), \
                f"{name}.predict: output {key!r} has shape {list(np.shape(value))} for {rows} rows"
    return facts


def score(handler: BatchModelHandler, inputs: Mapping[str, np.ndarray]) -> tuple[Inference, LoadedModel]:
    """``inputs`` scored by ``handler`` as one batch; the result and the loaded model."""
    model = handler.load_model()
    rows = len(next(iter(inputs.values())))
    features = dict(inputs) if len(inputs) > 1 else next(iter(inputs.values()))
    return handler.infer(model, Prepared(key=(0, 0), rows=rows, features=features)), model


def check_predictions(handler: BatchModelHandler, inputs: Mapping[str, np.ndarray],
                      reference: Optional[Mapping[str, np.ndarray]] = None, *, atol: float = 0.0,
                      rtol: float = 0.0) -> tuple[Inference, LoadedModel]:
    """The batch contract on one batch — every row scored, in order, each output named as the
    model names it with one entry per row — and, given a ``reference`` (output name → array),
    the same names, shapes and dtypes, and values within ``atol`` + ``rtol``."""
    result, model = score(handler, inputs)
    rows = len(next(iter(inputs.values())))
    assert result.failed == [], result.failed[:3]
    np.testing.assert_array_equal(result.ok_rows, np.arange(rows))
    assert list(result.outputs) == model.output_names()
    for name, value in result.outputs.items():
        assert np.shape(value)[:1] == (rows,), (name, np.shape(value))
    if reference is not None:
        assert list(result.outputs) == list(reference)
        for name, want in reference.items():
            have = result.outputs[name]
            assert have.shape == want.shape and have.dtype == want.dtype, name
            np.testing.assert_allclose(have, want, atol=atol, rtol=rtol, err_msg=name)
    return result, model


def check_distribution(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
    """Reduced precision keeps the distribution: each output's KL divergence from the reference
    ≤ ``parity.KL_LIMIT`` (docs/contract.md "Parity"), and its values did change, a little (the
    precision was applied)."""
    for name, (kl, diff) in parity.compare(reference, outputs).items():
        assert kl <= parity.KL_LIMIT, (name, kl, diff)
        assert 0 < diff < 0.1, (name, diff)


def check_bit_identical_reruns(make_handler: Callable[[], BatchModelHandler],
                               inputs: Mapping[str, np.ndarray]) -> None:
    """The same inputs on two handlers give the same bytes (contract §5.4: same input, triple,
    backend and device)."""
    first, _ = score(make_handler(), inputs)
    again, _ = score(make_handler(), inputs)
    for name in first.outputs:
        assert first.outputs[name].tobytes() == again.outputs[name].tobytes(), name


def check_rows_do_not_depend_on_their_neighbours(make_handler: Callable[[], BatchModelHandler],
                                                 inputs: Mapping[str, np.ndarray], *,
                                                 atol: float) -> None:
    """Each row scored alone agrees with it scored in the batch, within ``atol`` (kernels may
    sum in another order at another batch size): what makes isolating rejected rows and
    splitting calls safe."""
    whole, _ = score(make_handler(), inputs)
    for row in range(len(next(iter(inputs.values())))):
        single, _ = score(make_handler(), {k: v[row:row + 1] for k, v in inputs.items()})
        for name in whole.outputs:
            np.testing.assert_allclose(single.outputs[name][0], whole.outputs[name][row],
                                       atol=atol, err_msg=f"{name}, row {row}")


def check_a_bad_row_stays_in_its_row(make_handler: Callable[[], BatchModelHandler],
                                     inputs: Mapping[str, np.ndarray], rows: Sequence[int], *,
                                     atol: float) -> None:
    """NaN in ``rows`` of every float input changes no other row's outputs (beyond ``atol``):
    the pipeline quarantines a row whose output is not finite and commits its neighbours, which
    is right only if the bad value stayed in its row."""
    clean, _ = score(make_handler(), inputs)
    bad = {k: v.copy() for k, v in inputs.items()}
    floats = [k for k, v in bad.items() if np.issubdtype(v.dtype, np.floating)]
    assert floats, "no float input to put NaN in"
    for name in floats:
        bad[name][list(rows)] = np.nan
    result, _ = score(make_handler(), bad)
    keep = np.setdiff1d(np.arange(len(next(iter(inputs.values())))), rows)
    for name, want in clean.outputs.items():
        have = result.outputs[name]
        assert np.isfinite(have[keep]).all(), name
        np.testing.assert_allclose(have[keep], want[keep], atol=atol, rtol=0, err_msg=name)


def check_out_of_memory_loses_no_row(make_handler: Callable[..., BatchModelHandler],
                                     inputs: Mapping[str, np.ndarray], *, atol: float,
                                     rows: int = 400, fits: int = 100) -> None:
    """Calls of ``rows`` rows that run out of device memory above ``fits`` rows (the injected
    ``oom`` fault, batchinfer/faults.py) are halved until they fit and the same rows retried:
    every row scored once, in place, as a handler whose calls fit from the start scores it.

    ``make_handler(chunk_rows=n)`` builds a handler that calls the model on n rows at a time.
    """
    clean, _ = score(make_handler(chunk_rows=rows), inputs)
    with faults.scoped(faults.Faults("oom", fits)):
        handler = make_handler(chunk_rows=rows)
    result, _ = score(handler, inputs)
    halvings = 0
    while rows >> halvings > fits:
        halvings += 1
    assert result.failed == [] and result.oom_backoffs == halvings, (result.failed[:3], result.oom_backoffs)
    assert result.chunk_rows == rows >> halvings
    np.testing.assert_array_equal(result.ok_rows, clean.ok_rows)
    for name, want in clean.outputs.items():
        np.testing.assert_allclose(result.outputs[name], want, atol=atol, rtol=0, err_msg=name)


def check_threads_sharing_a_model(make_handler: Callable[[], BatchModelHandler],
                                  inputs: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Threads that share one loaded model, as a Beam worker's threads do (each with a handler
    of its own; one loads the model and the others are handed it), score ``inputs`` (one batch
    each) at once and get the bytes each batch gets alone. A backend that says it is
    ``thread_safe`` must really be; for one that does not, the handler's call lock is checked.
    That the calls did overlap is up to the scheduler: a pass is evidence, not proof."""
    handlers = [make_handler() for _ in inputs]
    model = handlers[0].load_model()

    def batch(arrays: Mapping[str, np.ndarray]) -> Prepared:
        rows = len(next(iter(arrays.values())))
        features = dict(arrays) if len(arrays) > 1 else next(iter(arrays.values()))
        return Prepared(key=(0, 0), rows=rows, features=features)

    alone = [handler.infer(model, batch(arrays)) for handler, arrays in zip(handlers, inputs)]
    start = threading.Barrier(len(inputs))
    together: list = [None] * len(inputs)

    def score_one(i: int) -> None:
        start.wait(timeout=60)
        try:
            together[i] = handlers[i].infer(model, batch(inputs[i]))
        except Exception as exc:  # noqa: BLE001 - reported below, in the test's thread
            together[i] = exc

    threads = [threading.Thread(target=score_one, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, (want, have) in enumerate(zip(alone, together)):
        assert isinstance(have, Inference), f"thread {i}: {have!r}"
        assert have.failed == [] and have.ok_rows.tolist() == want.ok_rows.tolist(), \
            f"thread {i}: {have.failed[:3]}"
        for name, value in want.outputs.items():
            assert have.outputs[name].tobytes() == value.tobytes(), f"{name}, thread {i}"


@dataclass(frozen=True, kw_only=True)
class BackendCase:
    """One backend, device and model under test, as :class:`BackendConformance` runs it.

    Attributes:
        make_handler: a fresh handler for the model; keyword ``chunk_rows`` (None: the
            backend's default) sets the rows per model call.
        inputs: ``inputs(rows, seed)``: model inputs by name for ``rows`` rows.
        reference: the expected outputs for some inputs (by output name), or None to check the
            batch contract only.
        atol, rtol: how close to the reference and to itself at other call sizes (``rtol``
            only against the reference).
        reduced_precision: the backend runs at fp16/bf16: the reference is checked by the
            distribution (``check_distribution``) as well.
        chunk_rows: the rows per call for the predictions check (None: the default; on a GPU,
            where a batch is one call, set it so that "more rows than a call" happens).
    """

    make_handler: Callable[..., BatchModelHandler]
    inputs: Callable[[int, int], Arrays]
    reference: Optional[Callable[[Arrays], Arrays]] = None
    atol: float = 1e-5
    rtol: float = 0.0
    reduced_precision: bool = False
    chunk_rows: Optional[int] = None


class BackendConformance:
    """The kit's checks as a pytest suite. Subclass it (named ``Test…``) and override the
    ``backend`` fixture; each test then runs on it::

        class TestMyBackend(BackendConformance):
            @pytest.fixture
            def backend(self):
                return BackendCase(
                    make_handler=lambda chunk_rows=None: handler_of(
                        MyBackend(), "model.bin", chunk_rows=chunk_rows),
                    inputs=lambda rows, seed: {"x": np.random.default_rng(seed).random((rows, 4), np.float32)},
                    reference=my_numpy_model)

    A fixture may be parametrized (over devices, precisions, models) like any other.
    """

    @pytest.fixture
    def backend(self) -> BackendCase:
        raise NotImplementedError("override the `backend` fixture with a BackendCase")

    def test_the_model_protocol(self, backend: BackendCase) -> None:
        handler = backend.make_handler()
        check_protocol(handler.model_backend, handler.model_path, backend.inputs(3, 0))

    @pytest.mark.parametrize("rows", SIZES)
    def test_predictions_and_the_batch_contract(self, backend: BackendCase, rows: int) -> None:
        inputs = backend.inputs(rows, 0)
        reference = backend.reference(inputs) if backend.reference else None
        atol, rtol = (0.05, 0.05) if backend.reduced_precision else (backend.atol, backend.rtol)
        check_predictions(backend.make_handler(chunk_rows=backend.chunk_rows), inputs, reference,
                          atol=atol, rtol=rtol)

    def test_reduced_precision_keeps_the_distribution(self, backend: BackendCase) -> None:
        if not backend.reduced_precision or backend.reference is None:
            pytest.skip("full precision, or no reference")
        inputs = backend.inputs(20_000, 11)
        result, _ = score(backend.make_handler(), inputs)
        check_distribution(backend.reference(inputs), result.outputs)

    def test_bit_identical_reruns(self, backend: BackendCase) -> None:
        check_bit_identical_reruns(backend.make_handler, backend.inputs(4097, 7))

    def test_rows_do_not_depend_on_their_neighbours(self, backend: BackendCase) -> None:
        atol = 0.05 if backend.reduced_precision else max(backend.atol, 1e-6)
        check_rows_do_not_depend_on_their_neighbours(backend.make_handler, backend.inputs(9, 3),
                                                     atol=atol)

    def test_a_bad_row_stays_in_its_row(self, backend: BackendCase) -> None:
        atol = 0.05 if backend.reduced_precision else max(backend.atol, 1e-6)
        check_a_bad_row_stays_in_its_row(backend.make_handler, backend.inputs(300, 9), [0, 150, 299],
                                         atol=atol)

    def test_threads_sharing_a_model(self, backend: BackendCase) -> None:
        check_threads_sharing_a_model(backend.make_handler,
                                      [backend.inputs(500, seed) for seed in range(4)])

    def test_out_of_memory_loses_no_row(self, backend: BackendCase) -> None:
        atol = 0.05 if backend.reduced_precision else max(backend.atol, 1e-6)
        check_out_of_memory_loses_no_row(backend.make_handler, backend.inputs(1000, 5), atol=atol)
