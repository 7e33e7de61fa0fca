"""Synthetic credit-risk data and a small model trained on it, for ``batchinfer demo``.

Everything here is a pure function of its arguments (seeded numpy generators, no clock), so the
demo writes the same bytes every time (given the same library versions). Only numpy, pyarrow
and onnx are used.

Data. :func:`generate` draws applications from a hidden latent credit quality, with realistic
marginals and correlations (income grows with age, the grade and the interest rate follow the
latent quality, the instalment follows the annuity formula, and so on), and a default label
from a hidden logistic ground truth with interactions (debt-to-income x revolving utilisation,
young renters, loan size relative to income). The label is never written to the Parquet data.

Deliberately bad rows. :func:`demo_shards` splits the demo partition into equal shards and
breaks exactly these rows (0-based row within the shard, i.e. ``_source_row``), one column
each, so that each fails ``credit_features@1``:

    =====  ======  ===============================  ===================================
    shard  row     change                           check that fails
    =====  ======  ===============================  ===================================
    1      1234    ``age`` = -3                     age in_range(18, 100)
    2      4321    ``annual_income`` = null         annual_income not_nullable
    3      15000   ``home_ownership`` = "CASTLE"    home_ownership isin
    4      777     ``debt_to_income`` = NaN         debt_to_income not_nullable, in_range
    4      19999   ``interest_rate`` = 300.0        interest_rate in_range(0, 40)
    =====  ======  ===============================  ===================================

(NaN counts as missing for pandera's polars backend, so that row fails two checks.) Rows
are taken modulo the shard size when shards are smaller than 20 000 rows, and a bad row whose
shard does not exist is skipped. With the defaults (120 000 rows, 6 shards) that is 5 bad rows,
about 0.004 % of the partition, well under the 1 % quarantine threshold.

Model. :func:`train_model` fits an MLP (D -> 32 -> 16 -> 1, ReLU, sigmoid) with mini-batch
Adam on the preprocessed features of a separately seeded training set, and
:func:`to_onnx` writes it as a plain ONNX graph (MatMul/Add/Relu/Sigmoid) with input
``features`` float32 ``[N, D]`` and output ``probability`` float32 ``[N, 1]``.
"""
from __future__ import annotations

import importlib.resources
import types
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# The columns of credit_features@1, in the schema's order, with their exact Arrow types.
COLUMNS: list[tuple[str, pa.DataType]] = [
    ("customer_id", pa.int64()),
    ("age", pa.int64()),
    ("annual_income", pa.float64()),
    ("debt_to_income", pa.float64()),
    ("loan_amount", pa.float64()),
    ("term_months", pa.int64()),
    ("interest_rate", pa.float64()),
    ("installment", pa.float64()),
    ("grade", pa.string()),
    ("home_ownership", pa.string()),
    ("loan_purpose", pa.string()),
    ("employment_years", pa.float64()),
    ("delinquencies_2y", pa.int64()),
    ("credit_lines", pa.int64()),
    ("open_accounts", pa.int64()),
    ("revolving_balance", pa.float64()),
    ("revolving_utilization", pa.float64()),
    ("inquiries_6m", pa.int64()),
    ("months_since_last_delinquency", pa.int64()),
    ("public_records", pa.int64()),
    ("mortgage_accounts", pa.int64()),
    ("credit_history_years", pa.float64()),
    ("has_cosigner", pa.bool_()),
    ("state", pa.string()),
]
ARROW_SCHEMA = pa.schema([pa.field(name, dtype) for name, dtype in COLUMNS])


@dataclass(frozen=True)
class BadRow:
    """One deliberately broken cell of the demo partition."""

    shard: int
    row: int  # 0-based within the shard, before taking it modulo the shard size
    column: str
    value: object
    reason: str


