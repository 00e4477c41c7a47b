"""The kinds of value the bytecode interpreter tracks.

Every value on the interpreter's stack or in its locals is a `V`. A `V` that came from outside the frame
(an argument, a global, a closure cell, an attribute of such) carries a `source`: a Python expression over
the frame's arguments that fetches it again on a later call. Guards and the generated entry code are written
in terms of sources.

  TensorV   a tensor: an fx node of the graph being captured plus its fake tensor (shape, dtype, ...)
  ConstV    an immutable Python value known at capture time (int, str, None, dtype, ...)
  ObjV      a Python object used by identity (function, class, module, nn.Module, user object...)
  ListV / TupleV / DictV / SetV   containers of V; lists, dicts and sets may be mutated
  NewObjV   a user-class instance created during capture (attributes are V)
  ClosureV  a function created during capture (MAKE_FUNCTION), with its defaults and closure cells
  CellV     a closure cell created during capture
  IterV     an iterator over a known sequence of V (for loops, zip, enumerate, generators...)
  BoundV    a method bound to a V (user method, Tensor method, builtin method of a container)
  SuperV    the result of super()
  GradModeExitV  the __exit__ of a grad-mode context (no_grad/enable_grad/set_grad_enabled) on the stack
  AutocastCtxV / AutocastExitV  torch.autocast(...) before __enter__ / its __exit__ on the stack
  PyFloatV  a Python float computed in the graph (an optimizer's step count), as a float64 0-d tensor
  NoOpCtxV  a context manager left out of the graph (profiler record_function); its __exit__ on the stack too
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


class V:
    source: str | None = None

    def python_type(self) -> type:
        raise NotImplementedError


@dataclasses.dataclass(eq=False)
class TensorV(V):
    node: torch.fx.Node
    fake: torch.Tensor
    source: str | None = None  # set for graph inputs

    def python_type(self):
        return type(self.fake) if not isinstance(self.fake, torch._subclasses.FakeTensor) else torch.Tensor


@dataclasses.dataclass(eq=False)
class PyFloatV(V):
    """A Python float whose value is known only when the graph runs: `_get_value(state['step'])` in torch.optim,
    which is `step.item()` in eager. It lives in the graph as a float64 0-d tensor (the exact value of the
    float), and only what keeps Python float semantics bit for bit is recorded on it (ember.frontend.py_float:
    PyFloats.py_float_binary / record_py_float_call); anything else needs its value, so it breaks the graph."""
    node: torch.fx.Node
    fake: torch.Tensor
    source: str | None = None

    def python_type(self):
        return float


@dataclasses.dataclass(eq=False)
class ConstV(V):
    value: Any   # (a torch.SymInt for an int computed from symbolic sizes: ember.frontend.symbolic)
    source: str | None = None

    def python_type(self):
        return int if isinstance(self.value, torch.SymInt) else type(self.value)


@dataclasses.dataclass(eq=False)
class ObjV(V):
    value: Any
    source: str | None = None
    writes: dict = dataclasses.field(default_factory=dict)  # attribute name -> V written during capture
    deleted: set = dataclasses.field(default_factory=set)

    def python_type(self):
        return type(self.value)


@dataclasses.dataclass(eq=False)
class NewObjV(V):
    cls: type
    attrs: dict = dataclasses.field(default_factory=dict)
    source: str | None = None

    def python_type(self):
        return self.cls


@dataclasses.dataclass(eq=False)
class ListV(V):
    items: list
    source: str | None = None
    mutated: bool = False

    def python_type(self):
        return list


@dataclasses.dataclass(eq=False)
class TupleV(V):
    items: list
    source: str | None = None
    cls: type = tuple  # a namedtuple class, or torch.Size

    def python_type(self):
        return self.cls


@dataclasses.dataclass(eq=False)
class DictV(V):
    items: dict  # python key -> V
    source: str | None = None
    mutated: bool = False
    cls: type = dict

    def python_type(self):
        return self.cls


@dataclasses.dataclass(eq=False)
class SetV(V):
    items: list  # V (ConstV) in insertion order
    source: str | None = None
    mutated: bool = False

    def python_type(self):
        return set


@dataclasses.dataclass(eq=False)
class CellV(V):
    contents: V | None = None
    source: str | None = None  # for cells of the root function's closure
    mutated: bool = False


@dataclasses.dataclass(eq=False)
class ClosureV(V):
    code: Any
    globals: dict
    name: str
    defaults: tuple = ()
    kwdefaults: dict = dataclasses.field(default_factory=dict)
    closure: tuple = ()  # CellV
    qualname: str = ""
    source: str | None = None

    def python_type(self):
        return type(lambda: None)


@dataclasses.dataclass(eq=False)
class IterV(V):
    items: list
    pos: int = 0
    source: str | None = None
    view: bool = False   # a dict's keys()/values()/items(): iterating it or `in` does not consume it

    def python_type(self):
        return type(iter([]))

    def remaining(self) -> list:
        return self.items[self.pos:]


@dataclasses.dataclass(eq=False)
class BoundV(V):
    self_v: V
    func: Any  # a python function (inlined), or a str: name of a Tensor / container method
    source: str | None = None

    def python_type(self):
        return type(self.func) if not isinstance(self.func, str) else type(len)


@dataclasses.dataclass(eq=False)
class SuperV(V):
    cls: type
    obj: V
    source: str | None = None


@dataclasses.dataclass(eq=False)
class GradModeExitV(V):
    prev: bool
    source: str | None = None


@dataclasses.dataclass(eq=False)
class AutocastCtxV(V):
    """torch.autocast(device_type, dtype, enabled, cache_enabled) before __enter__, arguments known at capture."""
    args: tuple
    source: str | None = None


@dataclasses.dataclass(eq=False)
class AutocastExitV(V):
    """The __exit__ of an autocast block entered in the graph: its _enter_autocast node, and the real context
    entered for the capture (the fake tensors' dtypes follow it). node None: a block entered before the graph
    (an AutocastExit handed to a resume function, ctx that object)."""
    node: Any
    ctx: Any
    source: str | None = None


@dataclasses.dataclass(eq=False)
class GradModeCtxV(V):
    """torch.no_grad() / enable_grad() / set_grad_enabled(b) before __enter__."""
    enabled: bool
    source: str | None = None
    prev: bool | None = None  # set when the mode already changed (set_grad_enabled(b) acts at once)


@dataclasses.dataclass(eq=False)
class NoOpCtxV(V):
    """A context manager whose effect ember leaves out of the graph (torch.autograd.profiler.record_function: a
    profiler annotation, no effect on values; torch.compile drops it too). Entered and exited as nothing."""
    cls: type
    args: tuple  # (args, kwargs) it was made with: a break rebuilds it as a real one
    exit: bool = False  # the __exit__ BEFORE_WITH pushes, rather than the context
    source: str | None = None


@dataclasses.dataclass(eq=False)
class PartialV(V):
    """functools.partial(func, *args, **kwargs) made during capture."""
    func: V
    args: list
    kwargs: dict
    source: str | None = None

    def python_type(self):
        return functools.partial


@dataclasses.dataclass(eq=False)
class NullV(V):
    """The NULL that CPython pushes before a callable (PUSH_NULL, LOAD_GLOBAL with the low bit)."""
    source: str | None = None


NULL = NullV()


def is_const(v: V) -> bool:
    return isinstance(v, ConstV)


class GradExit:
    """At run time: the __exit__ of a grad-mode context entered inside a graph, handed to a resume function."""

    def __init__(self, prev: bool):
        self.prev = prev

    def __call__(self, *exc):
        torch._C._set_grad_enabled(self.prev)
        return False


class AutocastExit:
    """At run time: the __exit__ of an autocast block entered inside a graph, handed to a resume function. Made
    where the graph breaks, it enters the block again (the graph's casts were its own, not the process's state),
    so the break's instruction and the rest of the block run under it, and leaves it at the block's end."""

    def __init__(self, *args):
        self.ctx = torch.amp.autocast(*args)
        self.ctx.__enter__()

    def __call__(self, *exc):
        return self.ctx.__exit__(*exc)


def noop_exit(*exc) -> bool:
    """At run time: the __exit__ of a NoOpCtxV entered during capture, on the stack of a graph break."""
    return False
