"""Subscripts over tracked values: `obj[idx]` and `obj[idx] = value` on tensors, containers, module containers,
tensor-keyed dicts and user classes."""
from __future__ import annotations

import collections
import dataclasses
import operator
import types

import torch

from ember.errors import Unsupported
from ember.frontend.capture import map_v, python_value, to_fake, to_node
from ember.frontend.guards import DICT_GET
from ember.frontend.python_objects import lookup_static
from ember.frontend.signals import PyError
from ember.frontend.values import BoundV, ConstV, DictV, ListV, NewObjV, ObjV, TensorV, TupleV, V


def _to_fake_tree(idx):
    return python_value(idx, lambda t: t.fake) if isinstance(idx, V) else idx


class Items:
    """Frame methods for subscripts."""

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
                    # the children wrapped with their sources first: the new container's items are then found by
                    # identity, so their parameters are guarded graph inputs, not constants autograd cannot reach
                    for k in keys[i]:
                        self.getattr(obj, k)
                    if isinstance(m, torch.nn.Sequential):
                        return ObjV(type(m)(collections.OrderedDict((k, m._modules[k]) for k in keys[i])))
                    return ObjV(type(m)([m._modules[k] for k in keys[i]]))
                return self.getattr(obj, keys[i])
        if isinstance(obj, (ObjV, NewObjV)):
            m = self.getattr(obj, "__getitem__")
            if isinstance(m, BoundV) and isinstance(m.func, (types.FunctionType, types.MethodDescriptorType,
                                                             types.WrapperDescriptorType)):
                return self.call(m, [idx], {})   # Python, or a read-only C method run at capture (call_bound)
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
                lookup_static(type(obj.value), m) is not getattr(dict, m) for m in ("__getitem__", "__contains__")):
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
                    fake_obj[_to_fake_tree(node_idx)] = to_fake(value) if isinstance(value, TensorV) else \
                        python_value(value, lambda t: t.fake)
            except Exception as e:
                raise Unsupported(f"tensor __setitem__ cannot be captured ({type(e).__name__})", self.where())
            n = self.cap.graph.call_function(operator.setitem, (obj.node, map_v(node_idx, to_node),
                                                                  to_node(value)))
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