BAD_ROWS: tuple[BadRow, ...] = (
    BadRow(1, 1234, "age", -3, "age below 18"),
    BadRow(2, 4321, "annual_income", None, "annual_income missing"),
    BadRow(3, 15_000, "home_ownership", "CASTLE", "unknown home_ownership"),
    BadRow(4, 777, "debt_to_income", float("nan"), "debt_to_income is NaN"),
    BadRow(4, 19_999, "interest_rate", 300.0, "interest_rate above 40"),
)

# Random streams: one per use, so that changing one never shifts another.
_STREAM_DEMO_DATA = 0
_STREAM_TRAIN_DATA = 1
_STREAM_MODEL = 2
_STREAM_STANDARDISATION = 9

_GRADES = np.array(list("ABCDEFG"))
# Share of applications per grade, A (best) to G.
_GRADE_SHARES = np.array([0.17, 0.28, 0.25, 0.15, 0.08, 0.045, 0.025])
# Grade boundaries on the grade score (quality plus noise, sd 1.141), ascending; they are the
# normal quantiles that give _GRADE_SHARES: G below -2.237, ..., A above 1.089.
_GRADE_CUTS = np.array([-2.237, -1.684, -1.183, -0.599, 0.144, 1.089])
_GRADE_BASE_RATE = np.array([7.2, 10.8, 14.1, 17.9, 21.6, 25.3, 28.9])
_PURPOSES = np.array(
    [
        "debt_consolidation",
        "credit_card",
        "home_improvement",
        "major_purchase",
        "car",
        "medical",
        "small_business",
        "other",
    ]
)
_PURPOSE_SHARES = np.array([0.48, 0.20, 0.08, 0.05, 0.05, 0.03, 0.03, 0.08])
# USPS code and approximate population in millions (2020 census), used as sampling weights.
_STATE_POPULATION = {
    "CA": 39.5, "TX": 29.1, "FL": 21.5, "NY": 20.2, "PA": 13.0, "IL": 12.8, "OH": 11.8,
    "GA": 10.7, "NC": 10.4, "MI": 10.1, "NJ": 9.3, "VA": 8.6, "WA": 7.7, "AZ": 7.2,
    "MA": 7.0, "TN": 6.9, "IN": 6.8, "MD": 6.2, "MO": 6.2, "WI": 5.9, "CO": 5.8, "MN": 5.7,
    "SC": 5.1, "AL": 5.0, "LA": 4.7, "KY": 4.5, "OR": 4.2, "OK": 4.0, "CT": 3.6, "UT": 3.3,
    "IA": 3.2, "NV": 3.1, "AR": 3.0, "MS": 3.0, "KS": 2.9, "NM": 2.1, "NE": 2.0, "ID": 1.8,
    "WV": 1.8, "HI": 1.5, "NH": 1.4, "ME": 1.4, "RI": 1.1, "MT": 1.1, "DE": 1.0, "SD": 0.9,
    "ND": 0.8, "AK": 0.7, "DC": 0.7, "VT": 0.6, "WY": 0.6,
}
_STATES = np.array(list(_STATE_POPULATION))
_STATE_WEIGHTS = np.array(list(_STATE_POPULATION.values()))
_SOUTH = {"DE", "FL", "GA", "MD", "NC", "SC", "VA", "DC", "WV", "AL", "KY", "MS", "TN",
          "AR", "LA", "OK", "TX"}


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _choice(rng: np.random.Generator, values: np.ndarray, shares: np.ndarray, n: int):
    return values[rng.choice(len(values), size=n, p=shares / shares.sum())]


