"""handlers/explain.py: the attribution methods and what is kept of them (contract §6
"Explanations"), checked against exact answers: Shapley values enumerated over every coalition,
integrated gradients against Captum's own on the same model, the sample rule against its
definition."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from batchinfer.errors import DataQualityError, SpecError
from batchinfer.handlers.explain import (
    GRADIENT_POINTS,
    GRADIENT_ROWS,
    PERMUTATION_CHUNK_ROWS,
    ExplainPlan,
    explain_rows,
    gradient_rows,
    grouped,
    orderings,
    permutation,
    selected,
    top,
)
from batchinfer.spec import ExplainSpec


def exact_shapley(f, x: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Shapley values with ``base`` as the absent value, by enumerating every coalition."""
    d = x.size
    out = np.zeros(d)
    for i in range(d):
        others = [j for j in range(d) if j != i]
        for size in range(d):
            for subset in itertools.combinations(others, size):
                weight = math.factorial(size) * math.factorial(d - size - 1) / math.factorial(d)
                z = base.copy()
                z[list(subset)] = x[list(subset)]
                without = f(z[None, :])[0]
                z[i] = x[i]
                out[i] += weight * (f(z[None, :])[0] - without)
    return out


def interacting(z: np.ndarray) -> np.ndarray:
    """Not additive: products and a max, so Shapley values are not w·(x − b)."""
    return z[:, 0] * z[:, 1] + np.maximum(z[:, 2], 0.5) - 0.3 * z[:, 0] * z[:, 2] * z[:, 1]


def test_permutation_over_every_ordering_is_the_exact_shapley_value(monkeypatch):
    import batchinfer.handlers.explain as explain

    rng = np.random.default_rng(3)
    x, base = rng.standard_normal((5, 3)), np.array([0.1, -0.2, 0.3])
    # The average over all 6 orderings of 3 positions is the Shapley value itself.
    every = np.array(list(itertools.permutations(range(3))))
    monkeypatch.setattr(explain, "orderings", lambda d, samples, seed: every)
    got = permutation(x, base, interacting, len(every), 0)
    for row in range(5):
        np.testing.assert_allclose(got[row], exact_shapley(interacting, x[row], base), atol=1e-12)


def test_permutation_is_exact_on_an_additive_model_and_complete_on_any():
    rng = np.random.default_rng(0)
    x, base = rng.standard_normal((40, 6)), rng.standard_normal(6)
    w = rng.standard_normal(6)
    np.testing.assert_allclose(permutation(x, base, lambda z: z @ w + 1.0, 2, 5), w * (x - base),
                               atol=1e-12)
    values = permutation(x[:, :3], base[:3], interacting, 4, 1)
    np.testing.assert_allclose(values.sum(axis=1),
                               interacting(x[:, :3]) - interacting(base[None, :3])[0], atol=1e-12)


def test_a_rows_attribution_does_not_depend_on_its_batch():
    rng = np.random.default_rng(1)
    x, base = rng.standard_normal((2500, 3)), np.zeros(3)
    whole = permutation(x, base, interacting, 6, 9)            # crosses the 1,024-row chunks
    alone = permutation(x[1700:1701], base, interacting, 6, 9)
    assert np.array_equal(whole[1700:1701], alone)


def test_orderings_come_from_the_seed_alone_in_antithetic_pairs():
    a, b = orderings(7, 6, 42), orderings(7, 6, 42)
    assert np.array_equal(a, b) and not np.array_equal(a, orderings(7, 6, 43))
    assert all(np.array_equal(a[i + 1], a[i][::-1]) for i in range(0, 6, 2))
    assert all(sorted(o) == list(range(7)) for o in a)


