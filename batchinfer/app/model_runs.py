"""The models of a run: the champion and each challenger built, checked and loaded before any
work, as the :class:`~batchinfer.pipeline.transforms.ModelRun` the pipeline runs.

A model that cannot load is exit 5 here, before the partition is touched; outputs that name no
usable prediction column are exit 2. The model is loaded once in this process: in-process
workers reuse the load (``handlers.sharing.shared_model``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from ..backends import backend_class, declared_options
from ..errors import BatchInferError, ModelError, SpecError
from ..rows.columns import check_output_columns
from ..spec import ExplainSpec, ModelFields
from .explain_plan import challenger_output, plan_for
from .explain_plan import declared as explain_declared
from .resolve import Resolved, ResolvedChallenger

if TYPE_CHECKING:
    from ..handlers.base import BatchModelHandler
    from ..pipeline.transforms import ModelRun
    from ..triple.models import ResolvedModel


def declared(model: ModelFields, explain: ExplainSpec | None = None) -> dict[str, str]:
    """The values of a model's backend's declared options (they change predictions), and with
    ``explain`` the declared explanation (it changes what is written: contract §6
    "Explanations")."""
    return {**declared_options(model.backend, model.options), **explain_declared(explain)}


def challenger_identity(challenger: ResolvedChallenger,
                        explain: ExplainSpec | None = None) -> tuple[str, dict[str, str], dict[str, str]]:
    return challenger.name, challenger.triple.as_dict(), declared(challenger.spec, explain)


def load_champion(resolved: Resolved) -> "ModelRun":
    """The champion as the pipeline runs it: its handler built and the model loaded once before
    any work (exit 5 early; in-process workers reuse this load, see handlers.sharing.shared_model).
    The model's outputs must name prediction columns that collide with nothing (exit 2)."""
    from ..pipeline.transforms import ModelRun
    from ..pipeline.writer.policy import WritePolicy

    spec = resolved.job.spec
    mapped = spec.output.predictions
    handler, device, outputs = load_model(resolved, spec.model, resolved.model,
                                          resolved.triple.model_digest, mapped)
    explain = plan_for(resolved, handler, spec.explain.output if spec.explain else None)
    return ModelRun(name="", triple=resolved.triple, handler=handler, device=device,
                    backend=spec.model.backend, model_options=declared(spec.model, spec.explain),
                    policy=WritePolicy.champion(), prediction_names=dict(mapped or {}) or None,
                    columns=tuple(mapped.values()) if mapped else tuple(outputs), explain=explain)


def load_challengers(resolved: Resolved, champion: "ModelRun") -> "list[ModelRun]":
    """Each challenger as the pipeline runs it, loaded before any work like the champion; an
    error names the challenger (the exit code stays the champion's: 5 not loading, 2 outputs).
    A challenger writes exactly the champion's prediction columns, in their order: through its
    own ``predictions`` mapping, else through ``output.predictions``, else its outputs must be
    named as the champion's (exit 2 otherwise)."""
    if not resolved.challengers:
        return []
    from ..pipeline.transforms import ModelRun
    from ..pipeline.writer.policy import WritePolicy

    output = resolved.job.spec.output
    columns = list(champion.columns)   # the champion's outputs, or as mapped
    loaded = []
    for challenger in resolved.challengers:
        own = challenger.spec.predictions
        try:
            handler, device, outputs = load_model(
                resolved, challenger.spec, challenger.model, challenger.triple.model_digest,
                output.predictions if own is None else own,
                "output.predictions" if own is None else "its predictions")
            hint = (f"map them with the challenger's predictions: "
                    f"{{{', '.join(f'{o}: {c}' for o, c in zip(outputs, columns))}}}"
                    if len(outputs) == len(columns) else "map them with the challenger's predictions")
            if own is not None and list(own.values()) != columns:
                raise SpecError(f"its predictions map to the columns {list(own.values())}, not "
                                f"to the champion's prediction columns {columns} (the same "
                                f"names in the same order): {hint}")
            if own is None and not output.predictions and outputs != columns:
                raise SpecError(f"its outputs {outputs} are not the champion's {columns}: "
                                f"{hint}, or export it with the champion's output names")
            explain = None
            if champion.explain is not None:
                explain = plan_for(resolved, handler, challenger_output(
                    champion.explain.output, output.predictions,
                    own if own is not None else output.predictions), "the challenger's model")
        except BatchInferError as exc:
            raise exc.within(f"challenger {challenger.name}") from None
        loaded.append(ModelRun(name=challenger.name, triple=challenger.triple, handler=handler,
                               device=device, backend=challenger.spec.backend,
                               model_options=declared(challenger.spec, resolved.job.spec.explain),
                               policy=WritePolicy.challenger(challenger.name),
                               prediction_names=dict(own or output.predictions or {}) or None,
                               columns=champion.columns, explain=explain))
    return loaded


def load_model(resolved: Resolved, spec: ModelFields, found: "ResolvedModel", digest: str,
               predictions: dict[str, str] | None,
               key: str = "output.predictions") -> "tuple[BatchModelHandler, str, list[str]]":
    """Load one model; ``predictions`` (named ``key`` in errors) maps its outputs to columns."""
    from ..handlers.base import BatchModelHandler

    batch = resolved.job.spec.batch   # a challenger gets the champion's batches: sized alike
    cls = backend_class(spec.backend)
    options = {k: v for k, v in spec.options.items() if k != "allow_pickle"}
    # A model in a store: the handler holds its URL and digest and loads it through the model
    # cache, here (the entry resolve placed) as on every worker (its own cache).
    handler = BatchModelHandler(cls(device=spec.device, options=options), found.where,
                                name=spec.backend, digest=digest, device=spec.device,
                                options=options, tokens=batch.tokens,
                                lengths_from=batch.lengths_from,
                                sequence_inputs=batch.sequence_inputs, source=found.source(digest))
    declared: Mapping[str, str] = found.declaration or {}
    for key, here in handler.runtime_facts().items():
        # e.g. a TensorRT engine runs only under the TensorRT version and on the GPU
        # architecture it was built for; loading it elsewhere fails, or worse, does not.
        if key in declared and declared[key] != here:
            raise ModelError(f"{resolved.job.display(spec.uri)} was built for {key} "
                             f"{declared[key]} but this machine has {here}: rebuild the model "
                             f"here (batchinfer export) and stamp it, or run where it was built")
    model = handler.load_model()
    if batch.tokens:
        inputs = model.input_names()
        if batch.lengths_from not in inputs:
            raise SpecError(f"batch.tokens sizes model calls by the lengths in the model input "
                            f"{batch.lengths_from!r}, which this model does not take (its inputs: "
                            f"{inputs}): set batch.lengths_from, or size batches by batch.rows")
        handler.sequence_inputs(model)   # which inputs a call cuts: exit 2 here if it cannot tell
    outputs = model.output_names()
    output_spec = resolved.job.spec.output
    if predictions:
        unknown = [o for o in predictions if o not in outputs]
        if unknown:
            raise SpecError(f"{key} names {unknown}, which the model does not output "
                            f"(its outputs: {outputs})")
    else:  # each output becomes a column of its own name: it must not take an id's or ours
        check_output_columns(output_spec.id_columns, {o: o for o in outputs},
                             source="the model's outputs (output.predictions maps none)",
                             partition=output_spec.table_partition)
    return handler, model.device_used(), list(outputs)
