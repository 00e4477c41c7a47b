"""Python floats computed in the graph (PyFloatV: an optimizer's step count as `_get_value(step)`), recorded as
float64 0-d tensor ops only where those compute what eager computes with the floats."""
from __future__ import annotations

import operator
import sys

import torch

from ember.errors import Unsupported
from ember.frontend.operators import INPLACE_TO_BINARY
from ember.frontend.values import ConstV, ListV, PyFloatV, TensorV, TupleV, V


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


def has_py_float(args: list[V], kwargs: dict) -> bool:
    items = [*args, *kwargs.values()]
    return any(isinstance(x, PyFloatV) or isinstance(x, (ListV, TupleV)) and has_py_float(x.items, {}) for x in items)


def all_py_floats(v: V) -> bool:
    return isinstance(v, (ListV, TupleV)) and bool(v.items) and all(isinstance(x, PyFloatV) for x in v.items)


class PyFloats:
    """Frame methods for Python floats computed in the graph."""

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
                and len(args) == 2 and all_py_floats(args[1]) and set(kwargs) <= {"alpha"} and \
                not has_py_float([], kwargs):
            for t in self.iterate(args[0]):
                self.check_scalar_partner(t)
            # the scalar-list overload runs `x[i] op= s[i]` per tensor; the tensor-list one `x[i] op= s_t[i]`
            return self.cap.record(kind, target, (args[0], ListV([to_t(x) for x in self.iterate(args[1])])),
                                   kwargs, where_)
        if kind == "call_function" and name in ("_foreach_addcdiv", "_foreach_addcdiv_") and len(args) == 4 and \
                not kwargs and all_py_floats(args[3]) and not has_py_float(args[:3], {}):
            for t in self.iterate(args[1]):
                self.check_scalar_partner(t)
            scalars = ListV([to_t(x) for x in self.iterate(args[3])])
            q = self.cap.record(kind, torch._foreach_div,
                                (self.cap.record(kind, torch._foreach_mul, (args[1], scalars), {}, where_), args[2]),
                                {}, where_)
            return self.cap.record(kind, torch._foreach_add_ if name.endswith("_") else torch._foreach_add,
                                   (args[0], q), {}, where_)
        raise Unsupported(f"{name} of a Python float computed in the graph (needs its value)", where_)
