"""`torch.autograd.Function` subclasses called in a captured program (`Fn.apply(...)`), as torch.compile captures
them.

- No gradient can flow (grad mode off, or no tensor argument requires grad): `forward` is inlined, under grad
  mode off as `apply` runs it, with `InlineCtx` for its ctx (its methods are plain Python, interpreted as the
  program is). A setup_context-style Function gets `forward(*args)` then `setup_context(ctx, args, output)`.
- Otherwise: one graph op, `Fn.apply(*args)`, whose result metadata comes from running it on the capture's fake
  tensors. Downstream, ember.autograd traces the graph on fakes with PyTorch's autograd recording: `apply` runs
  `forward` (its ATen ops are recorded) and builds Fn's backward node, and the joint trace's
  `torch.autograd.grad` runs Fn's `backward` on fakes (its ATen ops are recorded too), so ctx.save_for_backward,
  mark_non_differentiable, needs_input_grad and non-tensor arguments behave as in eager. Python side effects of
  forward or backward (a print, a counter) run when the graph is traced, not on each call: such Functions are
  rare; torch.compile breaks at them.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import _is_setup_context_defined

from ember.errors import Unsupported
from ember.frontend.python_objects import lookup_static
from ember.frontend.values import ConstV, ObjV, TensorV, TupleV, V

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame

# torch's own Function.apply (`Fn.apply` is it bound to Fn): the C base class's classmethod, which Function takes
# as it is on newer torch and wraps in a Python classmethod (functorch checks, then the C one) on torch 2.11
FUNCTION_APPLIES = tuple({torch._C._FunctionBase.__dict__["apply"], torch.autograd.Function.__dict__["apply"]})


class InlineCtx:
    """The ctx an inlined forward sees: what it saves is kept (forward may read it back), and nothing else is
    needed, as no backward will run."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.to_save = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.to_save = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_dirty(self, *args):
        pass

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value

    @property
    def saved_tensors(self):
        return self.to_save


def function_applied(f) -> type | None:
    """The torch.autograd.Function subclass whose `apply` f is (Fn.apply, not overridden), or None."""
    cls = getattr(f, "__self__", None)
    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and cls is not torch.autograd.Function \
            and getattr(f, "__name__", None) == "apply" \
            and any(_is_apply(lookup_static(cls, "apply"), f, a) for a in FUNCTION_APPLIES):
        return cls
    return None


def _is_apply(static, f, torch_apply) -> bool:
    # the class's `apply` is torch's, and f is it (a C classmethod binds as itself; a Python one binds its function)
    return static is torch_apply and (
        not isinstance(static, classmethod) or getattr(f, "__func__", None) is static.__func__)


@functools.lru_cache(maxsize=None)
def applier(cls: type):
    """`cls.apply` as a Python function: the graph op's target (fx names its targets by module and name, which a
    method bound to a class has not)."""
    def apply(*args):
        return cls.apply(*args)
    apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
    apply.__module__ = cls.__module__
    apply.function = cls
    return apply


def _needs_grad(frame: Frame, args: list[V]) -> bool:
    # as apply decides it: grad mode on and a tensor argument (a direct one) that requires grad
    return frame.cap.grad_enabled and any(isinstance(a, TensorV) and a.fake.requires_grad for a in args)


def apply_function(frame: Frame, cls: type, args: list[V], kwargs: dict) -> V:
    """`cls.apply(*args)` in the program: its forward inlined, or one graph op (the module's docstring)."""
    cls_v = frame.cap.wrap(cls, None)
    if kwargs:  # Function.apply takes positional arguments only; eager raises
        raise Unsupported(f"{cls.__name__}.apply with keyword arguments", frame.where())
    if _needs_grad(frame, args):
        return frame.cap.record("call_function", applier(cls), tuple(args), {}, frame.where())
    needs = TupleV([ConstV(False) for _ in args])
    ctx = frame.construct(ObjV(InlineCtx), InlineCtx, [needs], {})
    forward = frame.getattr(cls_v, "forward")
    prev = frame.cap.grad_enabled
    frame.set_grad(False)
    try:
        if _is_setup_context_defined(cls.setup_context):
            out = frame.call(forward, args, {})
            frame.call(frame.getattr(cls_v, "setup_context"), [ctx, TupleV(list(args)), out], {})
        else:
            out = frame.call(forward, [ctx] + args, {})
    finally:
        frame.set_grad(prev)
    return out