def generate(rows: int, rng: np.random.Generator, *, first_id: int = 100_000_001):
    """Draws ``rows`` loan applications and their hidden default labels.

    Args:
        rows: number of applications.
        rng: the random generator to draw from (consumed).
        first_id: ``customer_id`` of the first row; ids are consecutive.

    Returns:
        ``(table, default)``: a ``pyarrow.Table`` with exactly :data:`ARROW_SCHEMA`, and an
        ``int8`` array of 0/1 default labels (not part of the table).
    """
    n = rows
    quality = rng.standard_normal(n)  # hidden creditworthiness; higher is better

    age = np.clip(np.round(rng.normal(41.0, 12.5, n)), 18, 85)
    credit_history_years = np.round(
        np.clip((age - 18) * rng.uniform(0.35, 1.0, n) + rng.uniform(0.0, 1.0, n), 0, 80), 1
    )
    log_income = (
        np.log(58_000.0)
        + 0.22 * quality
        + 0.012 * (np.minimum(age, 60) - 40)
        + rng.normal(0.0, 0.45, n)
    )
    annual_income = np.round(np.clip(np.exp(log_income), 8_000, 1_500_000), -2)

    employment_years = np.round(np.minimum(age - 18, rng.gamma(1.8, 3.5, n)), 1)
    employment_missing = rng.random(n) < 0.06

    u = rng.random(n)
    p_mortgage = np.clip(0.08 + 0.016 * (age - 22) + 0.08 * quality, 0.02, 0.75)
    p_own = 0.10 + 0.002 * (age - 18)
    p_other = 0.02
    home_ownership = np.where(
        u < p_mortgage, "MORTGAGE",
        np.where(u < p_mortgage + p_own, "OWN",
                 np.where(u < p_mortgage + p_own + p_other, "OTHER", "RENT")),
    )
    mortgage_accounts = np.where(
        home_ownership == "MORTGAGE", 1 + rng.poisson(0.25, n), rng.poisson(0.05, n)
    )

    loan_purpose = _choice(rng, _PURPOSES, _PURPOSE_SHARES, n)
    log_amount = (
        np.log(11_000.0) + 0.35 * np.log(annual_income / 58_000.0) + rng.normal(0.0, 0.55, n)
    )
    loan_amount = np.round(np.clip(np.exp(log_amount), 1_000, 40_000), -1)
    p_long_term = np.clip(0.12 + 0.5 * (loan_amount - 5_000) / 35_000, 0.05, 0.7)
    term_months = np.where(rng.random(n) < p_long_term, 60, 36)

    grade_score = quality + rng.normal(0.0, 0.55, n)
    grade_index = len(_GRADE_CUTS) - np.searchsorted(_GRADE_CUTS, grade_score)
    grade = _GRADES[grade_index]
    interest_rate = np.round(
        np.clip(
            _GRADE_BASE_RATE[grade_index]
            + 1.1 * (term_months == 60)
            + rng.normal(0.0, 1.3, n),
            5.0,
            35.0,
        ),
        2,
    )
    monthly_rate = interest_rate / 1200.0
    installment = np.round(
        loan_amount * monthly_rate / (1.0 - (1.0 + monthly_rate) ** (-term_months)), 2
    )

    debt_to_income = np.round(
        np.clip(rng.gamma(2.4, 0.075, n) - 0.03 * quality, 0.0, 2.5), 4
    )
    revolving_balance = np.round(
        np.exp(np.log(7_500.0) + 0.5 * np.log(annual_income / 58_000.0)
               + rng.normal(0.0, 0.9, n)) * (rng.random(n) > 0.05),
        2,
    )
    revolving_utilization = np.round(
        np.clip(rng.beta(2.0, 2.6, n) - 0.09 * quality + rng.normal(0.0, 0.05, n), 0.0, 1.4), 4
    )
    credit_lines = 1 + rng.poisson(2.0 + 0.55 * credit_history_years)
    open_accounts = np.maximum(1, rng.binomial(credit_lines, 0.45))
    inquiries_6m = rng.poisson(np.exp(0.05 - 0.45 * quality))
    delinquencies_2y = rng.poisson(np.exp(-1.9 - 0.8 * quality))
    delinquency_unknown = rng.random(n) < 0.03
    # Anyone with a recent delinquency has one on file; older ones show up for weaker credit.
    older_delinquency = rng.random(n) < 1.0 / (1.0 + np.exp(0.6 + 0.9 * quality))
    months_since = np.where(
        delinquencies_2y > 0,
        rng.integers(0, 24, n),
        24 + np.round(rng.exponential(30.0, n)).astype(np.int64),
    )
    no_delinquency_on_file = (delinquencies_2y == 0) & ~older_delinquency
    public_records = rng.poisson(np.exp(-2.6 - 0.5 * quality))
    has_cosigner = rng.random(n) < np.where(age < 25, 0.12, 0.04)
    state = _choice(rng, _STATES, _STATE_WEIGHTS, n)

    # Hidden ground truth: a logistic model with interactions the network has to find.
    logit = (
        -2.85
        - 0.85 * quality
        + 2.4 * (debt_to_income - 0.18)
        + 0.9 * (revolving_utilization - 0.45)
        + 3.5 * np.maximum(debt_to_income - 0.3, 0.0) * np.maximum(revolving_utilization - 0.6, 0.0)
        + 0.10 * inquiries_6m
        + 0.40 * np.minimum(delinquencies_2y, 3)
        + 0.30 * np.minimum(public_records, 2)
        - 0.30 * np.log(annual_income / 58_000.0)
        + 0.9 * np.maximum(loan_amount / annual_income - 0.3, 0.0)
        + 0.25 * (term_months == 60)
        + 0.45 * (loan_purpose == "small_business")
        + 0.15 * (loan_purpose == "medical")
        - 0.45 * has_cosigner
        + 0.30 * employment_missing
        + 0.40 * ((age < 26) & (home_ownership == "RENT"))
        - 0.015 * np.minimum(credit_history_years, 25)
        + 0.10 * np.isin(state, list(_SOUTH))
    )
    default = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)

    arrays = {
        "customer_id": pa.array(first_id + np.arange(n, dtype=np.int64)),
        "age": pa.array(age.astype(np.int64)),
        "annual_income": pa.array(annual_income),
        "debt_to_income": pa.array(debt_to_income),
        "loan_amount": pa.array(loan_amount),
        "term_months": pa.array(term_months.astype(np.int64)),
        "interest_rate": pa.array(interest_rate),
        "installment": pa.array(installment),
        "grade": pa.array(grade, type=pa.string()),
        "home_ownership": pa.array(home_ownership, type=pa.string()),
        "loan_purpose": pa.array(loan_purpose, type=pa.string()),
        "employment_years": pa.array(employment_years, mask=employment_missing),
        "delinquencies_2y": pa.array(delinquencies_2y.astype(np.int64), mask=delinquency_unknown),
        "credit_lines": pa.array(credit_lines.astype(np.int64)),
        "open_accounts": pa.array(open_accounts.astype(np.int64)),
        "revolving_balance": pa.array(revolving_balance),
        "revolving_utilization": pa.array(revolving_utilization),
        "inquiries_6m": pa.array(inquiries_6m.astype(np.int64)),
        "months_since_last_delinquency": pa.array(
            months_since.astype(np.int64), mask=no_delinquency_on_file
        ),
        "public_records": pa.array(public_records.astype(np.int64)),
        "mortgage_accounts": pa.array(mortgage_accounts.astype(np.int64)),
        "credit_history_years": pa.array(credit_history_years),
        "has_cosigner": pa.array(has_cosigner),
        "state": pa.array(state, type=pa.string()),
    }
    table = pa.Table.from_arrays(
        [arrays[name].cast(dtype) for name, dtype in COLUMNS], schema=ARROW_SCHEMA
    )
    return table, default


