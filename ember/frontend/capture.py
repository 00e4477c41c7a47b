"""Torch-call recording: the state one capture shares across its frames (`Capture`: the fx graph, fake tensors,
graph inputs, guards, values to write back), how real values are wrapped as tracked ones, and how a torch op
is recorded and run on fake tensors for its result's metadata.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import operator
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ember.errors import Unsupported
from ember.frontend.dynamic_dims import DimPolicy
from ember.frontend.guards import Guards
from ember.frontend.modes import autocast_state
from ember.frontend.policy import CONST_TYPES, MODULE_WRAPPERS, overrides_torch_function
from ember.frontend.python_objects import is_key, is_namedtuple_cls, is_structseq_cls
from ember.frontend.symbolic import SYM_TYPES, Symbols, check_no_unbacked, log_dynamic, symbols_of
from ember.frontend.values import (
    AutocastExit, AutocastExitV, CellV, ConstV, DictV, GradExit, GradModeExitV, ListV, ObjV, SetV, TensorV, TupleV, V,
)
from ember.autograd.fake_dispatch import SymbolicFakeMode
from ember.autograd.recorder import cuda_attention
from ember.ir.meta import MATMUL_METHODS, MATMULS, fake_of_real, fast_result, symbolic_matmul
from ember.ir.symbols import SizeDecision, no_new_guards

# What an op's own argument checks raise (a shape mismatch, an index out of range): raised by a fake run, the op
# raises on the real tensors too. Fake tensors' own errors (data-dependent sizes, no fake kernel) are subclasses.
OP_ERRORS = (RuntimeError, ValueError, IndexError, TypeError)


@dataclasses.dataclass
class GraphInput:
    source: str | None
    real: torch.Tensor
    node: torch.fx.Node


class Capture:
    """The graph being built, its inputs, the guards, and every tracked value that may need writing back."""

    def __init__(self, consts: "ConstTable", dims: DimPolicy | None = None):
        self.graph = torch.fx.Graph()
        self.inputs: list[GraphInput] = []
        # symbolic sizes (ember.frontend.symbolic): a ShapeEnv only where this capture may have a symbolic dim
        self.dims = dims
        self.symbols = Symbols(self) if dims is not None and dims.may_be_symbolic() else None
        # (with symbols: SymbolicFakeMode, which answers a few ops directly that symbolic sizes make slow)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if self.symbols is None else \
            SymbolicFakeMode(allow_non_fake_inputs=True, shape_env=self.symbols.shape_env)
        self.guards = Guards(consts)
        self.consts = consts
        self.by_source: dict[str, V] = {}
        self.by_id: dict[int, V] = {}  # real mutable object / tensor -> its V (keeps aliasing)
        self.keepalive: list = []
        self.mutables: list[V] = []  # lists/dicts/sets/objects/cells with a source that may be mutated
        self.global_writes: dict[tuple[int, str], tuple[dict, V]] = {}
        # `.grad` of graph inputs as the code has set it so far (`p.grad = None`, an in-graph backward's `p.grad = g`):
        # id(TensorV of p) -> (that TensorV, the new value); written back after the graph
        self.grad_writes: dict[int, tuple[TensorV, V]] = {}
        # _enter_autocast nodes of the blocks still open: a graph that ends inside one (a break) closes them
        self.open_autocast: list[torch.fx.Node] = []
        self.backward_in_graph = False   # whether `loss.backward()` may join the graph (FrameCompiler.capture)
        self.backward_node: torch.fx.Node | None = None
        # policy.AT_CAPTURE's "answer" questions (torch.compiler.is_compiling()): torch.compile's answer unless
        # eager_answers; compile_answered once an answer differed from eager's (FrameCompiler.capture reads both)
        self.eager_answers = False
        self.compile_answered = False
        # guards under which a graph break stands that the program itself soon removes (an optimizer's state not
        # made yet): the graph then runs uncompiled (FrameCompiler.capture, EntryCodegen.call_graph)
        self.transient: tuple[str, ...] = ()
        self.tensor_constants: dict[int, torch.Tensor] = {}
        self.py_float_consts: dict[str, TensorV] = {}  # float.hex(c) -> its float64 0-d node (Frame.py_float_tensor)
        self.op_count = 0
        self.grad_enabled = torch.is_grad_enabled()
        self.guards.add(f"___torch.is_grad_enabled() is {self.grad_enabled}", cost=1)
        # a graph captured outside torch.autocast has no casts: reused inside one it would compute in the wrong
        # dtype (and the reverse), so the autocast state at entry is guarded like the grad mode
        if not torch._C._is_any_autocast_enabled():
            self.guards.add("___torch._C._is_any_autocast_enabled() is False", cost=1)
        else:
            self.guards.add(" and ".join(
                f"___torch.is_autocast_enabled({d!r}) is {on} and ___torch.get_autocast_dtype({d!r}) is "
                f"{consts.ref(dt)}" for d, (on, dt) in autocast_state().items()), cost=2)

    # -- wrapping real values ---------------------------------------------------------------------------
    def wrap(self, value: Any, source: str | None) -> V:
        if source is not None and source in self.by_source:
            return self.by_source[source]
        v = self._wrap(value, source)
        if source is not None:
            self.by_source[source] = v
        return v

    def _wrap(self, value, source):
        if type(value) in MODULE_WRAPPERS:  # a compiled module called from compiled code: its original, inlined
            return self.wrap(value._orig_mod, None if source is None else f"{source}._orig_mod")
        g = self.guards
        if isinstance(value, torch.Tensor):
            if id(value) in self.by_id:
                known = self.by_id[id(value)]
                if source is not None:
                    g.add(f"{source} is {known.source}" if known.source else f"{source} is {self.consts.ref(value)}", 0)
                return known
            if overrides_torch_function(type(value)):  # its torch calls run Python: the graph's ops would skip it
                if source is not None:
                    g.add(f"type({source}) is {self.consts.ref(type(value))}", 0)
                raise Unsupported(f"a {type(value).__name__}: a tensor subclass whose torch calls go through "
                                  f"__torch_function__")
            if source is None:
                return self.tensor_constant(value)
            dims = self.dims.dims(value, source) if self.dims is not None else {}
            if dims and self.symbols is not None:
                for d, old, new in self.dims.changed.pop(source, ()):
                    log_dynamic.debug("%s.shape[%d] changed from %d to %d: symbolic from now on (automatic dynamic)",
                                      source, d, old, new)
                fake, sizes, strides = self.symbols.fake(value, source, dims)
                g.symbolic_tensor(source, value, sizes, strides)
            else:
                g.tensor(source, value)
                fake = fake_of_real(self.fake_mode, value)
                if fake is None:   # (static: with a ShapeEnv, from_tensor would give each dim a symbol of its own)
                    fake = self.fake_mode.from_tensor(value, static_shapes=True)
            node = self.graph.placeholder(f"l_{len(self.inputs)}_" + _ident(source))
            node.meta["val"] = fake
            node.meta["source"] = source
            v = TensorV(node, fake, source)
            self.inputs.append(GraphInput(source, value, node))
            self.by_id[id(value)] = v
            self.keepalive.append(value)
            return v
        if type(value) is int and source is not None and self.dims is not None and \
                self.dims.int_is_symbolic(source, value) and self.symbols is not None:
            g.add(f"type({source}) is int", 1)
            return ConstV(self.symbols.int_input(value, source), source)
        if isinstance(value, bool) or value is None or type(value) in (int, float, str, bytes, complex):
            if source is not None:
                g.const(source, value)
            return ConstV(value, source)
        if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout, range, slice,
                              type(Ellipsis), torch.Size, enum.Enum, int, float, str)):
            if source is not None:
                g.add(f"{source} == {self.consts.ref(value)}" if not isinstance(value, (torch.dtype, enum.Enum))
                      else f"{source} is {self.consts.ref(value)}", 1)
            return ConstV(value, source)
        if type(value) is tuple or is_namedtuple_cls(type(value)) or is_structseq_cls(type(value)):
            if source is not None:
                g.sequence(source, value)
            items = [self.wrap(x, f"{source}[{i}]" if source else None) for i, x in enumerate(value)]
            return TupleV(items, source, type(value))
        if type(value) is list:
            if id(value) in self.by_id:
                return self.by_id[id(value)]
            if source is not None:
                g.add(f"type({source}) is list and len({source}) == {len(value)}", 0)
            v = ListV([self.wrap(x, f"{source}[{i}]" if source else None) for i, x in enumerate(value)], source)
            self._track(value, v)
            return v
        if type(value) in (dict, collections.OrderedDict) and all(is_key(k) for k in value):
            if id(value) in self.by_id:
                return self.by_id[id(value)]
            keys = tuple(value)
            if source is not None:
                g.dict_keys(source, value)
            v = DictV({k: self.wrap(value[k], f"{source}[{self.consts.key(k)}]" if source else None) for k in keys},
                      source, cls=type(value))
            self._track(value, v)
            return v
        if type(value) in (set, frozenset) and all(is_key(k) for k in value):
            if source is not None:
                g.add(f"{source} == {self.consts.ref(frozenset(value))}", 1)
            v = SetV([ConstV(k) for k in value], source)
            if type(value) is set:
                self._track(value, v)
            return v
        if isinstance(value, types.CellType):
            try:
                contents = value.cell_contents
            except ValueError:
                return CellV(None, source)
            v = CellV(None, source)
            v.contents = self.wrap(contents, f"{source}.cell_contents" if source else None)
            self._track(value, v)
            return v
        if type(value) is AutocastExit:   # (its __exit__ breaks the graph: calls.call_autocast_exit)
            if source is not None:
                g.add(f"type({source}) is {self.consts.ref(AutocastExit)}", 0)
            return AutocastExitV(None, value, source)
        if type(value) is GradExit:
            if source is not None:
                g.add(f"type({source}) is {self.consts.ref(GradExit)} and {source}.prev is {value.prev}", 0)
            return GradModeExitV(value.prev, source)
        # Objects used by identity: functions, classes, modules, nn.Modules, user objects.
        if id(value) in self.by_id:
            return self.by_id[id(value)]
        if source is not None:
            if _guard_by_identity(value):
                g.add(f"{source} {'==' if _bound_anew(value) else 'is'} {self.consts.ref(value)}", 0)
            else:
                g.add(f"type({source}) is {self.consts.ref(type(value))}", 0)
        v = ObjV(value, source)
        if not isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)):
            self._track(value, v)
        return v

    def _track(self, real, v):
        self.by_id[id(real)] = v
        self.keepalive.append(real)
        if v.source is not None:
            self.mutables.append(v)

    def tensor_constant(self, value: torch.Tensor) -> TensorV:
        """A real tensor reached without a source (e.g. made by a trusted library at capture time). A leaf that
        requires grad (a parameter found through an object made while capturing) is an input instead, fetched by
        identity: as a constant, autograd through the graph would never reach it and its gradient would be lost."""
        if value.requires_grad and value.is_leaf and self.grad_enabled:
            return self.wrap(value, self.consts.ref(value))
        name = f"_tensor_constant{len(self.tensor_constants)}"
        self.tensor_constants[id(value)] = value
        node = self.graph.get_attr(name)
        node.meta["tensor"] = value
        fake = self.fake_mode.from_tensor(value, static_shapes=True)   # (a constant: its sizes are fixed)
        node.meta["val"] = fake
        v = TensorV(node, fake, None)
        self.by_id[id(value)] = v
        self.keepalive.append(value)
        return v

    # -- recording ops ----------------------------------------------------------------------------------
    def record(self, kind: str, target, args: tuple, kwargs: dict, where: str = "") -> V:
        """Add one op to the graph; run it on fake tensors to learn what it returns."""
        node_args = map_v(args, to_node)
        node_kwargs = map_v(kwargs, to_node)
        fake_args = map_v(args, to_fake)
        fake_kwargs = map_v(kwargs, to_fake)
        # the commonest ops on plain inputs: the result's metadata without a FakeTensorMode dispatch (ember.ir.meta)
        symbolic = self.symbols is not None and self.symbols.any
        if not symbolic:
            out = fast_result(self.fake_mode, kind, target, fake_args, fake_kwargs)
        else:
            # symbolic sizes: the same rules with the ShapeEnv closed, so each comparison they make on a size is
            # one its ranges decide (a symbol is >= 2) and any other gives up on the rule, never adding a guard
            try:
                with no_new_guards(self.symbols.shape_env):
                    out = fast_result(self.fake_mode, kind, target, fake_args, fake_kwargs)
            except SizeDecision:
                out = None
        if out is None and symbolic and not fake_kwargs and len(fake_args) == 2 and (
                target in MATMULS if kind == "call_function" else kind == "call_method" and target in MATMUL_METHODS):
            with self.fake_mode:
                out = symbolic_matmul(*fake_args)
        elif out is None and symbolic and target is F.scaled_dot_product_attention:
            try:   # (what the ATen recorder records: torch's C++ choice on fakes reads sizes as ints)
                with self.fake_mode:
                    out = cuda_attention(*fake_args, **fake_kwargs)
            except Exception:   # (arguments the op itself refuses: its own run below says how)
                out = None
        if out is None:
            try:
                _QUIET_FAKE_ERRORS.capturing += 1
                with self.fake_mode:
                    if kind == "call_method":
                        out = getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
                    else:
                        out = target(*fake_args, **fake_kwargs)
            except Unsupported:
                raise
            except Exception as e:  # data-dependent shapes, or an error eager would raise too: run it in Python
                raise Unsupported(f"{_target_name(target)} cannot be captured ({type(e).__name__}: {str(e)[:200]})",
                                  raises=type(e) in OP_ERRORS)
            finally:
                _QUIET_FAKE_ERRORS.capturing -= 1
            if self.symbols is not None:
                check_no_unbacked(out, _target_name(target))
        if not _contains_tensor(out):
            if kind == "call_method" and target.endswith("_") or out is None:
                raise Unsupported(f"{_target_name(target)} returns no tensor")
            return self.wrap_fake_result(out, None)
        node = self.graph.create_node(kind, target, node_args, node_kwargs)
        self.op_count += 1
        node.meta["where"] = where
        node.meta["val"] = out
        return self.wrap_fake_result(out, node)

    def wrap_fake_result(self, out, node):
        if isinstance(out, torch.Tensor):
            return TensorV(node, out)
        if isinstance(out, (tuple, list)):
            items = []
            for i, x in enumerate(out):
                if isinstance(x, torch.Tensor):
                    sub = self.graph.call_function(operator.getitem, (node, i))
                    sub.meta["val"] = x
                    items.append(TensorV(sub, x))
                else:
                    items.append(self.wrap_fake_result(x, None))
            if isinstance(out, list):
                return ListV(items)
            return TupleV(items, None, type(out))
        if isinstance(out, CONST_TYPES):
            return ConstV(out)
        if isinstance(out, SYM_TYPES):
            return ConstV(sym_value(out))
        raise Unsupported(f"an op returned {type(out).__name__}")


def _ident(source: str) -> str:
    s = "".join(c if c.isalnum() else "_" for c in source.replace("___K", "K").replace("._parameters", "")
                .replace("._buffers", "").replace("._modules", "").replace("cell_contents", ""))
    return s.strip("_")[:40] or "x"


def _guard_by_identity(value) -> bool:
    # nn.Modules are guarded by type, and each attribute read has its own guard: a module built anew on every
    # call (or passed to a resume function) then reuses the graph, and its parameters stay graph inputs.
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                              types.ModuleType, functools.partial, types.MethodWrapperType,
                              types.WrapperDescriptorType, types.MethodDescriptorType))


def _bound_anew(value) -> bool:
    # a method bound on each attribute read (Fn.apply: a C classmethod bound to Fn): equal to the one captured
    # (same function, same object), never identical
    return isinstance(value, (types.MethodType, types.MethodWrapperType)) or isinstance(
        value, types.BuiltinMethodType) and not isinstance(value.__self__, (types.ModuleType, type(None)))


def _contains_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_contains_tensor(y) for y in x)
    return False


def _target_name(t) -> str:
    return t if isinstance(t, str) else getattr(t, "__qualname__", None) or getattr(t, "__name__", repr(t))


class _QuietFakeErrors(logging.Filter):
    """Drops torch's ERROR record (with a traceback) of a fake kernel that raised while ember captures an op: ember
    handles that error (a break: the op runs in Python, and raises there if eager raises), so the user's stderr
    should not show a traceback for it."""
    capturing = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.capturing and record.getMessage().startswith("failed while attempting to run meta"))


_QUIET_FAKE_ERRORS = _QuietFakeErrors()
logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QUIET_FAKE_ERRORS)


def map_v(x: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(x, tuple):
        return tuple(map_v(y, fn) for y in x)
    if isinstance(x, list):
        return [map_v(y, fn) for y in x]
    if isinstance(x, dict):
        return {k: map_v(y, fn) for k, y in x.items()}
    return fn(x)


def to_node(v: Any) -> Any:
    if isinstance(v, TensorV):
        return v.node
    return _sym_nodes(python_value(v, lambda t: t.node))


def sym_value(x):
    """A symbolic value as a ConstV holds it: a SymInt stays symbolic; a decision on a SymBool and a SymFloat's
    value are taken at capture (guarded by the ShapeEnv)."""
    if isinstance(x, torch.SymBool):
        return bool(x)
    if isinstance(x, torch.SymFloat):
        return float(x)
    if isinstance(x, torch.SymInt):
        n = x.node.maybe_as_int()
        return n if n is not None else x
    return x


def _sym_nodes(x: Any) -> Any:
    """SymInts inside an op's argument (a size, a slice bound, a torch.Size) as graph nodes."""
    if isinstance(x, torch.SymInt):
        syms = symbols_of(x)
        if syms is None:
            raise Unsupported("a SymInt of another capture")
        return syms.sym_node(x)
    if isinstance(x, slice):
        if any(isinstance(p, torch.SymInt) for p in (x.start, x.stop, x.step)):
            return slice(_sym_nodes(x.start), _sym_nodes(x.stop), _sym_nodes(x.step))
        return x
    if isinstance(x, tuple) and any(isinstance(p, (torch.SymInt, slice, tuple, list)) for p in x):
        items = [_sym_nodes(p) for p in x]
        return tuple(items) if type(x) in (tuple, torch.Size) else type(x)(*items)
    if isinstance(x, list):
        return [_sym_nodes(p) for p in x]
    if isinstance(x, (torch.SymBool, torch.SymFloat)):
        return sym_value(x)
    return x


