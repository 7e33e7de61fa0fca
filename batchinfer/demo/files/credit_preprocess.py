"""Preprocessing for the credit_risk model: credit_features@1 rows -> float32 model input.

``transform(batch)`` takes a ``pyarrow.RecordBatch`` of validated credit_features@1 rows and
returns a C-contiguous ``float32`` array of shape ``[rows, len(OUTPUT_COLUMNS)]``, one column
per entry of ``OUTPUT_COLUMNS``, in that order:

* numeric columns: missing values imputed with fixed constants, money columns (income, loan,
  instalment, revolving balance) through ``log1p``, then standardised as ``(x - mean) / scale``;
* missing-value indicators (0/1) for the nullable columns, and ``has_cosigner`` as 0/1;
* categoricals one-hot encoded in a fixed category order (an unknown value gives all zeros);
  the state is first mapped to its US census region.

Every constant is written below. They were derived once, offline, from a large sample of
training data, so the output depends on nothing but the row: the same row gives the same
features in any batch, run after run. The work is vectorised with pyarrow.compute and numpy;
there is no Python loop over rows. The module reads no files (``ASSETS`` is empty), and the
whole source is covered by the job's preprocess hash: editing a constant changes the hash, and
the model must then be re-stamped.
"""
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ASSETS = []  # files this module reads; none

# Fill-in values for nulls in the nullable columns.
IMPUTE = {
    "employment_years": 4.8,  # the median
    "delinquencies_2y": 0,  # no bureau record: assume none
    "months_since_last_delinquency": 120,  # none on file: treat as long ago
}

# name -> (transform, mean, scale), applied as (transform(x) - mean) / scale. Mean and scale
# are the mean and standard deviation of transform(x), nulls imputed, over 1,000,000 training
# rows (batchinfer.demo.train.derive_standardisation), rounded to three significant digits.
NUMERIC = {
    "age": ("identity", 41.2, 12.1),
    "annual_income": ("log1p", 10.98, 0.52),
    "debt_to_income": ("identity", 0.18, 0.119),
    "loan_amount": ("log1p", 9.31, 0.573),
    "interest_rate": ("identity", 14.31, 5.54),
    "installment": ("log1p", 5.85, 0.552),
    "employment_years": ("identity", 5.7, 4.27),
    "delinquencies_2y": ("identity", 0.2, 0.489),
    "credit_lines": ("identity", 11.9, 6.2),
    "open_accounts": ("identity", 5.37, 3.24),
    "revolving_balance": ("log1p", 8.48, 2.15),
    "revolving_utilization": ("identity", 0.436, 0.231),
    "inquiries_6m": ("identity", 1.16, 1.21),
    "months_since_last_delinquency": ("identity", 82.2, 46.2),
    "public_records": ("identity", 0.084, 0.293),
    "mortgage_accounts": ("identity", 0.511, 0.684),
    "credit_history_years": ("identity", 16.1, 9.55),
}

CATEGORIES = {
    "grade": ["A", "B", "C", "D", "E", "F", "G"],
    "home_ownership": ["RENT", "OWN", "MORTGAGE", "OTHER"],
    "loan_purpose": [
        "debt_consolidation",
        "credit_card",
        "home_improvement",
        "major_purchase",
        "car",
        "medical",
        "small_business",
        "other",
    ],
}

REGIONS = ["northeast", "midwest", "south", "west"]
STATE_REGION = {
    **dict.fromkeys(["CT", "ME", "MA", "NH", "RI", "VT", "NJ", "NY", "PA"], "northeast"),
    **dict.fromkeys(
        ["IL", "IN", "MI", "OH", "WI", "IA", "KS", "MN", "MO", "NE", "ND", "SD"], "midwest"
    ),
    **dict.fromkeys(
        ["DE", "FL", "GA", "MD", "NC", "SC", "VA", "DC", "WV", "AL", "KY", "MS", "TN", "AR",
         "LA", "OK", "TX"],
        "south",
    ),
    **dict.fromkeys(
        ["AZ", "CO", "ID", "MT", "NV", "NM", "UT", "WY", "AK", "CA", "HI", "OR", "WA"], "west"
    ),
}

