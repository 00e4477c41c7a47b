"""Questions ember asks of real Python classes and objects without running their code: static attribute lookup,
descriptors, named tuples and struct sequences, which values can be dict keys, whether an object holds a tensor.
"""
from __future__ import annotations

import collections
import enum
import types
from typing import Any

import torch

# code object flags (co_flags)
CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR = 0x20, 0x80, 0x200
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08
# the types of dict views (d.keys(), d.values(), d.items())
DICT_VIEWS = {type({}.keys()), type({}.values()), type({}.items()), type(collections.OrderedDict().keys()),
              type(collections.OrderedDict().values()), type(collections.OrderedDict().items())}


def is_namedtuple_cls(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields") and cls is not tuple


def is_structseq_cls(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "n_fields")


def structseq_fields(cls: type) -> list[str]:
    if hasattr(cls, "_fields"):
        return list(cls._fields)
    return [k for k, v in vars(cls).items() if isinstance(v, types.MemberDescriptorType)][: cls.n_sequence_fields]


def is_key(k: Any) -> bool:
    return isinstance(k, (int, str, bool, float, type(None), bytes, enum.Enum, tuple, torch.dtype, type)) and (
        not isinstance(k, tuple) or all(is_key(x) for x in k))


MISSING = object()  # what lookup_static finds where no class of the MRO defines the name


def lookup_static(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return MISSING


def is_data_descriptor(x: Any) -> bool:
    t = type(x)
    return x is not MISSING and not isinstance(x, (types.FunctionType, property)) and (
        hasattr(t, "__set__") or hasattr(t, "__delete__")) and hasattr(t, "__get__")


def hashable(f: Any) -> bool:
    try:
        hash(f)
        return True
    except TypeError:
        return False


def holds_tensor(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 3:
        return False
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return any(holds_tensor(x, depth + 1) for x in items)
