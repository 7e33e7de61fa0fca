"""handlers/explain.py: the attribution methods and what is kept of them (contract §6
"Explanations"), checked against exact answers: Shapley values enumerated over every coalition,
integrated gradients against Captum's own on the same model, the sample rule against its
definition."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from batchinfer.errors import SpecError
from batchinfer.handlers.explain import (
    ExplainPlan,
    explain_rows,
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
    from batchinfer.handlers.pytorch import TorchModel, TorchModelHandler

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).eval()
    model = TorchModel(module=net, device=torch.device("cpu"), inputs=["x"], outputs=["y"],
                       input_dtypes={"x": np.dtype("float32")}, autocast=None)
    handler = TorchModelHandler("unused.pt2", digest="d", device="cpu")
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
