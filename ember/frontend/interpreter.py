"""A symbolic interpreter of CPython 3.11/3.12 bytecode that records torch operations into a torch.fx.Graph.

It runs a function's instructions on tracked values (ember.frontend.values) instead of real ones. Python-level
values are known at capture time (they come from the first call's arguments), so Python control flow is
followed, and every assumption made about them becomes a guard. Tensors are fake: each tensor operation adds a
node to the graph and is run on fake tensors only for its result's shape and dtype.

One `Frame` interprets one code object; calls to user functions are inlined as child frames sharing the
`Capture` (graph, guards, wrapped inputs). Whatever cannot be recorded raises `Unsupported`; the caller
(ember.frontend.convert) turns that into a graph break at the root frame's current instruction.
"""
from __future__ import annotations

import bisect
import builtins
import collections
import copy
import dataclasses
import dis
import enum
import functools
import inspect
import itertools
import keyword
import math
import operator
import sys
import types
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ember import config
from ember.autograd.backward import grads_of
from ember.errors import Unsupported
from ember.frontend.guards import DICT_GET, Guards
from ember.ir.meta import fake_of_real, fast_result
from ember.frontend.values import (
    NULL, AutocastCtxV, AutocastExitV, GradExit, PartialV, BoundV, CellV, ClosureV, ConstV, DictV, GradModeCtxV,
    GradModeExitV, IterV, ListV, NewObjV, NoOpCtxV, NullV, ObjV, PyFloatV, SetV, SuperV, TensorV, TupleV, V,
)

PY312 = sys.version_info >= (3, 12)
CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR = 0x20, 0x80, 0x200
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08

# ---------------------------------------------------------------------------------------------------------
# What counts as a torch operation, a pure function, a constant.

CONST_TYPES = (int, float, bool, str, type(None), complex, bytes, torch.dtype, torch.device, torch.memory_format,
               torch.layout, range, slice, type(Ellipsis), type(NotImplemented), torch.Size)
TORCH_NAMESPACES = [torch, torch.nn.functional, torch.linalg, torch.fft, torch.special, torch._C._nn,
                    torch._C._VariableFunctions, torch._C._linalg, torch._C._fft, torch._C._special]
# torch callables that change global state or do I/O: never recorded, never evaluated at capture time.
TORCH_IMPURE = {"manual_seed", "seed", "save", "load", "set_default_dtype", "set_default_device", "set_printoptions",
                "compile", "use_deterministic_algorithms", "set_num_threads", "set_rng_state", "get_rng_state",
                "initial_seed", "set_float32_matmul_precision", "set_anomaly_enabled", "set_autocast_enabled",
                "_assert_async", "set_default_tensor_type", "set_deterministic_debug_mode"}
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "tensor", "as_tensor", "randn",
             "rand", "randint", "randperm", "normal", "eye", "scalar_tensor", "empty_strided", "zeros_like",
             "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "bernoulli",
             "tril_indices", "triu_indices", "complex", "polar"}
# torch functions of no tensor argument whose result depends only on their arguments or guarded global state.
TORCH_PURE_CONST = {"is_grad_enabled", "get_default_dtype", "is_tensor", "is_floating_point", "is_complex",
                    "is_autocast_enabled", "is_inference_mode_enabled", "result_type", "promote_types",
                    "can_cast", "is_storage", "numel", "typename", "finfo", "iinfo", "is_nonzero_",
                    "_get_tracing_state", "is_scripting", "is_anomaly_enabled", "is_deterministic_algorithms_warn_only_enabled",
                    "are_deterministic_algorithms_enabled", "broadcast_shapes", "_has_torch_function",
                    "_has_torch_function_unary", "_has_torch_function_variadic", "get_autocast_gpu_dtype",
                    "is_autocast_cpu_enabled"}
# Device types whose losses' backward() joins the graph (Frame.tensor_backward). On CUDA a training step becomes
# one graph and one CUDA-graph replay (densenet121's step on an H200: 9.7 -> 7.3 ms, against Inductor's 7.7).
# On the CPU, resnet18's training step (bench/cpu.py resnet18_train, 2-core VM) measured 44 ms with the
# backward as separate graphs and 66-72 ms in one graph, so it stays separate there.
BACKWARD_IN_GRAPH_DEVICES = {"cuda"}
TENSOR_METHODS_UNSUPPORTED = {"item", "tolist", "numpy", "backward", "register_hook", "retain_grad", "data_ptr",
                              "storage", "untyped_storage", "__bool__", "__int__", "__float__", "__index__",
                              "__len__", "__iter__", "__array__", "record_stream", "share_memory_", "pin_memory",
                              "register_post_accumulate_grad_hook", "__reduce_ex__", "__setstate__", "cpu_",
                              "set_", "resize_", "resize_as_", "__repr__", "__str__", "__format__", "tolist"}


def _namespace_items(ns):
    return [(name, getattr(ns, name, None)) for name in dir(ns) if not name.startswith("__")]


def _torch_callables() -> dict[int, str]:
    found = {}
    for ns in TORCH_NAMESPACES:
        for name, v in _namespace_items(ns):
            if callable(v) and not isinstance(v, (type, types.ModuleType)) and name not in TORCH_IMPURE:
                found.setdefault(id(v), name)
    return found


TORCH_OPS = _torch_callables()
TORCH_OP_OBJS = {id(v): v for ns in TORCH_NAMESPACES for _, v in _namespace_items(ns) if id(v) in TORCH_OPS}
TRUSTED_MODULE_PREFIXES = ("torch", "math", "operator", "functools", "itertools", "collections", "builtins",
                           "numbers", "typing", "enum", "dataclasses", "warnings", "inspect", "abc", "copy")
PURE_BUILTIN_FUNCS = {abs, round, divmod, pow, hash, chr, ord, hex, oct, bin, repr, ascii, format, callable, id}
COMPILING_PROBES = {getattr(torch.compiler, n) for n in ("is_compiling", "is_dynamo_compiling", "is_exporting")
                    if hasattr(torch.compiler, n)} - {getattr(torch.compiler, "is_exporting", None)}
STATE_PROBES = {getattr(torch._C, n) for n in ("_is_tracing", "_get_tracing_state", "_get_cudnn_enabled",
                                               "_get_mkldnn_enabled", "is_grad_enabled", "_is_torch_function_enabled",
                                               "_is_functional_tensor",
                                               # fixed once set (torch.utils.rename_privateuse1_backend): asked by
                                               # torch.optim when it picks the foreach implementation
                                               "_get_privateuse1_backend_name") if hasattr(torch._C, n)}

# The wrapper torch._disable_dynamo puts around torch functions torch.compile must not trace (Optimizer.zero_grad,
# state_dict...): ember runs them as Python too rather than interpreting torch._dynamo's own code.
TORCH_DISABLED_CODE = torch._disable_dynamo(lambda: None).__code__
DYNAMO_WRAPPER_FILE = "/".join(("_dynamo", "eval_frame.py"))


def optim_helpers() -> tuple:
    """torch.optim's `_get_value` and `_stack_if_compiling`, whose eager behavior ember keeps although
    is_compiling() is True (see Frame.optim_get_value); (None, None) until torch.optim is loaded (lazily)."""
    mod = sys.modules.get("torch.optim.optimizer")
    return (getattr(mod, "_get_value", None), getattr(mod, "_stack_if_compiling", None)) if mod else (None, None)


# Python float arithmetic as float64 0-d tensor ops: the same IEEE double operations (pow: both reach the C
# library's pow; a 1-element float64 tensor takes the kernels' scalar path)
PY_FLOAT_OPS = {operator.add: torch.add, operator.sub: torch.sub, operator.mul: torch.mul,
                operator.truediv: torch.div, operator.pow: torch.pow}
REFLECTED = {operator.add: "__radd__", operator.sub: "__rsub__", operator.mul: "__rmul__",
             operator.truediv: "__rtruediv__"}


def autocast_state() -> dict:
    """{device type: (enabled, dtype)} of autocast, for the guards and to restore it after a capture."""
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")}


def restore_autocast(state: dict) -> None:
    for d, (on, dt) in state.items():
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dt)


AUTOCAST_CLASSES = {torch.autocast: None, torch.amp.autocast: None, torch.cpu.amp.autocast: "cpu",
                    torch.cuda.amp.autocast: "cuda"}   # the last two: the deprecated per-device spellings
OUTPUT_MODULES = {"logging", "warnings"}  # their calls may write output: graph breaks, as print
DICT_VIEWS = {type({}.keys()), type({}.values()), type({}.items()), type(collections.OrderedDict().keys()),
              type(collections.OrderedDict().values()), type(collections.OrderedDict().items())}
MODULE_TRAVERSALS = {"children", "named_children", "parameters", "named_parameters", "buffers", "named_buffers",
                     "modules", "named_modules"}
PURE_METHODS = {"get", "__getitem__", "__contains__", "__len__", "keys", "values", "items", "count", "index",
                "__eq__", "__ne__", "__hash__", "startswith", "endswith", "copy"}
MATH_FUNCS = {id(v) for v in vars(math).values() if callable(v)}
OPERATOR_FUNCS = {id(v): v for v in vars(operator).values() if callable(v)}

BINARY_OPS = {  # BINARY_OP arg -> (operator function, in place?)
    0: (operator.add, False), 1: (operator.and_, False), 2: (operator.floordiv, False), 3: (operator.lshift, False),
    4: (operator.matmul, False), 5: (operator.mul, False), 6: (operator.mod, False), 7: (operator.or_, False),
    8: (operator.pow, False), 9: (operator.rshift, False), 10: (operator.sub, False), 11: (operator.truediv, False),
    12: (operator.xor, False), 13: (operator.iadd, True), 14: (operator.iand, True), 15: (operator.ifloordiv, True),
    16: (operator.ilshift, True), 17: (operator.imatmul, True), 18: (operator.imul, True), 19: (operator.imod, True),
    20: (operator.ior, True), 21: (operator.ipow, True), 22: (operator.irshift, True), 23: (operator.isub, True),
    24: (operator.itruediv, True), 25: (operator.ixor, True),
}
INPLACE_TO_BINARY = {operator.iadd: operator.add, operator.iand: operator.and_, operator.ifloordiv: operator.floordiv,
                     operator.ilshift: operator.lshift, operator.imatmul: operator.matmul, operator.imul: operator.mul,
                     operator.imod: operator.mod, operator.ior: operator.or_, operator.ipow: operator.pow,
                     operator.irshift: operator.rshift, operator.isub: operator.sub,
                     operator.itruediv: operator.truediv, operator.ixor: operator.xor}
COMPARE_OPS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt,
               ">=": operator.ge}


def is_namedtuple_cls(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields") and cls is not tuple


def is_structseq_cls(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "n_fields")


def structseq_fields(cls) -> list[str]:
    if hasattr(cls, "_fields"):
        return list(cls._fields)
    return [k for k, v in vars(cls).items() if isinstance(v, types.MemberDescriptorType)][: cls.n_sequence_fields]


def attr_source(parent: str | None, name: str) -> str | None:
    """`parent.name`, or `getattr(parent, 'name')` where the name is no identifier. A dunder or private name is
    plain too: the entry is a module-level function, where no name mangling happens, and share_paths walks a
    plain attribute once per call (BertModel's `self.__class__.__name__` reads, as getattr calls: 185 builtin
    calls per cached call)."""
    if parent is None:
        return None
    plain = name.isidentifier() and not keyword.iskeyword(name)
    return f"{parent}.{name}" if plain else f"getattr({parent}, {name!r})"


def where(code: types.CodeType, offset: int) -> str:
    """file:line of an instruction (every recorded op carries one: walking co_lines per op was a tenth of
    GPT-2's capture, so each code's line starts are listed once)"""
    starts = _LINE_STARTS.get(code)
    if starts is None:
        starts = _LINE_STARTS[code] = ([], [])
        for start, _end, lineno in code.co_lines():
            if lineno is not None:
                starts[0].append(start)
                starts[1].append(lineno)
    i = bisect.bisect_right(starts[0], offset)
    return f"{code.co_filename}:{starts[1][i - 1] if i else None}"


# ---------------------------------------------------------------------------------------------------------
# The state shared by every frame of one capture.

@dataclasses.dataclass
class GraphInput:
    source: str | None
    real: torch.Tensor
    node: torch.fx.Node


class Capture:
    """The graph being built, its inputs, the guards, and every tracked value that may need writing back."""

    def __init__(self, consts: "ConstTable"):
        self.graph = torch.fx.Graph()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.inputs: list[GraphInput] = []
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
        self.backward_in_graph = False   # whether `loss.backward()` may join the graph (FrameCompiler.capture)
        self.backward_node: torch.fx.Node | None = None
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
        g = self.guards
        if isinstance(value, torch.Tensor):
            if id(value) in self.by_id:
                known = self.by_id[id(value)]
                if source is not None:
                    g.add(f"{source} is {known.source}" if known.source else f"{source} is {self.consts.ref(value)}", 0)
                return known
            if source is None:
                return self.tensor_constant(value)
            g.tensor(source, value)
            fake = fake_of_real(self.fake_mode, value)
            if fake is None:
                fake = self.fake_mode.from_tensor(value)
            node = self.graph.placeholder(f"l_{len(self.inputs)}_" + _ident(source))
            node.meta["val"] = fake
            node.meta["source"] = source
            v = TensorV(node, fake, source)
            self.inputs.append(GraphInput(source, value, node))
            self.by_id[id(value)] = v
            self.keepalive.append(value)
            return v
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
        if type(value) in (dict, collections.OrderedDict) and all(_is_key(k) for k in value):
            if id(value) in self.by_id:
                return self.by_id[id(value)]
            keys = tuple(value)
            if source is not None:
                g.dict_keys(source, value)
            v = DictV({k: self.wrap(value[k], f"{source}[{self.consts.key(k)}]" if source else None) for k in keys},
                      source, cls=type(value))
            self._track(value, v)
            return v
        if type(value) in (set, frozenset) and all(_is_key(k) for k in value):
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
        if type(value) is GradExit:
            if source is not None:
                g.add(f"type({source}) is {self.consts.ref(GradExit)} and {source}.prev is {value.prev}", 0)
            return GradModeExitV(value.prev, source)
        # Objects used by identity: functions, classes, modules, nn.Modules, user objects.
        if id(value) in self.by_id:
            return self.by_id[id(value)]
        if source is not None:
            if _guard_by_identity(value):
                g.add(f"{source} is {self.consts.ref(value)}", 0)
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
        """A real tensor reached without a source (e.g. made by a trusted library at capture time)."""
        name = f"_tensor_constant{len(self.tensor_constants)}"
        self.tensor_constants[id(value)] = value
        node = self.graph.get_attr(name)
        node.meta["tensor"] = value
        fake = self.fake_mode.from_tensor(value)
        node.meta["val"] = fake
        v = TensorV(node, fake, None)
        self.by_id[id(value)] = v
        self.keepalive.append(value)
        return v

    # -- recording ops ----------------------------------------------------------------------------------
    def record(self, kind: str, target, args: tuple, kwargs: dict, where: str = "") -> V:
        """Add one op to the graph; run it on fake tensors to learn what it returns."""
        node_args = _map_v(args, _to_node)
        node_kwargs = _map_v(kwargs, _to_node)
        fake_args = _map_v(args, _to_fake)
        fake_kwargs = _map_v(kwargs, _to_fake)
        # the commonest ops on plain inputs: the result's metadata without a FakeTensorMode dispatch (ember.ir.meta)
        out = fast_result(self.fake_mode, kind, target, fake_args, fake_kwargs)
        if out is None:
            try:
                with self.fake_mode:
                    if kind == "call_method":
                        out = getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
                    else:
                        out = target(*fake_args, **fake_kwargs)
            except Unsupported:
                raise
            except Exception as e:  # data-dependent shapes, or an error eager would raise too: run it in Python
                raise Unsupported(f"{_target_name(target)} cannot be captured ({type(e).__name__}: {str(e)[:200]})")
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
        raise Unsupported(f"an op returned {type(out).__name__}")


def _has_py_float(args, kwargs) -> bool:
    items = [*args, *kwargs.values()]
    return any(isinstance(x, PyFloatV) or isinstance(x, (ListV, TupleV)) and _has_py_float(x.items, {}) for x in items)


def _all_py_floats(v) -> bool:
    return isinstance(v, (ListV, TupleV)) and bool(v.items) and all(isinstance(x, PyFloatV) for x in v.items)


def _ident(source: str) -> str:
    s = "".join(c if c.isalnum() else "_" for c in source.replace("___K", "K").replace("._parameters", "")
                .replace("._buffers", "").replace("._modules", "").replace("cell_contents", ""))
    return s.strip("_")[:40] or "x"


def _is_key(k) -> bool:
    return isinstance(k, (int, str, bool, float, type(None), bytes, enum.Enum, tuple, torch.dtype, type)) and (
        not isinstance(k, tuple) or all(_is_key(x) for x in k))


def _guard_by_identity(value) -> bool:
    # nn.Modules are guarded by type, and each attribute read has its own guard: a module built anew on every
    # call (or passed to a resume function) then reuses the graph, and its parameters stay graph inputs.
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                              types.ModuleType, functools.partial, types.MethodWrapperType,
                              types.WrapperDescriptorType, types.MethodDescriptorType))