def demo_shards(rows: int, shards: int, seed: int) -> list[pa.Table]:
    """The demo partition: ``shards`` equal tables with :data:`BAD_ROWS` broken in them.

    Raises:
        ValueError: if ``rows`` is not a positive multiple of ``shards``.
    """
    if shards < 1 or rows < shards or rows % shards:
        raise ValueError(f"rows ({rows}) must be a positive multiple of shards ({shards})")
    table, _ = generate(rows, _rng(seed, _STREAM_DEMO_DATA))
    shard_rows = rows // shards
    parts = [table.slice(i * shard_rows, shard_rows) for i in range(shards)]
    for bad in BAD_ROWS:
        if bad.shard >= shards:
            continue
        part = parts[bad.shard]
        index = part.schema.get_field_index(bad.column)
        values = part.column(index).to_pylist()
        values[bad.row % shard_rows] = bad.value
        column = pa.array(values, type=part.schema.field(index).type, from_pandas=False)
        parts[bad.shard] = part.set_column(index, part.schema.field(index), column)
    return parts


def load_preprocess() -> types.ModuleType:
    """Imports the packaged ``credit_preprocess.py`` (package data, not a submodule)."""
    source = (importlib.resources.files("batchinfer.demo") / "files" / "credit_preprocess.py")
    module = types.ModuleType("credit_preprocess")
    module.__file__ = "credit_preprocess.py"
    exec(compile(source.read_text(encoding="utf-8"), module.__file__, "exec"), module.__dict__)
    return module


