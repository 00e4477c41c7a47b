"""Backend registry: a backend is any callable (gm: torch.fx.GraphModule, example_inputs: list) -> callable.

This is exactly torch.compile's custom-backend contract, so a backend written for torch.compile works here.
Built-in backends register themselves on import of this package:
  "eager"      run the captured graph as it is
  "aot_eager"  ahead-of-time autograd (ember.autograd), both graphs run eagerly
  "ember"      autograd -> decompositions -> codegen (C++/OpenMP on CPUs)
"""
from __future__ import annotations

import difflib
from typing import Callable

import torch

Backend = Callable[[torch.fx.GraphModule, list], Callable]
_REGISTRY: dict[str, Backend] = {}


def register_backend(fn: Backend | None = None, *, name: str | None = None):
    """Register a backend under its function name (or `name`). Usable as `@register_backend` or with arguments."""

    def register(f: Backend) -> Backend:
        _REGISTRY[name or f.__name__] = f
        return f

    return register(fn) if fn is not None else register


def list_backends() -> list[str]:
    return sorted(_REGISTRY)


def lookup_backend(backend: str | Backend) -> Backend:
    if callable(backend):
        return backend
    if isinstance(backend, str):
        if backend in _REGISTRY:
            return _REGISTRY[backend]
        near = difflib.get_close_matches(backend, list(_REGISTRY), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown backend {backend!r}; registered backends: {list_backends()}.{hint}")
    raise TypeError(f"backend must be a registered name or a callable (gm, example_inputs) -> callable, "
                    f"got {type(backend).__name__}")


def backend_name(backend: str | Backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def _ember(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
           options: dict | None = None) -> Callable:
    from ember.backends.ember_backend import compile_graph  # imported on first use: codegen is heavy
    return compile_graph(gm, example_inputs, mode=mode, options=options)


def with_mode(backend: Backend, mode: str | None, options: dict | None) -> Backend:
    """The backend as ember.compile calls it: like torch.compile, `mode` (unless default) and `options` are
    passed on as keyword arguments, so a backend that takes neither gets neither."""
    kwargs = {}
    if mode not in (None, "default"):
        kwargs["mode"] = mode
    if options:
        kwargs["options"] = options
    if not kwargs:
        return backend

    def backend_with_mode(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return backend(gm, example_inputs, **kwargs)
    backend_with_mode.__name__ = getattr(backend, "__name__", type(backend).__name__)
    backend_with_mode.__wrapped__ = backend   # (what a repro names, and whether it is ember's own: fail_safe)
    return backend_with_mode


@register_backend
def eager(gm: torch.fx.GraphModule, example_inputs: list, **_mode_and_options) -> Callable:
    return gm.forward


def _aot_eager(gm: torch.fx.GraphModule, example_inputs: list, **_mode_and_options) -> Callable:
    from ember.autograd import aot_eager
    return aot_eager(gm, example_inputs)


register_backend(_ember, name="ember")
register_backend(_aot_eager, name="aot_eager")
# ember's own backends: a crash inside them runs the graph eagerly instead of reaching the user (tools/failsafe.py)
_ember.fail_safe = _aot_eager.fail_safe = eager.fail_safe = True
# the backends that trace the graph through ember.autograd (which rewrites it first: ddp_buckets does so before
# splitting it)
_ember.traces_aten = _aot_eager.traces_aten = True