def _contains_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_contains_tensor(y) for y in x)
    return False


def _target_name(t) -> str:
    return t if isinstance(t, str) else getattr(t, "__qualname__", None) or getattr(t, "__name__", repr(t))


def _map_v(x, fn):
    if isinstance(x, tuple):
        return tuple(_map_v(y, fn) for y in x)
    if isinstance(x, list):
        return [_map_v(y, fn) for y in x]
    if isinstance(x, dict):
        return {k: _map_v(y, fn) for k, y in x.items()}
    return fn(x)


def _to_node(v):
    if isinstance(v, TensorV):
        return v.node
    return _python_value(v, lambda t: t.node)


def _to_fake(v):
    if isinstance(v, TensorV):
        return v.fake
    return _python_value(v, lambda t: t.fake)


def _python_value(v, tensor_fn):
    """A V as the plain value an op receives (tensors mapped by tensor_fn)."""
    if isinstance(v, TensorV):
        return tensor_fn(v)
    if isinstance(v, ConstV):
        return v.value
    if isinstance(v, TupleV):
        items = [_python_value(x, tensor_fn) for x in v.items]
        if v.cls is torch.Size:
            return torch.Size(items)
        return tuple(items) if v.cls is tuple or not is_namedtuple_cls(v.cls) else v.cls(*items)
    if isinstance(v, ListV):
        return [_python_value(x, tensor_fn) for x in v.items]
    if isinstance(v, DictV):
        return {k: _python_value(x, tensor_fn) for k, x in v.items.items()}
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


# ---------------------------------------------------------------------------------------------------------
# Control-flow signals inside the interpreter.

class PyError(Unsupported):
    """A Python exception the captured code raises. Handlers in the code (try/except, with) may catch it;
    one that escapes the root frame becomes a graph break, so Python raises it for real."""

    def __init__(self, exc: BaseException, where_: str = ""):
        super().__init__(f"{type(exc).__name__}: {exc}", where_)
        self.exc = exc


class _Return(Exception):
    def __init__(self, value: V):
        self.value = value


class StopCapture(Exception):
    """Raised at the root frame's stop offset: the state there is what the entry code rebuilds."""

    def __init__(self, frame: "Frame", inst: dis.Instruction, reason: str):
        self.frame, self.inst, self.reason = frame, inst, reason


# ---------------------------------------------------------------------------------------------------------

_INSTRUCTIONS: dict[types.CodeType, tuple[list, dict]] = {}
_LINE_STARTS: dict[types.CodeType, tuple[list, list]] = {}
_EXCEPTION_TABLES: dict[types.CodeType, list] = {}


def clear_caches() -> None:
    _INSTRUCTIONS.clear()
    _EXCEPTION_TABLES.clear()
    _LINE_STARTS.clear()


def exception_table(code: types.CodeType) -> list:
    if code not in _EXCEPTION_TABLES:
        _EXCEPTION_TABLES[code] = list(dis._parse_exception_table(code))
    return _EXCEPTION_TABLES[code]


def instructions(code: types.CodeType):
    if code not in _INSTRUCTIONS:
        insts = list(dis.get_instructions(code))
        _INSTRUCTIONS[code] = (insts, {inst.offset: i for i, inst in enumerate(insts)})
    return _INSTRUCTIONS[code]


