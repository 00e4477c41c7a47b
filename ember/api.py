"""ember.compile and the wrappers it returns: they look like what was passed in.

A CompiledFunction calls the frontend (capture, guards, cache) instead of the function.
A CompiledModule shares everything with the original module (parameters, buffers, state_dict,
attribute reads and writes) and compiles only the call.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
from typing import Any, Callable

import torch

from ember.backends import backend_name, lookup_backend, with_mode
from ember.backends.ddp_buckets import split_at_ddp_buckets
from ember.errors import GraphBreakError
from ember.frontend.policy import COMPILED_MODULE, MODULE_WRAPPERS

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
VALID_OPTIONS = ("model", "fullgraph", "dynamic", "backend", "mode", "options", "disable")
# Keywords that tutorials write but torch.compile never had, and what to write instead.
KNOWN_MISTAKES = {
    "optimization_level": 'mode="max-autotune" (or "reduce-overhead")',
    "opt_level": 'mode="max-autotune" (or "reduce-overhead")',
    "device": "model.to(device) before or after ember.compile",
    "training": "model.train() / model.eval()",
}


@dataclasses.dataclass(frozen=True)
class Config:
    """How a function is compiled; one per ember.compile call."""
    backend: Callable
    backend_name: str
    fullgraph: bool = False
    dynamic: bool | None = None
    mode: str | None = None
    options: dict | None = None


def _bad_keyword(name: str) -> TypeError:
    if name in KNOWN_MISTAKES:
        hint = f" ember.compile (like torch.compile) has no {name!r}; use {KNOWN_MISTAKES[name]}."
    else:
        near = difflib.get_close_matches(name, VALID_OPTIONS, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
    return TypeError(f"ember.compile() got an unexpected keyword argument {name!r}. "
                     f"Valid options: {', '.join(VALID_OPTIONS)}.{hint}")


def _check_mode(mode: Any) -> None:
    if mode in MODES:
        return
    if mode in ("training", "train"):
        raise ValueError(f"mode={mode!r} is not a compile mode: call model.train() for training. "
                         f"Valid modes: {[m for m in MODES if m]}.")
    near = difflib.get_close_matches(str(mode), [m for m in MODES if m], n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ValueError(f"unknown mode {mode!r}; valid modes: {[m for m in MODES if m]}.{hint}")


def compile(model: Callable | None = None, *, fullgraph: bool = False, dynamic: bool | None = None,
            backend: str | Callable = "ember", mode: str | None = None, options: dict | None = None,
            disable: bool = False, **unknown: Any):
    """Compile a function, bound method or nn.Module; usable as a decorator with or without arguments.

    Same signature as torch.compile: switching is a change of one import.
    """
    if unknown:
        raise _bad_keyword(next(iter(unknown)))
    _check_mode(mode)
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    cfg = Config(split_at_ddp_buckets(with_mode(lookup_backend(backend), mode, options)), backend_name(backend), fullgraph,
                 dynamic, mode, options)

    def wrap(m: Callable):
        if disable:
            return m
        if isinstance(m, (CompiledFunction, CompiledModule)):
            return m
        if isinstance(m, torch.nn.Module):
            return CompiledModule(m, cfg)
        if isinstance(m, (types.FunctionType, types.MethodType)) or (callable(m) and not isinstance(m, type)):
            return CompiledFunction(m, cfg)
        raise TypeError(f"ember.compile expects a function, a bound method or an nn.Module, "
                        f"got {type(m).__name__}: {m!r}")

    if model is None:
        return wrap
    return wrap(model)


class CompiledFunction:
    """A function whose calls go through the frontend's cache of captured graphs."""

    def __init__(self, fn: Callable, cfg: Config):
        from ember.frontend.convert import FrameCompiler
        self._fn = fn
        self._cfg = cfg
        self._frame = FrameCompiler.for_callable(fn, cfg)
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        return self._frame(args, kwargs)

    def __get__(self, obj, objtype=None):
        # @ember.compile on a method: bind like a function would.
        if obj is None:
            return self
        return types.MethodType(self, obj)

    def __repr__(self):
        return f"ember.compile({self._fn!r}, backend={self._cfg.backend_name!r})"


