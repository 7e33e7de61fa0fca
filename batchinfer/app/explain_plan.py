"""The job's ``explain`` section, resolved against each loaded model before any work (contract §6
"Explanations"): what the declaration records of it, and the plan its workers run.

Exit 2 here for what no batch could fix (a model with several inputs, an output that is not one
of the model's, a baseline or feature mapping of another width than the model's input, an
``INPUT_FEATURES`` naming no schema feature); exit 5 when Captum, which integrated gradients
needs, is not installed.
"""
from __future__ import annotations

import hashlib
import importlib.util
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ContractError, ModelError, SpecError
from ..io.storage import url_to_fs
from ..spec import COMPLETE_METHODS, ExplainSpec

if TYPE_CHECKING:
    from ..handlers.base import BatchModelHandler
    from ..handlers.explain import ExplainPlan
    from .resolve import Resolved

# The declaration's key (sidecar key; registry tag batchinfer.explain) for the explain section.
DECLARED = "explain"
# What a preprocessing module names to say which schema feature each model-input position came
# from: a list of schema features, one per position (repeated for a feature spread over several).
INPUT_FEATURES = "INPUT_FEATURES"


# The declaration's key for the sha256 of explain.background's bytes (registry tag
# batchinfer.explain_background_sha256).
BACKGROUND_SHA256 = "explain_background_sha256"


def declared(explain: ExplainSpec | None) -> dict[str, str]:
    """What the model's declaration records of ``explain`` (nothing without one)."""
    return {} if explain is None else {DECLARED: explain.declared()}


def background_bytes(explain: ExplainSpec | None) -> bytes | None:
    """The bytes of ``explain.background`` (None without one).

    Raises:
        SpecError: it cannot be read (exit 2).
    """
    if explain is None or explain.background is None:
        return None
    try:
        fs, path = url_to_fs(explain.background)
        return fs.cat_file(path)
    except (OSError, ValueError) as exc:
        raise SpecError(f"explain.background {explain.background}: cannot read it: {exc}") from None


def declared_background(explain: ExplainSpec | None) -> dict[str, str]:
    """``explain_background_sha256`` for the declaration, with a background."""
    data = background_bytes(explain)
    return {} if data is None else {BACKGROUND_SHA256: hashlib.sha256(data).hexdigest()}


def check_background(model: str, declaration: Mapping[str, str], explain: ExplainSpec | None) -> None:
    """Exit 3 unless ``explain.background`` holds the bytes the model was stamped with: the
    baseline is its mean, so other rows explain against another baseline."""
    wanted = declared_background(explain).get(BACKGROUND_SHA256)
    if wanted is None:
        return
    stamped = declaration.get(BACKGROUND_SHA256)
    if stamped != wanted:
        raise ContractError(
            f"contract mismatch for {model}: explain.background {explain.background if explain else ''} "
            f"has sha256 {wanted[:16]}… but the model was stamped with "
            f"{(stamped or '(none)')[:16]}…: restore the background the model was stamped with, "
            f"or re-stamp the model with `batchinfer stamp`")


def background_baseline(resolved: "Resolved", explain: ExplainSpec) -> tuple[float, ...] | None:
    """The mean model input over the background's rows that validate and preprocess (each row
    as a run would prepare it), float64; None without a background.

    Raises:
        SpecError: it is not Parquet, none of its rows validates and preprocesses, or the mean
            is not finite (an infinite value the schema lets through, or a sum past float64's
            range: every attribution against it would be NaN) (exit 2).
    """
    data = background_bytes(explain)
    if data is None:
        return None
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..pipeline.prepare import prepare_batch

    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise SpecError(f"explain.background {explain.background}: not a Parquet file ({exc})") from None
    total, rows, first = None, 0, 0
    for batch in table.to_batches(max_chunksize=65536):
        prepared = prepare_batch(batch, resolved.schema, resolved.preprocessor,
                                 source_shard=str(explain.background), first_row=first)
        first += batch.num_rows
        features = prepared.features
        if features is None:
            continue
        x = np.asarray(next(iter(features.values())) if isinstance(features, Mapping) else features,
                       dtype=np.float64)
        part = x.reshape(x.shape[0], -1).sum(axis=0)
        total = part if total is None else total + part
        rows += x.shape[0]
    if not rows or total is None:
        raise SpecError(f"explain.background {explain.background}: none of its {table.num_rows} rows "
                        f"passes the schema and the preprocessing")
    with np.errstate(over="ignore", invalid="ignore"):
        mean = total / rows
    bad = np.flatnonzero(~np.isfinite(mean))
    if bad.size:
        raise SpecError(f"explain.background {explain.background}: the mean of its {rows} rows is "
                        f"{mean[bad[0]]} at model-input position {bad[0]}: give rows whose "
                        f"prepared values are finite")
    return tuple(float(v) for v in mean)