class Frame:
    """Interprets one code object over tracked values."""

    def __init__(self, cap: Capture, code: types.CodeType, f_globals: dict, local_vars: dict[str, V],
                 cells: dict[str, CellV], parent: Frame | None = None, stop_at: dict | None = None,
                 start_offset: int = 0, globals_source: str | None = None):
        self.cap, self.code, self.f_globals = cap, code, f_globals
        self.locals = local_vars
        self.cells = cells
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.stack: list[V] = []
        self.insts, self.index = instructions(code)
        self.ip = self.index[start_offset]
        self.kw_names: tuple = ()
        self.stop_at = stop_at or {}
        self.globals_source = globals_source if globals_source is not None else cap.consts.ref(f_globals)
        self.yields: list[V] | None = [] if code.co_flags & CO_GENERATOR else None
        self.exc_info: list[V] = []
        self.current: dis.Instruction | None = None

    def where(self) -> str:
        return where(self.code, self.current.offset if self.current else 0)

    # -- main loop ----------------------------------------------------------------------------------------
    def run(self) -> V:
        try:
            while True:
                inst = self.insts[self.ip]
                self.current = inst
                if self.parent is None and inst.offset in self.stop_at:
                    raise StopCapture(self, inst, self.stop_at[inst.offset])
                self.ip += 1
                handler = getattr(self, inst.opname, None)
                if handler is None:
                    raise Unsupported(f"bytecode {inst.opname} is not supported", self.where())
                try:
                    handler(inst)
                except PyError as e:
                    if not self.catch(inst, e):
                        raise
        except _Return as r:
            return r.value

    def catch(self, inst, e: PyError) -> bool:
        """Jump to the handler the exception table names for this instruction, as CPython does."""
        for entry in exception_table(self.code):
            if entry.start <= inst.offset < entry.end:
                del self.stack[entry.depth:]
                if entry.lasti:
                    self.push(ConstV(inst.offset))
                self.push(ObjV(e.exc))
                self.ip = self.index[entry.target]
                return True
        return False

    def PUSH_EXC_INFO(self, inst):
        exc = self.pop()
        self.push(self.exc_info[-1] if self.exc_info else ConstV(None))
        self.exc_info.append(exc)
        self.push(exc)

    def POP_EXCEPT(self, inst):
        self.pop()
        if self.exc_info:
            self.exc_info.pop()

    def CHECK_EXC_MATCH(self, inst):
        typ = self.pop()
        exc = self.stack[-1]
        self.push(ConstV(isinstance(exc.value, _classes(typ))))

    def RERAISE(self, inst):
        exc = self.pop()
        raise PyError(exc.value, self.where())

    def WITH_EXCEPT_START(self, inst):
        exc = self.stack[-1]
        exit_fn = self.stack[-4]
        e = exc.value
        self.push(self.call(exit_fn, [ObjV(type(e)), exc, ConstV(None)], {}))

    def push(self, v: V):
        self.stack.append(v)

    def pop(self) -> V:
        return self.stack.pop()

    def popn(self, n: int) -> list[V]:
        if n == 0:
            return []
        out = self.stack[-n:]
        del self.stack[-n:]
        return out

    def jump(self, inst):
        self.ip = self.index[inst.argval]

    # -- loads and stores ----------------------------------------------------------------------------
    def NOP(self, inst): pass
    RESUME = NOP
    PRECALL = NOP
    EXTENDED_ARG = NOP
    CACHE = NOP

    def POP_TOP(self, inst):
        self.pop()

    def PUSH_NULL(self, inst):
        self.push(NULL)

    def COPY(self, inst):
        self.push(self.stack[-inst.arg])

    def SWAP(self, inst):
        s = self.stack
        s[-1], s[-inst.arg] = s[-inst.arg], s[-1]

    def LOAD_CONST(self, inst):
        self.push(self.const_v(inst.argval))

    def const_v(self, value) -> V:
        if isinstance(value, tuple):
            return TupleV([self.const_v(x) for x in value])
        if isinstance(value, frozenset):
            return ConstV(value)
        return ConstV(value)

    def RETURN_CONST(self, inst):
        raise _Return(self.const_v(inst.argval))

    def LOAD_FAST(self, inst):
        name = inst.argval
        if name not in self.locals:
            raise Unsupported(f"local variable {name!r} referenced before assignment", self.where())
        self.push(self.locals[name])

    LOAD_FAST_CHECK = LOAD_FAST

    def LOAD_FAST_AND_CLEAR(self, inst):
        self.push(self.locals.pop(inst.argval, NULL))

    def STORE_FAST(self, inst):
        v = self.pop()
        if isinstance(v, NullV):
            self.locals.pop(inst.argval, None)
        else:
            self.locals[inst.argval] = v

    def DELETE_FAST(self, inst):
        self.locals.pop(inst.argval, None)

    def MAKE_CELL(self, inst):
        name = inst.argval
        if name not in self.cells:
            self.cells[name] = CellV(self.locals.pop(name, None))

    def COPY_FREE_VARS(self, inst):
        pass  # the frame's free cells were set up when it was created

    def LOAD_CLOSURE(self, inst):
        self.push(self.cells[inst.argval])

    def LOAD_DEREF(self, inst):
        cell = self.cells.get(inst.argval)
        if cell is None or cell.contents is None:
            raise Unsupported(f"free variable {inst.argval!r} referenced before assignment", self.where())
        self.push(cell.contents)

    def STORE_DEREF(self, inst):
        cell = self.cells.setdefault(inst.argval, CellV(None))
        cell.contents = self.pop()
        cell.mutated = True

    def LOAD_GLOBAL(self, inst):
        if inst.arg & 1:
            self.push(NULL)
        self.push(self.load_global(inst.argval))

    def load_global(self, name: str) -> V:
        key = (id(self.f_globals), name)
        if key in self.cap.global_writes:
            return self.cap.global_writes[key][1]
        if name in self.f_globals:
            value = self.f_globals[name]
            trusted = isinstance(value, types.ModuleType) and value.__name__.split(".")[0] in TRUSTED_MODULE_PREFIXES
            return self.cap.wrap(value, None if trusted else f"{self.globals_source}[{name!r}]")
        b = self.f_globals.get("__builtins__", builtins)
        b = b if isinstance(b, dict) else vars(b)
        if name not in b:
            raise Unsupported(f"name {name!r} is not defined", self.where())
        return ObjV(b[name])

    def STORE_GLOBAL(self, inst):
        self.cap.global_writes[(id(self.f_globals), inst.argval)] = (self.f_globals, self.pop())

    def LOAD_ATTR(self, inst):
        obj = self.pop()
        if PY312 and inst.arg & 1:
            self.push(NULL)
        self.push(self.getattr(obj, inst.argval))

    def LOAD_METHOD(self, inst):
        obj = self.pop()
        self.push(NULL)
        self.push(self.getattr(obj, inst.argval))

    def STORE_ATTR(self, inst):
        obj = self.pop()
        value = self.pop()
        self.setattr(obj, inst.argval, value)

    def DELETE_ATTR(self, inst):
        obj = self.pop()
        if isinstance(obj, ObjV) and not isinstance(obj.value, torch.nn.Module) and obj.source is not None:
            had_write = obj.writes.pop(inst.argval, None) is not None
            if inst.argval in getattr(obj.value, "__dict__", {}):
                obj.deleted.add(inst.argval)  # deleting what the real object has: done after the graph
            elif not had_write:
                raise PyError(AttributeError(inst.argval), self.where())
            return
        if isinstance(obj, NewObjV) and inst.argval in obj.attrs:
            del obj.attrs[inst.argval]
            return
        raise Unsupported(f"del of attribute {inst.argval!r}", self.where())

    def LOAD_SUPER_ATTR(self, inst):
        self_v = self.pop()
        cls_v = self.pop()
        self.pop()  # the global `super`
        sup = SuperV(cls_v.value, self_v)
        if inst.arg & 1:
            self.push(NULL)
        self.push(self.getattr(sup, inst.argval))

    def LOAD_ASSERTION_ERROR(self, inst):
        self.push(ObjV(AssertionError))

    # -- building containers ---------------------------------------------------------------------------
    def BUILD_TUPLE(self, inst):
        self.push(TupleV(self.popn(inst.arg)))

    def BUILD_LIST(self, inst):
        self.push(ListV(self.popn(inst.arg)))

    def BUILD_SET(self, inst):
        items = self.popn(inst.arg)
        s = SetV([])
        for x in items:
            self.set_add(s, x)
        self.push(s)

    def BUILD_MAP(self, inst):
        flat = self.popn(2 * inst.arg)
        self.push(DictV({self.key(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}))

    def BUILD_CONST_KEY_MAP(self, inst):
        keys = self.pop()
        values = self.popn(inst.arg)
        self.push(DictV({self.key(k): v for k, v in zip(keys.items, values)}))

    def BUILD_STRING(self, inst):
        parts = self.popn(inst.arg)
        self.push(ConstV("".join(self.const_value(p) for p in parts)))

    def BUILD_SLICE(self, inst):
        parts = self.popn(inst.arg)
        self.push(ConstV(slice(*[self.const_value(p) for p in parts])))

    def LIST_APPEND(self, inst):
        v = self.pop()
        self.list_mutate(self.stack[-inst.arg]).items.append(v)

    def LIST_EXTEND(self, inst):
        v = self.pop()
        self.list_mutate(self.stack[-inst.arg]).items.extend(self.iterate(v))

    def SET_ADD(self, inst):
        v = self.pop()
        self.set_add(self.stack[-inst.arg], v)

    def SET_UPDATE(self, inst):
        v = self.pop()
        for x in self.iterate(v):
            self.set_add(self.stack[-inst.arg], x)

    def MAP_ADD(self, inst):
        value = self.pop()
        key = self.pop()
        self.dict_mutate(self.stack[-inst.arg]).items[self.key(key)] = value

    def DICT_UPDATE(self, inst):
        other = self.pop()
        d = self.dict_mutate(self.stack[-inst.arg])
        d.items.update(self.as_dict(other))

    def DICT_MERGE(self, inst):
        other = self.as_dict(self.pop())
        d = self.dict_mutate(self.stack[-inst.arg])
        for k in other:
            if k in d.items:
                raise Unsupported(f"duplicate keyword argument {k!r}", self.where())
        d.items.update(other)

    def LIST_TO_TUPLE(self, inst):
        self.push(TupleV(list(self.pop().items)))

    def CALL_INTRINSIC_1(self, inst):
        if inst.argrepr == "INTRINSIC_LIST_TO_TUPLE":
            return self.LIST_TO_TUPLE(inst)
        if inst.argrepr == "INTRINSIC_UNARY_POSITIVE":
            return self.push(self.unary(operator.pos, self.pop()))
        raise Unsupported(f"{inst.argrepr} is not supported", self.where())

    def UNPACK_SEQUENCE(self, inst):
        items = self.iterate(self.pop())
        if len(items) != inst.arg:
            raise Unsupported("unpacking a sequence of the wrong length", self.where())
        for x in reversed(items):
            self.push(x)

    def UNPACK_EX(self, inst):
        items = self.iterate(self.pop())
        before, after = inst.arg & 0xFF, inst.arg >> 8
        if len(items) < before + after:
            raise Unsupported("unpacking a sequence of the wrong length", self.where())
        rest = items[before:len(items) - after]
        out = items[:before] + [ListV(rest)] + items[len(items) - after:]
        for x in reversed(out):
            self.push(x)

    # -- operators ---------------------------------------------------------------------------------------
    def BINARY_OP(self, inst):
        b = self.pop()
        a = self.pop()
        fn, inplace = BINARY_OPS[inst.arg]
        self.push(self.binary(fn, a, b, inplace))

    def UNARY_NEGATIVE(self, inst):
        self.push(self.unary(operator.neg, self.pop()))

    def UNARY_INVERT(self, inst):
        self.push(self.unary(operator.invert, self.pop()))

    def UNARY_POSITIVE(self, inst):
        self.push(self.unary(operator.pos, self.pop()))

    def UNARY_NOT(self, inst):
        v = self.pop()
        if isinstance(v, TensorV):
            raise Unsupported("`not` of a tensor needs its value", self.where())
        self.push(ConstV(not self.truth(v)))

    def COMPARE_OP(self, inst):
        b = self.pop()
        a = self.pop()
        op = inst.argval if not PY312 else inst.argrepr.split()[0] if inst.argrepr else inst.argval
        self.push(self.binary(COMPARE_OPS[op.strip()], a, b, False))

    def IS_OP(self, inst):
        b = self.pop()
        a = self.pop()
        same = self.is_same(a, b)
        self.push(ConstV(same != bool(inst.arg)))

    def CONTAINS_OP(self, inst):
        container = self.pop()
        item = self.pop()
        self.push(ConstV(self.contains(container, item) != bool(inst.arg)))

    def BINARY_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        self.push(self.getitem(obj, idx))

    def BINARY_SLICE(self, inst):
        end = self.pop()
        start = self.pop()
        obj = self.pop()
        self.push(self.getitem(obj, ConstV(slice(self.const_value(start), self.const_value(end)))))

    def STORE_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        value = self.pop()
        self.setitem(obj, idx, value)

    def STORE_SLICE(self, inst):
        end = self.pop()
        start = self.pop()
        obj = self.pop()
        value = self.pop()
        self.setitem(obj, ConstV(slice(self.const_value(start), self.const_value(end))), value)

    def DELETE_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        if isinstance(obj, DictV):
            self.dict_mutate(obj).items.pop(self.key(idx))
        elif isinstance(obj, ListV):
            items = self.list_mutate(obj).items
            del items[self.const_value(idx)]
        else:
            raise Unsupported(f"del on {type(obj).__name__}", self.where())

    def FORMAT_VALUE(self, inst):
        spec = self.const_value(self.pop()) if (inst.arg & 0x04) == 0x04 else ""
        v = self.pop()
        value = self.const_value(v)
        conv = inst.arg & 0x03
        value = {0: value, 1: str(value), 2: repr(value), 3: ascii(value)}[conv]
        self.push(ConstV(format(value, spec)))

    # -- control flow -----------------------------------------------------------------------------------
    def JUMP_FORWARD(self, inst):
        self.jump(inst)

    JUMP_BACKWARD = JUMP_FORWARD
    JUMP_BACKWARD_NO_INTERRUPT = JUMP_FORWARD
    JUMP_ABSOLUTE = JUMP_FORWARD
    JUMP = JUMP_FORWARD

    def _pop_jump(self, inst, when: bool):
        v = self.pop()
        if isinstance(v, TensorV):
            self.push(v)  # restore: the break happens before this instruction
            raise Unsupported("data-dependent control flow: a branch on a tensor's value", self.where())
        if self.truth(v) == when:
            self.jump(inst)

    def POP_JUMP_IF_TRUE(self, inst):
        self._pop_jump(inst, True)

    def POP_JUMP_IF_FALSE(self, inst):
        self._pop_jump(inst, False)

    POP_JUMP_FORWARD_IF_TRUE = POP_JUMP_BACKWARD_IF_TRUE = POP_JUMP_IF_TRUE
    POP_JUMP_FORWARD_IF_FALSE = POP_JUMP_BACKWARD_IF_FALSE = POP_JUMP_IF_FALSE

    def POP_JUMP_IF_NONE(self, inst):
        v = self.pop()
        if self.is_none(v):
            self.jump(inst)

    def POP_JUMP_IF_NOT_NONE(self, inst):
        v = self.pop()
        if not self.is_none(v):
            self.jump(inst)

    POP_JUMP_FORWARD_IF_NONE = POP_JUMP_BACKWARD_IF_NONE = POP_JUMP_IF_NONE
    POP_JUMP_FORWARD_IF_NOT_NONE = POP_JUMP_BACKWARD_IF_NOT_NONE = POP_JUMP_IF_NOT_NONE

    def JUMP_IF_TRUE_OR_POP(self, inst):
        v = self.stack[-1]
        if isinstance(v, TensorV):
            raise Unsupported("data-dependent control flow: `or` on a tensor's value", self.where())
        if self.truth(v):
            self.jump(inst)
        else:
            self.pop()

    def JUMP_IF_FALSE_OR_POP(self, inst):
        v = self.stack[-1]
        if isinstance(v, TensorV):
            raise Unsupported("data-dependent control flow: `and` on a tensor's value", self.where())
        if not self.truth(v):
            self.jump(inst)
        else:
            self.pop()

    def GET_ITER(self, inst):
        v = self.pop()
        self.push(v if isinstance(v, IterV) else IterV(self.iterate(v)))

    def FOR_ITER(self, inst):
        it = self.stack[-1]
        if not isinstance(it, IterV):
            raise Unsupported("iteration over an object ember cannot see into", self.where())
        if it.pos < len(it.items):
            self.push(it.items[it.pos])
            it.pos += 1
        else:
            self.pop()
            self.jump(inst)
            if PY312:  # 3.12 jumps past the END_FOR that follows the target
                self.ip += 1

    def END_FOR(self, inst):
        self.pop()
        self.pop()

    def RETURN_VALUE(self, inst):
        raise _Return(self.pop())

    def RETURN_GENERATOR(self, inst):
        self.push(ConstV(None))

    def YIELD_VALUE(self, inst):
        if self.yields is None:
            raise Unsupported("yield outside a generator", self.where())
        self.yields.append(self.pop())
        self.push(ConstV(None))  # the value sent in by next()

    def SEND(self, inst):
        self.pop()  # the value sent in: always None for generators consumed by iteration
        it = self.stack[-1]
        if not isinstance(it, IterV):
            raise Unsupported("yield from a non-iterable", self.where())
        if it.pos < len(it.items):
            self.push(it.items[it.pos])
            it.pos += 1
            return
        if not PY312:
            self.pop()
        self.push(ConstV(None))
        self.jump(inst)

    def END_SEND(self, inst):
        v = self.pop()
        self.pop()
        self.push(v)

    def GET_YIELD_FROM_ITER(self, inst):
        v = self.pop()
        self.push(v if isinstance(v, IterV) else IterV(self.iterate(v)))

    def RAISE_VARARGS(self, inst):
        if inst.arg == 0:
            if not self.exc_info:
                raise Unsupported("bare raise outside an except block", self.where())
            raise PyError(self.exc_info[-1].value, self.where())
        if inst.arg == 2:
            self.pop()  # the cause: kept by Python when the exception escapes (it is re-raised for real)
        v = self.pop()
        raise PyError(self.real_exception(v), self.where())

    def real_exception(self, v: V) -> BaseException:
        if isinstance(v, ObjV) and isinstance(v.value, type) and issubclass(v.value, BaseException):
            return v.value()
        if isinstance(v, ObjV) and isinstance(v.value, BaseException):
            return v.value
        if isinstance(v, NewObjV) and issubclass(v.cls, BaseException):
            args = v.attrs.get("args")
            try:
                return v.cls(*[self.const_value(a) for a in args.items]) if args else v.cls()
            except Unsupported:
                return v.cls("<value known at run time>")
        raise Unsupported(f"raise of {self.type_name(v)}", self.where())

    # -- with blocks --------------------------------------------------------------------------------------
    def BEFORE_WITH(self, inst):
        ctx = self.pop()
        if isinstance(ctx, GradModeCtxV):
            prev = self.cap.grad_enabled if ctx.prev is None else ctx.prev
            self.set_grad(ctx.enabled)
            self.push(GradModeExitV(prev))
            self.push(ConstV(None))
            return
        if isinstance(ctx, AutocastCtxV):
            self.push(self.enter_autocast(ctx))
            self.push(ConstV(None))
            return
        if isinstance(ctx, NoOpCtxV):
            self.push(NoOpCtxV(ctx.cls, ctx.args, exit=True))  # its __exit__: calling it does nothing (see call)
            self.push(ctx)  # record_function.__enter__ returns self
            return
        enter = self.getattr(ctx, "__enter__")
        exit_ = self.getattr(ctx, "__exit__")
        if not isinstance(enter, BoundV) or not isinstance(exit_, BoundV):
            raise Unsupported(f"context manager {type(ctx).__name__} is not supported", self.where())
        self.push(exit_)
        self.push(self.call(enter, [], {}))

    def enter_autocast(self, ctx: AutocastCtxV) -> AutocastExitV:
        """An autocast block inside the graph: _enter_autocast/_exit_autocast nodes around it (the ATen tracer
        runs them, so the casts autocast inserts reach the ATen graph), and the real context entered while
        capturing, so the fake tensors' dtypes are autocast's."""
        node = self.cap.graph.call_function(torch.amp.autocast_mode._enter_autocast, ctx.args)
        real = torch.amp.autocast(*ctx.args)
        real.__enter__()
        return AutocastExitV(node, real)

    def exit_autocast(self, v: AutocastExitV) -> V:
        self.cap.graph.call_function(torch.amp.autocast_mode._exit_autocast, (v.node,))
        v.ctx.__exit__(None, None, None)
        return ConstV(None)

    def autocast_args(self, device: str | None, args: list[V], kwargs: dict[str, V]) -> AutocastCtxV:
        a = [self.const_value(x) for x in args]
        kw = {k: self.const_value(x) for k, x in kwargs.items()}
        if device is None:
            sig = ("device_type", "dtype", "enabled", "cache_enabled")
        else:   # torch.cuda.amp.autocast(enabled, dtype, cache_enabled)
            sig = ("enabled", "dtype", "cache_enabled")
            kw["device_type"] = device
        kw.update(zip(sig, a))
        dev = kw["device_type"]
        dtype = kw.get("dtype") or torch.get_autocast_dtype(dev)
        cache = kw.get("cache_enabled")
        return AutocastCtxV((dev, dtype, bool(kw.get("enabled", True)),
                             torch.is_autocast_cache_enabled() if cache is None else bool(cache)))

    def set_grad(self, enabled: bool):
        if enabled != self.cap.grad_enabled:
            self.cap.graph.call_function(torch._C._set_grad_enabled, (enabled,))
            torch._C._set_grad_enabled(enabled)
            self.cap.grad_enabled = enabled

    # -- functions ----------------------------------------------------------------------------------------
    def KW_NAMES(self, inst):
        self.kw_names = self.code.co_consts[inst.arg]

    def CALL(self, inst):
        n = inst.arg
        args = self.popn(n)
        kw = self.kw_names
        self.kw_names = ()
        b = self.pop()
        a = self.pop()
        if isinstance(a, NullV):
            fn = b
        else:
            fn, args = a, [b] + args
        kwargs = {}
        if kw:
            kwargs = dict(zip(kw, args[len(args) - len(kw):]))
            args = args[:len(args) - len(kw)]
        self.push(self.call(fn, args, kwargs))

    def CALL_FUNCTION_EX(self, inst):
        kwargs = self.as_dict(self.pop()) if inst.arg & 1 else {}
        args = self.iterate(self.pop())
        fn = self.pop()
        if self.stack and isinstance(self.stack[-1], NullV):
            self.pop()
        self.push(self.call(fn, list(args), dict(kwargs)))

    def MAKE_FUNCTION(self, inst):
        if PY312 or sys.version_info >= (3, 11):
            code = self.pop().value
        flags = inst.arg
        closure = tuple(self.pop().items) if flags & 0x08 else ()
        if flags & 0x04:
            self.pop()  # annotations
        kwdefaults = self.as_dict(self.pop()) if flags & 0x02 else {}
        defaults = tuple(self.pop().items) if flags & 0x01 else ()
        self.push(ClosureV(code, self.f_globals, code.co_name, defaults, kwdefaults, closure, code.co_qualname))

    def IMPORT_NAME(self, inst):
        fromlist = self.const_value(self.pop())
        level = self.const_value(self.pop())
        name = inst.argval
        package = self.f_globals.get("__package__") or self.f_globals.get("__name__")
        full = name if level == 0 else _resolve_relative(name, package, level)
        if full not in sys.modules:
            raise Unsupported(f"import of {full}, not imported yet (importing runs its code)", self.where())
        mod = __import__(name, self.f_globals, None, fromlist, level)
        self.push(ObjV(mod))

    def IMPORT_FROM(self, inst):
        self.push(self.getattr(self.stack[-1], inst.argval))

    def LOAD_BUILD_CLASS(self, inst):
        raise Unsupported("class definition inside a compiled function", self.where())

    # =====================================================================================================
    # Python semantics over tracked values.

    def const_value(self, v: V):
        if isinstance(v, ConstV):
            return v.value
        if isinstance(v, TupleV) and all(isinstance(x, ConstV) for x in v.items):
            return tuple(x.value for x in v.items)
        if isinstance(v, ListV) and all(isinstance(x, ConstV) for x in v.items):
            return [x.value for x in v.items]
        if isinstance(v, TensorV):
            raise Unsupported("a tensor's value is needed by Python (formatting or conversion)", self.where())
        raise Unsupported(f"a {type(v).__name__} used where ember needs a constant", self.where())

    def key(self, v: V):
        if isinstance(v, ConstV) and _is_key(v.value):
            return v.value
        if isinstance(v, TupleV):
            return tuple(self.key(x) for x in v.items)
        if isinstance(v, ObjV) and isinstance(v.value, (type, enum.Enum)):
            return v.value
        raise Unsupported(f"a {type(v).__name__} as a dict key or set item", self.where())

    def list_mutate(self, v: V) -> ListV:
        if not isinstance(v, ListV):
            raise Unsupported(f"mutating a {type(v).__name__} as a list", self.where())
        v.mutated = True
        return v

    def dict_mutate(self, v: V) -> DictV:
        if not isinstance(v, DictV):
            raise Unsupported(f"mutating a {type(v).__name__} as a dict", self.where())
        v.mutated = True
        return v

    def set_add(self, s: V, x: V):
        if not isinstance(s, SetV):
            raise Unsupported("set.add on a non-set", self.where())
        k = self.key(x)
        if all(self.key(y) != k or type(self.key(y)) is not type(k) for y in s.items):
            s.items.append(ConstV(k) if not isinstance(x, ObjV) else x)
            s.mutated = True

    def as_dict(self, v: V) -> dict:
        if isinstance(v, DictV):
            return dict(v.items)
        raise Unsupported(f"** of a {type(v).__name__}", self.where())

    def iterate(self, v: V) -> list[V]:
        """The items a for loop over v would see, all at once."""
        if isinstance(v, (ListV, TupleV)):
            return list(v.items)
        if isinstance(v, IterV):
            items = v.remaining()
            v.pos = len(v.items)
            return items
        if isinstance(v, DictV):
            return [self.const_v(k) if not isinstance(k, (type, enum.Enum)) else ObjV(k) for k in v.items]
        if isinstance(v, SetV):
            return list(v.items)
        if isinstance(v, ConstV) and isinstance(v.value, (range, str, bytes, tuple, frozenset, torch.Size)):
            return [ConstV(x) for x in v.value]
        if isinstance(v, TensorV):
            if v.fake.dim() == 0:
                raise Unsupported("iteration over a 0-d tensor", self.where())
            return [self.cap.record("call_function", operator.getitem, (v, i), {}, self.where())
                    for i in range(v.fake.shape[0])]
        if isinstance(v, ObjV):
            m = v.value
            self.guard_structure(v)
            if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
                return [self.getattr(v, k) for k in m._modules]
            if isinstance(m, torch.nn.ModuleDict):
                return [ConstV(k) for k in m._modules]
            if isinstance(m, (torch.nn.ParameterList,)):
                return [self.getattr(v, k) for k in m._parameters]
            if isinstance(m, torch.nn.ParameterDict):
                return [ConstV(k) for k in m._keys] if hasattr(m, "_keys") else [ConstV(k) for k in m.keys()]
        if isinstance(v, ObjV) and type(v.value) in DICT_VIEWS and (v.source is not None or not _holds_tensor(
                list(v.value))):
            return [self.cap.wrap(x, f"list({v.source})[{i}]" if v.source else None) for i, x in enumerate(v.value)]
        if isinstance(v, (ObjV, NewObjV)):
            it = self.getattr(v, "__iter__")
            if isinstance(it, BoundV) and isinstance(it.func, types.FunctionType):
                return self.iterate(self.call(it, [], {}))
        raise Unsupported(f"iteration over {self.type_name(v)}", self.where())

    def guard_structure(self, v: V) -> None:
        """Iterating or indexing a module container depends on which children it has."""
        m = getattr(v, "value", None)
        if isinstance(m, torch.nn.Module) and v.source is not None:
            table = "_parameters" if isinstance(m, (torch.nn.ParameterList, torch.nn.ParameterDict)) else "_modules"
            self.cap.guards.add(f"tuple({v.source}.{table}) == {self.cap.consts.ref(tuple(getattr(m, table)))}", 1)

    def type_name(self, v: V) -> str:
        if isinstance(v, ObjV):
            return type(v.value).__name__
        return type(v).__name__

    def truth(self, v: V) -> bool:
        if isinstance(v, ConstV):
            return bool(v.value)
        if isinstance(v, (ListV, TupleV, SetV)):
            return len(v.items) > 0
        if isinstance(v, DictV):
            return len(v.items) > 0
        if isinstance(v, TensorV):
            raise Unsupported("data-dependent control flow: the truth of a tensor", self.where())
        if isinstance(v, ObjV):
            obj = v.value
            cls = type(obj)
            if isinstance(obj, torch.nn.Module):
                if hasattr(cls, "__len__") and cls.__len__ is not torch.nn.Module.__dict__.get("__len__"):
                    self.guard_structure(v)
                    return len(obj) > 0
                return True
            if getattr(cls, "__bool__", None) is None and getattr(cls, "__len__", None) is None:
                return True
            for name in ("__bool__", "__len__"):
                if isinstance(inspect.getattr_static(obj, name, None), types.FunctionType):
                    r = self.call(self.getattr(v, name), [], {})
                    return self.truth(r) if name == "__bool__" else self.const_value(r) > 0
            if callable(obj) or isinstance(obj, (types.ModuleType,)):
                return True
        if isinstance(v, (NewObjV, ClosureV, BoundV, CellV, GradModeCtxV, SuperV)):
            if isinstance(v, NewObjV):
                for name in ("__bool__", "__len__"):
                    if hasattr(v.cls, name):
                        r = self.call(self.getattr(v, name), [], {})
                        return self.truth(r) if name == "__bool__" else self.const_value(r) > 0
            return True
        raise Unsupported(f"truth of {self.type_name(v)}", self.where())

    def is_none(self, v: V) -> bool:
        return isinstance(v, ConstV) and v.value is None

    def is_same(self, a: V, b: V) -> bool:
        if a is b:
            return True
        if isinstance(a, ConstV) and isinstance(b, ConstV):
            return a.value is b.value
        if isinstance(a, ObjV) and isinstance(b, ObjV):
            return a.value is b.value
        if isinstance(a, ConstV) and isinstance(b, ObjV) or isinstance(a, ObjV) and isinstance(b, ConstV):
            return a.value is b.value
        if isinstance(a, TensorV) and isinstance(b, TensorV):
            return False
        return False

    def contains(self, container: V, item: V) -> bool:
        if isinstance(container, DictV):
            return self.key(item) in container.items
        if isinstance(container, (ListV, TupleV, SetV)):
            if isinstance(item, TensorV) or any(isinstance(x, TensorV) for x in container.items):
                if isinstance(item, TensorV) and all(isinstance(x, TensorV) for x in container.items) and \
                        any(x is item for x in container.items):
                    return True
                raise Unsupported("`in` over tensors compares their values", self.where())
            needle = self.const_value(item) if isinstance(item, ConstV) else item
            return any(self.const_value(x) == needle if isinstance(x, ConstV) else x is item for x in container.items)
        if isinstance(container, ConstV):
            return self.const_value(item) in container.value
        if isinstance(container, ObjV) and isinstance(container.value, torch.nn.ModuleDict):
            return self.const_value(item) in container.value._modules
        if isinstance(container, (ObjV, NewObjV)):
            m = self.getattr(container, "__contains__")
            if isinstance(m, BoundV):
                return self.truth(self.call(m, [item], {}))
        raise Unsupported(f"`in` on {self.type_name(container)}", self.where())

    def unary(self, fn, v: V) -> V:
        if isinstance(v, PyFloatV) and fn in (operator.neg, operator.pos):
            r = self.cap.record("call_function", torch.neg if fn is operator.neg else torch.clone,
                                (self.py_float_tensor(v),), {}, self.where())
            return PyFloatV(r.node, r.fake)
        if isinstance(v, TensorV):
            return self.cap.record("call_function", fn, (v,), {}, self.where())
        if isinstance(v, ConstV):
            return self.concrete(fn, [v], {})
        if isinstance(v, (ObjV, NewObjV)):
            dunder = {operator.neg: "__neg__", operator.pos: "__pos__", operator.invert: "__invert__"}[fn]
            return self.call(self.getattr(v, dunder), [], {})
        raise Unsupported(f"{fn.__name__} of {self.type_name(v)}", self.where())

    def binary(self, fn, a: V, b: V, inplace: bool) -> V:
        if isinstance(a, PyFloatV) or isinstance(b, PyFloatV):
            return self.py_float_binary(fn, a, b, inplace)
        if isinstance(a, TensorV) or isinstance(b, TensorV):
            if isinstance(a, TensorV) and inplace:
                self.cap.record("call_function", fn, (a, b), {}, self.where())
                return a
            base = INPLACE_TO_BINARY.get(fn, fn)
            return self.cap.record("call_function", base, (a, b), {}, self.where())
        if isinstance(a, ConstV) and isinstance(b, ConstV):
            return self.concrete(fn, [a, b], {})
        if isinstance(a, (ListV, TupleV)) and isinstance(b, (ListV, TupleV)) and fn in (
                operator.add, operator.iadd, operator.eq, operator.ne):
            if fn in (operator.eq, operator.ne):
                same = len(a.items) == len(b.items) and all(
                    self.truth(self.binary(operator.eq, x, y, False)) for x, y in zip(a.items, b.items))
                return ConstV(same == (fn is operator.eq))
            if fn is operator.iadd and isinstance(a, ListV):
                self.list_mutate(a).items.extend(b.items)
                return a
            return type(a)(a.items + b.items) if isinstance(a, ListV) else TupleV(a.items + b.items)
        if isinstance(a, ListV) and fn is operator.iadd:
            self.list_mutate(a).items.extend(self.iterate(b))
            return a
        if isinstance(a, (ListV, TupleV)) and isinstance(b, ConstV) and fn in (operator.mul, operator.imul):
            items = a.items * b.value
            return ListV(items) if isinstance(a, ListV) else TupleV(items)
        if isinstance(a, TupleV) and isinstance(b, TupleV) or isinstance(a, TupleV) and isinstance(b, ConstV) \
                or isinstance(a, ConstV) and isinstance(b, TupleV):
            try:
                return self.concrete(fn, [ConstV(self.const_value(a)), ConstV(self.const_value(b))], {})
            except Unsupported:
                pass
        if isinstance(a, DictV) and isinstance(b, DictV) and fn in (operator.or_, operator.ior):
            if fn is operator.ior:
                self.dict_mutate(a).items.update(b.items)
                return a
            return DictV({**a.items, **b.items})
        if isinstance(a, SetV) or isinstance(b, SetV):
            try:
                r = fn(set(self.key(x) for x in self.iterate(a)), set(self.key(x) for x in self.iterate(b)))
                return ConstV(r) if not isinstance(r, set) else SetV([ConstV(x) for x in r])
            except TypeError:
                pass
        if fn in (operator.eq, operator.ne) and not isinstance(a, (NewObjV,)) and isinstance(a, (ObjV, ConstV)) \
                and isinstance(b, (ObjV, ConstV)) and (_eq_is_identity(a) and _eq_is_identity(b)):
            return ConstV((a.value is b.value or a.value == b.value) == (fn is operator.eq))
        if fn in (operator.eq, operator.ne) and (isinstance(a, (NullV,)) or isinstance(b, NullV)):
            raise Unsupported("comparison with NULL", self.where())
        # user-defined operators
        for obj, other, names in ((a, b, _DUNDERS.get(fn)),):
            if names and isinstance(obj, (NewObjV, ObjV)) and not isinstance(getattr(obj, "value", None), type):
                meth = names[0]
                try:
                    m = self.getattr(obj, meth)
                except Unsupported:
                    m = None
                if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
                    r = self.call(m, [other], {})
                    if not (isinstance(r, ConstV) and r.value is NotImplemented):
                        return r
        if names := _DUNDERS.get(fn):
            if isinstance(b, (NewObjV, ObjV)) and len(names) > 1:
                try:
                    m = self.getattr(b, names[1])
                except Unsupported:
                    m = None
                if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
                    r = self.call(m, [a], {})
                    if not (isinstance(r, ConstV) and r.value is NotImplemented):
                        return r
        if fn in (operator.eq, operator.ne):
            return ConstV((self.is_same(a, b)) == (fn is operator.eq))
        raise Unsupported(f"operator {fn.__name__} on {self.type_name(a)} and {self.type_name(b)}", self.where())

    def concrete(self, fn, args: list[V], kwargs: dict) -> V:
        """Evaluate a pure function on constants at capture time."""
        vals = [self.const_value(a) for a in args]
        kw = {k: self.const_value(v) for k, v in kwargs.items()}
        try:
            r = fn(*vals, **kw)
        except Exception as e:
            raise Unsupported(f"{getattr(fn, '__name__', fn)} raised {type(e).__name__} at capture time", self.where())
        return self.const_v(r) if isinstance(r, (tuple, *CONST_TYPES)) else self.from_python(r)

    def from_python(self, r) -> V:
        if isinstance(r, tuple):
            return TupleV([self.from_python(x) for x in r])
        if isinstance(r, list):
            return ListV([self.from_python(x) for x in r])
        if isinstance(r, CONST_TYPES):
            return ConstV(r)
        if isinstance(r, dict) and all(_is_key(k) for k in r):
            return DictV({k: self.from_python(x) for k, x in r.items()})
        if isinstance(r, (set, frozenset)):
            return SetV([ConstV(x) for x in r])
        if isinstance(r, torch.Tensor):
            return self.cap.tensor_constant(r)
        return ObjV(r)

    # -- items --------------------------------------------------------------------------------------------
    def getitem(self, obj: V, idx: V) -> V:
        if isinstance(obj, TensorV):
            return self.cap.record("call_function", operator.getitem, (obj, self.index_arg(idx)), {}, self.where())
        if isinstance(obj, (ListV, TupleV)):
            if isinstance(idx, TensorV):
                raise Unsupported("indexing a list with a tensor", self.where())
            i = self.const_value(idx)
            if isinstance(i, slice):
                return ListV(obj.items[i]) if isinstance(obj, ListV) else TupleV(obj.items[i])
            try:
                return obj.items[i]
            except IndexError as e:
                raise PyError(e, self.where())
        if isinstance(obj, DictV) and obj.cls is not dict and dataclasses.is_dataclass(obj.cls) and \
                isinstance(idx, ConstV) and isinstance(idx.value, (int, slice)):
            return self.getitem(TupleV(list(obj.items.values())), idx)
        if isinstance(obj, DictV):
            k = self.key(idx)
            if k not in obj.items:
                raise PyError(KeyError(k), self.where())
            return obj.items[k]
        if isinstance(obj, ConstV):
            return self.concrete(operator.getitem, [obj, idx], {})
        if isinstance(obj, ObjV) and isinstance(obj.value, dict) and isinstance(idx, TensorV):
            return self.tensor_keyed_item(obj, idx)
        if isinstance(obj, ObjV):
            m = obj.value
            if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict, torch.nn.ParameterList,
                              torch.nn.ParameterDict)):
                i = self.const_value(idx)
                self.guard_structure(obj)
                if isinstance(m, torch.nn.ModuleDict):
                    return self.getattr(obj, i)
                if isinstance(m, torch.nn.ParameterDict):
                    return self.getattr(obj, i)
                keys = list(m._modules) if not isinstance(m, torch.nn.ParameterList) else list(m._parameters)
                if isinstance(i, slice):
                    if isinstance(m, torch.nn.Sequential):
                        return ObjV(type(m)(collections.OrderedDict((k, m._modules[k]) for k in keys[i])))
                    return ObjV(type(m)([m._modules[k] for k in keys[i]]))
                return self.getattr(obj, keys[i])
        if isinstance(obj, (ObjV, NewObjV)):
            m = self.getattr(obj, "__getitem__")
            if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
                return self.call(m, [idx], {})
        if isinstance(obj, ObjV) and isinstance(obj.value, type):
            return ObjV(obj.value[self.type_arg(idx)])  # typing generics like list[int], list[Tensor]
        raise Unsupported(f"indexing {self.type_name(obj)}", self.where())

    def tensor_keyed_item(self, obj: ObjV, idx: TensorV) -> V:
        """d[t] for a dict keyed by tensors that are graph inputs (an optimizer's `state`, keyed by parameters):
        the value is read through `dict.get(d, <t's source>)` (guards.DICT_GET: one lookup per call, shared by the
        guards and graph inputs that read it), so each call looks it up with the tensor found at that source, and
        the value's own guards (type and keys) fail when it is missing. A missing key (a
        defaultdict's lazy state creation) is left to Python."""
        real = next((inp.real for inp in self.cap.inputs if inp.node is idx.node), None)
        if real is None or idx.source is None or obj.source is None or any(
                _lookup_static(type(obj.value), m) is not getattr(dict, m) for m in ("__getitem__", "__contains__")):
            raise Unsupported(f"indexing {self.type_name(obj)} with a tensor made in the graph", self.where())
        if real not in obj.value:
            # a defaultdict creating the value (an optimizer's lazy state): Python does it; once the key exists,
            # the entry that broke here misses and the next call captures the lookup
            raise Unsupported(f"{type(obj.value).__name__}[tensor] of a missing key (a write, left to Python)",
                              self.where(), holds_while=(f"{idx.source} not in {obj.source}",))
        return self.cap.wrap(obj.value[real], f"{DICT_GET}({obj.source}, {idx.source})")

    def type_arg(self, v: V):
        """The argument of a generic alias (list[Tensor], dict[str, int]): classes are ObjV, not constants."""
        if isinstance(v, ObjV) and isinstance(v.value, (type, types.GenericAlias)):
            return v.value
        if isinstance(v, TupleV):
            return tuple(self.type_arg(x) for x in v.items)
        return self.const_value(v)

    def index_arg(self, idx: V):
        if isinstance(idx, (TensorV, ConstV)):
            return idx
        if isinstance(idx, TupleV):
            return TupleV([self.index_arg(x) for x in idx.items])
        if isinstance(idx, ListV):
            return ListV([self.index_arg(x) for x in idx.items])
        raise Unsupported(f"indexing a tensor with {self.type_name(idx)}", self.where())

    def setitem(self, obj: V, idx: V, value: V):
        if isinstance(obj, TensorV):
            node_idx = self.index_arg(idx)
            fake_obj = obj.fake
            try:
                with self.cap.fake_mode:
                    fake_obj[_to_fake_tree(node_idx)] = _to_fake(value) if isinstance(value, TensorV) else \
                        _python_value(value, lambda t: t.fake)
            except Exception as e:
                raise Unsupported(f"tensor __setitem__ cannot be captured ({type(e).__name__})", self.where())
            n = self.cap.graph.call_function(operator.setitem, (obj.node, _map_v(node_idx, _to_node),
                                                                  _to_node(value)))
            n.meta["where"] = self.where()
            self.cap.op_count += 1
            return
        if isinstance(obj, ListV):
            i = self.const_value(idx)
            items = self.list_mutate(obj).items
            if isinstance(i, slice):
                items[i] = self.iterate(value)
            else:
                items[i] = value
            return
        if isinstance(obj, DictV):
            self.dict_mutate(obj).items[self.key(idx)] = value
            return
        if isinstance(obj, (ObjV, NewObjV)):
            m = self.getattr(obj, "__setitem__")
            if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
                self.call(m, [idx, value], {})
                return
        raise Unsupported(f"item assignment on {self.type_name(obj)}", self.where())

    # -- attributes ---------------------------------------------------------------------------------------
    def getattr(self, obj: V, name: str) -> V:
        cap = self.cap
        if isinstance(obj, TensorV):
            return self.tensor_attr(obj, name)
        if isinstance(obj, SuperV):
            cls = obj.cls
            mro = type(self.python_object_type(obj.obj)).__mro__ if not isinstance(obj.obj, NewObjV) else obj.obj.cls.__mro__
            for klass in mro[mro.index(cls) + 1:]:
                if name in vars(klass):
                    return self.bind_descriptor(obj.obj, vars(klass)[name], name, None, klass)
            raise Unsupported(f"super().{name} not found", self.where())
        if isinstance(obj, NewObjV):
            if name in obj.attrs:
                return obj.attrs[name]
            if name == "__class__":
                return ObjV(obj.cls)
            static = _lookup_static(obj.cls, name)
            if static is _MISSING:
                raise self.no_attribute(obj, name, f"{obj.cls.__name__} object has no attribute {name!r}")
            return self.bind_descriptor(obj, static, name, None, obj.cls)
        if isinstance(obj, ObjV):
            value = obj.value
            if name in obj.writes:
                return obj.writes[name]
            if name in obj.deleted:
                raise Unsupported(f"attribute {name!r} was deleted", self.where())
            if isinstance(value, torch.nn.Module):
                d = value.__dict__
                for table in ("_parameters", "_buffers", "_modules"):
                    if name in d[table]:
                        src = f"{obj.source}.{table}[{name!r}]" if obj.source else None
                        return cap.wrap(d[table][name], src)
                if name == "training":
                    return cap.wrap(value.training, f"{obj.source}.training" if obj.source else None)
            if isinstance(value, types.ModuleType):
                try:
                    attr = getattr(value, name)
                except AttributeError:
                    raise self.no_attribute(obj, name, f"module {value.__name__} has no attribute {name!r}")
                trusted = value.__name__.split(".")[0] in TRUSTED_MODULE_PREFIXES
                return cap.wrap(attr, None if trusted or obj.source is None else attr_source(obj.source, name))
            if isinstance(value, type):
                if is_namedtuple_cls(value) and name == "_make":
                    return BoundV(obj, "_make")
                static = _lookup_static(value, name)
                if isinstance(static, (classmethod,)):
                    return BoundV(obj, static.__func__)
                if isinstance(static, staticmethod):
                    return ObjV(static.__func__)
                if isinstance(static, types.FunctionType):
                    return ObjV(static)
                try:
                    attr = getattr(value, name)
                except AttributeError:
                    raise self.no_attribute(obj, name, f"type object {value.__name__!r} has no attribute {name!r}")
                trusted = value.__module__.split(".")[0] in TRUSTED_MODULE_PREFIXES
                return cap.wrap(attr, None if trusted or obj.source is None else attr_source(obj.source, name))
            if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
                if name in ("__name__", "__qualname__", "__module__", "__doc__"):
                    return ConstV(getattr(value, name))
                if isinstance(value, types.MethodType) and name in ("__self__", "__func__"):
                    return cap.wrap(getattr(value, name), attr_source(obj.source, name))
                if isinstance(value, functools.partial) and name in ("func", "args", "keywords"):
                    return cap.wrap(getattr(value, name), attr_source(obj.source, name))
                try:
                    return cap.wrap(getattr(value, name), attr_source(obj.source, name))
                except AttributeError:
                    raise self.no_attribute(obj, name, f"function has no attribute {name!r}")
            # instances
            if type(value).__getattribute__ is not object.__getattribute__ and not isinstance(value, torch.nn.Module):
                try:  # a class that computes attributes (transformers' configs): read it, guard what was read
                    attr = getattr(value, name)
                except AttributeError as e:
                    raise self.no_attribute(obj, name, str(e))
                if not callable(attr) or isinstance(attr, type):
                    return cap.wrap(attr, attr_source(obj.source, name))
            inst_dict = getattr(value, "__dict__", None)
            static = _lookup_static(type(value), name)
            if isinstance(static, (property, types.FunctionType, staticmethod, classmethod)) or \
                    _is_data_descriptor(static):
                return self.bind_descriptor(obj, static, name, value, type(value))
            if inst_dict is not None and name in inst_dict:
                return cap.wrap(inst_dict[name], attr_source(obj.source, name))
            if static is not _MISSING:
                return self.bind_descriptor(obj, static, name, value, type(value))
            getattr_fn = _lookup_static(type(value), "__getattr__")
            if isinstance(value, torch.nn.Module) or getattr_fn is _MISSING:
                raise self.no_attribute(obj, name, f"{type(value).__name__!r} object has no attribute {name!r}")
            if isinstance(getattr_fn, types.FunctionType):
                return self.call(BoundV(obj, getattr_fn), [ConstV(name)], {})
            raise Unsupported(f"attribute {name!r} of {type(value).__name__}", self.where())
        if isinstance(obj, TupleV):
            if obj.cls is not tuple and (is_namedtuple_cls(obj.cls) or is_structseq_cls(obj.cls)):
                fields = structseq_fields(obj.cls) if not is_namedtuple_cls(obj.cls) else list(obj.cls._fields)
                if name in fields:
                    return obj.items[fields.index(name)]
            if name in ("count", "index"):
                return BoundV(obj, name)
            if is_namedtuple_cls(obj.cls) and name in ("_asdict", "_replace"):
                return BoundV(obj, name)
            if is_namedtuple_cls(obj.cls) and name == "_fields":
                return self.const_v(obj.cls._fields)
            if is_namedtuple_cls(obj.cls):
                static = _lookup_static(obj.cls, name)
                if isinstance(static, (types.FunctionType, property)):
                    return self.bind_descriptor(obj, static, name, None, obj.cls)
        if isinstance(obj, DictV) and obj.cls is not dict and dataclasses.is_dataclass(obj.cls):
            if name in {f.name for f in dataclasses.fields(obj.cls)}:
                return obj.items.get(name, ConstV(None))
            if name == "to_tuple":
                return BoundV(obj, name)
        if isinstance(obj, (ListV, DictV, SetV)):
            if name in _CONTAINER_METHODS[type(obj)]:
                return BoundV(obj, name)
        if isinstance(obj, ConstV):
            try:
                attr = getattr(obj.value, name)
            except AttributeError:
                raise self.no_attribute(obj, name, f"{type(obj.value).__name__!r} object has no attribute {name!r}")
            if isinstance(attr, CONST_TYPES) and not callable(attr):
                return ConstV(attr)
            if isinstance(attr, types.BuiltinMethodType) or callable(attr):
                return ObjV(attr)
            return self.from_python(attr)
        if isinstance(obj, GradModeCtxV) and name in ("__enter__", "__exit__"):
            return BoundV(obj, name)
        if isinstance(obj, (ClosureV,)) and name in ("__name__", "__qualname__"):
            return ConstV(obj.name)
        if isinstance(obj, IterV) and name == "__next__":
            return BoundV(obj, name)
        raise Unsupported(f"attribute {name!r} of {self.type_name(obj)}", self.where())

    def no_attribute(self, obj: V, name: str, msg: str) -> PyError:
        if obj.source is not None:
            self.cap.guards.add(f"hasattr({obj.source}, {name!r}) is False", 1)
        return PyError(AttributeError(msg), self.where())

    def python_object_type(self, v: V):
        return v.value if isinstance(v, ObjV) else v

    def bind_descriptor(self, owner: V, static, name: str, instance, cls) -> V:
        if isinstance(static, property):
            if static.fget is None:
                raise Unsupported(f"unreadable property {name}", self.where())
            return self.call(ObjV(static.fget), [owner], {})
        if isinstance(static, types.FunctionType):
            return BoundV(owner, static)
        if isinstance(static, staticmethod):
            return ObjV(static.__func__)
        if isinstance(static, classmethod):
            return BoundV(ObjV(cls), static.__func__)
        if isinstance(static, (int, float, str, bool, type(None), tuple, torch.dtype)):
            src = attr_source(owner.source, name) if isinstance(owner, ObjV) else None
            trusted = cls.__module__.split(".")[0] in TRUSTED_MODULE_PREFIXES
            return self.cap.wrap(static, None if trusted else src)
        if isinstance(static, (types.MethodDescriptorType, types.WrapperDescriptorType)) and isinstance(owner, ObjV):
            return BoundV(owner, static)
        if isinstance(static, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
            if instance is not None:
                return ObjV(getattr(instance, name))
        if instance is not None and isinstance(owner, ObjV):
            try:
                attr = getattr(instance, name)
            except Exception:
                raise Unsupported(f"attribute {name!r} of {type(instance).__name__}", self.where())
            return self.cap.wrap(attr, attr_source(owner.source, name))
        if isinstance(static, (type, types.ModuleType)) or callable(static):
            return self.cap.wrap(static, None)
        raise Unsupported(f"attribute {name!r} of {cls.__name__}", self.where())

    def tensor_attr(self, t: TensorV, name: str) -> V:
        fake = t.fake
        if name in ("shape",):
            return TupleV([ConstV(s) for s in fake.shape], None, torch.Size)
        if name in ("dtype", "device", "ndim", "requires_grad", "is_cuda", "is_sparse", "layout", "is_leaf",
                    "is_quantized", "is_meta", "is_nested", "itemsize", "nbytes"):
            return ConstV(getattr(fake, name))
        if name == "grad" and t.source is not None:
            if id(t) in self.cap.grad_writes:
                return self.cap.grad_writes[id(t)][1]
            return self.cap.wrap(_real_attr(self.cap, t, "grad"), f"{t.source}.grad")
        if name in ("grad_fn", "_base", "_version", "names", "output_nr", "grad"):
            raise Unsupported(f"tensor attribute {name!r}", self.where())
        if name in ("T", "mT", "H", "mH", "real", "imag", "data"):
            if name == "data":
                return self.cap.record("call_method", "detach", (t,), {}, self.where())
            return self.cap.record("call_function", getattr, (t, name), {}, self.where())
        if name in TENSOR_METHODS_UNSUPPORTED:
            return BoundV(t, name)
        if hasattr(torch.Tensor, name):
            return BoundV(t, name)
        raise self.no_attribute(t, name, f"tensor has no attribute {name!r}")

    def tensor_backward(self, loss: TensorV, args: list[V], kwargs: dict[str, V]) -> V:
        """`loss.backward()` as part of the graph (ember.autograd.backward): the gradients of the leaves it
        reaches come from one recorded op, and AccumulateGrad's work is done here: `p.grad = g` where the grad
        is None, `p.grad += g` in place where it is a tensor. Anything else breaks the graph here, where eager
        autograd runs it: arguments, a second backward, a gradient into a tensor made before the compiled code
        or into one with hooks."""
        cap = self.cap
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        bound = {**dict(zip(names, args)), **kwargs}
        if len(args) > len(names) or set(kwargs) - set(names) or \
                any(not (isinstance(v, ConstV) and (v.value is None or v.value is False)) for v in bound.values()):
            raise Unsupported("Tensor.backward() with arguments", self.where())
        if cap.backward_node is not None:
            raise Unsupported("a second backward() in one graph", self.where())
        if not loss.fake.requires_grad or loss.fake.numel() != 1:
            raise Unsupported("backward() of a tensor that does not require grad or is not a scalar", self.where())
        if loss.fake.device.type not in BACKWARD_IN_GRAPH_DEVICES:
            raise Unsupported(f"backward() of a {loss.fake.device.type} loss (BACKWARD_IN_GRAPH_DEVICES)", self.where())
        # DistributedDataParallel and FSDP hook their gradient accumulators (no Python API shows those hooks):
        # with a process group, autograd runs the backward
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise Unsupported("backward() with torch.distributed initialized (its gradient hooks)", self.where())
        if torch.distributed.is_available():
            cap.guards.add("not ___torch.distributed.is_initialized()", cost=1)
        leaves = []
        for inp in _inputs_reached(cap, loss, self.where()):
            real = inp.real
            if not real.is_leaf:
                raise Unsupported("backward() reaches a tensor computed before the compiled code", self.where())
            if real._backward_hooks or getattr(real, "_post_accumulate_grad_hooks", None) or real.is_sparse:
                raise Unsupported("backward() into a tensor with hooks", self.where())
            # hooks registered later must be seen: the entry is used only while there are none
            cap.guards.falsy(f"{inp.source}._backward_hooks")
            cap.guards.falsy(f"{inp.source}._post_accumulate_grad_hooks")
            leaves.append(cap.by_id[id(real)])
        if not leaves:
            return ConstV(None)
        node = cap.graph.call_function(grads_of, (loss.node, *[v.node for v in leaves]))
        with cap.fake_mode:
            fakes = tuple(torch.empty_strided(v.fake.shape, v.fake.stride(), dtype=v.fake.dtype,
                                              device=v.fake.device) for v in leaves)
        node.meta["val"] = fakes
        node.meta["where"] = self.where()
        cap.op_count += 1
        cap.backward_node = node
        grads = cap.wrap_fake_result(fakes, node)
        for leaf, g in zip(leaves, grads.items):
            old = self.tensor_attr(leaf, "grad")
            if isinstance(old, TensorV):
                self.call_method(old, "add_", [g], {})     # AccumulateGrad adds in place, outside grad mode
            elif isinstance(old, ConstV) and old.value is None:
                cap.grad_writes[id(leaf)] = (leaf, g)
            else:
                raise Unsupported(f"backward() into a .grad that is a {self.type_name(old)}", self.where())
        return ConstV(None)

    def setattr(self, obj: V, name: str, value: V):
        if isinstance(obj, NewObjV):
            static = _lookup_static(obj.cls, name)
            if isinstance(static, property) and static.fset is not None:
                self.call(ObjV(static.fset), [obj, value], {})
                return
            obj.attrs[name] = value
            return
        if isinstance(obj, ObjV) and obj.source is not None and not isinstance(obj.value, type):
            value_obj = obj.value
            static = _lookup_static(type(value_obj), name)
            if isinstance(static, property):
                if static.fset is None:
                    raise Unsupported(f"can't set attribute {name!r}", self.where())
                self.call(ObjV(static.fset), [obj, value], {})
                return
            if _is_data_descriptor(static) or _lookup_static(type(value_obj), "__setattr__") not in (
                    _MISSING, object.__setattr__, torch.nn.Module.__setattr__):
                raise Unsupported(f"setting attribute {name!r} of {type(value_obj).__name__}", self.where())
            if isinstance(value_obj, torch.nn.Module):
                d = value_obj.__dict__
                if any(name in d[t] for t in ("_parameters", "_buffers", "_modules")) or \
                        (isinstance(value, TensorV) and isinstance(value.fake, torch.nn.Parameter)) or \
                        (isinstance(value, ObjV) and isinstance(value.value, torch.nn.Module)):
                    raise Unsupported(f"assigning a parameter, buffer or submodule ({name!r}) inside a compiled "
                                      f"module", self.where())
            obj.writes[name] = value
            obj.deleted.discard(name)
            if obj not in self.cap.mutables:
                self.cap.mutables.append(obj)
            return
        if isinstance(obj, TensorV) and name == "grad" and obj.source is not None and \
                isinstance(value, ConstV) and value.value is None:
            self.cap.grad_writes[id(obj)] = (obj, value)
            return
        raise Unsupported(f"setting attribute {name!r} of {self.type_name(obj)}", self.where())

    # =====================================================================================================
    # Calls.

    def call(self, fn: V, args: list[V], kwargs: dict[str, V]) -> V:
        if isinstance(fn, BoundV):
            if isinstance(fn.func, str):
                return self.call_method(fn.self_v, fn.func, args, kwargs)
            if isinstance(fn.func, (types.MethodDescriptorType, types.WrapperDescriptorType)):
                return self.call_builtin_method(fn.self_v, fn.func, args, kwargs)
            if isinstance(fn.self_v, ObjV) and isinstance(fn.self_v.value, torch.nn.Module) and \
                    fn.func is getattr(torch.nn.Module, fn.func.__name__, None) and fn.func.__name__ in MODULE_TRAVERSALS:
                return self.module_traversal(fn.self_v, fn.func.__name__, args, kwargs)
            return self.call(ObjV(fn.func), [fn.self_v] + args, kwargs)
        if isinstance(fn, ClosureV):
            return self.inline(fn.code, fn.globals, fn.defaults, fn.kwdefaults, fn.closure, args, kwargs, fn.name)
        if isinstance(fn, PartialV):
            return self.call(fn.func, fn.args + list(args), {**fn.kwargs, **kwargs})
        if isinstance(fn, GradModeExitV):
            self.set_grad(fn.prev)
            return ConstV(None)
        if isinstance(fn, AutocastExitV):
            return self.exit_autocast(fn)
        if isinstance(fn, NoOpCtxV) and fn.exit:
            return ConstV(None)  # the __exit__ of a no-op context
        if isinstance(fn, (ObjV, ConstV)):
            return self.call_value(fn, fn.value, args, kwargs)
        if isinstance(fn, NewObjV):
            m = self.getattr(fn, "__call__")
            return self.call(m, args, kwargs)
        raise Unsupported(f"calling {self.type_name(fn)}", self.where())

    def call_value(self, fn_v: V, f, args: list[V], kwargs: dict[str, V]) -> V:
        if getattr(f, "__ember_disable__", False) or getattr(getattr(f, "__func__", None), "__ember_disable__", False):
            raise Unsupported(f"{getattr(f, '__qualname__', f)} is marked ember.disable", self.where())
        if id(f) in TORCH_OPS and TORCH_OP_OBJS.get(id(f)) is f:
            return self.call_torch(f, TORCH_OPS[id(f)], args, kwargs)
        handler = BUILTIN_HANDLERS.get(f) if _hashable(f) else None
        if handler is not None:
            return handler(self, args, kwargs)
        if f in COMPILING_PROBES:
            return ConstV(True)  # libraries take their compile-friendly paths, as under torch.compile
        if f in STATE_PROBES:
            return self.concrete(f, args, kwargs)
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
        if _hashable(f) and f in AUTOCAST_CLASSES:
            return self.autocast_args(AUTOCAST_CLASSES[f], args, kwargs)
        if f is torch.set_grad_enabled:
            enabled = self.const_value(args[0] if args else kwargs["mode"])
            prev = self.cap.grad_enabled
            self.set_grad(bool(enabled))  # set_grad_enabled(b) takes effect at once, also without `with`
            return GradModeCtxV(bool(enabled), None, prev)
        if isinstance(f, torch.nn.Module):
            return self.call_module(fn_v, f, args, kwargs)
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
        call = _lookup_static(type(f), "__call__")
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

    # -- Python floats computed in the graph (PyFloatV) ---------------------------------------------------
    def optim_get_value(self, x: V) -> V:
        """torch.optim's `_get_value(step)`: `step.item()` in eager (the step count as a Python float), `step`
        itself under torch.compile (is_compiling() is True here too). Returning the float32 tensor would compute
        the bias corrections in float32 where eager computes them in double, so results would differ; the float
        becomes a PyFloatV instead, exact, and the optimizer step stays one graph (.item() would break it)."""
        if not isinstance(x, TensorV):
            return x  # a Python number: returned as is, as in eager
        if x.fake.dim() != 0 or not x.fake.is_floating_point() or x.fake.requires_grad:
            raise Unsupported("_get_value of a tensor that is not a 0-d float (its .item())", self.where())
        # on the CPU, as a Python float given to a tensor op is (a CUDA tensor takes a CPU 0-d operand)
        r = self.cap.record("call_method", "to", (x, "cpu", torch.float64), {"copy": True}, self.where())
        return PyFloatV(r.node, r.fake)

    def py_float_tensor(self, v: V) -> TensorV:
        """A PyFloatV or a Python number as a float64 0-d tensor of the graph."""
        if isinstance(v, PyFloatV):
            return TensorV(v.node, v.fake)
        if isinstance(v, ConstV) and (type(v.value) is float or
                                      type(v.value) in (int, bool) and abs(v.value) < 2 ** 53):
            key = float(v.value).hex()  # not the float: 0.0 == -0.0
            if key not in self.cap.py_float_consts:
                self.cap.py_float_consts[key] = self.cap.record(
                    "call_function", torch.full, ((), float(v.value)), {"dtype": torch.float64, "device": "cpu"},
                    self.where())
            return self.cap.py_float_consts[key]
        raise Unsupported(f"a {self.type_name(v)} in Python float arithmetic", self.where())

    def check_scalar_partner(self, t: V) -> None:
        """A Python float given to a tensor op becomes a 0-d double tensor (a "wrapped number"); a PyFloatV is
        one too, but without the flag, which only matters for type promotion: with a floating tensor of one
        dimension or more both leave the result's dtype to that tensor, and the kernels read the scalar the same
        way. Anything else (a 0-d or integer tensor) would promote differently."""
        if not (isinstance(t, TensorV) and t.fake.dim() >= 1 and t.fake.is_floating_point()):
            raise Unsupported("a Python float computed in the graph used with a 0-d or non-float tensor "
                              "(type promotion would differ from eager's)", self.where())

    def py_float_binary(self, fn, a: V, b: V, inplace: bool) -> V:
        base = INPLACE_TO_BINARY.get(fn, fn)
        if base not in PY_FLOAT_OPS:
            raise Unsupported(f"operator {base.__name__} on a Python float computed in the graph (needs its value)",
                              self.where())
        other = b if isinstance(a, PyFloatV) else a
        if isinstance(other, (PyFloatV, ConstV)):
            # Python's float ops raise on a zero divisor or an overflowing pow where the tensor ops give inf; the
            # floats this meets (an optimizer's bias corrections) never reach either.
            if base is operator.truediv and isinstance(b, ConstV) and b.value == 0:
                raise Unsupported("division of a Python float by zero", self.where())
            r = self.cap.record("call_function", PY_FLOAT_OPS[base], (self.py_float_tensor(a), self.py_float_tensor(b)),
                                {}, self.where())
            return PyFloatV(r.node, r.fake)
        if base not in REFLECTED:
            raise Unsupported(f"operator {base.__name__} of a tensor and a Python float computed in the graph",
                              self.where())
        self.check_scalar_partner(other)
        if isinstance(a, TensorV):  # tensor OP float: Tensor.__op__ (in place: Tensor.__iop__)
            out = self.cap.record("call_function", fn if inplace else base, (a, self.py_float_tensor(b)), {},
                                  self.where())
            return a if inplace else out
        # float OP tensor: float.__op__ returns NotImplemented, so Python calls Tensor.__rop__ (for /, that is
        # reciprocal() * float, not a division)
        return self.cap.record("call_method", REFLECTED[base], (b, self.py_float_tensor(a)), {}, self.where())

    def record_py_float_call(self, kind: str, target, name: str, args: list[V], kwargs: dict) -> V:
        """A torch op given Python floats computed in the graph: recorded only where the same op on float64 0-d
        tensors computes what eager computes with the floats (addcdiv's value, foreach scalar lists)."""
        where_ = self.where()
        to_t = self.py_float_tensor
        if name in ("addcdiv", "addcdiv_") and len(args) in (3, 4) and set(kwargs) <= {"value"}:
            self_v, t1, t2 = args[:3]
            value = kwargs.get("value", args[3] if len(args) == 4 else None)
            if not isinstance(value, PyFloatV) or not all(isinstance(t, TensorV) for t in (self_v, t1, t2)) or \
                    len({t.fake.dtype for t in (self_v, t1, t2)}) != 1:
                raise Unsupported(f"{name} with a Python float computed in the graph", where_)
            self.check_scalar_partner(t1)
            # the kernel computes self + value * t1 / t2 in the tensors' dtype, left to right
            q = self.cap.record("call_function", operator.truediv,
                                (self.cap.record("call_function", operator.mul, (t1, to_t(value)), {}, where_), t2),
                                {}, where_)
            if kind == "call_method" and name.endswith("_"):
                self.cap.record("call_method", "add_", (self_v, q), {}, where_)
                return self_v
            return self.cap.record("call_function", torch.add, (self_v, q), {}, where_)
        base = name.rstrip("_")
        if kind == "call_function" and base in ("_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div") \
                and len(args) == 2 and _all_py_floats(args[1]) and set(kwargs) <= {"alpha"} and \
                not _has_py_float([], kwargs):
            for t in self.iterate(args[0]):
                self.check_scalar_partner(t)
            # the scalar-list overload runs `x[i] op= s[i]` per tensor; the tensor-list one `x[i] op= s_t[i]`
            return self.cap.record(kind, target, (args[0], ListV([to_t(x) for x in self.iterate(args[1])])),
                                   kwargs, where_)
        if kind == "call_function" and name in ("_foreach_addcdiv", "_foreach_addcdiv_") and len(args) == 4 and \
                not kwargs and _all_py_floats(args[3]) and not _has_py_float(args[:3], {}):
            for t in self.iterate(args[1]):
                self.check_scalar_partner(t)
            scalars = ListV([to_t(x) for x in self.iterate(args[3])])
            q = self.cap.record(kind, torch._foreach_div,
                                (self.cap.record(kind, torch._foreach_mul, (args[1], scalars), {}, where_), args[2]),
                                {}, where_)
            return self.cap.record(kind, torch._foreach_add_ if name.endswith("_") else torch._foreach_add,
                                   (args[0], q), {}, where_)
        raise Unsupported(f"{name} of a Python float computed in the graph (needs its value)", where_)

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
        if descr.__name__ not in PURE_METHODS or kwargs or not isinstance(owner, ObjV) or \
                not all(isinstance(a, ConstV) for a in args):
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
        if _has_py_float(args, kwargs):
            return self.record_py_float_call("call_function", f, name, args, kwargs)
        has_tensor = _any_tensor(args) or _any_tensor(list(kwargs.values()))
        if has_tensor or name in FACTORIES:
            return self.cap.record("call_function", f, tuple(args), kwargs, self.where())
        if name in TORCH_PURE_CONST:
            return self.concrete(f, args, kwargs)
        if isinstance(f, types.FunctionType):  # a Python helper of torch's own (torch._none_or_dtype...)
            return self.inline(f.__code__, f.__globals__, tuple(ConstV(d) for d in f.__defaults__ or ()),
                               {k: ConstV(d) for k, d in (f.__kwdefaults__ or {}).items()},
                               tuple(CellV(self.cap.wrap(c.cell_contents, None)) for c in f.__closure__ or ()),
                               args, kwargs, f.__qualname__)
        raise Unsupported(f"torch.{name} is not captured (no tensor argument)", self.where())

    def call_method(self, self_v: V, name: str, args: list[V], kwargs: dict) -> V:
        if isinstance(self_v, TensorV):
            if name == "backward" and self.cap.backward_in_graph:
                return self.tensor_backward(self_v, args, kwargs)
            if name in TENSOR_METHODS_UNSUPPORTED:
                raise Unsupported(f"Tensor.{name}() needs the tensor's value in Python", self.where())
            if _has_py_float(args, kwargs):
                return self.record_py_float_call("call_method", name, name, [self_v, *args], kwargs)
            out = self.cap.record("call_method", name, (self_v, *args), kwargs, self.where())
            if name.endswith("_") and not name.endswith("__") and isinstance(out, TensorV):
                return self_v  # in-place methods return self
            return out
        if isinstance(self_v, ListV):
            items = self_v.items
            if name == "append":
                self.list_mutate(self_v).items.append(args[0])
            elif name == "extend":
                self.list_mutate(self_v).items.extend(self.iterate(args[0]))
            elif name == "insert":
                self.list_mutate(self_v).items.insert(self.const_value(args[0]), args[1])
            elif name == "pop":
                i = self.const_value(args[0]) if args else -1
                if not items:
                    raise Unsupported("pop from empty list", self.where())
                return self.list_mutate(self_v).items.pop(i)
            elif name == "clear":
                self.list_mutate(self_v).items.clear()
            elif name == "reverse":
                self.list_mutate(self_v).items.reverse()
            elif name == "copy":
                return ListV(list(items))
            elif name in ("index", "count"):
                target = args[0]
                matches = [self.truth(self.binary(operator.eq, x, target, False)) for x in items]
                if name == "count":
                    return ConstV(sum(matches))
                if True not in matches:
                    raise PyError(ValueError("list.index(x): x not in list"), self.where())
                return ConstV(matches.index(True))
            elif name == "remove":
                matches = [self.truth(self.binary(operator.eq, x, args[0], False)) for x in items]
                if True not in matches:
                    raise PyError(ValueError("list.remove(x): x not in list"), self.where())
                del self.list_mutate(self_v).items[matches.index(True)]
            elif name == "sort":
                key = kwargs.get("key")
                reverse = self.const_value(kwargs["reverse"]) if "reverse" in kwargs else False
                self_v.items[:] = self.sorted_items(items, key, reverse)
                self_v.mutated = True
            else:
                raise Unsupported(f"list.{name}", self.where())
            return ConstV(None)
        if isinstance(self_v, DictV):
            d = self_v.items
            if name == "items":
                return IterV([TupleV([self.key_v(k), v]) for k, v in d.items()])
            if name == "keys":
                return IterV([self.key_v(k) for k in d])
            if name == "values":
                return IterV(list(d.values()))
            if name == "get":
                k = self.key(args[0])
                return d.get(k, args[1] if len(args) > 1 else ConstV(None))
            if name == "pop":
                k = self.key(args[0])
                if k in d:
                    return self.dict_mutate(self_v).items.pop(k)
                if len(args) > 1:
                    return args[1]
                raise PyError(KeyError(k), self.where())
            if name == "setdefault":
                k = self.key(args[0])
                if k not in d:
                    self.dict_mutate(self_v).items[k] = args[1] if len(args) > 1 else ConstV(None)
                return d[k]
            if name == "update":
                other = self.as_dict(args[0]) if args else {}
                self.dict_mutate(self_v).items.update({**other, **kwargs})
                return ConstV(None)
            if name == "clear":
                self.dict_mutate(self_v).items.clear()
                return ConstV(None)
            if name == "copy":
                return DictV(dict(d), cls=self_v.cls)
            if name == "__contains__":
                return ConstV(self.key(args[0]) in d)
            if name == "__getitem__":
                return self.getitem(self_v, args[0])
            if name == "to_tuple":
                return TupleV(list(d.values()))
            if name == "move_to_end":
                k = self.key(args[0])
                last = self.const_value(args[1] if len(args) > 1 else kwargs.get("last", ConstV(True)))
                v = self.dict_mutate(self_v).items.pop(k)
                d2 = {k: v, **d} if not last else {**d, k: v}
                d.clear()
                d.update(d2)
                return ConstV(None)
            raise Unsupported(f"dict.{name}", self.where())
        if isinstance(self_v, SetV):
            if name == "add":
                self.set_add(self_v, args[0])
                return ConstV(None)
            if name in ("update",):
                for a in args:
                    for x in self.iterate(a):
                        self.set_add(self_v, x)
                return ConstV(None)
            if name in ("discard", "remove"):
                k = self.key(args[0])
                before = len(self_v.items)
                self_v.items[:] = [x for x in self_v.items if self.key(x) != k]
                self_v.mutated = True
                if name == "remove" and len(self_v.items) == before:
                    raise Unsupported("KeyError in set.remove", self.where())
                return ConstV(None)
            if name in ("union", "intersection", "difference", "issubset", "issuperset", "copy"):
                mine = {self.key(x) for x in self_v.items}
                others = [{self.key(x) for x in self.iterate(a)} for a in args]
                r = getattr(mine, name)(*others)
                return SetV([ConstV(x) for x in r]) if isinstance(r, set) else ConstV(r)
            raise Unsupported(f"set.{name}", self.where())
        if isinstance(self_v, TupleV):
            if name == "_asdict":
                return DictV(dict(zip(self_v.cls._fields, self_v.items)))
            if name == "_replace":
                fields = list(self_v.cls._fields)
                items = list(self_v.items)
                for k, v in kwargs.items():
                    items[fields.index(k)] = v
                return TupleV(items, None, self_v.cls)
            target = args[0]
            matches = [self.truth(self.binary(operator.eq, x, target, False)) for x in self_v.items]
            return ConstV(sum(matches) if name == "count" else matches.index(True))
        if isinstance(self_v, GradModeCtxV):
            if name == "__enter__":
                self.set_grad(self_v.enabled)
                return ConstV(None)
            self.set_grad(not self_v.enabled)
            return ConstV(None)
        if isinstance(self_v, ObjV) and name == "_make":
            return TupleV(self.iterate(args[0]), None, self_v.value)
        if isinstance(self_v, IterV) and name == "__next__":
            return _next(self, [self_v], {})
        raise Unsupported(f"method {name} of {self.type_name(self_v)}", self.where())

    def key_v(self, k) -> V:
        return ObjV(k) if isinstance(k, (type, enum.Enum)) else self.const_v(k)

    def sorted_items(self, items: list[V], key: V | None, reverse: bool) -> list[V]:
        keys = [self.const_value(self.call(key, [x], {})) if key is not None else self.const_value(x) for x in items]
        order = sorted(range(len(items)), key=lambda i: keys[i], reverse=reverse)
        return [items[i] for i in order]

    def call_module(self, mod_v: V, mod: torch.nn.Module, args: list[V], kwargs: dict) -> V:
        from torch.nn.modules import module as module_mod
        if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks or \
                module_mod._global_backward_hooks or getattr(module_mod, "_global_backward_pre_hooks", None) or \
                mod._backward_hooks or getattr(mod, "_backward_pre_hooks", None):
            raise Unsupported("backward hooks or global module hooks", self.where())
        src = mod_v.source
        g = self.cap.guards
        # hooks registered after the capture must be seen: the global ones and this module's backward ones are
        # empty (checked above), its forward ones as many as the capture called. Backward hooks do nothing
        # where grad mode is off (no output has a grad_fn to hook), so an inference call does not check them:
        # two more checks per module were 10-15% of BertModel's cached call.
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
        for hook_id, hook in list(mod._forward_pre_hooks.items()):
            if mod._forward_pre_hooks_with_kwargs.get(hook_id):
                raise Unsupported("forward pre-hook with kwargs", self.where())
            hook_v = self.cap.wrap(hook, f"{src}._forward_pre_hooks[{hook_id}]" if src else None)
            r = self.call(hook_v, [mod_v, TupleV(list(args))], {})
            if not self.is_none(r):
                args = list(r.items) if isinstance(r, TupleV) else [r]
        forward = type(mod).forward
        if "forward" in mod.__dict__:
            out = self.call(self.cap.wrap(mod.__dict__["forward"], attr_source(src, "forward")), args, kwargs)
        else:
            out = self.call(ObjV(forward), [mod_v] + args, kwargs)
        for hook_id, hook in list(mod._forward_hooks.items()):
            if mod._forward_hooks_with_kwargs.get(hook_id):
                raise Unsupported("forward hook with kwargs", self.where())
            hook_v = self.cap.wrap(hook, f"{src}._forward_hooks[{hook_id}]" if src else None)
            r = self.call(hook_v, [mod_v, TupleV(list(args)), out], {})
            if not self.is_none(r):
                out = r
        return out

    def construct(self, cls_v: V, cls: type, args: list[V], kwargs: dict) -> V:
        if issubclass(cls, torch.nn.Module):
            raise Unsupported(f"creating a module ({cls.__name__}) inside a compiled function", self.where())
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
        if cls.__module__.split(".")[0] in ("builtins",) or cls.__new__ is not object.__new__ or \
                cls.__module__.split(".")[0] == "torch":
            if all(isinstance(a, ConstV) for a in [*args, *kwargs.values()]) and cls in (
                    torch.device, torch.Size, torch.dtype, slice, range, complex, torch.finfo, torch.iinfo):
                return self.concrete(cls, args, kwargs)
            if dataclasses.is_dataclass(cls) and issubclass(cls, dict):
                return self.construct_dict_dataclass(cls, args, kwargs)
            raise Unsupported(f"creating a {cls.__name__} inside a compiled function", self.where())
        if _lookup_static(cls, "__slots__") is not _MISSING and "__dict__" not in dir(cls):
            raise Unsupported(f"class {cls.__name__} with __slots__", self.where())
        obj = NewObjV(cls)
        init = _lookup_static(cls, "__init__")
        if isinstance(init, types.FunctionType):
            self.call(BoundV(obj, init), args, kwargs)
        elif init is not object.__init__ or args or kwargs:
            raise Unsupported(f"{cls.__name__}.__init__ is not Python", self.where())
        if dataclasses.is_dataclass(cls) and getattr(cls, "__post_init__", None) is None:
            pass
        return obj

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

    def inline(self, code, f_globals, defaults, kwdefaults, closure, args, kwargs, name) -> V:
        if self.depth >= config.MAX_INLINE_DEPTH:
            raise Unsupported(f"call depth over {config.MAX_INLINE_DEPTH} (recursion) in {name}", self.where())
        local_vars = bind_arguments(code, defaults, kwdefaults, args, kwargs, name, self.where())
        cells = {}
        for i, fv in enumerate(code.co_freevars):
            c = closure[i] if i < len(closure) else None
            if c is None or not isinstance(c, CellV):
                raise Unsupported(f"closure of {name} is not trackable", self.where())
            cells[fv] = c
        child = Frame(self.cap, code, f_globals, local_vars, cells, parent=self,
                      globals_source=None if f_globals is not self.f_globals else self.globals_source)
        try:
            result = child.run()
        except Unsupported as u:
            # where the break sits in each inlined frame, outermost first: the callee compiled at the root's
            # break instruction starts with its stop there (convert.StopHint) instead of rediscovering it
            inner = getattr(u, "inlined_at", ())
            u.inlined_at = None if inner is None or child.current is None else [(code, child.current.offset), *inner]
            raise
        if child.yields is not None:
            return IterV(child.yields)
        return result


# ---------------------------------------------------------------------------------------------------------

_MISSING = object()


def _lookup_static(cls: type, name: str):
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _MISSING


def _is_data_descriptor(x) -> bool:
    t = type(x)
    return x is not _MISSING and not isinstance(x, (types.FunctionType, property)) and (
        hasattr(t, "__set__") or hasattr(t, "__delete__")) and hasattr(t, "__get__")


def _resolve_relative(name: str, package: str | None, level: int) -> str:
    base = (package or "").rsplit(".", level - 1)[0]
    return f"{base}.{name}" if name else base


def _inputs_reached(cap: Capture, loss: TensorV, where_: str) -> list[GraphInput]:
    """The graph inputs `loss.backward()` gives a gradient. The capture's fake tensors carry no autograd
    history, so the graph so far runs again on fresh fake inputs, with autograd recording."""
    graph, env = torch.fx.Graph(), {}
    graph.graph_copy(cap.graph, env)
    graph.output(env[loss.node])
    by_node = {inp.node: inp for inp in cap.inputs}
    root, args, wrt = torch.nn.Module(), [], []
    prev_autocast = autocast_state()
    try:
        with cap.fake_mode, torch.set_grad_enabled(cap.grad_enabled):
            for n in cap.graph.nodes:
                f = n.meta.get("val")
                if n.op in ("placeholder", "get_attr"):
                    fresh = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
                    if n.op == "get_attr":
                        root.register_buffer(n.target, fresh, persistent=False)
                        continue
                    inp = by_node.get(n)
                    if inp is not None and inp.real.requires_grad:
                        fresh.requires_grad_(True)
                        wrt.append(inp)
                    args.append(fresh)
            out = torch.fx.Interpreter(torch.fx.GraphModule(root, graph)).run(*args)
            grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], allow_unused=True)
    except Exception as e:
        raise Unsupported(f"backward() could not be traced ({type(e).__name__}: {str(e)[:200]})", where_)
    finally:
        if autocast_state() != prev_autocast:
            restore_autocast(prev_autocast)
    return [inp for inp, g in zip(wrt, grads) if g is not None]


