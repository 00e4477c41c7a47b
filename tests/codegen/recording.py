"""A test helper: compile with ember's default backend and keep the compiled graphs it made."""
import torch

import ember
from ember.backends import cpp_backend as ember_backend


def compiled_graphs(fn, *args, run=lambda f, *args: f(*args), **compile_options):
    """Compile fn with the ember backend (ember.compile's `compile_options`) and call run(compiled fn, *args) (a
    backward compiles at its first run); return (compiled fn, the CompiledGraph objects it made)."""
    made = []
    orig = ember_backend.compile_aten

    def rec(gm, ex, options=None):
        r = orig(gm, ex, options)
        made.append(getattr(r, "compiled", None))
        return r
    ember_backend.compile_aten = rec
    try:
        f = ember.compile(fn, **compile_options)
        run(f, *args)
    finally:
        ember_backend.compile_aten = orig
    return f, [g for g in made if g is not None]
