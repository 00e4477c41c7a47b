"""Calls over tracked values: torch ops, builtins, user functions (inlined), methods, modules (with their hooks),
classes (constructed), and the torch calls ember evaluates at capture time or leaves to Python."""
from __future__ import annotations

import dataclasses
import functools
import numbers
import types
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ember.errors import Unsupported
from ember.frontend.attributes import attr_source
from ember.frontend.capture import map_v, to_fake
from ember.frontend.autograd_functions import apply_function, function_applied
from ember.frontend.builtin_functions import BUILTIN_HANDLERS
from ember.frontend.modes import AUTOCAST_CLASSES
from ember.frontend.policy import (
    AT_CAPTURE, DYNAMO_WRAPPER_FILE, FACTORIES, MATH_FUNCS, MODULE_TRAVERSALS, OPERATOR_FUNCS, OUTPUT_MODULES,
    PURE_BUILTIN_FUNCS, PURE_METHODS, TORCH_DISABLED_CODE, TORCH_OP_OBJS, TORCH_OPS, AtCapture, is_numpy_ufunc,
    marked_constant, python_hook, wrapped_module_attr,
)
from ember.frontend.py_float import has_py_float, optim_helpers
from ember.frontend.python_objects import (
    CO_ASYNC_GENERATOR, CO_COROUTINE, MISSING, hashable, is_namedtuple_cls, lookup_static,
)
from ember.frontend.vmap import call_torch_vmapped, call_vmapped, make_vmapped, torch_vmapped_parts, vmapped
from ember.frontend.values import (
    AutocastExitV, BoundV, CellV, ClosureV, ConstV, DictV, GradModeCtxV, GradModeExitV, IterV, ListV, NewObjV,
    NoOpCtxV, ObjV, PartialV, TensorV, TupleV, V,
)

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


def _op_on_numbers(f, args: list, kwargs: dict) -> bool:
    """An ATen function of torch on Python numbers (`torch.div(n, 2, rounding_mode="trunc")`): eager returns a 0-d
    tensor, recorded like a factory. Its fake holds the value (fake tensors propagate constants), so it can size a
    view or a new tensor in the capture, as in eager where such a tensor is read as an index."""
    return bool(args) and getattr(torch._C._VariableFunctions, getattr(f, "__name__", ""), None) is f and \
        all(isinstance(v, ConstV) and type(v.value) in (int, float, bool) for v in args) and \
        all(isinstance(v, ConstV) for v in kwargs.values())


def _any_tensor(vs) -> bool:
    for v in vs:
        if isinstance(v, TensorV):
            return True
        if isinstance(v, (ListV, TupleV)) and _any_tensor(v.items):
            return True
        if isinstance(v, DictV) and _any_tensor(list(v.items.values())):
            return True
    return False


def _callable_name(f) -> str:
    mod = getattr(f, "__module__", None) or type(f).__module__
    return f"{mod}.{getattr(f, '__qualname__', type(f).__name__)}"


def cannot_call(frame: Frame, fn: V) -> Unsupported:
    return Unsupported(f"calling {frame.type_name(fn)}", frame.where())


