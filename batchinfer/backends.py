"""The backend registry: the one place that says what a ``model.backend`` is.

A :class:`Backend` owns its name, the suffixes of its model files, the ``model.options`` it
accepts (with their types) and the class that implements it (a model backend:
handlers/protocol.py), named as ``"module:Class"`` so that checking a job spec, planning or
parsing a DAG never imports ONNX Runtime, torch or TensorRT. The spec
validates ``model.backend`` and ``model.options`` here, the model resolver looks for a registry
model's file by these suffixes, and the run builds its backend from here; ``register()`` adds a
backend everywhere at once, and so does an installed distribution that names a :class:`Backend`
in the ``batchinfer.backends`` entry-point group (:mod:`batchinfer.registry`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ModelError, SpecError
from .registry import Provenance, Registry

# Accepted by every backend: `allow_pickle` lifts the refusal of pickle-based model files (contract
# §5.6); `share_across_processes` serves one copy of the model to all worker processes of a
# machine (`model_copies` of them), see handlers/base.py.
COMMON_OPTIONS: Mapping[str, type] = MappingProxyType(
    {"allow_pickle": bool, "share_across_processes": bool, "model_copies": int})


@dataclass(frozen=True, kw_only=True)
class Backend:
    """A model backend.

    Attributes:
        name: the ``model.backend`` value.
        suffixes: model file suffixes, lower case (a registry model's folder must hold one file
            with one of them).
        options: ``model.options`` keys this backend accepts, with their types, or with the
            tuple of the strings they may be.
        implementation: ``"package.module:Class"`` of its model backend (the protocol of
            handlers/protocol.py, built as ``Class(device=…, options=…)``); None for a backend
            the contract names but this version does not ship.
        install: what to install (or do) when its library is missing.
        declared: options that change predictions, with their defaults: ``stamp`` records their
            values in the model's declaration and a run with other values is a contract
            mismatch (exit 3), as for the triple.
        implied: declared options that declarations written before the backend declared them
            leave out, with the value such a declaration means (``precision`` of an ONNX model
            stamped before precision was declared: fp32).
    """

    name: str
    suffixes: tuple[str, ...]
    options: Mapping[str, type | tuple[str, ...]] = field(default_factory=dict)
    implementation: str | None = None
    install: str = ""
    declared: Mapping[str, str] = field(default_factory=dict)
    implied: Mapping[str, str] = field(default_factory=dict)


# What a model computes in (contract §6 "Precision"): every backend declares it, fp32 unless the
# job says otherwise; a run whose model was stamped for another precision exits 3.
PRECISIONS = ("fp32", "fp16", "bf16", "int8")


def register(backend: Backend, *, clobber: bool = False) -> None:
    """Make ``backend`` available under ``backend.name``.

    Raises:
        ValueError: another backend has that name and ``clobber`` is False, or batchinfer or an
            installed distribution has it (their entries are never replaced).
    """
    _REGISTRY.register(backend, clobber=clobber)


def provenance(name: str) -> Provenance | None:
    """Where backend ``name`` came from: batchinfer, or the distribution that holds it (None: no
    such backend)."""
    return _REGISTRY.provenance(name)


def entries() -> Mapping[str, Backend]:
    """Every backend by name (a read-only view), those of installed distributions included."""
    return _REGISTRY.entries()


def names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY.names()))


def get(name: str) -> Backend:
    """The backend called ``name``.

    Raises:
        SpecError: no backend has that name (the message lists the known ones).
    """
    backend = _REGISTRY.find(name)
    if backend is None:
        raise SpecError(f"unknown model.backend {name!r} (known: {', '.join(names())})")
    return backend


def check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` if every key is one the backend (or every backend) accepts, with its type.

    Raises:
        SpecError: an unknown key, a value of another type (``true`` is not an int), or a string
            that is not one of the key's choices.
    """
    known = {**get(name).options, **COMMON_OPTIONS}
    for key, value in options.items():
        kind = known.get(key)
        if kind is None:
            raise SpecError(f"unknown key 'model.options.{key}' for backend {name} "
                            f"(known: {', '.join(sorted(known))})")
        if isinstance(kind, tuple):
            if value not in kind:
                raise SpecError(f"model.options.{key}: {value!r} is not one of {', '.join(kind)}")
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise SpecError(f"model.options.{key}: expected {kind.__name__}, got {value!r}")
    return dict(options)


def declared_options(name: str, options: Mapping[str, Any]) -> dict[str, str]:
    """The values of backend ``name``'s declared options in ``options`` (defaults filled in)."""
    return {key: str(options.get(key, default)) for key, default in get(name).declared.items()}