def to_fake(v: Any) -> Any:
    if isinstance(v, TensorV):
        return v.fake
    return python_value(v, lambda t: t.fake)


def python_value(v: Any, tensor_fn: Callable[[TensorV], Any]) -> Any:
    """A V as the plain value an op receives (tensors mapped by tensor_fn)."""
    if isinstance(v, TensorV):
        return tensor_fn(v)
    if isinstance(v, ConstV):
        if type(v.value).__module__ == "numpy" and getattr(v.value, "ndim", None) == 0:
            return v.value.item()   # a numpy scalar: the Python number torch takes it as (fx cannot print it)
        return v.value
    if isinstance(v, TupleV):
        items = [python_value(x, tensor_fn) for x in v.items]
        if v.cls is torch.Size:
            return torch.Size(items)
        return tuple(items) if v.cls is tuple or not is_namedtuple_cls(v.cls) else v.cls(*items)
    if isinstance(v, ListV):
        return [python_value(x, tensor_fn) for x in v.items]
    if isinstance(v, DictV):
        return {k: python_value(x, tensor_fn) for k, x in v.items.items()}
    if isinstance(v, ObjV) and not v.writes:
        if isinstance(v.value, (torch.nn.Module,)) or not hasattr(v.value, "__dict__") or callable(v.value):
            return v.value
    if isinstance(v, V):
        raise Unsupported(f"cannot pass a {type(v).__name__} to a torch op")
    return v


class ConstTable:
    """Python objects the generated guard and entry code refer to, by name (___K0, ___K1, ...)."""

    def __init__(self):
        self.objs: dict[str, Any] = {}
        self.names: dict[int, str] = {}

    def ref(self, obj) -> str:
        key = id(obj)
        if key not in self.names:
            name = f"___K{len(self.objs)}"
            self.names[key] = name
            self.objs[name] = obj
        return self.names[key]

    def key(self, k) -> str:
        if isinstance(k, (str, int, bool, type(None))) and not isinstance(k, enum.Enum):
            return repr(k)
        return self.ref(k)

