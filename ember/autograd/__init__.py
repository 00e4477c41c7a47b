"""Ahead-of-time autograd: captured graphs become functional ATen graphs, forward and backward, run through one
torch.autograd.Function. See docs/autograd.md.

  trace.py          driving an ATen trace on fake tensors (trace_forward, trace_joint); the graph's contract
  trace_meta.py     TraceMeta (inputs, outputs, input mutations of a traced graph) and TraceError
  recorder.py       the TorchDispatchMode that records ATen ops into an fx graph, functionalized
  functionalize.py  functionalization's rules: out-of-place forms of in-place ops, view writes as scatters
  fake_dispatch.py  an ATen op on fake tensors: argument walkers, direct metadata rules, a trace's dispatch memo
  after_graph.py    after the compiled graph: copy-backs of mutated inputs, aliased outputs (finish, run_graph)
  partition.py      joint graph -> forward + backward graphs, min-cut choice of saved activations
  function.py       aot_module / aot_eager: the autograd.Function and the runtime around the compiled graphs
  backward.py       grads_of / with_freed_history: `loss.backward()` inside a captured graph
  symbolic.py       symbolic graphs (docs/dynamic.md): SymInts as fx nodes, sizes at run time, admitted calls
"""
from ember.autograd.function import CompiledGraphFunction, aot_eager, aot_module
from ember.autograd.partition import Partition, partition
from ember.autograd.after_graph import run_graph
from ember.autograd.trace import trace_forward, trace_joint
from ember.autograd.trace_meta import InputMutation, OutputSpec, TraceError, TraceMeta

__all__ = ["aot_module", "aot_eager", "CompiledGraphFunction", "trace_forward", "trace_joint", "partition",
           "Partition", "run_graph", "TraceMeta", "InputMutation", "OutputSpec", "TraceError"]
