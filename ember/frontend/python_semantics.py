"""Python's meaning over tracked values: constants, dict keys, truth, iteration, identity, membership, mutation
of containers, and evaluation of pure functions at capture time."""
from __future__ import annotations

import enum
import inspect
import operator
import types

import torch

from ember.errors import Unsupported
from ember.frontend.policy import CONST_TYPES
from ember.frontend.capture import sym_value
from ember.frontend.python_objects import DICT_VIEWS, holds_tensor, is_key
from ember.frontend.symbolic import SYM_TYPES, SYMBOLIC_FUNCS, has_sym, numeric, specialize
from ember.frontend.values import (
    BoundV, CellV, ClosureV, ConstV, DictV, GradModeCtxV, IterV, ListV, NewObjV, ObjV, SetV, SuperV, TensorV, TupleV,
    V,
)


class PythonSemantics:
    """Frame methods that give tracked values Python's meaning."""

    def const_v(self, value) -> V:
        if isinstance(value, tuple):
            return TupleV([self.const_v(x) for x in value])
        if isinstance(value, frozenset):
            return ConstV(value)
        return ConstV(value)

    def const_value(self, v: V, symbolic: bool = False):
        """The Python value of a constant. A symbolic size (a SymInt) in it is specialized (an equality guard)
        unless `symbolic`: the caller then computes with it as SymInt arithmetic (Python ints are needed by
        everything else: formatting, list lengths and indices, dict keys)."""
        if isinstance(v, ConstV):
            x = v.value
            return x if symbolic or not has_sym(x) else specialize(x)
        if isinstance(v, TupleV) and all(isinstance(x, ConstV) for x in v.items):
            return tuple(self.const_value(x, symbolic) for x in v.items)
        if isinstance(v, ListV) and all(isinstance(x, ConstV) for x in v.items):
            return [self.const_value(x, symbolic) for x in v.items]
        if isinstance(v, TensorV):
            raise Unsupported("a tensor's value is needed by Python (formatting or conversion)", self.where())
        raise Unsupported(f"a {type(v).__name__} used where ember needs a constant", self.where())

    def key(self, v: V):
        if isinstance(v, ConstV) and is_key(v.value):
            return v.value
        if isinstance(v, ConstV) and has_sym(v.value):
            return specialize(v.value)
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
            if not v.view:
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
        if isinstance(v, ObjV) and type(v.value) in DICT_VIEWS and (v.source is not None or not holds_tensor(
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
            # one fake per tensor: an op that returns its input itself (`x.to(x.dtype)`, `x.contiguous()` of a
            # contiguous x) returns its fake itself on the fake run, as eager returns the same tensor
            return a.fake is b.fake
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
        if isinstance(container, IterV):
            # an iterator is consumed up to the item found (all of it when none is); a dict view is not consumed
            for i, x in enumerate(container.remaining()):
                if self.contains(TupleV([x]), item):
                    if not container.view:
                        container.pos += i + 1
                    return True
            if not container.view:
                container.pos = len(container.items)
            return False
        if isinstance(container, ObjV) and isinstance(container.value, torch.nn.ModuleDict):
            return self.const_value(item) in container.value._modules
        if isinstance(container, (ObjV, NewObjV)):
            m = self.getattr(container, "__contains__")
            if isinstance(m, BoundV):
                return self.truth(self.call(m, [item], {}))
        raise Unsupported(f"`in` on {self.type_name(container)}", self.where())

    def concrete(self, fn, args: list[V], kwargs: dict) -> V:
        """Evaluate a pure function on constants at capture time (on symbolic sizes: SymInt arithmetic, for
        the functions SYMBOLIC_FUNCS lists on numbers; any other use specializes them)."""
        symbolic = fn in SYMBOLIC_FUNCS and not kwargs
        vals = [self.const_value(a, symbolic) for a in args]
        if symbolic and not all(numeric(x) for x in vals):
            vals = [specialize(x) for x in vals]
        kw = {k: self.const_value(v) for k, v in kwargs.items()}
        try:
            r = fn(*vals, **kw)
        except Exception as e:
            raise Unsupported(f"{getattr(fn, '__name__', fn)} raised {type(e).__name__} at capture time", self.where())
        if isinstance(r, SYM_TYPES):   # an int computed from symbolic sizes stays symbolic (ember.frontend.symbolic)
            return ConstV(sym_value(r))
        if type(r).__module__ == "numpy" and getattr(r, "ndim", None) == 0:
            return ConstV(r)   # a numpy scalar: a constant with numpy's own arithmetic
        return self.const_v(r) if isinstance(r, (tuple, *CONST_TYPES)) else self.from_python(r)

    def from_python(self, r) -> V:
        if isinstance(r, tuple):
            return TupleV([self.from_python(x) for x in r])
        if isinstance(r, list):
            return ListV([self.from_python(x) for x in r])
        if isinstance(r, CONST_TYPES):
            return ConstV(r)
        if isinstance(r, SYM_TYPES):
            return ConstV(sym_value(r))
        if isinstance(r, dict) and all(is_key(k) for k in r):
            return DictV({k: self.from_python(x) for k, x in r.items()})
        if isinstance(r, (set, frozenset)):
            return SetV([ConstV(x) for x in r])
        if isinstance(r, torch.Tensor):
            return self.cap.tensor_constant(r)
        return ObjV(r)

    def key_v(self, k) -> V:
        return ObjV(k) if isinstance(k, (type, enum.Enum)) else self.const_v(k)

    def sorted_items(self, items: list[V], key: V | None, reverse: bool) -> list[V]:
        keys = [self.const_value(self.call(key, [x], {})) if key is not None else self.const_value(x) for x in items]
        order = sorted(range(len(items)), key=lambda i: keys[i], reverse=reverse)
        return [items[i] for i in order]