def call_bound(frame: Frame, fn: BoundV, args: list[V], kwargs: dict[str, V]) -> V:
    """A method bound to a value: by name (Tensor and container methods), a C method of a builtin base class,
    an nn.Module traversal, or a Python function called with the value first."""
    if isinstance(fn.func, str):
        return frame.call_method(fn.self_v, fn.func, args, kwargs)
    if isinstance(fn.func, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return frame.call_builtin_method(fn.self_v, fn.func, args, kwargs)
    if isinstance(fn.self_v, ObjV) and isinstance(fn.self_v.value, type) and \
            getattr(fn.func, "__name__", "") == "apply":
        applied = function_applied(types.MethodType(fn.func, fn.self_v.value))   # a Python classmethod `apply`
        if applied is not None:
            return apply_function(frame, applied, args, kwargs)
    if isinstance(fn.self_v, ObjV) and isinstance(fn.self_v.value, torch.nn.Module) and \
            fn.func is getattr(torch.nn.Module, fn.func.__name__, None) and fn.func.__name__ in MODULE_TRAVERSALS:
        return frame.module_traversal(fn.self_v, fn.func.__name__, args, kwargs)
    return frame.call(ObjV(fn.func), [fn.self_v] + args, kwargs)


def call_closure(frame: Frame, fn: ClosureV, args: list[V], kwargs: dict[str, V]) -> V:
    return frame.inline(fn.code, fn.globals, fn.defaults, fn.kwdefaults, fn.closure, args, kwargs, fn.name)


def call_partial(frame: Frame, fn: PartialV, args: list[V], kwargs: dict[str, V]) -> V:
    return frame.call(fn.func, fn.args + list(args), {**fn.kwargs, **kwargs})


def call_grad_mode_exit(frame: Frame, fn: GradModeExitV, args: list[V], kwargs: dict[str, V]) -> V:
    frame.set_grad(fn.prev)
    return ConstV(None)


def call_autocast_exit(frame: Frame, fn: AutocastExitV, args: list[V], kwargs: dict[str, V]) -> V:
    if fn.node is None:   # a block entered before this graph (values.AutocastExit): its end runs in Python
        raise Unsupported("the end of an autocast block entered before a graph break", frame.where())
    return frame.exit_autocast(fn)


def call_no_op_exit(frame: Frame, fn: NoOpCtxV, args: list[V], kwargs: dict[str, V]) -> V:
    if fn.exit:
        return ConstV(None)  # the __exit__ of a no-op context
    raise cannot_call(frame, fn)


def call_real_value(frame: Frame, fn: ObjV | ConstV, args: list[V], kwargs: dict[str, V]) -> V:
    return frame.call_value(fn, fn.value, args, kwargs)


def call_new_object(frame: Frame, fn: NewObjV, args: list[V], kwargs: dict[str, V]) -> V:
    m = frame.getattr(fn, "__call__")
    return frame.call(m, args, kwargs)


class Calls:
    """Frame methods for calls."""

    def call(self, fn: V, args: list[V], kwargs: dict[str, V]) -> V:
        caller = CALLERS_BY_KIND.get(type(fn))
        if caller is None:
            raise cannot_call(self, fn)
        return caller(self, fn, args, kwargs)

    def call_value(self, fn_v: V, f, args: list[V], kwargs: dict[str, V]) -> V:
        if getattr(f, "__ember_disable__", False) or getattr(getattr(f, "__func__", None), "__ember_disable__", False):
            raise Unsupported(f"{getattr(f, '__qualname__', f)} is marked ember.disable", self.where())
        if f is torch.vmap:
            return make_vmapped(self, args, kwargs)
        if f is vmapped:
            return call_vmapped(self, args, kwargs)
        if isinstance(f, torch._ops.HigherOrderOperator):
            # a higher-order op (associative_scan, cond, ...): its dense kernel is Python over torch ops, inlined
            # so its ops are captured and differentiated like any others (the ops' own autograd kernels are not
            # used: associative_scan's pointwise-mode gradient is wrong in eager torch)
            dense = f.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
            if dense is not None:
                return self.call(self.cap.wrap(dense, None), args, kwargs)
        rule = AT_CAPTURE.get(f) if hashable(f) else None
        if rule is not None and not (rule.rule == "pure" and (_any_tensor(args) or _any_tensor(list(kwargs.values())))):
            return self.at_capture(f, rule, args, kwargs)
        if id(f) in TORCH_OPS and TORCH_OP_OBJS.get(id(f)) is f:
            return self.call_torch(f, TORCH_OPS[id(f)], args, kwargs)
        if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch.library.CustomOpDef)):
            return self.call_registered_op(f, args, kwargs)
        if is_numpy_ufunc(f):
            return self.numpy_on_numbers(f, args, kwargs)
        if marked_constant(f) and all(isinstance(a, ConstV) for a in [*args, *kwargs.values()]):
            return self.concrete(f, args, kwargs)
        handler = BUILTIN_HANDLERS.get(f) if hashable(f) else None
        if handler is not None:
            return handler(self, args, kwargs)
        if isinstance(f, types.FunctionType) and f.__code__ is TORCH_DISABLED_CODE:
            raise Unsupported(f"{f.__qualname__} is marked torch._disable_dynamo: it runs in Python", self.where())
        if isinstance(f, types.FunctionType) and f.__code__.co_filename.endswith(DYNAMO_WRAPPER_FILE) \
                and isinstance(getattr(f, "__wrapped__", None), types.FunctionType):
            # a function torch.compile's first use wrapped for its own tracer (torch.optim's _init_group): the
            # same function to ember, which runs what it wraps (the wrapper only switches Dynamo off)
            return self.call_value(fn_v, f.__wrapped__, args, kwargs)
        if isinstance(f, types.FunctionType) and f.__module__ == "torch.optim.optimizer":
            get_value, stack_if_compiling = optim_helpers()
            if f is get_value:
                return self.optim_get_value(args[0])
            if f is stack_if_compiling:
                return args[0]  # eager keeps the list of Python floats (consumers: record_py_float_call)
        if f is torch.autograd.profiler.record_function:
            # A profiler range: no effect on values, so it is left out of the graph (torch.compile drops it too);
            # the range is then missing from profiles of compiled code.
            return NoOpCtxV(f, (tuple(self.const_value(a) for a in args),
                                {k: self.const_value(v) for k, v in kwargs.items()}))
        if f in (torch.no_grad, torch.enable_grad):
            return GradModeCtxV(f is torch.enable_grad, None)
        if hashable(f) and f in AUTOCAST_CLASSES:
            return self.autocast_args(AUTOCAST_CLASSES[f], args, kwargs)
        if f is torch.set_grad_enabled:
            enabled = self.const_value(args[0] if args else kwargs["mode"])
            prev = self.cap.grad_enabled
            self.set_grad(bool(enabled))  # set_grad_enabled(b) takes effect at once, also without `with`
            return GradModeCtxV(bool(enabled), None, prev)
        if isinstance(f, torch.nn.Module):
            return self.call_module(fn_v, f, args, kwargs)
        applied = function_applied(f) if isinstance(f, (types.BuiltinMethodType, types.MethodType)) else None
        if applied is not None:
            return apply_function(self, applied, args, kwargs)
        if isinstance(f, types.MethodType):
            return self.call(ObjV(f.__func__), [self.cap.wrap(f.__self__, attr_source(fn_v.source, "__self__"))] + args,
                             kwargs)
        if isinstance(f, functools.partial):
            inner = self.cap.wrap(f.func, attr_source(fn_v.source, "func"))
            pargs = [self.cap.wrap(a, f"{fn_v.source}.args[{i}]" if fn_v.source else None) for i, a in enumerate(f.args)]
            pkw = {k: self.cap.wrap(a, f"{fn_v.source}.keywords[{k!r}]" if fn_v.source else None)
                   for k, a in f.keywords.items()}
            return self.call(inner, pargs + args, {**pkw, **kwargs})
        if isinstance(f, types.FunctionType):
            if torch_vmapped_parts(f) is not None:
                return call_torch_vmapped(self, fn_v, f, args, kwargs)
            if (f.__module__ or "").split(".")[0] in OUTPUT_MODULES:
                raise Unsupported(f"{f.__module__}.{f.__qualname__} writes output: it runs in Python", self.where())
            if f.__code__.co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR):
                raise Unsupported("async functions", self.where())
            closure = ()
            if f.__closure__:
                closure = tuple(self.cap.wrap(c, f"{fn_v.source}.__closure__[{i}]" if fn_v.source else None)
                                for i, c in enumerate(f.__closure__))
            defaults = tuple(self.cap.wrap(d, f"{fn_v.source}.__defaults__[{i}]" if fn_v.source else None)
                             for i, d in enumerate(f.__defaults__ or ()))
            kwdefaults = {k: self.cap.wrap(d, f"{fn_v.source}.__kwdefaults__[{k!r}]" if fn_v.source else None)
                          for k, d in (f.__kwdefaults__ or {}).items()}
            return self.inline(f.__code__, f.__globals__, defaults, kwdefaults, closure, args, kwargs, f.__qualname__)
        if isinstance(f, type):
            return self.construct(fn_v, f, args, kwargs)
        call = lookup_static(type(f), "__call__")
        if isinstance(call, types.FunctionType):
            return self.call(BoundV(fn_v, call), args, kwargs)
        if id(f) in MATH_FUNCS or f in PURE_BUILTIN_FUNCS or id(f) in OPERATOR_FUNCS:
            if any(isinstance(a, TensorV) for a in args):
                if id(f) in OPERATOR_FUNCS:
                    return self.binary(f, *args, False) if len(args) == 2 else self.unary(f, args[0])
                raise Unsupported(f"{f.__name__} of a tensor needs its value", self.where())
            return self.concrete(f, args, kwargs)
        if isinstance(f, (types.BuiltinMethodType, types.MethodWrapperType)) and isinstance(
                getattr(f, "__self__", None), (str, int, float, tuple, bytes, frozenset)):
            return self.concrete(f, args, kwargs)
        raise Unsupported(f"call to {_callable_name(f)} (not a torch op and not Python ember can inline)",
                          self.where())

    def module_traversal(self, mod_v: ObjV, name: str, args: list[V], kwargs: dict) -> V:
        """nn.Module.children(), parameters(), named_modules()...: walked at capture time, each item with its
        source, so the module structure is fixed by the identity guards and tensors stay graph inputs."""
        table = {"children": "_modules", "named_children": "_modules", "parameters": "_parameters",
                 "named_parameters": "_parameters", "buffers": "_buffers", "named_buffers": "_buffers",
                 "modules": "_modules", "named_modules": "_modules"}[name]
        named = name.startswith("named_")
        kw = {k: self.const_value(v) for k, v in kwargs.items()}
        posargs = [self.const_value(a) for a in args]
        recurse = kw.get("recurse", posargs[0] if posargs and name in ("parameters", "buffers") else True)
        prefix = kw.get("prefix", "")
        out, seen = [], set()

        def walk(m, src, path, include_self):
            if src is not None:
                for t in {"_modules", table}:
                    self.cap.guards.add(f"tuple({src}.{t}) == {self.cap.consts.ref(tuple(getattr(m, t)))}", 1)
            if name in ("modules", "named_modules"):
                if include_self and id(m) not in seen:
                    seen.add(id(m))
                    out.append((path, m, src))
                for k, child in m._modules.items():
                    if child is not None:
                        walk(child, f"{src}._modules[{k!r}]" if src else None, f"{path}.{k}" if path else k, True)
                return
            for k, x in getattr(m, table).items():
                if x is not None and id(x) not in seen:
                    seen.add(id(x))
                    out.append((f"{path}.{k}" if path else k, x, f"{src}.{table}[{k!r}]" if src else None))
            if recurse and table != "_modules":
                for k, child in m._modules.items():
                    if child is not None:
                        walk(child, f"{src}._modules[{k!r}]" if src else None, f"{path}.{k}" if path else k, True)

        walk(mod_v.value, mod_v.source, prefix, True)
        items = [self.cap.wrap(x, s) for _, x, s in out]
        if named:
            items = [TupleV([ConstV(p), v]) for (p, _, _), v in zip(out, items)]
        return IterV(items)

    def call_builtin_method(self, owner: V, descr, args: list[V], kwargs: dict) -> V:
        """A C method of a builtin base class (dict.get on a dict subclass...): read-only ones run at capture
        time, and their result is guarded by calling them again."""
        # arguments: constants, or classes and functions (a pytree's node types: identity-hashed, guarded by it)
        if descr.__name__ not in PURE_METHODS or kwargs or not isinstance(owner, ObjV) or not all(
                isinstance(a, ConstV) or isinstance(a, ObjV) and isinstance(a.value, (type, types.FunctionType))
                for a in args):
            raise Unsupported(f"{descr.__qualname__} on {self.type_name(owner)}", self.where())
        vals = [a.value for a in args]
        try:
            r = descr(owner.value, *vals)
        except Exception as e:
            raise Unsupported(f"{descr.__qualname__} raised {type(e).__name__}", self.where())
        src = None
        if owner.source is not None:
            src = f"{self.cap.consts.ref(descr)}({owner.source}{''.join(', ' + self.cap.consts.key(v) for v in vals)})"
        return self.cap.wrap(r, src)

    def call_torch(self, f, name: str, args: list[V], kwargs: dict) -> V:
        if has_py_float(args, kwargs):
            return self.record_py_float_call("call_function", f, name, args, kwargs)
        has_tensor = _any_tensor(args) or _any_tensor(list(kwargs.values()))
        if has_tensor or name in FACTORIES or _op_on_numbers(f, args, kwargs):
            return self.cap.record("call_function", f, tuple(args), kwargs, self.where())
        if isinstance(f, types.FunctionType):  # a Python helper of torch's own (torch._none_or_dtype...)
            return self.inline(f.__code__, f.__globals__, tuple(ConstV(d) for d in f.__defaults__ or ()),
                               {k: ConstV(d) for k, d in (f.__kwdefaults__ or {}).items()},
                               tuple(CellV(self.cap.wrap(c.cell_contents, None)) for c in f.__closure__ or ()),
                               args, kwargs, f.__qualname__)
        raise Unsupported(f"torch.{name} is not captured (no tensor argument)", self.where())

    def at_capture(self, f, rule: AtCapture, args: list[V], kwargs: dict) -> V:
        """A call policy.AT_CAPTURE answers at capture time, by its rule."""
        if rule.rule == "skip":
            return ConstV(None)
        if rule.rule == "answer":
            eager = self.concrete(f, args, kwargs)   # (what the function says outside a capture)
            if self.cap.eager_answers:
                return eager
            self.cap.compile_answered |= not (isinstance(eager, ConstV) and eager.value == rule.answer)
            return ConstV(rule.answer)
        out = self.concrete(f, args, kwargs)
        if rule.rule == "guarded":
            if not isinstance(out, ConstV):
                raise Unsupported(f"{_callable_name(f)} returned {self.type_name(out)} at capture", self.where())
            c = self.cap.consts
            call_args = [c.key(self.const_value(a)) for a in args]
            call_args += [f"{k}={c.key(self.const_value(v))}" for k, v in kwargs.items()]
            value = out.value
            if value is None or isinstance(value, bool):
                expected = f"is {value!r}"
            else:
                expected = f"{'is' if isinstance(value, torch.dtype) else '=='} {c.ref(value)}"
            self.cap.guards.add(f"{c.ref(f)}({', '.join(call_args)}) {expected}", 1)
        return out

    def numpy_on_numbers(self, f, args: list[V], kwargs: dict) -> V:
        """A numpy ufunc on numbers: its numpy scalar result at capture (numpy's own semantics kept)."""
        vals = [a.value if isinstance(a, ConstV) else a for a in args]
        kw = {k: v.value if isinstance(v, ConstV) else v for k, v in kwargs.items()}
        if not all(isinstance(v, (int, float, complex)) or type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0
                   for v in [*vals, *kw.values()]):
            raise Unsupported(f"numpy.{f.__name__} of a value that is not a number", self.where())
        try:
            out = f(*vals, **kw)
        except Exception as e:
            raise Unsupported(f"numpy.{f.__name__} raised {type(e).__name__} at capture time", self.where())
        if getattr(out, "ndim", 1) != 0:
            raise Unsupported(f"numpy.{f.__name__} returned {type(out).__name__}", self.where())
        return ConstV(out)

    def call_registered_op(self, op, args: list[V], kwargs: dict) -> V:
        """An operator of torch's dispatcher (`torch.ops.ns.op`, an ATen op, or a `torch.library.custom_op`): one
        graph op, its result's metadata from its fake (or Meta) kernel, as torch.compile records it. An op that
        writes its arguments (a mutable schema) is left to Python, and so is one with no fake kernel (the fake run
        fails: a break)."""
        if isinstance(op, torch.library.CustomOpDef):
            op = op._opoverload
        overloads = [op]
        if isinstance(op, torch._ops.OpOverloadPacket):   # the overload is picked at the call: any but an out= one
            overloads = [getattr(op, name) for name in op.overloads()]
            overloads = [o for o in overloads if not any(a.is_out for a in o._schema.arguments)]
        if "out" in kwargs or any(o._schema.is_mutable for o in overloads):
            raise Unsupported(f"{op} writes its arguments (a mutable schema)", self.where())
        if not (_any_tensor(args) or _any_tensor(list(kwargs.values()))):
            raise Unsupported(f"{op} without a tensor argument", self.where())
        if (why := self.untraceable_gradient(op, args, kwargs)) is not None:
            raise Unsupported(f"{op}'s gradient formula cannot be traced ({why}): the op runs in Python",
                              self.where())
        return self.cap.record("call_function", op, tuple(args), kwargs, self.where())

    def untraceable_gradient(self, op, args: list[V], kwargs: dict) -> str | None:
        """Why a custom op's gradient (a Python formula, torch.library.register_autograd) cannot be traced on fake
        tensors, or None. ember's autograd traces it when the graph compiles; one that reads values (`offs.tolist()`
        of a grouped product's offsets) would make the whole graph run eagerly, so the op is a break instead and
        the graph around it compiles."""
        if str(op).split(".")[0] in ("aten", "prims") or not self.cap.grad_enabled:
            return None
        fake_args, fake_kwargs = map_v(tuple(args), to_fake), map_v(kwargs, to_fake)
        leaves = [t for t in pytree.tree_leaves((fake_args, fake_kwargs))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            return None
        # (a symbolic capture's fakes answer a value read, `.tolist()`, with fresh unbacked symbols instead of
        # raising; ember's autograd cannot trace sizes made from them either)
        shape_env = self.cap.fake_mode.shape_env
        known = set(shape_env.var_to_range) if shape_env is not None else set()
        try:
            with self.cap.fake_mode, torch.enable_grad():
                outs = [t for t in pytree.tree_leaves(op(*fake_args, **fake_kwargs))
                        if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                if outs:
                    torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
        except Exception as e:  # noqa: BLE001 - whatever stops the fake backward stops ember's autograd too
            return f"{type(e).__name__}: {str(e).strip()[:120]}"
        if shape_env is not None and any(free_unbacked_symbols(s) for s in set(shape_env.var_to_range) - known):
            return "it reads tensor values (data-dependent sizes)"
        return None

    def call_module(self, mod_v: V, mod: torch.nn.Module, args: list[V], kwargs: dict) -> V:
        from torch.nn.modules import module as module_mod
        if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks or \
                module_mod._global_backward_hooks or getattr(module_mod, "_global_backward_pre_hooks", None) or \
                mod._backward_hooks or getattr(mod, "_backward_pre_hooks", None):
            raise Unsupported("backward hooks or global module hooks", self.where())
        if (why := self.python_run_module(mod)) is not None:
            raise Unsupported(why, self.where())
        src = mod_v.source
        g = self.cap.guards
        # hooks registered after the capture must be seen: the global ones and this module's backward ones are
        # empty (checked above), its forward ones as many as the capture called. Backward hooks do nothing
        # where grad mode is off (no output has a grad_fn to hook), so an inference call does not check them
        # (two more checks per module: docs/evidence.md).
        hooks = f"{self.cap.consts.ref(module_mod)}."
        grad = torch.is_grad_enabled()
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks"):
            if hasattr(module_mod, name) and (grad or "forward" in name):
                g.falsy(hooks + name)
        if src is not None:
            for name in ("_backward_hooks", "_backward_pre_hooks"):
                if grad and hasattr(mod, name):
                    g.falsy(f"{src}.{name}")
            if not (mod._forward_hooks or mod._forward_pre_hooks):
                g.falsy(f"{src}._forward_hooks")
                g.falsy(f"{src}._forward_pre_hooks")
            else:
                g.add(f"len({src}._forward_hooks) == {len(mod._forward_hooks)} and "
                      f"len({src}._forward_pre_hooks) == {len(mod._forward_pre_hooks)}", 1)
        kwargs_v = DictV(dict(kwargs))   # the one kwargs dict every hook with kwargs receives, as in nn.Module
        for hook_id, hook in list(mod._forward_pre_hooks.items()):
            hook_v = self.cap.wrap(hook, f"{src}._forward_pre_hooks[{hook_id}]" if src else None)
            if mod._forward_pre_hooks_with_kwargs.get(hook_id):
                r = self.call(hook_v, [mod_v, TupleV(list(args)), kwargs_v], {})
                if not self.is_none(r):
                    args, kwargs_v = self.hook_args_kwargs(r)
                continue
            r = self.call(hook_v, [mod_v, TupleV(list(args))], {})
            if not self.is_none(r):
                args = list(r.items) if isinstance(r, TupleV) else [r]
        kwargs = dict(kwargs_v.items)
        forward = type(mod).forward
        if "forward" in mod.__dict__:
            out = self.call(self.cap.wrap(mod.__dict__["forward"], attr_source(src, "forward")), args, kwargs)
        else:
            out = self.call(ObjV(forward), [mod_v] + args, kwargs)
        for hook_id, hook in list(mod._forward_hooks.items()):
            hook_v = self.cap.wrap(hook, f"{src}._forward_hooks[{hook_id}]" if src else None)
            with_kwargs = [kwargs_v] if mod._forward_hooks_with_kwargs.get(hook_id) else []
            r = self.call(hook_v, [mod_v, TupleV(list(args)), *with_kwargs, out], {})
            if not self.is_none(r):
                out = r
        return out

    def python_run_module(self, mod: torch.nn.Module) -> str | None:
        """Why calling this module is a graph break at once (its forward or hooks run as Python there, the module's
        own forward compiled: break_frames.call_compiled), or None."""
        if wrapped_module_attr(mod) is not None:
            return f"{type(mod).__name__}'s forward runs as Python (its {wrapped_module_attr(mod)} compiled)"
        if any(python_hook(h) for h in [*mod._forward_pre_hooks.values(), *mod._forward_hooks.values()]):
            return "torch.distributed's module hooks run as Python (the module's forward compiled)"
        return None

    def hook_args_kwargs(self, r: V) -> tuple[list[V], DictV]:
        """The (args, kwargs) a forward pre-hook with kwargs returned; anything else Python raises at a break."""
        if isinstance(r, TupleV) and len(r.items) == 2 and isinstance(r.items[0], TupleV) and \
                isinstance(r.items[1], DictV) and all(isinstance(k, str) for k in r.items[1].items):
            return list(r.items[0].items), r.items[1]
        raise Unsupported(f"a forward pre-hook returned {self.type_name(r)}, not (args, kwargs)", self.where())

    def construct(self, cls_v: V, cls: type, args: list[V], kwargs: dict) -> V:
        if issubclass(cls, torch.nn.Module):
            return self.construct_stateless_module(cls, args, kwargs)
        if cls.__module__ == "numpy" and getattr(cls, "ndim", None) is not None and issubclass(cls, numbers.Number):
            return self.numpy_on_numbers(cls, args, kwargs)   # a numpy scalar (np.float32(0.1)) of a number
        if is_namedtuple_cls(cls):
            fields = list(cls._fields)
            defaults = getattr(cls, "_field_defaults", {})
            vals = list(args) + [kwargs[f] if f in kwargs else self.const_v(defaults[f])
                                 for f in fields[len(args):]]
            return TupleV(vals, None, cls)
        if issubclass(cls, BaseException):
            return NewObjV(cls, {"args": TupleV(list(args))})
        if cls is types.CellType:
            return CellV(args[0] if args else None)
        if cls is functools.partial:
            return PartialV(args[0], list(args[1:]), dict(kwargs))
        if cls is pytree.TreeSpec:
            return self.construct_treespec(args, kwargs)
        if cls.__module__.split(".")[0] in ("builtins",) or cls.__new__ is not object.__new__ or \
                cls.__module__.split(".")[0] == "torch":
            if all(isinstance(a, ConstV) for a in [*args, *kwargs.values()]) and cls in (
                    torch.device, torch.Size, torch.dtype, slice, range, complex, torch.finfo, torch.iinfo):
                return self.concrete(cls, args, kwargs)
            if dataclasses.is_dataclass(cls) and issubclass(cls, dict):
                return self.construct_dict_dataclass(cls, args, kwargs)
            raise Unsupported(f"creating a {cls.__name__} inside a compiled function", self.where())
        if lookup_static(cls, "__slots__") is not MISSING and "__dict__" not in dir(cls):
            raise Unsupported(f"class {cls.__name__} with __slots__", self.where())
        obj = NewObjV(cls)
        init = lookup_static(cls, "__init__")
        if isinstance(init, types.FunctionType):
            self.call(BoundV(obj, init), args, kwargs)
        elif init is not object.__init__ or args or kwargs:
            raise Unsupported(f"{cls.__name__}.__init__ is not Python", self.where())
        if dataclasses.is_dataclass(cls) and getattr(cls, "__post_init__", None) is None:
            pass
        return obj

    def construct_treespec(self, args: list[V], kwargs: dict) -> V:
        """A pytree's structure (torch.utils._pytree.tree_flatten builds one per node): immutable, so it is built at
        capture from its node type, context and children's specs, which must be known then."""
        def plain(v):
            if isinstance(v, ConstV) or isinstance(v, ObjV) and isinstance(v.value, (type, pytree.TreeSpec)):
                return v.value
            if isinstance(v, (ListV, TupleV)):
                return type(v.items)(plain(x) for x in v.items) if isinstance(v, ListV) else tuple(map(plain, v.items))
            raise Unsupported(f"a pytree TreeSpec of a {self.type_name(v)}", self.where())
        return ObjV(pytree.TreeSpec(*map(plain, args), **{k: plain(v) for k, v in kwargs.items()}))

    def construct_stateless_module(self, cls: type, args: list[V], kwargs: dict) -> V:
        """A module made inside the program (transformers' `ACT2FN[name](x)` builds its activation on every call):
        built at capture when its arguments are constants and it holds no parameters, buffers or submodules, so
        calling it is its forward on constants. The capture's instance stands for each call's new one (its
        identity is the only difference; assigning it to a module is a break). Else a break."""
        if not all(isinstance(a, ConstV) for a in [*args, *kwargs.values()]):
            raise Unsupported(f"creating a module ({cls.__name__}) from values known only when it runs", self.where())
        try:
            with torch.random.fork_rng(devices=[]):   # initializing parameters draws random numbers: not at capture
                mod = cls(*[a.value for a in args], **{k: v.value for k, v in kwargs.items()})
        except Exception as e:
            raise Unsupported(f"creating a module ({cls.__name__}) raised {type(e).__name__}", self.where())
        if mod._parameters or mod._buffers or mod._modules:
            raise Unsupported(f"creating a module with state ({cls.__name__}) inside a compiled function",
                              self.where())
        return ObjV(mod)

    def construct_dict_dataclass(self, cls, args, kwargs) -> V:
        """A dataclass that is also a dict of its non-None fields (transformers' ModelOutput): a DictV of cls."""
        fields = [f.name for f in dataclasses.fields(cls)]
        values = dict(zip(fields, args))
        values.update(kwargs)
        items = {}
        for f in dataclasses.fields(cls):
            v = values.get(f.name)
            if v is None and f.default is not dataclasses.MISSING:
                v = self.const_v(f.default)
            if v is not None and not self.is_none(v):
                items[f.name] = v
        return DictV(items, cls=cls)


# The caller of each kind of value, by its exact class: the kinds in ember.frontend.values are leaf classes
# (tests/frontend/test_values.py checks that none is subclassed), so no order among them matters.
CALLERS_BY_KIND = {
    BoundV: call_bound, ClosureV: call_closure, PartialV: call_partial, GradModeExitV: call_grad_mode_exit,
    AutocastExitV: call_autocast_exit, NoOpCtxV: call_no_op_exit, ObjV: call_real_value, ConstV: call_real_value,
    NewObjV: call_new_object,
}