def _real_attr(cap: Capture, t: TensorV, name: str):
    for inp in cap.inputs:
        if inp.node is t.node:
            return getattr(inp.real, name)
    raise Unsupported(f"tensor attribute {name}")


def _to_fake_tree(idx):
    return _python_value(idx, lambda t: t.fake) if isinstance(idx, V) else idx


def _eq_is_identity(v: V) -> bool:
    value = v.value
    if isinstance(v, ConstV):
        return True
    return isinstance(value, (type, types.FunctionType, types.ModuleType, torch.nn.Module, enum.Enum,
                              types.BuiltinFunctionType)) or type(value).__eq__ is object.__eq__


def _any_tensor(vs) -> bool:
    for v in vs:
        if isinstance(v, TensorV):
            return True
        if isinstance(v, (ListV, TupleV)) and _any_tensor(v.items):
            return True
        if isinstance(v, DictV) and _any_tensor(list(v.items.values())):
            return True
    return False


def _hashable(f) -> bool:
    try:
        hash(f)
        return True
    except TypeError:
        return False


def _callable_name(f) -> str:
    mod = getattr(f, "__module__", None) or type(f).__module__
    return f"{mod}.{getattr(f, '__qualname__', type(f).__name__)}"


_DUNDERS = {operator.add: ("__add__", "__radd__"), operator.sub: ("__sub__", "__rsub__"),
            operator.mul: ("__mul__", "__rmul__"), operator.truediv: ("__truediv__", "__rtruediv__"),
            operator.matmul: ("__matmul__", "__rmatmul__"), operator.eq: ("__eq__",), operator.ne: ("__ne__",),
            operator.lt: ("__lt__",), operator.le: ("__le__",), operator.gt: ("__gt__",), operator.ge: ("__ge__",),
            operator.iadd: ("__iadd__",), operator.getitem: ("__getitem__",)}