def test_integrated_gradients_is_captums_on_the_same_model():
    torch = pytest.importorskip("torch")
    captum = pytest.importorskip("captum.attr")
    from batchinfer.handlers.pytorch import TorchBackend, TorchModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    model = TorchModel(module=net, device=torch.device("cpu"), inputs=["x"], outputs=["y"],
                       input_dtypes={"x": np.dtype("float32")}, autocast=None)
    handler = TorchBackend(device="cpu")
    x = np.random.default_rng(2).standard_normal((9, 4)).astype(np.float32)
    base = np.full(4, 0.25)
    got, gap = handler.attribute(model, "x", x, base, "y", "integrated_gradients", 24)
    want, delta = captum.IntegratedGradients(lambda t: net(t)[:, 0]).attribute(
        torch.from_numpy(x), baselines=torch.full((9, 4), 0.25), n_steps=24,
        method="gausslegendre", return_convergence_delta=True)
    np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gap, delta.double().numpy(), atol=1e-7)
    grads, zero = handler.attribute(model, "x", x, base, "y", "gradient_x_input", 0)
    xt = torch.from_numpy(x).requires_grad_(True)
    (g,) = torch.autograd.grad(net(xt).sum(), xt)
    np.testing.assert_allclose(grads, (g * (xt - 0.25)).detach().double().numpy(), atol=1e-7)
    assert not zero.any()


def test_explain_rows_returns_the_baseline_value_and_each_rows_gap():
    plan = ExplainPlan(method="permutation", input="x", output="y", samples=2, seed=0,
                       baseline=(1.0, 2.0))
    x = np.array([[0.0, 0.0], [3.0, 1.0]])
    values, at_base, gap = explain_rows(plan, x, lambda z: 2 * z[:, 0] - z[:, 1])
    assert at_base == 0.0 and np.allclose(gap, 0) and np.allclose(values, [[-2, 2], [4, 1]])
    with pytest.raises(SpecError, match="needs the model's gradients"):
        explain_rows(ExplainPlan(method="gradient_x_input", input="x", output="y"), x,
                     lambda z: z[:, 0])
    with pytest.raises(SpecError, match="explain.baseline has 2 values"):
        plan.baseline_row(3)


def test_grouped_sums_the_positions_of_one_feature_and_top_keeps_the_largest():
    values = np.array([[1.0, -3.0, 0.5, 2.0], [0.1, 0.2, -0.3, 0.0]])
    by_feature = grouped(values, (0, 1, 1, 2), 3)
    np.testing.assert_allclose(by_feature, [[1.0, -2.5, 2.0], [0.1, -0.1, 0.0]])
    positions, kept = top(by_feature, 2)
    assert positions.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(kept, [[-2.5, 2.0], [0.1, -0.1]])
    positions, kept = top(by_feature, None)
    assert positions.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_the_sample_is_the_rows_whose_hash_falls_below_the_fraction():
    hashes = ["0" * 16, "7fffffffffffffff", "8000000000000000", "f" * 16]
    assert selected(hashes, 0.5).tolist() == [True, True, False, False]
    assert selected(hashes, 1.0).all()
    # read in numpy, digit by digit: the same rows as reading each hash as a Python int
    rng = np.random.default_rng(5)
    many = [f"{int(v):016x}" for v in rng.integers(0, 2**64, 2000, dtype=np.uint64)]
    for fraction in (0.01, 0.3, 0.999):
        expected = [int(h, 16) < int(fraction * 2**64) for h in many]
        assert selected(np.array(many, dtype=object), fraction).tolist() == expected


def test_the_declaration_holds_every_parameter_but_the_thresholds():
    spec = ExplainSpec(method="permutation", top_k="all", tolerance=0.5)
    assert spec.declared() == ('{"baseline":"zeros","fraction":1.0,"method":"permutation",'
                               '"samples":8,"seed":0,"top_k":"all"}')
    assert ExplainSpec(method="integrated_gradients").steps == 50
    with pytest.raises(ValueError, match="explain.seed is a parameter of permutation"):
        ExplainSpec(method="gradient_x_input", seed=1)
    with pytest.raises(ValueError, match="positive number"):
        ExplainSpec(method="permutation", top_k=0)


def in_batches(plan: ExplainPlan, x: np.ndarray, rows: int, predict, gradients=None) -> np.ndarray:
    """``explain_rows`` over ``x`` in batches of ``rows`` rows, as a job with ``batch.rows``
    would call it."""
    return np.concatenate([explain_rows(plan, x[s:s + rows], predict, gradients)[0]
                           for s in range(0, x.shape[0], rows)])


