"""Method calls on tracked values ember models itself: Tensor methods (recorded), list, dict, set and tuple
methods, grad-mode contexts, named tuples' _make, iterators' __next__."""
from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.builtin_functions import builtin_next
from ember.frontend.policy import TENSOR_METHODS_UNSUPPORTED
from ember.frontend.py_float import has_py_float
from ember.frontend.signals import PyError
from ember.frontend.values import (
    ConstV, DictV, GradModeCtxV, IterV, ListV, ObjV, SetV, TensorV, TupleV, V,
)

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame

CONTAINER_METHODS = {
    ListV: {"append", "extend", "insert", "pop", "clear", "reverse", "copy", "index", "count", "remove", "sort"},
    DictV: {"items", "keys", "values", "get", "pop", "setdefault", "update", "clear", "copy", "__contains__",
            "__getitem__", "move_to_end"},
    SetV: {"add", "update", "discard", "remove", "union", "intersection", "difference", "issubset", "issuperset",
           "copy"},
}


def no_such_method(frame: Frame, self_v: V, name: str) -> Unsupported:
    return Unsupported(f"method {name} of {frame.type_name(self_v)}", frame.where())


def tensor_method(frame: Frame, self_v: TensorV, name: str, args: list[V], kwargs: dict) -> V:
    """Tensor methods: recorded into the graph (in-place ones return the tensor itself)."""
    if name == "backward" and frame.cap.backward_in_graph:
        return frame.tensor_backward(self_v, args, kwargs)
    if name in TENSOR_METHODS_UNSUPPORTED:
        raise Unsupported(f"Tensor.{name}() needs the tensor's value in Python", frame.where())
    if has_py_float(args, kwargs):
        return frame.record_py_float_call("call_method", name, name, [self_v, *args], kwargs)
    out = frame.cap.record("call_method", name, (self_v, *args), kwargs, frame.where())
    if name.endswith("_") and not name.endswith("__") and isinstance(out, TensorV):
        return self_v  # in-place methods return self
    return out


def list_method(frame: Frame, self_v: ListV, name: str, args: list[V], kwargs: dict) -> V:
    items = self_v.items
    if name == "append":
        frame.list_mutate(self_v).items.append(args[0])
    elif name == "extend":
        frame.list_mutate(self_v).items.extend(frame.iterate(args[0]))
    elif name == "insert":
        frame.list_mutate(self_v).items.insert(frame.const_value(args[0]), args[1])
    elif name == "pop":
        i = frame.const_value(args[0]) if args else -1
        if not items:
            raise Unsupported("pop from empty list", frame.where())
        return frame.list_mutate(self_v).items.pop(i)
    elif name == "clear":
        frame.list_mutate(self_v).items.clear()
    elif name == "reverse":
        frame.list_mutate(self_v).items.reverse()
    elif name == "copy":
        return ListV(list(items))
    elif name in ("index", "count"):
        target = args[0]
        matches = [frame.truth(frame.binary(operator.eq, x, target, False)) for x in items]
        if name == "count":
            return ConstV(sum(matches))
        if True not in matches:
            raise PyError(ValueError("list.index(x): x not in list"), frame.where())
        return ConstV(matches.index(True))
    elif name == "remove":
        matches = [frame.truth(frame.binary(operator.eq, x, args[0], False)) for x in items]
        if True not in matches:
            raise PyError(ValueError("list.remove(x): x not in list"), frame.where())
        del frame.list_mutate(self_v).items[matches.index(True)]
    elif name == "sort":
        key = kwargs.get("key")
        reverse = frame.const_value(kwargs["reverse"]) if "reverse" in kwargs else False
        self_v.items[:] = frame.sorted_items(items, key, reverse)
        self_v.mutated = True
    else:
        raise Unsupported(f"list.{name}", frame.where())
    return ConstV(None)


