"""Ahead-of-time autograd: ATen-level tracing (trace.py), functionalization, partitioning, autograd.Function."""
from ember.autograd.trace import InputMutation, OutputSpec, TraceError, TraceMeta, run_graph, trace_forward, trace_joint

__all__ = ["trace_forward", "trace_joint", "run_graph", "TraceMeta", "InputMutation", "OutputSpec", "TraceError"]
