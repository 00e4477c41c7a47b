"""Method calls on tracked values ember models itself: Tensor methods (recorded), list, dict, set and tuple
methods, grad-mode contexts, named tuples' _make, iterators' __next__."""
from __future__ import annotations

import operator

from ember.errors import Unsupported
from ember.frontend.builtin_functions import builtin_next
from ember.frontend.policy import TENSOR_METHODS_UNSUPPORTED
from ember.frontend.py_float import has_py_float
from ember.frontend.signals import PyError
from ember.frontend.values import (
    ConstV, DictV, GradModeCtxV, IterV, ListV, ObjV, SetV, TensorV, TupleV, V,
)

CONTAINER_METHODS = {
    ListV: {"append", "extend", "insert", "pop", "clear", "reverse", "copy", "index", "count", "remove", "sort"},
    DictV: {"items", "keys", "values", "get", "pop", "setdefault", "update", "clear", "copy", "__contains__",
            "__getitem__", "move_to_end"},
    SetV: {"add", "update", "discard", "remove", "union", "intersection", "difference", "issubset", "issuperset",
           "copy"},
}


class Methods:
    """The Frame method for calls of methods of tracked values."""

    def call_method(self, self_v: V, name: str, args: list[V], kwargs: dict) -> V:
        if isinstance(self_v, TensorV):
            if name == "backward" and self.cap.backward_in_graph:
                return self.tensor_backward(self_v, args, kwargs)
            if name in TENSOR_METHODS_UNSUPPORTED:
                raise Unsupported(f"Tensor.{name}() needs the tensor's value in Python", self.where())
            if has_py_float(args, kwargs):
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
            return builtin_next(self, [self_v], {})
        raise Unsupported(f"method {name} of {self.type_name(self_v)}", self.where())