def implied_options(name: str) -> dict[str, str]:
    """What a declaration that lacks one of backend ``name``'s declared options means by it."""
    return dict(get(name).implied)


def backend_class(name: str) -> Any:
    """The model backend class of backend ``name`` (imports the backend's module and library).

    Raises:
        ModelError: the backend is not in this version, or its library is not installed (exit 5).
    """
    backend = get(name)
    if backend.implementation is None:
        raise ModelError(f"backend {name!r} is not available in this version of batchinfer "
                         f"(available: {', '.join(n for n in names() if entries()[n].implementation)})")
    module_name, class_name = backend.implementation.split(":")
    where = provenance(name)
    plugin = where is not None and not where.builtin
    held = f" (distribution {where.distribution} {where.version or ''})".replace(" )", ")") \
        if where is not None and plugin and where.distribution else ""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"backend {name!r}{held} needs a package that is not installed ({exc.name}): "
                         f"{backend.install or 'install the package that provides it'}") from None
    except Exception as exc:
        if not plugin:
            raise
        # A plugin's backend module that fails as it is imported (one that tries to replace a
        # built-in entry, say): its name and its distribution, in one line.
        raise ModelError(f"backend {name!r}{held}: its backend module {module_name} cannot be "
                         f"imported: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    implementation = getattr(module, class_name, None)
    if implementation is None:
        raise ModelError(f"backend {name!r}{held} names the backend class {backend.implementation}, "
                         f"which {module_name} does not define: fix or reinstall what provides it")
    return implementation


def build_facts(name: str, model_path: str) -> dict[str, str]:
    """What backend ``name``'s model file was built for that the runtime must match (its class's
    ``build_facts``, if it has one: a TensorRT engine's TensorRT version and GPU), for ``stamp``.

    Raises:
        ModelError: as :func:`backend_class`.
    """
    facts = getattr(backend_class(name), "build_facts", None)
    return dict(facts(model_path)) if facts is not None else {}


# batchinfer's own backends; installed distributions add theirs (group batchinfer.backends).
BUILTIN: tuple[Backend, ...] = (
    Backend(
        name="onnxruntime", suffixes=(".onnx",),
        options={
            "intra_op_num_threads": int,      # 0 = ONNX Runtime's default (one per core)
            "inter_op_num_threads": int,
            "graph_optimization_level": ("disable", "basic", "extended", "all"),
            "enable_cpu_mem_arena": bool,
            "allow_spinning": bool,           # intra-op threads busy-wait for work (default: false)
            "chunk_rows": int,                # rows per session.run call (default: 4,096 on CPU)
            "call_threads": int,              # CPU: session.run calls at once (default: one per core)
            "providers": list,                # explicit provider list, overrides `device`
            "tensorrt": bool,                 # on CUDA: TensorRT provider first (engine cache beside the model)
            "io_binding": bool,               # bind inputs/outputs (default: on CUDA only)
            "precision": PRECISIONS,          # what the model file computes in; declared
        },
        implementation="batchinfer.handlers.onnx:OnnxBackend",
        install="pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA/TensorRT), e.g. "
                "pip install 'batchinfer[cpu]'",
        declared={"precision": "fp32"}, implied={"precision": "fp32"}),
    Backend(
        name="torch", suffixes=(".pt2",),
        options={
            "precision": ("fp32", "fp16", "bf16"),   # autocast; declared
            "chunk_rows": int,                # rows per model call (default: 4,096 on CPU, all on CUDA)
            "intra_op_num_threads": int,      # torch.set_num_threads (0 = torch's default)
        },
        implementation="batchinfer.handlers.pytorch:TorchBackend",
        install="pip install 'batchinfer[torch]' (CPU), or a CUDA build of torch 2.13 for GPUs",
        declared={"precision": "fp32"}),
    Backend(
        name="tensorrt", suffixes=(".engine", ".plan"),
        options={"chunk_rows": int,           # default: the engine profile's max batch
                 "precision": PRECISIONS},    # what the engine was built for; declared
        implementation="batchinfer.handlers.tensorrt:TensorRTBackend",
        install="pip install 'batchinfer[gpu]' on a machine with an NVIDIA GPU (TensorRT >= 10 and a "
                "CUDA build of torch)",
        declared={"precision": "fp32"}, implied={"precision": "fp32"}),
)

_REGISTRY: Registry[Backend] = Registry(kind="backend", entry_type=Backend, group="batchinfer.backends",
                                        builtin=BUILTIN)
