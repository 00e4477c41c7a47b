"""The "ember" backend: autograd (ember.autograd) -> decompositions -> loop IR -> fused kernels, printed for each
graph's device by the backend DEVICE_BACKENDS names: C++/OpenMP for CPU graphs (cpp_backend), Triton for CUDA
graphs (triton_backend, which also splits off a graph's CPU scalars: host_scalars).

compile_graph(gm, example_inputs, mode=None, options=None) is the backend; each device backend's compile_aten is
the inner compiler the autograd layer calls on each ATen-level graph (forward and backward).
mode (ember.compile(mode=...)): "reduce-overhead" and "max-autotune" replay CUDA graphs (ember.runtime.cudagraphs).
options (ember.compile(options=...)):
  {"fallback": "eager"}         a graph whose generated code fails to build runs eagerly (logged), not raising
  {"triton.cudagraphs": False}  no CUDA graphs under mode="reduce-overhead" / "max-autotune"
  {"max_autotune": True}        matmul templates with fused epilogues where they time faster (ember.codegen.
                                mm_template); on by default under mode="max-autotune" / "max-autotune-no-cudagraphs"
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ember.tools.logs import get_logger

# device type -> the module whose compile_aten(gm, example_inputs, options) compiles an ATen graph for it, imported
# when a graph first needs it (a CPU program never loads the Triton printer)
DEVICE_BACKENDS = {"cpu": "ember.backends.cpp_backend", "cuda": "ember.backends.triton_backend"}


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
                  options: dict | None = None) -> Callable:
    """The backend entry point (torch.compile's custom-backend contract, with its `mode` and `options`).

    Each ATen graph (forward, backward) goes to the backend of its device (DEVICE_BACKENDS: the C++ code
    generator, or the Triton one when it works on CUDA tensors); mode="reduce-overhead" / "max-autotune" replay
    the CUDA ones as CUDA graphs."""
    from ember.autograd import aot_module
    options = dict(options or {})
    if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        options.setdefault("max_autotune", True)

    inner = _device_compiler(options)

    cuda_graphs = mode in ("reduce-overhead", "max-autotune") and options.get("triton.cudagraphs", True) \
        and _on_cuda(gm, example_inputs)
    if cuda_graphs:
        # (a graph that reads CPU tensors, torch.optim's step counters, replays its device part: aot_compilers; a
        # symbolic graph is recorded once per distinct size, lazily, in one pool: cudagraphs.MAX_RECORDINGS)
        from ember.runtime.cudagraphs import aot_compilers
        fw, bw = aot_compilers(inner)
        return aot_module(gm, example_inputs, fw_compiler=fw, bw_compiler=bw)
    return aot_module(gm, example_inputs, fw_compiler=inner, bw_compiler=inner)


def _device_compiler(options: dict) -> Callable:
    """The inner compiler of each ATen graph (forward, backward): its device's backend with these options."""

    def inner(g: torch.fx.GraphModule, ex: list, more_options: dict | None = None) -> Callable:
        backend = importlib.import_module(DEVICE_BACKENDS["cuda" if _on_cuda(g, ex) else "cpu"])
        if not getattr(backend, "SYMBOLIC", False) and _is_symbolic(g):
            # a code generator that does not say it lowers symbolic sizes: the ATen graph runs as it is, correct
            # at every size (docs/dynamic.md)
            if backend.__name__ not in _logged_symbolic:
                _logged_symbolic.add(backend.__name__)
                get_logger("dynamic").info("%s has no SYMBOLIC = True: symbolic graphs run as ATen graphs",
                                           backend.__name__)
            return g.forward
        return backend.compile_aten(g, ex, {**options, **(more_options or {})})

    inner.ember_saved = lambda: (_device_compiler, (options,))   # (ember.save_cache: a backward compiled later)
    return inner


_logged_symbolic: set[str] = set()   # device backends whose symbolic fallback was logged


def _is_symbolic(g: torch.fx.GraphModule) -> bool:
    from ember.autograd.symbolic import placeholder_values
    return placeholder_values(g) is not None


def _on_cuda(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """Whether a graph computes on the GPU: a CUDA input, or (a graph with no tensor inputs) a CUDA value."""
    import torch.utils._pytree as pytree
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return True
    return any(isinstance(v, torch.Tensor) and v.is_cuda
               for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val")))

