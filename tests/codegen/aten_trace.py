"""A throwaway ATen tracer for the codegen tests (until ember.autograd.trace lands): runs a function on real
tensors under a TorchDispatchMode and records every ATen call into an fx graph with meta['val']."""
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class _Recorder(TorchDispatchMode):
    def __init__(self, graph, env):
        super().__init__()
        self.graph, self.env = graph, env

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)

        def to_node(a):
            if isinstance(a, torch.Tensor):
                if id(a) not in self.env:  # a tensor made outside the trace: a constant input we cannot name
                    raise RuntimeError("untraced tensor")
                return self.env[id(a)][0]
            return a
        nargs, nkwargs = pytree.tree_map(to_node, (args, kwargs))
        node = self.graph.call_function(func, tuple(nargs), nkwargs)
        node.meta["val"] = pytree.tree_map(lambda t: _meta(t) if isinstance(t, torch.Tensor) else t, out)
        if isinstance(out, torch.Tensor):
            self.env[id(out)] = (node, out)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    g = self.graph.call_function(__import__("operator").getitem, (node, i))
                    g.meta["val"] = _meta(t)
                    self.env[id(t)] = (g, t)
        return out


def trace_aten(fn, inputs):
    """(GraphModule over ATen ops, eager outputs) for fn(*inputs); inputs: a list of tensors."""
    graph = torch.fx.Graph()
    env = {}
    for i, t in enumerate(inputs):
        p = graph.placeholder(f"arg{i}")
        p.meta["val"] = _meta(t)
        env[id(t)] = (p, t)
    with torch.no_grad(), _Recorder(graph, env):
        out = fn(*inputs)
    leaves, spec = pytree.tree_flatten(out)
    res = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            res.append(env[id(t)][0])
        else:
            res.append(t)
    graph.output(tuple(res))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return gm, out