OUTPUT_COLUMNS = [
    *NUMERIC,
    "term_60",
    "has_cosigner",
    "employment_years_missing",
    "delinquencies_2y_missing",
    "no_delinquency_on_file",
    *(f"{column}={value}" for column, values in CATEGORIES.items() for value in values),
    *(f"region={region}" for region in REGIONS),
]

# The schema feature each column of the model input comes from, one entry per OUTPUT_COLUMNS
# entry: batchinfer's explain sums a feature's columns (its one-hot columns, its missing-value
# indicator) into one attribution, so "why" is said in the schema's features.
INPUT_FEATURES = [
    *NUMERIC,
    "term_months",
    "has_cosigner",
    "employment_years",
    "delinquencies_2y",
    "months_since_last_delinquency",
    *(column for column, values in CATEGORIES.items() for _ in values),
    *("state" for _ in REGIONS),
]

_STATES = pa.array(list(STATE_REGION), type=pa.string())
_REGION_OF_STATE = np.array([REGIONS.index(STATE_REGION[s]) for s in STATE_REGION])


def _values(batch, name):
    """A column as float64 numpy, nulls imputed for the nullable columns."""
    column = batch.column(name)
    if name in IMPUTE:
        column = pc.fill_null(column, IMPUTE[name])
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)


def _is_null(batch, name):
    return np.asarray(pc.is_null(batch.column(name)).to_numpy(zero_copy_only=False))


def _codes(batch, name, value_set):
    """Index of each row's value in the ``value_set`` array; -1 for a value not in it."""
    indices = pc.index_in(batch.column(name), value_set=value_set)
    return np.asarray(pc.fill_null(indices, -1).to_numpy(zero_copy_only=False))


def raw_numeric(batch):
    """The numeric block before standardisation, ``[rows, len(NUMERIC)]`` float64.

    Kept apart from :func:`transform` so that the constants above can be re-derived from it.
    """
    block = np.empty((batch.num_rows, len(NUMERIC)), dtype=np.float64)
    for j, (name, (kind, _, _)) in enumerate(NUMERIC.items()):
        x = _values(batch, name)
        block[:, j] = np.log1p(x) if kind == "log1p" else x
    return block


def transform(batch):
    """Turns a batch of credit_features@1 rows into the model's input.

    Args:
        batch: a ``pyarrow.RecordBatch`` (or ``Table``) with the credit_features@1 columns.

    Returns:
        ``float32`` array ``[batch.num_rows, len(OUTPUT_COLUMNS)]``, C-contiguous.
    """
    rows = batch.num_rows
    out = np.zeros((rows, len(OUTPUT_COLUMNS)), dtype=np.float32)
    mean = np.array([m for _, m, _ in NUMERIC.values()])
    scale = np.array([s for _, _, s in NUMERIC.values()])
    out[:, : len(NUMERIC)] = (raw_numeric(batch) - mean) / scale
    j = len(NUMERIC)

    out[:, j] = _values(batch, "term_months") == 60
    out[:, j + 1] = _values(batch, "has_cosigner")
    out[:, j + 2] = _is_null(batch, "employment_years")
    out[:, j + 3] = _is_null(batch, "delinquencies_2y")
    out[:, j + 4] = _is_null(batch, "months_since_last_delinquency")
    j += 5

    row_index = np.arange(rows)
    for name, values in CATEGORIES.items():
        codes = _codes(batch, name, pa.array(values, type=pa.string()))
        known = codes >= 0
        out[row_index[known], j + codes[known]] = 1.0
        j += len(values)

    state = _codes(batch, "state", _STATES)
    known = state >= 0
    out[row_index[known], j + _REGION_OF_STATE[state[known]]] = 1.0
    return out