@dataclass(frozen=True)
class MLP:
    """Weights of the demo network, float32, ``x @ w1 + b1 -> relu -> ... -> sigmoid``."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    w3: np.ndarray
    b3: np.ndarray

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Probabilities ``[N, 1]`` computed with numpy (the ONNX graph does the same)."""
        h1 = np.maximum(features @ self.w1 + self.b1, 0)
        h2 = np.maximum(h1 @ self.w2 + self.b2, 0)
        return 1.0 / (1.0 + np.exp(-(h2 @ self.w3 + self.b3)))


def train_model(
    features: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    *,
    hidden: tuple[int, int] = (32, 16),
    epochs: int = 6,
    batch_rows: int = 256,
    learning_rate: float = 3e-3,
    weight_decay: float = 1e-4,
) -> MLP:
    """Fits the MLP with mini-batch Adam on binary cross-entropy.

    Args:
        features: ``[N, D]`` preprocessed inputs.
        labels: ``[N]`` 0/1 targets.
        rng: generator for the initial weights and the batch order (consumed).

    Returns:
        The trained weights as float32.
    """
    x = np.ascontiguousarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64).reshape(-1, 1)
    sizes = [x.shape[1], *hidden, 1]
    params: list[np.ndarray] = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append(rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)))
        params.append(np.zeros((1, fan_out)))
    # Start the output at the base rate, so early steps learn structure, not the mean.
    base_rate = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
    params[-1][:] = np.log(base_rate / (1 - base_rate))
    first = [np.zeros_like(p) for p in params]
    second = [np.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch_rows):
            index = order[start : start + batch_rows]
            xb, yb = x[index], y[index]
            w1, b1, w2, b2, w3, b3 = params
            z1 = xb @ w1 + b1
            h1 = np.maximum(z1, 0)
            z2 = h1 @ w2 + b2
            h2 = np.maximum(z2, 0)
            p = 1.0 / (1.0 + np.exp(-(h2 @ w3 + b3)))
            d3 = (p - yb) / len(xb)  # d(mean BCE)/d(logit)
            d2 = (d3 @ w3.T) * (z2 > 0)
            d1 = (d2 @ w2.T) * (z1 > 0)
            grads = [
                xb.T @ d1, d1.sum(0, keepdims=True),
                h1.T @ d2, d2.sum(0, keepdims=True),
                h2.T @ d3, d3.sum(0, keepdims=True),
            ]
            step += 1
            for i, (param, grad) in enumerate(zip(params, grads)):
                if i % 2 == 0:
                    grad = grad + weight_decay * param
                first[i] = beta1 * first[i] + (1 - beta1) * grad
                second[i] = beta2 * second[i] + (1 - beta2) * grad * grad
                m_hat = first[i] / (1 - beta1**step)
                v_hat = second[i] / (1 - beta2**step)
                param -= learning_rate * m_hat / (np.sqrt(v_hat) + eps)
    w1, b1, w2, b2, w3, b3 = (np.ascontiguousarray(p, dtype=np.float32) for p in params)
    return MLP(w1, b1.reshape(-1), w2, b2.reshape(-1), w3, b3.reshape(-1))


