"""Model handlers: one module per backend behind Beam's ``ModelHandler``.

The registry maps a backend name to ``"module:Class"`` so that choosing a backend imports only
that backend's library (planning and DAG parsing never import onnxruntime, torch or TensorRT).
"""
from __future__ import annotations

import importlib
from types import MappingProxyType

from ..errors import ModelError

_REGISTRY: dict[str, tuple[str, str]] = {
    # name: ("module:Class", install hint)
    "onnxruntime": ("batchinfer.handlers.onnx:OnnxModelHandler",
                    "pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA/TensorRT)"),
}
registry = MappingProxyType(_REGISTRY)


def register(name: str, target: str, install_hint: str = "") -> None:
    """Make a backend available under ``name`` (``target`` is ``"package.module:Class"``)."""
    _REGISTRY[name] = (target, install_hint)


def handler_class(backend: str):
    """The handler class for ``backend``.

    Raises:
        ModelError: the backend is not available in this installation (exit 5).
    """
    if backend not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ModelError(f"backend {backend!r} is not available in this version of batchinfer "
                         f"(available: {known})")
    target, hint = _REGISTRY[backend]
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"backend {backend!r} needs a package that is not installed ({exc.name}): "
                         f"{hint}") from None
    return getattr(module, class_name)


__all__ = ["handler_class", "register", "registry"]