_CONTAINER_METHODS = {
    ListV: {"append", "extend", "insert", "pop", "clear", "reverse", "copy", "index", "count", "remove", "sort"},
    DictV: {"items", "keys", "values", "get", "pop", "setdefault", "update", "clear", "copy", "__contains__",
            "__getitem__", "move_to_end"},
    SetV: {"add", "update", "discard", "remove", "union", "intersection", "difference", "issubset", "issuperset",
           "copy"},
}


def bind_arguments(code, defaults, kwdefaults, args, kwargs, name, where_) -> dict[str, V]:
    """CPython's argument binding, over tracked values."""
    nargs = code.co_argcount
    nkwonly = code.co_kwonlyargcount
    names = code.co_varnames
    posonly = code.co_posonlyargcount
    out: dict[str, V] = {}
    positional = names[:nargs]
    for i, v in enumerate(args[:nargs]):
        out[positional[i]] = v
    extra = args[nargs:]
    idx = nargs + nkwonly
    varargs_name = varkw_name = None
    if code.co_flags & CO_VARARGS:
        varargs_name = names[idx]
        idx += 1
    if code.co_flags & CO_VARKEYWORDS:
        varkw_name = names[idx]
    if extra and varargs_name is None:
        raise Unsupported(f"{name}() takes {nargs} positional arguments but {len(args)} were given", where_)
    if varargs_name is not None:
        out[varargs_name] = TupleV(list(extra))
    rest = {}
    kwonly = names[nargs:nargs + nkwonly]
    for k, v in kwargs.items():
        if k in positional[posonly:] or k in kwonly:
            if k in out:
                raise Unsupported(f"{name}() got multiple values for argument {k!r}", where_)
            out[k] = v
        elif varkw_name is not None:
            rest[k] = v
        else:
            raise Unsupported(f"{name}() got an unexpected keyword argument {k!r}", where_)
    if varkw_name is not None:
        out[varkw_name] = DictV(rest)
    first_default = nargs - len(defaults)
    for i, pname in enumerate(positional):
        if pname not in out:
            if i >= first_default:
                out[pname] = defaults[i - first_default]
            else:
                raise Unsupported(f"{name}() missing required argument {pname!r}", where_)
    for k in kwonly:
        if k not in out:
            if k in kwdefaults:
                out[k] = kwdefaults[k]
            else:
                raise Unsupported(f"{name}() missing required keyword-only argument {k!r}", where_)
    return out


