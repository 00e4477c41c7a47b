"""Ahead-of-time autograd: captured graphs become functional ATen graphs, forward and backward, run through one
torch.autograd.Function. See docs/autograd.md.

  trace.py      ATen tracing on fake tensors under a TorchDispatchMode, functionalized (trace_forward, trace_joint)
  partition.py  joint graph -> forward + backward graphs, min-cut choice of saved activations
  function.py   aot_module / aot_eager: the autograd.Function and the runtime around the compiled graphs
"""
from ember.autograd.function import CompiledGraphFunction, aot_eager, aot_module
from ember.autograd.partition import Partition, partition
from ember.autograd.trace import InputMutation, OutputSpec, TraceError, TraceMeta, run_graph, trace_forward, trace_joint

__all__ = ["aot_module", "aot_eager", "CompiledGraphFunction", "trace_forward", "trace_joint", "partition",
           "Partition", "run_graph", "TraceMeta", "InputMutation", "OutputSpec", "TraceError"]
