"""Attribute reads and writes on tracked values: tensors, modules, classes, instances (descriptors, properties,
__getattr__), named tuples, containers' methods."""
from __future__ import annotations

import dataclasses
import functools
import keyword
import types
from typing import TYPE_CHECKING

import torch

from ember.errors import Unsupported
from ember.frontend.capture import Capture
from ember.frontend.methods import CONTAINER_METHODS
from ember.frontend.policy import CONST_TYPES, TENSOR_METHODS_UNSUPPORTED, TRUSTED_MODULE_PREFIXES
from ember.frontend.python_objects import (
    MISSING, is_data_descriptor, is_namedtuple_cls, is_structseq_cls, lookup_static, structseq_fields,
)
from ember.frontend.signals import PyError
from ember.frontend.values import (
    BoundV, ClosureV, ConstV, DictV, GradModeCtxV, IterV, ListV, NewObjV, ObjV, SetV, SuperV, TensorV, TupleV, V,
)

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


def attr_source(parent: str | None, name: str) -> str | None:
    """`parent.name`, or `getattr(parent, 'name')` where the name is no identifier. A dunder or private name is
    plain too: the entry is a module-level function, where no name mangling happens, and share_paths walks a
    plain attribute once per call, where a getattr call would run on every read (docs/evidence.md)."""
    if parent is None:
        return None
    plain = name.isidentifier() and not keyword.iskeyword(name)
    return f"{parent}.{name}" if plain else f"getattr({parent}, {name!r})"


def _real_attr(cap: Capture, t: TensorV, name: str):
    for inp in cap.inputs:
        if inp.node is t.node:
            return getattr(inp.real, name)
    raise Unsupported(f"tensor attribute {name}")


def unsupported_attribute(frame: Frame, obj: V, name: str) -> Unsupported:
    return Unsupported(f"attribute {name!r} of {frame.type_name(obj)}", frame.where())


def super_attribute(frame: Frame, obj: SuperV, name: str) -> V:
    """super().name: looked up along the MRO after the class super() names."""
    cls = obj.cls
    mro = type(frame.python_object_type(obj.obj)).__mro__ if not isinstance(obj.obj, NewObjV) else obj.obj.cls.__mro__
    for klass in mro[mro.index(cls) + 1:]:
        if name in vars(klass):
            return frame.bind_descriptor(obj.obj, vars(klass)[name], name, None, klass)
    raise Unsupported(f"super().{name} not found", frame.where())


def new_object_attribute(frame: Frame, obj: NewObjV, name: str) -> V:
    """An instance made during capture: its own attributes, then its class's."""
    if name in obj.attrs:
        return obj.attrs[name]
    if name == "__class__":
        return ObjV(obj.cls)
    static = lookup_static(obj.cls, name)
    if static is MISSING:
        raise frame.no_attribute(obj, name, f"{obj.cls.__name__} object has no attribute {name!r}")
    return frame.bind_descriptor(obj, static, name, None, obj.cls)


def object_attribute(frame: Frame, obj: ObjV, name: str) -> V:
    """A real object: module, nn.Module, class, function or instance (descriptors, properties, __getattr__)."""
    cap = frame.cap
    value = obj.value
    if name in obj.writes:
        return obj.writes[name]
    if name in obj.deleted:
        raise Unsupported(f"attribute {name!r} was deleted", frame.where())
    if isinstance(value, torch.nn.Module):
        d = value.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if name in d[table]:
                src = f"{obj.source}.{table}[{name!r}]" if obj.source else None
                return cap.wrap(d[table][name], src)
        if name == "training":
            return cap.wrap(value.training, f"{obj.source}.training" if obj.source else None)
    if isinstance(value, types.ModuleType):
        return _read_through(frame, obj, name, value.__name__, f"module {value.__name__} has no attribute {name!r}")
    if isinstance(value, type):
        if is_namedtuple_cls(value) and name == "_make":
            return BoundV(obj, "_make")
        static = lookup_static(value, name)
        if isinstance(static, (classmethod,)):
            return BoundV(obj, static.__func__)
        if isinstance(static, staticmethod):
            return ObjV(static.__func__)
        if isinstance(static, types.FunctionType):
            return ObjV(static)
        return _read_through(frame, obj, name, value.__module__,
                             f"type object {value.__name__!r} has no attribute {name!r}")
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
            raise frame.no_attribute(obj, name, f"function has no attribute {name!r}")
    # instances
    if type(value).__getattribute__ is not object.__getattribute__ and not isinstance(value, torch.nn.Module):
        try:  # a class that computes attributes (transformers' configs): read it, guard what was read
            attr = getattr(value, name)
        except AttributeError as e:
            raise frame.no_attribute(obj, name, str(e))
        if not callable(attr) or isinstance(attr, type):
            return cap.wrap(attr, attr_source(obj.source, name))
    inst_dict = getattr(value, "__dict__", None)
    static = lookup_static(type(value), name)
    if isinstance(static, (property, types.FunctionType, staticmethod, classmethod)) or \
            is_data_descriptor(static):
        return frame.bind_descriptor(obj, static, name, value, type(value))
    if inst_dict is not None and name in inst_dict:
        return cap.wrap(inst_dict[name], attr_source(obj.source, name))
    if static is not MISSING:
        return frame.bind_descriptor(obj, static, name, value, type(value))
    getattr_fn = lookup_static(type(value), "__getattr__")
    if isinstance(value, torch.nn.Module) or getattr_fn is MISSING:
        raise frame.no_attribute(obj, name, f"{type(value).__name__!r} object has no attribute {name!r}")
    if isinstance(getattr_fn, types.FunctionType):
        return frame.call(BoundV(obj, getattr_fn), [ConstV(name)], {})
    raise Unsupported(f"attribute {name!r} of {type(value).__name__}", frame.where())