def to_onnx(mlp: MLP, feature_names: list[str]):
    """Builds the ONNX graph of ``mlp`` (opset 17, IR version 8) and checks it.

    Returns:
        An ``onnx.ModelProto`` with input ``features`` float32 ``[N, D]`` and output
        ``probability`` float32 ``[N, 1]``.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    d = mlp.w1.shape[0]
    initializers = [
        numpy_helper.from_array(array, name)
        for name, array in [
            ("w1", mlp.w1), ("b1", mlp.b1), ("w2", mlp.w2),
            ("b2", mlp.b2), ("w3", mlp.w3), ("b3", mlp.b3),
        ]
    ]
    nodes = [
        helper.make_node("MatMul", ["features", "w1"], ["h1_matmul"], name="dense1"),
        helper.make_node("Add", ["h1_matmul", "b1"], ["h1_linear"], name="dense1_bias"),
        helper.make_node("Relu", ["h1_linear"], ["h1"], name="relu1"),
        helper.make_node("MatMul", ["h1", "w2"], ["h2_matmul"], name="dense2"),
        helper.make_node("Add", ["h2_matmul", "b2"], ["h2_linear"], name="dense2_bias"),
        helper.make_node("Relu", ["h2_linear"], ["h2"], name="relu2"),
        helper.make_node("MatMul", ["h2", "w3"], ["logit_matmul"], name="dense3"),
        helper.make_node("Add", ["logit_matmul", "b3"], ["logit"], name="dense3_bias"),
        helper.make_node("Sigmoid", ["logit"], ["probability"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "credit_risk_mlp",
        inputs=[helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", d])],
        outputs=[helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["N", 1])],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
        producer_name="batchinfer-demo",
        producer_version="1",
        doc_string=(
            "Demo credit-risk model: probability of default from credit_features@1 rows "
            "preprocessed by credit_preprocess:transform. MLP D->32->16->1 trained on "
            "synthetic data; not for real decisions."
        ),
    )
    helper.set_model_props(model, {"feature_names": ",".join(feature_names)})
    onnx.checker.check_model(model, full_check=True)
    return model


def train_demo_model(seed: int = 0, *, rows: int = 60_000):
    """Generates a training set, trains the MLP on its preprocessed features, exports it.

    Returns:
        ``(model_proto, mlp)``.
    """
    preprocess = load_preprocess()
    table, labels = generate(rows, _rng(seed, _STREAM_TRAIN_DATA), first_id=900_000_001)
    features = preprocess.transform(table.combine_chunks().to_batches()[0])
    mlp = train_model(features, labels, _rng(seed, _STREAM_MODEL))
    return to_onnx(mlp, list(preprocess.OUTPUT_COLUMNS)), mlp


def derive_standardisation(
    rows: int = 1_000_000, seed: int = 123
) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation of each numeric input of ``credit_preprocess``.

    This is how the constants written into ``credit_preprocess.NUMERIC`` were obtained, once;
    the module never computes them itself, so that its output depends on the row alone.
    """
    preprocess = load_preprocess()
    table, _ = generate(rows, _rng(seed, _STREAM_STANDARDISATION))
    block = preprocess.raw_numeric(table.combine_chunks().to_batches()[0])
    return {
        name: (float(block[:, j].mean()), float(block[:, j].std()))
        for j, name in enumerate(preprocess.NUMERIC)
    }


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # Average ranks over runs of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    run_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(run_rank, ends - starts)
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))
