"""credit_features, version 1: one row per loan application, as scored by credit_risk.

Published schema versions are immutable. To change a column, a type or a check, copy this
file to ``v2.py``, edit the copy and point jobs (and a newly stamped model) at
``credit_features@2``.

Money is in US dollars, rates are percentages per year, ratios are plain fractions
(``debt_to_income`` 0.25 means a quarter of monthly income goes to debt payments).
"""
import pandera.polars as pa
import polars as pl

GRADES = ["A", "B", "C", "D", "E", "F", "G"]
HOME_OWNERSHIP = ["RENT", "OWN", "MORTGAGE", "OTHER"]
LOAN_PURPOSES = [
    "debt_consolidation",
    "credit_card",
    "home_improvement",
    "major_purchase",
    "car",
    "medical",
    "small_business",
    "other",
]

SCHEMA = pa.DataFrameSchema(
    {
        "customer_id": pa.Column(pl.Int64, nullable=False),
        "age": pa.Column(pl.Int64, pa.Check.in_range(18, 100)),
        "annual_income": pa.Column(pl.Float64, pa.Check.ge(0)),
        "debt_to_income": pa.Column(pl.Float64, pa.Check.in_range(0, 10)),
        "loan_amount": pa.Column(pl.Float64, pa.Check.in_range(500, 100_000)),
        "term_months": pa.Column(pl.Int64, pa.Check.isin([36, 60])),
        "interest_rate": pa.Column(pl.Float64, pa.Check.in_range(0, 40)),
        "installment": pa.Column(pl.Float64, pa.Check.ge(0)),
        "grade": pa.Column(pl.Utf8, pa.Check.isin(GRADES)),
        "home_ownership": pa.Column(pl.Utf8, pa.Check.isin(HOME_OWNERSHIP)),
        "loan_purpose": pa.Column(pl.Utf8, pa.Check.isin(LOAN_PURPOSES)),
        # Null when the applicant did not state it.
        "employment_years": pa.Column(pl.Float64, pa.Check.in_range(0, 60), nullable=True),
        # Null when the bureau record was unavailable.
        "delinquencies_2y": pa.Column(pl.Int64, pa.Check.ge(0), nullable=True),
        "credit_lines": pa.Column(pl.Int64, pa.Check.ge(0)),
        "open_accounts": pa.Column(pl.Int64, pa.Check.ge(0)),
        "revolving_balance": pa.Column(pl.Float64, pa.Check.ge(0)),
        "revolving_utilization": pa.Column(pl.Float64, pa.Check.in_range(0, 1.5)),
        "inquiries_6m": pa.Column(pl.Int64, pa.Check.ge(0)),
        # Null when there is no delinquency on file at all.
        "months_since_last_delinquency": pa.Column(pl.Int64, pa.Check.ge(0), nullable=True),
        "public_records": pa.Column(pl.Int64, pa.Check.ge(0)),
        "mortgage_accounts": pa.Column(pl.Int64, pa.Check.ge(0)),
        "credit_history_years": pa.Column(pl.Float64, pa.Check.in_range(0, 85)),
        "has_cosigner": pa.Column(pl.Boolean),
        # Two-letter USPS code of the applicant's state (DC included).
        "state": pa.Column(pl.Utf8, pa.Check.str_length(2, 2)),
    },
    strict=True,
    name="credit_features@1",
)

# The model's input columns, in order: everything but the id.
FEATURES = [name for name in SCHEMA.columns if name != "customer_id"]