def dict_method(frame: Frame, self_v: DictV, name: str, args: list[V], kwargs: dict) -> V:
    d = self_v.items
    if name == "items":
        return IterV([TupleV([frame.key_v(k), v]) for k, v in d.items()], view=True)
    if name == "keys":
        return IterV([frame.key_v(k) for k in d], view=True)
    if name == "values":
        return IterV(list(d.values()), view=True)
    if name == "get":
        k = frame.key(args[0])
        return d.get(k, args[1] if len(args) > 1 else ConstV(None))
    if name == "pop":
        k = frame.key(args[0])
        if k in d:
            return frame.dict_mutate(self_v).items.pop(k)
        if len(args) > 1:
            return args[1]
        raise PyError(KeyError(k), frame.where())
    if name == "setdefault":
        k = frame.key(args[0])
        if k not in d:
            frame.dict_mutate(self_v).items[k] = args[1] if len(args) > 1 else ConstV(None)
        return d[k]
    if name == "update":
        other = frame.as_dict(args[0]) if args else {}
        frame.dict_mutate(self_v).items.update({**other, **kwargs})
        return ConstV(None)
    if name == "clear":
        frame.dict_mutate(self_v).items.clear()
        return ConstV(None)
    if name == "copy":
        return DictV(dict(d), cls=self_v.cls)
    if name == "__contains__":
        return ConstV(frame.key(args[0]) in d)
    if name == "__getitem__":
        return frame.getitem(self_v, args[0])
    if name == "to_tuple":
        return TupleV(list(d.values()))
    if name == "move_to_end":
        k = frame.key(args[0])
        last = frame.const_value(args[1] if len(args) > 1 else kwargs.get("last", ConstV(True)))
        v = frame.dict_mutate(self_v).items.pop(k)
        d2 = {k: v, **d} if not last else {**d, k: v}
        d.clear()
        d.update(d2)
        return ConstV(None)
    raise Unsupported(f"dict.{name}", frame.where())


def set_method(frame: Frame, self_v: SetV, name: str, args: list[V], kwargs: dict) -> V:
    if name == "add":
        frame.set_add(self_v, args[0])
        return ConstV(None)
    if name in ("update",):
        for a in args:
            for x in frame.iterate(a):
                frame.set_add(self_v, x)
        return ConstV(None)
    if name in ("discard", "remove"):
        k = frame.key(args[0])
        before = len(self_v.items)
        self_v.items[:] = [x for x in self_v.items if frame.key(x) != k]
        self_v.mutated = True
        if name == "remove" and len(self_v.items) == before:
            raise Unsupported("KeyError in set.remove", frame.where())
        return ConstV(None)
    if name in ("union", "intersection", "difference", "issubset", "issuperset", "copy"):
        mine = {frame.key(x) for x in self_v.items}
        others = [{frame.key(x) for x in frame.iterate(a)} for a in args]
        r = getattr(mine, name)(*others)
        return SetV([ConstV(x) for x in r]) if isinstance(r, set) else ConstV(r)
    raise Unsupported(f"set.{name}", frame.where())


def tuple_method(frame: Frame, self_v: TupleV, name: str, args: list[V], kwargs: dict) -> V:
    """count and index; a named tuple's _asdict and _replace; a torch.Size's numel."""
    if name == "_asdict":
        return DictV(dict(zip(self_v.cls._fields, self_v.items)))
    if name == "_replace":
        fields = list(self_v.cls._fields)
        items = list(self_v.items)
        for k, v in kwargs.items():
            items[fields.index(k)] = v
        return TupleV(items, None, self_v.cls)
    if name == "numel":   # a torch.Size's product (symbolic sizes stay symbolic)
        return functools.reduce(lambda a, b: frame.binary(operator.mul, a, b, False), self_v.items, ConstV(1))
    target = args[0]
    matches = [frame.truth(frame.binary(operator.eq, x, target, False)) for x in self_v.items]
    return ConstV(sum(matches) if name == "count" else matches.index(True))


def grad_mode_method(frame: Frame, self_v: GradModeCtxV, name: str, args: list[V], kwargs: dict) -> V:
    """__enter__ and __exit__ of no_grad(), enable_grad(), set_grad_enabled(b)."""
    if name == "__enter__":
        frame.set_grad(self_v.enabled)
        return ConstV(None)
    frame.set_grad(not self_v.enabled)
    return ConstV(None)


def class_method(frame: Frame, self_v: ObjV, name: str, args: list[V], kwargs: dict) -> V:
    """A named tuple class's _make (an attribute read binds it by name, see Attributes.getattr)."""
    if name == "_make":
        return TupleV(frame.iterate(args[0]), None, self_v.value)
    raise no_such_method(frame, self_v, name)


def iterator_method(frame: Frame, self_v: IterV, name: str, args: list[V], kwargs: dict) -> V:
    if name == "__next__":
        return builtin_next(frame, [self_v], {})
    raise no_such_method(frame, self_v, name)


# The method handler of each kind of value, by its exact class: the kinds in ember.frontend.values are leaf
# classes (tests/frontend/test_values.py checks that none is subclassed), so no order among them matters.
METHODS_BY_KIND = {
    TensorV: tensor_method, ListV: list_method, DictV: dict_method, SetV: set_method, TupleV: tuple_method,
    GradModeCtxV: grad_mode_method, ObjV: class_method, IterV: iterator_method,
}


class Methods:
    """The Frame method for calls of methods of tracked values."""

    def call_method(self, self_v: V, name: str, args: list[V], kwargs: dict) -> V:
        handler = METHODS_BY_KIND.get(type(self_v))
        if handler is None:
            raise no_such_method(self, self_v, name)
        return handler(self, self_v, name, args, kwargs)