class CompiledModule(torch.nn.Module):
    """The original module with its calls compiled: an nn.Module (isinstance, DDP, trainers) that stands for it.

    Every nn.Module method is the original's (its class's overrides included), returning the wrapper where the
    original returns itself; nn.Module's state (`_parameters`, `_modules`, hook dicts, `training`) is the
    original's, read through properties, so code reaching into it sees the same dicts; attribute reads and writes
    go to the original. So `state_dict()` keys have no prefix (torch.compile's OptimizedModule adds `_orig_mod.`):
    a state_dict saved from the compiled model loads into the uncompiled one, and back. Hooks registered on
    either are the original's, run once by the compiled call.
    """

    def __init__(self, mod: torch.nn.Module, cfg: Config):
        # nn.Module.__init__ is not called: the state it would make is the original's (the properties below)
        object.__setattr__(self, "_orig_mod", mod)
        object.__setattr__(self, "_ember_call", CompiledFunction(_call_module, cfg))

    def __call__(self, *args, **kwargs):
        return self._ember_call(self._orig_mod, *args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._ember_call(self._orig_mod, *args, **kwargs)

    def __getattr__(self, name: str):
        if name in ("_orig_mod", "_ember_call"):  # not set yet (a half-built copy): no recursion through them
            raise AttributeError(name)
        attr = getattr(self._orig_mod, name)
        if isinstance(attr, types.MethodType) and attr.__self__ is self._orig_mod:
            return _returning_wrapper(self, attr)
        return attr

    def __setattr__(self, name: str, value):
        setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str):
        delattr(self._orig_mod, name)

    def __dir__(self):
        return dir(self._orig_mod)

    def __len__(self):
        return len(self._orig_mod)

    def __repr__(self):
        return f"CompiledModule({self._orig_mod!r})"

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The original's load_state_dict; a state_dict saved from torch.compile's wrapper (every key prefixed
        `_orig_mod.`) loads too, its prefix dropped."""
        prefix = "_orig_mod."
        if state_dict and all(k.startswith(prefix) for k in state_dict) and \
                not isinstance(getattr(self._orig_mod, "_modules", {}).get("_orig_mod"), torch.nn.Module):
            state_dict = type(state_dict)((k[len(prefix):], v) for k, v in state_dict.items()) \
                if isinstance(state_dict, dict) else {k[len(prefix):]: v for k, v in state_dict.items()}
        return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo):
        # a copy of the model, compiled anew with the same options (an EMA copy of a compiled model)
        return CompiledModule(copy.deepcopy(self._orig_mod, memo), self._ember_call._cfg)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"cannot pickle an ember-compiled module: save the original module instead "
                        f"(torch.save(model) or torch.save(model.state_dict()) on the {type(self._orig_mod).__name__} "
                        f"you passed to ember.compile), and compile again after loading.")


def _returning_wrapper(wrapper: CompiledModule, method: types.MethodType) -> Callable:
    @functools.wraps(method)
    def call(*args, **kwargs):
        out = method(*args, **kwargs)
        return wrapper if out is wrapper._orig_mod else out
    return call


def _original_method(name: str) -> Callable:
    def method(self, *args, **kwargs):
        out = getattr(self._orig_mod, name)(*args, **kwargs)
        return self if out is self._orig_mod else out
    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(torch.nn.Module, name).__doc__
    return method


def _original_state(name: str) -> property:
    return property(lambda self: getattr(self._orig_mod, name))


# nn.Module's methods that stay the wrapper's own: the call (compiled), the attribute protocol (to the original),
# and the extra-state hooks nn.Module finds by class (state_dict itself is the original's)
_OWN_METHODS = {"__call__", "_call_impl", "_wrapped_call_impl", "_slow_forward", "get_extra_state", "set_extra_state"}
for _name, _value in vars(torch.nn.Module).items():
    if callable(_value) and not _name.startswith("__") and _name not in _OWN_METHODS and \
            _name not in vars(CompiledModule):
        setattr(CompiledModule, _name, _original_method(_name))
for _name in vars(torch.nn.Module()):
    setattr(CompiledModule, _name, _original_state(_name))
del _name, _value
MODULE_WRAPPERS.add(CompiledModule)
COMPILED_MODULE.append(CompiledModule)


def _call_module(mod, *args, **kwargs):
    return mod(*args, **kwargs)


def export(model: Callable, example_args: tuple, example_kwargs: dict | None = None, *,
           dynamic_shapes: Any = None, backend: str = "ember", options: dict | None = None, training: bool = False):
    """One whole graph of `model` (a function or nn.Module) on these example inputs, compiled, as a standalone
    program: its guards over the inputs become its input constraints, its parameters and buffers are saved
    with it (`.save(path)`, then ember.load_exported(path) anywhere of the same environment, with neither the
    model's source nor its class). Captured with fullgraph=True (a graph break, data-dependent control flow
    among them, is an error naming its file:line) and run under no_grad.

    dynamic_shapes: which dims of the example's tensors vary: None (all fixed), True (every dim), or per
    positional argument (a tuple) or by name (a dict), None or the dims (a dict {dim: name}, or a list).
    training: captured with grad enabled and run as the caller's grad mode says: the program's parameters are
    Parameters of its own (`program.named_parameters()`), and a backward of its results computes their
    gradients and the inputs' with the backward compiled at export (the joint graph, partitioned), saved with
    it; the example inputs' requires_grad say which inputs get gradients."""
    import inspect
    from ember.frontend.convert import FrameCompiler
    from ember.frontend.dynamic_dims import mark_dynamic
    from ember.frontend.exported import ExportedProgram, single_entry
    example_kwargs = dict(example_kwargs or {})
    def own(v):   # (marks on our own objects; training: as requiring grad as the example)
        return v.detach().requires_grad_(training and v.requires_grad) if isinstance(v, torch.Tensor) else v
    args = [own(a) for a in example_args]
    kwargs = {k: own(v) for k, v in example_kwargs.items()}
    if dynamic_shapes is not None and dynamic_shapes is not True:
        names = list(inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model).parameters)
        per_name = dynamic_shapes if isinstance(dynamic_shapes, dict) else dict(zip(names, dynamic_shapes))
        by_name = {**dict(zip(names, range(len(args)))), **{k: k for k in kwargs}}
        for name, dims in per_name.items():
            if dims is None:
                continue
            if name not in by_name:
                raise ValueError(f"dynamic_shapes names {name!r}, which is no argument of the example call")
            slot = by_name[name]
            mark_dynamic(args[slot] if isinstance(slot, int) else kwargs[slot], list(dims))
    fn = _call_module if isinstance(model, torch.nn.Module) else model
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"ember.export expects a function or an nn.Module, got {type(model).__name__}")
    cfg = Config(with_mode(lookup_backend(backend), None, options), backend_name(backend), True,
                 True if dynamic_shapes is True else None, None, options)
    fc = FrameCompiler(fn, cfg)   # (its own: not the cache ember.compile keeps, nor entries ember.load_cache read)
    fc.restore_asked = True
    call_args = (model, *args) if fn is _call_module else tuple(args)
    try:
        with torch.set_grad_enabled(training):
            fc(call_args, kwargs)
    except GraphBreakError as e:
        if "backward()" not in str(e):
            raise
        raise GraphBreakError(f"{e}\nember.export exports one forward graph: export the model with training=True "
                              f"and call .backward() on the program's result (its backward is compiled with "
                              f"it)") from e
    entry = single_entry(fc)
    frame_args = fc.bind(*call_args, **kwargs)
    if fn is _call_module:
        forward = getattr(type(model).forward, "__code__", None)
        where = f"{forward.co_filename}:{forward.co_firstlineno}" if forward else type(model).__module__
        program = ExportedProgram.from_entry(fc, entry, frame_args, None, ["args", "kwargs"],
                                             type(model).__qualname__, where, training)
    else:
        sig = inspect.signature(fn)   # (without annotations: the program binds arguments, it checks no types)
        sig = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                          return_annotation=sig.empty)
        program = ExportedProgram.from_entry(fc, entry, frame_args, sig, list(fc.params), fn.__qualname__,
                                             f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}", training)
    if training:
        program.compile_backward([own(a) for a in example_args], {k: own(v) for k, v in example_kwargs.items()})
    return program


def disable(fn: Callable | None = None, recursive: bool = True):
    """Decorator: never compile this function, also when it is called from compiled code."""
    def mark(f):
        target = getattr(f, "__func__", f)
        target.__ember_disable__ = True
        return f
    return mark(fn) if fn is not None else mark