# ---------------------------------------------------------------------------------------------------------
# Python builtins over tracked values.

def _isinstance(fr: Frame, args, kwargs):
    obj, cls_v = args
    classes = _classes(cls_v)
    t = _static_type(fr, obj)
    if isinstance(obj, TensorV) and t is torch.Tensor:
        return ConstV(isinstance(obj.fake, classes) if not isinstance(classes, tuple) or torch.Tensor in classes
                      else any(issubclass(torch.Tensor, c) for c in classes))
    if isinstance(obj, ObjV):
        return ConstV(isinstance(obj.value, classes))
    return ConstV(issubclass(t, classes))


def _classes(v: V):
    if isinstance(v, TupleV):
        return tuple(_classes(x) for x in v.items)
    return v.value


def _static_type(fr: Frame, v: V) -> type:
    if isinstance(v, PyFloatV):
        return float
    if isinstance(v, TensorV):
        if v.source is not None:
            for inp in fr.cap.inputs:
                if inp.node is v.node:
                    return type(inp.real)
        return torch.Tensor
    if isinstance(v, ObjV):
        return type(v.value)
    if isinstance(v, NewObjV):
        return v.cls
    if isinstance(v, ConstV):
        return type(v.value)
    if isinstance(v, (ClosureV,)):
        return types.FunctionType
    if isinstance(v, BoundV):
        return types.MethodType if not isinstance(v.func, str) else types.BuiltinMethodType
    return v.python_type()