def test_every_gradient_call_has_one_shape_whatever_the_batch():
    calls: list[tuple[int, ...]] = []

    def gradients(z, base):   # a row's "attribution" is the row itself: it shows the padding
        calls.append(z.shape)
        return z.astype(np.float64) - base, np.zeros(z.shape[0])

    x = np.random.default_rng(4).standard_normal((200, 3)).astype(np.float32)
    plan = ExplainPlan(method="integrated_gradients", input="x", output="y", steps=50)
    for rows in (1, 7, 64, 65, 200):
        calls.clear()
        got = in_batches(plan, x, rows, lambda z: z.sum(axis=1), gradients)
        assert set(calls) == {(GRADIENT_ROWS, 3)}, (rows, set(calls))
        np.testing.assert_array_equal(got, x.astype(np.float64))   # the padding is dropped
    # past GRADIENT_POINTS / GRADIENT_ROWS steps a row goes alone (the backend would split it)
    assert gradient_rows(GRADIENT_POINTS // GRADIENT_ROWS) == GRADIENT_ROWS
    assert gradient_rows(GRADIENT_POINTS // GRADIENT_ROWS + 1) == 1
    assert gradient_rows(0) == GRADIENT_ROWS    # gradient × input: one point a row


def test_the_backend_makes_one_call_of_each_group():
    # a group the torch backend cut again would bring back shapes that depend on the steps
    from batchinfer.handlers import pytorch

    assert GRADIENT_POINTS <= pytorch.IG_POINTS and GRADIENT_ROWS % 64 == 0


def test_every_permutation_call_has_one_shape_whatever_the_batch():
    shapes: set[tuple[int, ...]] = set()

    def predict(z):
        shapes.add(z.shape)
        return interacting(z)

    x = np.random.default_rng(6).standard_normal((300, 3))
    whole = permutation(x, np.zeros(3), predict, 4, 2)
    for rows in (1, 7, 300):
        got = np.concatenate([permutation(x[s:s + rows], np.zeros(3), predict, 4, 2)
                              for s in range(0, 300, rows)])
        assert np.array_equal(got, whole)
    assert shapes == {(4 * PERMUTATION_CHUNK_ROWS, 3)}


def _torch_program(squash: bool):
    torch = pytest.importorskip("torch")
    from batchinfer.handlers.pytorch import TorchBackend, TorchModel

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    net = torch.nn.Sequential(*layers, *([torch.nn.Sigmoid()] if squash else [])).eval()
    program = torch.export.export(net, (torch.randn(8, 4),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    model = TorchModel(module=program, device=torch.device("cpu"), inputs=["x"], outputs=["y"],
                       input_dtypes={"x": np.dtype("float32")}, autocast=None)
    handler = TorchBackend(device="cpu")

    def predict(z):
        return handler.predict(model, {"x": z})["y"].astype(np.float64).reshape(-1)

    def gradients(method, steps):
        return lambda z, base: handler.attribute(model, "x", z, base, "y", method, steps)

    return predict, gradients


@pytest.mark.parametrize("method, steps", [("integrated_gradients", 16),
                                           ("gradient_x_input", 0), ("permutation", 0)])
def test_a_rows_attributions_are_the_same_bytes_in_any_batch(method, steps):
    # tanh and sigmoid: a vector loop's tail computes them by another routine, and the batch's
    # shape decides which rows land there (contract §5.4, §6 "Explanations")
    pytest.importorskip("captum")
    predict, gradients = _torch_program(squash=True)
    plan = ExplainPlan(method=method, input="x", output="y", steps=steps,
                       samples=4 if method == "permutation" else 0, baseline=(0.5, -0.5, 1.0, 0.0))
    x = np.random.default_rng(8).standard_normal((300, 4)).astype(np.float32)
    by = {rows: in_batches(plan, x, rows, predict, gradients(method, steps)) for rows in (7, 64, 300)}
    for rows, got in by.items():
        differ = int((~(got == by[300]).all(axis=1)).sum())
        assert got.tobytes() == by[300].tobytes(), f"{differ} rows differ in batches of {rows}"


def test_non_finite_attributions_are_never_complete_and_refused():
    plan = ExplainPlan(method="gradient_x_input", input="x", output="y")
    x = np.ones((5, 2), dtype=np.float32)

    def gradients(z, base):
        values = z.astype(np.float64) - base
        values[1, 0] = np.nan            # 0/0 in the model's gradient
        return values, np.zeros(z.shape[0])

    with pytest.raises(DataQualityError, match="1 of 5 explained rows .* not finite"):
        explain_rows(plan, x, lambda z: z.sum(axis=1), gradients)
    # a NaN gap with finite values: abs(nan) > tolerance is false, so it is refused here
    with pytest.raises(DataQualityError, match="2 of 5 explained rows"):
        explain_rows(plan, x, lambda z: z.sum(axis=1),
                     lambda z, base: (np.ones(z.shape), np.where(np.arange(z.shape[0]) < 2, np.nan, 0.0)))
    # permutation: a model that is not finite between the baseline and the rows
    walk = ExplainPlan(method="permutation", input="x", output="y", samples=2)
    with pytest.raises(DataQualityError, match="model's output is not finite"), np.errstate(invalid="ignore"):
        explain_rows(walk, x, lambda z: np.where(z[:, 0] == 1, np.inf, 0.0) + z[:, 1])


def test_a_baseline_the_model_or_the_input_cannot_hold_is_the_baselines_fault():
    x = np.ones((3, 2), dtype=np.float32)
    plan = ExplainPlan(method="permutation", input="x", output="y", samples=2)
    with pytest.raises(SpecError, match=r"at the baseline \(explain.baseline\) is -inf"), \
            np.errstate(divide="ignore"):
        explain_rows(plan, x, lambda z: np.log(np.abs(z[:, 0])))      # log(0) at zeros
    from_background = ExplainPlan(method="permutation", input="x", output="y", samples=2,
                                  background=True, baseline=(1.0, 0.0))
    with pytest.raises(SpecError, match=r"\(explain.background\) is nan"):
        explain_rows(from_background, x, lambda z: np.full(z.shape[0], np.nan))
    # finite in the spec, infinite in the model input's float32
    huge = ExplainPlan(method="permutation", input="x", output="y", samples=2, baseline=(1e39, 0.0))
    with pytest.raises(SpecError, match="explain.baseline: value 1e.39 at position 0 is not a finite float32"):
        explain_rows(huge, x, lambda z: z.sum(axis=1))
    assert huge.baseline_row(2, np.float64)[0] == 1e39


@pytest.mark.parametrize("setting, message", [
    ({"baseline": [0.0, float("nan")]}, r"explain.baseline\[1\] is nan"),
    ({"baseline": [float("-inf")]}, r"explain.baseline\[0\] is -inf"),
    ({"baseline": []}, "explain.baseline is empty"),
    ({"tolerance": float("nan")}, "finite number"),
    ({"tolerance": float("inf")}, "finite number"),
    ({"fraction": float("nan")}, "finite number"),
    ({"fraction": 0.0}, "greater than 0"),
    ({"max_incomplete_fraction": float("inf")}, "finite number"),
    ({"max_incomplete_fraction": 1.5}, "less than or equal to 1"),
    ({"seed": 2**63}, "less than or equal to"),
])
def test_every_numeric_setting_is_finite_and_in_its_range(setting, message):
    with pytest.raises(ValueError, match=message):
        ExplainSpec(method="permutation", **setting)


def test_a_spec_error_names_the_key():
    from batchinfer.spec import parse_spec

    job = {"name": "j", "input": {"path": "d/*.parquet"}, "schema": "s@1",
           "model": {"uri": "m.onnx"}, "output": {"path": "out"},
           "explain": {"method": "permutation", "tolerance": float("nan")}}
    with pytest.raises(SpecError, match=r"explain.tolerance: Input should be a finite number \(got 'nan'\)"):
        parse_spec(job)