def tuple_attribute(frame: Frame, obj: TupleV, name: str) -> V:
    """A named tuple's or struct sequence's fields and methods; count and index; a torch.Size's numel."""
    if obj.cls is not tuple and (is_namedtuple_cls(obj.cls) or is_structseq_cls(obj.cls)):
        fields = structseq_fields(obj.cls) if not is_namedtuple_cls(obj.cls) else list(obj.cls._fields)
        if name in fields:
            return obj.items[fields.index(name)]
    if name in ("count", "index") or name == "numel" and obj.cls is torch.Size:
        return BoundV(obj, name)
    if is_namedtuple_cls(obj.cls) and name in ("_asdict", "_replace"):
        return BoundV(obj, name)
    if is_namedtuple_cls(obj.cls) and name == "_fields":
        return frame.const_v(obj.cls._fields)
    if is_namedtuple_cls(obj.cls):
        static = lookup_static(obj.cls, name)
        if isinstance(static, (types.FunctionType, property)):
            return frame.bind_descriptor(obj, static, name, None, obj.cls)
    raise unsupported_attribute(frame, obj, name)


def dict_attribute(frame: Frame, obj: DictV, name: str) -> V:
    """A dict's methods; the fields of a dataclass that is a dict (transformers' ModelOutput)."""
    if obj.cls is not dict and dataclasses.is_dataclass(obj.cls):
        if name in {f.name for f in dataclasses.fields(obj.cls)}:
            return obj.items.get(name, ConstV(None))
        if name == "to_tuple":
            return BoundV(obj, name)
    if name in CONTAINER_METHODS[type(obj)]:
        return BoundV(obj, name)
    raise unsupported_attribute(frame, obj, name)


def container_attribute(frame: Frame, obj: ListV | SetV, name: str) -> V:
    """A list's or set's methods, called by name (ember.frontend.methods)."""
    if name in CONTAINER_METHODS[type(obj)]:
        return BoundV(obj, name)
    raise unsupported_attribute(frame, obj, name)


def constant_attribute(frame: Frame, obj: ConstV, name: str) -> V:
    try:
        attr = getattr(obj.value, name)
    except AttributeError:
        raise frame.no_attribute(obj, name, f"{type(obj.value).__name__!r} object has no attribute {name!r}")
    if isinstance(attr, CONST_TYPES) and not callable(attr):
        return ConstV(attr)
    if isinstance(attr, types.BuiltinMethodType) or callable(attr):
        return ObjV(attr)
    return frame.from_python(attr)


def grad_mode_attribute(frame: Frame, obj: GradModeCtxV, name: str) -> V:
    if name in ("__enter__", "__exit__"):
        return BoundV(obj, name)
    raise unsupported_attribute(frame, obj, name)


def closure_attribute(frame: Frame, obj: ClosureV, name: str) -> V:
    if name in ("__name__", "__qualname__"):
        return ConstV(obj.name)
    raise unsupported_attribute(frame, obj, name)