def _type(fr: Frame, args, kwargs):
    if len(args) != 1:
        raise Unsupported("type() with 3 arguments", fr.where())
    return ObjV(_static_type(fr, args[0]))


def _len(fr: Frame, args, kwargs):
    v = args[0]
    if isinstance(v, (ListV, TupleV, SetV)):
        return ConstV(len(v.items))
    if isinstance(v, DictV):
        return ConstV(len(v.items))
    if isinstance(v, ConstV):
        return ConstV(len(v.value))
    if isinstance(v, TensorV):
        if v.fake.dim() == 0:
            raise Unsupported("len() of a 0-d tensor", fr.where())
        return ConstV(v.fake.shape[0])
    if isinstance(v, IterV):
        raise Unsupported("len() of an iterator", fr.where())
    if isinstance(v, ObjV) and isinstance(v.value, torch.nn.Module):
        fr.guard_structure(v)
        return ConstV(len(v.value))
    if isinstance(v, (ObjV, NewObjV)):
        return fr.call(fr.getattr(v, "__len__"), [], {})
    raise Unsupported(f"len() of {fr.type_name(v)}", fr.where())


def _range(fr, args, kwargs):
    return ConstV(range(*[fr.const_value(a) for a in args]))


def _enumerate(fr, args, kwargs):
    start = fr.const_value(args[1] if len(args) > 1 else kwargs.get("start", ConstV(0)))
    return IterV([TupleV([ConstV(i + start), x]) for i, x in enumerate(fr.iterate(args[0]))])


