"""How a call's arguments become a compiled frame's: a binder with the function's signature, and the trampoline
a compiled callable is called through."""
from __future__ import annotations

import inspect
import types
from typing import Any, Callable

def arg_names(code) -> list[str]:
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    return list(code.co_varnames[:n])


def make_binder(fn: types.FunctionType, argnames: list[str], shared: bool = False) -> Callable:
    """A function with fn's signature that returns its arguments as a tuple, in co_varnames order (a shared
    compiler's: the closure first, then those)."""
    if not all(n.isidentifier() for n in argnames):  # e.g. pytest's `@py_assert1` locals in resume functions
        return lambda *args: args
    sig = inspect.signature(fn, follow_wrapped=False)
    ns: dict[str, Any] = {}
    parts, seen_star = [], False
    for i, p in enumerate(sig.parameters.values()):
        default = ""
        if p.default is not inspect.Parameter.empty:
            ns[f"___d{i}"] = p.default
            default = f"=___d{i}"
        if p.kind == p.POSITIONAL_ONLY:
            parts.append(p.name + default)
            if i + 1 == len(sig.parameters) or list(sig.parameters.values())[i + 1].kind != p.POSITIONAL_ONLY:
                parts.append("/")
        elif p.kind == p.VAR_POSITIONAL:
            parts.append("*" + p.name)
            seen_star = True
        elif p.kind == p.KEYWORD_ONLY:
            if not seen_star:
                parts.append("*")
                seen_star = True
            parts.append(p.name + default)
        elif p.kind == p.VAR_KEYWORD:
            parts.append("**" + p.name)
        else:
            parts.append(p.name + default)
    if shared:
        parts.insert(0, "___clo")
        argnames = ["___clo", *argnames]
    body = "(" + "".join(n + ", " for n in argnames) + ")"
    src = f"def ___bind({', '.join(parts)}):\n    return {body}\n"
    exec(compile(src, f"<ember binder of {fn.__qualname__}>", "exec"), ns)
    return ns["___bind"]


def trampoline(f: Callable) -> types.FunctionType:
    def call(*args, **kwargs):
        return f(*args, **kwargs)
    call.__qualname__ = getattr(f, "__qualname__", type(f).__name__)
    return call