def plan_for(resolved: "Resolved", handler: "BatchModelHandler", output: str | None,
             who: str = "the model") -> "ExplainPlan | None":
    """The explain plan for one loaded model; ``output``: the model output it explains (None:
    its only one). None without ``explain``.

    Raises:
        SpecError: the model or the preprocessing does not fit the section (exit 2).
        ModelError: Captum is missing for integrated gradients (exit 5).
    """
    from ..handlers.explain import ExplainPlan

    explain = resolved.job.spec.explain
    if explain is None:
        return None
    if explain.method == "integrated_gradients" and importlib.util.find_spec("captum") is None:
        raise ModelError("explain.method integrated_gradients needs captum, which is not "
                         "installed: pip install 'batchinfer[explain]'")
    loaded = handler.load_model()
    inputs, outputs = loaded.input_names(), loaded.output_names()
    if len(inputs) != 1:
        raise SpecError(f"explain attributes a model with one input [rows, positions]; {who} "
                        f"takes {inputs}")
    if output is None:
        if len(outputs) != 1:
            raise SpecError(f"explain: {who} has outputs {outputs}: name the one to explain in "
                            f"explain.output")
        output = outputs[0]
    if output not in outputs:
        raise SpecError(f"explain.output {output!r} is not an output of {who} (its outputs: "
                        f"{outputs})")
    if explain.method in ("integrated_gradients", "gradient_x_input") and not handler.gradients:
        raise SpecError(f"explain.method {explain.method} needs the model's gradients, which "
                        f"backend {handler.backend} does not give: use method permutation")
    shape = loaded.input_shapes().get(inputs[0])
    width = shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None
    if shape is not None and len(shape) != 1:
        raise SpecError(f"explain attributes a model input of [rows, positions]; {who}'s input "
                        f"{inputs[0]!r} has {len(shape) + 1} dimensions")
    features, groups = _features(resolved)
    baseline = background_baseline(resolved, explain)
    if baseline is None and explain.baseline != "zeros":
        baseline = tuple(float(v) for v in explain.baseline)
    plan = ExplainPlan(
        method=explain.method, input=inputs[0], output=output, baseline=baseline,
        steps=explain.steps or 0, samples=explain.samples or 0, seed=explain.seed or 0,
        top_k=None if explain.top_k == "all" else int(explain.top_k), fraction=explain.fraction,
        tolerance=explain.tolerance, complete=explain.method in COMPLETE_METHODS,
        features=features, groups=groups, declared=explain.declared(), width=width,
        background=explain.background is not None)
    if width is not None:   # what the first batch would find: said before any work
        plan.baseline_row(width)
        plan.names(width)
    return plan


def _features(resolved: "Resolved") -> tuple[tuple[str, ...] | None, tuple[int, ...] | None]:
    """The feature names and each input position's feature: the schema's features in order for
    the default preprocessing; the module's ``INPUT_FEATURES`` for a function of the user's;
    (None, None) when it declares none (positions are then named ``<input>[<i>]``)."""
    preprocessor = resolved.preprocessor
    if preprocessor.source is None:
        return tuple(preprocessor.features), None
    mapping: Any = getattr(preprocessor.source.load(), INPUT_FEATURES, None)
    if mapping is None:
        return None, None
    if not isinstance(mapping, (list, tuple)) or not all(isinstance(f, str) for f in mapping):
        raise SpecError(f"preprocess {preprocessor.ref}: {INPUT_FEATURES} must be a list of schema "
                        f"feature names, one per model-input position")
    known = set(resolved.features)
    unknown = sorted({f for f in mapping if f not in known})
    if unknown:
        raise SpecError(f"preprocess {preprocessor.ref}: {INPUT_FEATURES} names {unknown}, which are "
                        f"not features of schema {resolved.schema.ref} (its features: "
                        f"{', '.join(resolved.features)})")
    names = tuple(dict.fromkeys(mapping))
    index = {name: i for i, name in enumerate(names)}
    return names, tuple(index[f] for f in mapping)


def challenger_output(champion_output: str, champion_names: Mapping[str, str] | None,
                      own_names: Mapping[str, str] | None) -> str:
    """The challenger's output that writes the champion's explained column: through the
    challenger's mapping (its output → the champion's column), or the same name."""
    column = (champion_names or {}).get(champion_output, champion_output)
    for output, mapped in (own_names or {}).items():
        if mapped == column:
            return output
    return column