def _zip(fr, args, kwargs):
    if kwargs.get("strict") is not None and fr.const_value(kwargs["strict"]):
        lens = {len(fr.iterate(a)) for a in args}
        if len(lens) > 1:
            raise Unsupported("zip(strict=True) of unequal lengths", fr.where())
    return IterV([TupleV(list(t)) for t in zip(*[fr.iterate(a) for a in args])])


def _chain(fr, args, kwargs):
    return IterV([x for a in args for x in fr.iterate(a)])


def _chain_from_iterable(fr, args, kwargs):
    return IterV([x for a in fr.iterate(args[0]) for x in fr.iterate(a)])


def _reversed(fr, args, kwargs):
    v = args[0]
    if isinstance(v, (ObjV, NewObjV)) and not (isinstance(v, ObjV) and isinstance(v.value, torch.nn.Module)):
        m = fr.getattr(v, "__reversed__")
        return fr.call(m, [], {})
    return IterV(list(reversed(fr.iterate(v))))


def _list(fr, args, kwargs):
    return ListV(fr.iterate(args[0]) if args else [])


def _tuple(fr, args, kwargs):
    return TupleV(fr.iterate(args[0]) if args else [])


def _dict(fr, args, kwargs):
    d = {}
    if args:
        src = args[0]
        if isinstance(src, DictV):
            d.update(src.items)
        else:
            for pair in fr.iterate(src):
                k, v = fr.iterate(pair)
                d[fr.key(k)] = v
    d.update(kwargs)
    return DictV(d)


def _ordered_dict(fr, args, kwargs):
    d = _dict(fr, args, kwargs)
    d.cls = collections.OrderedDict
    return d


def _set(fr, args, kwargs):
    s = SetV([])
    for x in fr.iterate(args[0]) if args else []:
        fr.set_add(s, x)
    return s


def _sorted(fr, args, kwargs):
    items = fr.iterate(args[0])
    reverse = fr.const_value(kwargs["reverse"]) if "reverse" in kwargs else False
    return ListV(fr.sorted_items(items, kwargs.get("key"), reverse))


def _minmax(pick):
    def handler(fr, args, kwargs):
        items = fr.iterate(args[0]) if len(args) == 1 else list(args)
        if any(isinstance(x, TensorV) for x in items):
            if len(items) == 2 and "key" not in kwargs:
                return fr.cap.record("call_function", torch.maximum if pick is max else torch.minimum,
                                     tuple(items), {}, fr.where()) if all(isinstance(x, TensorV) for x in items) \
                    else _raise(fr, f"{pick.__name__}() of a tensor and a number needs its value")
            raise Unsupported(f"{pick.__name__}() over tensors compares their values", fr.where())
        if "key" in kwargs:
            keys = [fr.const_value(fr.call(kwargs["key"], [x], {})) for x in items]
            best = pick(range(len(items)), key=lambda i: keys[i])
            return items[best]
        if not items and "default" in kwargs:
            return kwargs["default"]
        return ConstV(pick(fr.const_value(x) for x in items))
    return handler


def _raise(fr, msg):
    raise Unsupported(msg, fr.where())


def _sum(fr, args, kwargs):
    items = fr.iterate(args[0])
    acc = args[1] if len(args) > 1 else kwargs.get("start", ConstV(0))
    for x in items:
        acc = fr.binary(operator.add, acc, x, False)
    return acc


def _any_all(which):
    def handler(fr, args, kwargs):
        vals = [fr.truth(x) for x in fr.iterate(args[0])]
        return ConstV(which(vals))
    return handler


def _getattr_builtin(fr, args, kwargs):
    name = fr.const_value(args[1])
    try:
        return fr.getattr(args[0], name)
    except Unsupported:
        if len(args) > 2 and not _has_attr(fr, args[0], name):
            return args[2]
        raise


def _has_attr(fr, v, name) -> bool:
    if isinstance(v, ObjV):
        return hasattr(v.value, name) if name not in v.writes else True
    if isinstance(v, NewObjV):
        return name in v.attrs or _lookup_static(v.cls, name) is not _MISSING
    if isinstance(v, TensorV):
        return hasattr(v.fake, name)
    if isinstance(v, ConstV):
        return hasattr(v.value, name)
    if isinstance(v, TupleV):
        return hasattr(v.cls, name)
    return False


def _hasattr(fr, args, kwargs):
    obj, name = args[0], fr.const_value(args[1])
    if isinstance(obj, ObjV) and obj.source is not None and name not in obj.writes and \
            not isinstance(obj.value, (types.ModuleType, type)):
        r = hasattr(obj.value, name)
        fr.cap.guards.add(f"hasattr({obj.source}, {name!r}) is {r}", 1)
        return ConstV(r)
    return ConstV(_has_attr(fr, obj, name))


def _setattr_builtin(fr, args, kwargs):
    fr.setattr(args[0], fr.const_value(args[1]), args[2])
    return ConstV(None)


def _iter(fr, args, kwargs):
    return IterV(fr.iterate(args[0]))


def _next(fr, args, kwargs):
    it = args[0]
    if not isinstance(it, IterV):
        it = IterV(fr.iterate(it))
    if it.pos >= len(it.items):
        if len(args) > 1:
            return args[1]
        raise PyError(StopIteration(), fr.where())
    it.pos += 1
    return it.items[it.pos - 1]


def _scalar_conv(typ):
    def handler(fr, args, kwargs):
        if args and isinstance(args[0], TensorV):
            raise Unsupported(f"{typ.__name__}() of a tensor needs its value", fr.where())
        return fr.concrete(typ, args, kwargs)
    return handler


def _str(fr, args, kwargs):
    if args and isinstance(args[0], ObjV) and isinstance(args[0].value, (type, types.FunctionType, types.ModuleType)):
        return ConstV(str(args[0].value))
    if args and not isinstance(args[0], ConstV):
        if isinstance(args[0], (ObjV, NewObjV)):
            m = fr.getattr(args[0], "__str__") if isinstance(args[0], NewObjV) else None
            if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
                return fr.call(m, [], {})
        raise Unsupported(f"str() of {fr.type_name(args[0])}", fr.where())
    return fr.concrete(str, args, kwargs)


def _super(fr, args, kwargs):
    if args:
        return SuperV(fr.const_value(args[0]) if isinstance(args[0], ConstV) else args[0].value, args[1])
    cell = fr.cells.get("__class__")
    if cell is None or cell.contents is None:
        raise Unsupported("super() outside a method", fr.where())
    first = fr.code.co_varnames[0] if fr.code.co_argcount else None
    self_v = fr.locals.get(first)
    if self_v is None and first in fr.cells:
        self_v = fr.cells[first].contents
    return SuperV(cell.contents.value, self_v)


def _callable_builtin(fr, args, kwargs):
    v = args[0]
    if isinstance(v, (ClosureV, BoundV)):
        return ConstV(True)
    if isinstance(v, (ObjV, ConstV)):
        return ConstV(callable(v.value))
    if isinstance(v, NewObjV):
        return ConstV(_lookup_static(v.cls, "__call__") is not _MISSING)
    return ConstV(False)


def _issubclass(fr, args, kwargs):
    a, b = args
    return ConstV(issubclass(a.value, _classes(b)))


def _abs(fr, args, kwargs):
    if isinstance(args[0], TensorV):
        return fr.cap.record("call_function", torch.abs, (args[0],), {}, fr.where())
    return fr.concrete(abs, args, kwargs)


def _pow_builtin(fr, args, kwargs):
    if any(isinstance(a, TensorV) for a in args):
        return fr.binary(operator.pow, args[0], args[1], False)
    return fr.concrete(pow, args, kwargs)


def _round(fr, args, kwargs):
    if isinstance(args[0], TensorV):
        return fr.cap.record("call_function", torch.round, tuple(args), {}, fr.where())
    return fr.concrete(round, args, kwargs)


def _id(fr, args, kwargs):
    v = args[0]
    if isinstance(v, ObjV):
        return ConstV(id(v.value))
    raise Unsupported("id() of a value made during capture", fr.where())


def _map(fr, args, kwargs):
    fn, seqs = args[0], [fr.iterate(a) for a in args[1:]]
    return IterV([fr.call(fn, list(t), {}) for t in zip(*seqs)])


def _filter(fr, args, kwargs):
    fn, seq = args[0], fr.iterate(args[1])
    if fr.is_none(fn):
        return IterV([x for x in seq if fr.truth(x)])
    return IterV([x for x in seq if fr.truth(fr.call(fn, [x], {}))])


def _object_new(fr, args, kwargs):
    cls = args[0].value
    if cls.__new__ is not object.__new__ or issubclass(cls, torch.nn.Module):
        raise Unsupported(f"{cls.__name__}.__new__", fr.where())
    return NewObjV(cls)


def _object_setattr(fr, args, kwargs):
    obj, name, value = args
    if isinstance(obj, NewObjV):
        obj.attrs[fr.const_value(name)] = value
        return ConstV(None)
    fr.setattr(obj, fr.const_value(name), value)
    return ConstV(None)


def _dataclass_fields(fr, args, kwargs):
    cls = _static_type(fr, args[0]) if not (isinstance(args[0], ObjV) and isinstance(args[0].value, type)) \
        else args[0].value
    return TupleV([ObjV(f) for f in dataclasses.fields(cls)])


def _signature(fr, args, kwargs):
    v = args[0]
    if isinstance(v, BoundV) and isinstance(v.func, types.FunctionType):
        sig = inspect.signature(v.func)
        return ObjV(sig.replace(parameters=list(sig.parameters.values())[1:]))
    if isinstance(v, ClosureV):
        return ObjV(inspect.signature(_make_function_value(v)))
    if isinstance(v, ObjV) and callable(v.value):
        return ObjV(inspect.signature(v.value))
    raise Unsupported(f"inspect.signature of {fr.type_name(v)}", fr.where())


def _make_function_value(v: ClosureV):
    return types.FunctionType(v.code, v.globals, v.name)


def _reduce(fr, args, kwargs):
    fn, items = args[0], fr.iterate(args[1])
    if len(args) > 2:
        acc = args[2]
    elif items:
        acc, items = items[0], items[1:]
    else:
        raise PyError(TypeError("reduce() of empty iterable with no initial value"), fr.where())
    for x in items:
        acc = fr.call(fn, [acc, x], {})
    return acc


def _copy(deep: bool):
    def handler(fr, args, kwargs):
        v = args[0]
        if isinstance(v, ObjV) and not isinstance(v.value, (torch.nn.Module, torch.Tensor)) and not v.writes \
                and not _holds_tensor(v.value):
            # A plain-data object (a model config): copied now; the copy is read, never written back.
            return ObjV((copy.deepcopy if deep else copy.copy)(v.value))
        if isinstance(v, (ListV, DictV, TupleV)) and deep:
            return _deepcopy_v(fr, v)
        if isinstance(v, (ListV, DictV, TupleV)) and not deep:
            return {ListV: _list, DictV: _dict, TupleV: lambda f, a, k: a[0]}[type(v)](fr, [v], {})
        raise Unsupported(f"copy.{'deepcopy' if deep else 'copy'} of {fr.type_name(v)}", fr.where())
    return handler


def _deepcopy_v(fr, v: V) -> V:
    if isinstance(v, ConstV):
        return v
    if isinstance(v, (ListV, TupleV)):
        items = [_deepcopy_v(fr, x) for x in v.items]
        return ListV(items) if isinstance(v, ListV) else TupleV(items, None, v.cls)
    if isinstance(v, DictV):
        return DictV({k: _deepcopy_v(fr, x) for k, x in v.items.items()}, cls=v.cls)
    if isinstance(v, ObjV) and not v.writes and not _holds_tensor(v.value) and \
            not isinstance(v.value, (torch.nn.Module, types.ModuleType, type, types.FunctionType)):
        return ObjV(copy.deepcopy(v.value))
    if isinstance(v, ObjV) and isinstance(v.value, (type, types.FunctionType, types.ModuleType)):
        return v
    raise Unsupported(f"copy.deepcopy of {fr.type_name(v)}", fr.where())


def _holds_tensor(obj, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 3:
        return False
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return any(_holds_tensor(x, depth + 1) for x in items)


def _print(fr, args, kwargs):
    raise Unsupported("print() writes output: it runs in Python", fr.where())


BUILTIN_HANDLERS = {
    isinstance: _isinstance, type: _type, len: _len, range: _range, enumerate: _enumerate, zip: _zip,
    reversed: _reversed, list: _list, tuple: _tuple, dict: _dict, set: _set, frozenset: _set, sorted: _sorted,
    min: _minmax(min), max: _minmax(max), sum: _sum, any: _any_all(any), all: _any_all(all),
    getattr: _getattr_builtin, hasattr: _hasattr, setattr: _setattr_builtin, iter: _iter, next: _next,
    int: _scalar_conv(int), float: _scalar_conv(float), bool: _scalar_conv(bool), complex: _scalar_conv(complex),
    str: _str, super: _super, callable: _callable_builtin, issubclass: _issubclass, abs: _abs, pow: _pow_builtin,
    round: _round, id: _id, map: _map, filter: _filter, object.__new__: _object_new,
    object.__setattr__: _object_setattr, dataclasses.fields: _dataclass_fields, print: _print,
    collections.OrderedDict: _ordered_dict, copy.deepcopy: _copy(True), copy.copy: _copy(False), functools.reduce: _reduce, inspect.signature: _signature,
    itertools.chain: _chain, itertools.chain.from_iterable: _chain_from_iterable,
}
