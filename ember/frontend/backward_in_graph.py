"""`loss.backward()` inside the graph: one recorded op gives the leaves' gradients (ember.autograd.backward), and
AccumulateGrad's work is done as graph ops and `.grad` writes."""
from __future__ import annotations

import torch
import torch.fx

from ember.autograd.backward import grads_of
from ember.errors import Unsupported
from ember.frontend import policy
from ember.frontend.capture import Capture, GraphInput
from ember.frontend.modes import autocast_state, restore_autocast
from ember.frontend.values import ConstV, TensorV, V


class BackwardInGraph:
    """The Frame method for Tensor.backward() in the graph."""

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
        if loss.fake.device.type not in policy.BACKWARD_IN_GRAPH_DEVICES:
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
                if isinstance(f, torch.SymInt):   # a symbol's int input (ember.frontend.symbolic)
                    args.append(f)
                    continue
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