def iterator_attribute(frame: Frame, obj: IterV, name: str) -> V:
    if name == "__next__":
        return BoundV(obj, name)
    raise unsupported_attribute(frame, obj, name)


class Attributes:
    """Frame methods for attribute reads and writes."""

    def getattr(self, obj: V, name: str) -> V:
        reader = ATTRIBUTE_READERS.get(type(obj))
        if reader is None:
            raise unsupported_attribute(self, obj, name)
        return reader(self, obj, name)

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

    def buffer_assignment(self, obj: ObjV, name: str, value: V) -> bool:
        """Whether `module.name = value` re-registers a buffer as eager's Module.__setattr__ does (name a buffer,
        value a plain tensor or None, register_buffer torch's own): the entry then makes the same setattr after the
        graph. torch's global buffer-registration hooks would run there, late: guarded to be none."""
        module = obj.value
        hooks = getattr(torch.nn.modules.module, "_global_buffer_registration_hooks", None)
        if name not in module.__dict__["_buffers"] or hooks is None or hooks or \
                type(module).register_buffer is not torch.nn.Module.register_buffer:
            return False
        if not (isinstance(value, TensorV) and not isinstance(value.fake, torch.nn.Parameter) or self.is_none(value)):
            return False
        self.cap.guards.add(f"not {self.cap.consts.ref(hooks)}", 1)
        return True

    def setattr(self, obj: V, name: str, value: V):
        if isinstance(obj, NewObjV):
            static = lookup_static(obj.cls, name)
            if isinstance(static, property) and static.fset is not None:
                self.call(ObjV(static.fset), [obj, value], {})
                return
            obj.attrs[name] = value
            return
        if isinstance(obj, ObjV) and obj.source is not None and not isinstance(obj.value, type):
            value_obj = obj.value
            static = lookup_static(type(value_obj), name)
            if isinstance(static, property):
                if static.fset is None:
                    raise Unsupported(f"can't set attribute {name!r}", self.where())
                self.call(ObjV(static.fset), [obj, value], {})
                return
            if is_data_descriptor(static) or lookup_static(type(value_obj), "__setattr__") not in (
                    MISSING, object.__setattr__, torch.nn.Module.__setattr__):
                raise Unsupported(f"setting attribute {name!r} of {type(value_obj).__name__}", self.where())
            if isinstance(value_obj, torch.nn.Module) and self.buffer_assignment(obj, name, value):
                value = self.getattr(obj, name) if isinstance(value, TensorV) and \
                    self.is_same(value, self.getattr(obj, name)) else value   # (the buffer itself: set again)
            elif isinstance(value_obj, torch.nn.Module):
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
        if isinstance(obj, DictV) and obj.source is None and dataclasses.is_dataclass(obj.cls) and \
                name in obj.items and not self.is_none(value) and \
                lookup_static(obj.cls, "__setattr__") not in (object.__setattr__, dict.__setattr__):
            # a field of a dict dataclass made in the capture (transformers' ModelOutput, clip's
            # `outputs.pooler_output = ...`), present as an item: its __setattr__ sets the item as well
            obj.items[name] = value
            return
        raise Unsupported(f"setting attribute {name!r} of {self.type_name(obj)}", self.where())


def tensor_attribute(frame: Frame, obj: TensorV, name: str) -> V:
    return frame.tensor_attr(obj, name)


# The attribute reader of each kind of value, by its exact class: the kinds in ember.frontend.values are leaf
# classes (tests/frontend/test_values.py checks that none is subclassed), so no order among them matters.
ATTRIBUTE_READERS = {
    TensorV: tensor_attribute, SuperV: super_attribute, NewObjV: new_object_attribute, ObjV: object_attribute,
    TupleV: tuple_attribute, DictV: dict_attribute, ListV: container_attribute, SetV: container_attribute,
    ConstV: constant_attribute, GradModeCtxV: grad_mode_attribute, ClosureV: closure_attribute,
    IterV: iterator_attribute,
}


def _read_through(frame, obj, name: str, module: str, missing: str) -> V:
    """getattr on a module or class object, wrapped: a trusted library's attribute needs no guard of its own (its
    value is the library's), any other is read again from its source by the guards."""
    value = obj.value
    try:
        attr = getattr(value, name)
    except AttributeError:
        raise frame.no_attribute(obj, name, missing)
    trusted = module.split(".")[0] in TRUSTED_MODULE_PREFIXES
    return frame.cap.wrap(attr, None if trusted or obj.source is None else attr_source(obj.source, name))
