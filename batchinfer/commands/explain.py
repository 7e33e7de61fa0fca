"""The job's ``explain`` section, resolved against each loaded model before any work (contract §6
"Explanations"): what the declaration records of it, and the plan its workers run.

Exit 2 here for what no batch could fix (a model with several inputs, an output that is not one
of the model's, a baseline or feature mapping of another width than the model's input, an
``INPUT_FEATURES`` naming no schema feature); exit 5 when Captum, which integrated gradients
needs, is not installed.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ModelError, SpecError
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


def declared(explain: ExplainSpec | None) -> dict[str, str]:
    """What the model's declaration records of ``explain`` (nothing without one)."""
    return {} if explain is None else {DECLARED: explain.declared()}


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
    loaded = handler.loaded(handler.load_model())
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
    plan = ExplainPlan(
        method=explain.method, input=inputs[0], output=output,
        baseline=None if explain.baseline == "zeros" else tuple(float(v) for v in explain.baseline),
        steps=explain.steps or 0, samples=explain.samples or 0, seed=explain.seed or 0,
        top_k=None if explain.top_k == "all" else int(explain.top_k), fraction=explain.fraction,
        tolerance=explain.tolerance, complete=explain.method in COMPLETE_METHODS,
        features=features, groups=groups, declared=explain.declared(), width=width)
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
