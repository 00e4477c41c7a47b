"""Python builtins (and a few functions of functools, itertools, copy, inspect, dataclasses) over tracked
values: BUILTIN_HANDLERS maps each function to its handler(frame, args, kwargs)."""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import itertools
import operator
import types
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ember.errors import Unsupported
from ember.frontend.python_objects import MISSING, holds_tensor, lookup_static
from ember.frontend.signals import PyError
from ember.frontend.symbolic import specialize
from ember.frontend.values import (
    BoundV, ClosureV, ConstV, DictV, IterV, ListV, NewObjV, ObjV, PyFloatV, SetV, SuperV, TensorV, TupleV, V,
)

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


def _isinstance(fr: Frame, args, kwargs):
    obj, cls_v = args
    classes = classes_of(cls_v)
    t = _static_type(fr, obj)
    if isinstance(obj, TensorV) and t is torch.Tensor:
        # the fake answers for what the real tensor is (an nn.Parameter's fake is one), except its own class: the
        # program's tensor is no FakeTensor (transformers' `is_tracing` asks)
        return ConstV(any(isinstance(obj.fake, c) and not issubclass(c, FakeTensor) for c in _flat(classes)))
    if isinstance(obj, ObjV):
        return ConstV(isinstance(obj.value, classes))
    return ConstV(issubclass(t, classes))


def _flat(classes: type | tuple) -> list[type]:
    return [c for x in classes for c in _flat(x)] if isinstance(classes, tuple) else [classes]


def classes_of(v: V) -> type | tuple:
    if isinstance(v, TupleV):
        return tuple(classes_of(x) for x in v.items)
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
        return v.python_type()
    if isinstance(v, (ClosureV,)):
        return types.FunctionType
    if isinstance(v, BoundV):
        return types.MethodType if not isinstance(v.func, str) else types.BuiltinMethodType
    try:
        return v.python_type()
    except NotImplementedError:   # (a context manager's exit, a cell...): Python answers at a break
        raise Unsupported(f"type() of a {type(v).__name__}", fr.where()) from None


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
        values = [fr.const_value(x, symbolic=True) for x in items]
        if any(isinstance(x, torch.SymInt) for x in values) and all(isinstance(x, (int, torch.SymInt)) for x in values):
            # max(n, 4) of a symbolic size stays symbolic (torch.sym_max), not a guard on which is larger
            return ConstV(functools.reduce(torch.sym_max if pick is max else torch.sym_min, values))
        return ConstV(pick(specialize(values)))
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
        return name in v.attrs or lookup_static(v.cls, name) is not MISSING
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


def builtin_next(fr: Frame, args: list[V], kwargs: dict) -> V:
    it = args[0]
    if isinstance(it, IterV) and it.view:   # a dict view is not an iterator: Python raises TypeError
        raise Unsupported("next() of a dict view", fr.where())
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
        if typ is int and len(args) == 1 and not kwargs and isinstance(args[0], ConstV) and \
                isinstance(args[0].value, torch.SymInt):
            return args[0]   # int() of a symbolic size is itself (no value needed yet, as torch.compile)
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
        return ConstV(lookup_static(v.cls, "__call__") is not MISSING)
    return ConstV(False)


def _issubclass(fr, args, kwargs):
    a, b = args
    return ConstV(issubclass(a.value, classes_of(b)))


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
                and not holds_tensor(v.value):
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
    if isinstance(v, ObjV) and not v.writes and not holds_tensor(v.value) and \
            not isinstance(v.value, (torch.nn.Module, types.ModuleType, type, types.FunctionType)):
        return ObjV(copy.deepcopy(v.value))
    if isinstance(v, ObjV) and isinstance(v.value, (type, types.FunctionType, types.ModuleType)):
        return v
    raise Unsupported(f"copy.deepcopy of {fr.type_name(v)}", fr.where())


def _print(fr, args, kwargs):
    raise Unsupported("print() writes output: it runs in Python", fr.where())


BUILTIN_HANDLERS = {
    isinstance: _isinstance, type: _type, len: _len, range: _range, enumerate: _enumerate, zip: _zip,
    reversed: _reversed, list: _list, tuple: _tuple, dict: _dict, set: _set, frozenset: _set, sorted: _sorted,
    min: _minmax(min), max: _minmax(max), sum: _sum, any: _any_all(any), all: _any_all(all),
    getattr: _getattr_builtin, hasattr: _hasattr, setattr: _setattr_builtin, iter: _iter, next: builtin_next,
    int: _scalar_conv(int), float: _scalar_conv(float), bool: _scalar_conv(bool), complex: _scalar_conv(complex),
    str: _str, super: _super, callable: _callable_builtin, issubclass: _issubclass, abs: _abs, pow: _pow_builtin,
    round: _round, id: _id, map: _map, filter: _filter, object.__new__: _object_new,
    object.__setattr__: _object_setattr, dataclasses.fields: _dataclass_fields, print: _print,
    collections.OrderedDict: _ordered_dict, copy.deepcopy: _copy(True), copy.copy: _copy(False), functools.reduce: _reduce, inspect.signature: _signature,
    itertools.chain: _chain, itertools.chain.from_iterable: _chain_from_iterable,
}
