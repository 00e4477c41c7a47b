"""Unary and binary operators over tracked values: recorded on tensors, evaluated on constants, Python's rules
for containers, user-defined dunder methods."""
from __future__ import annotations

import enum
import operator
import types

import torch

from ember.errors import Unsupported
from ember.frontend.values import (
    BoundV, ConstV, DictV, ListV, NewObjV, NullV, ObjV, PyFloatV, SetV, TensorV, TupleV, V,
)

INPLACE_TO_BINARY = {operator.iadd: operator.add, operator.iand: operator.and_, operator.ifloordiv: operator.floordiv,
                     operator.ilshift: operator.lshift, operator.imatmul: operator.matmul, operator.imul: operator.mul,
                     operator.imod: operator.mod, operator.ior: operator.or_, operator.ipow: operator.pow,
                     operator.irshift: operator.rshift, operator.isub: operator.sub,
                     operator.itruediv: operator.truediv, operator.ixor: operator.xor}
_DUNDERS = {operator.add: ("__add__", "__radd__"), operator.sub: ("__sub__", "__rsub__"),
            operator.mul: ("__mul__", "__rmul__"), operator.truediv: ("__truediv__", "__rtruediv__"),
            operator.matmul: ("__matmul__", "__rmatmul__"), operator.eq: ("__eq__",), operator.ne: ("__ne__",),
            operator.lt: ("__lt__",), operator.le: ("__le__",), operator.gt: ("__gt__",), operator.ge: ("__ge__",),
            operator.iadd: ("__iadd__",), operator.getitem: ("__getitem__",)}


def _eq_is_identity(v: V) -> bool:
    value = v.value
    if isinstance(v, ConstV):
        return True
    return isinstance(value, (type, types.FunctionType, types.ModuleType, torch.nn.Module, enum.Enum,
                              types.BuiltinFunctionType)) or type(value).__eq__ is object.__eq__


class Operators:
    """Frame methods for Python's operators."""

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
        # user-defined operators: a.__op__(b), then b.__rop__(a), as Python tries them
        names = _DUNDERS.get(fn)
        if names and not isinstance(getattr(a, "value", None), type):
            r = self.user_dunder(a, names[0], b)
            if r is not None:
                return r
        if names and len(names) > 1:
            r = self.user_dunder(b, names[1], a)
            if r is not None:
                return r
        if fn in (operator.eq, operator.ne):
            return ConstV((self.is_same(a, b)) == (fn is operator.eq))
        raise Unsupported(f"operator {fn.__name__} on {self.type_name(a)} and {self.type_name(b)}", self.where())

    def user_dunder(self, obj: V, name: str, other: V) -> V | None:
        """obj.name(other) where obj is a user object whose class defines `name` in Python; None where it does not,
        or where the method returns NotImplemented (Python then tries the reflected one)."""
        if not isinstance(obj, (NewObjV, ObjV)):
            return None
        try:
            m = self.getattr(obj, name)
        except Unsupported:
            return None
        if isinstance(m, BoundV) and isinstance(m.func, types.FunctionType):
            r = self.call(m, [other], {})
            if not (isinstance(r, ConstV) and r.value is NotImplemented):
                return r
        return None
