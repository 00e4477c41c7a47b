"""What a trace hands the runtime: TraceMeta (the graph's inputs, outputs and input mutations, the contract
ember.autograd.trace's docstring describes) and TraceError, the refusal callers answer with eager."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.utils._pytree as pytree


class TraceError(Exception):
    """The program does something the ATen tracer cannot make functional; callers fall back to eager."""


@dataclasses.dataclass(frozen=True)
class InputMutation:
    input_index: int   # which placeholder the program mutated in place
    output_index: int  # which graph output holds its final value
    grad_enabled: bool = True  # the grad mode the program wrote it under (an optimizer step: off)
    grad_written: bool = True  # some write ran with grad on: the new value may carry autograd history


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    kind: str                  # "graph": graph output `index`; "alias": view of input `index`; "const": `value`;
                               # "sym": an int computed from the sizes of the inputs, `value(inputs)`
    index: int = -1
    views: tuple = ()          # for "alias": ((op, args, kwargs, item), ...) replayed on the input (symbolic
                               # sizes among args: ember.autograd.symbolic.SymArg, computed from the inputs)
    value: Any = None          # for "const": a non-tensor output (None, int, ...) returned as is; "sym": a SymArg


@dataclasses.dataclass
class TraceMeta:
    num_inputs: int                       # placeholders (len(example_inputs) + len(lifted)); joint: primals only
    lifted: list[str]                     # gm parameters then buffers appended after example_inputs
    outputs: list[OutputSpec]             # one per flat program output, in order
    out_spec: pytree.TreeSpec             # rebuilds the program's output structure
    mutations: list[InputMutation]        # applied after the graph, in order
    num_graph_outputs: int = 0            # program outputs the graph computes (mutation values follow them)
    # joint trace only (trace_joint):
    requires_grad: list[bool] = dataclasses.field(default_factory=list)   # per primal
    tangent_of: list[int] = dataclasses.field(default_factory=list)       # per tangent: which forward output
    copy_back_without_grad: bool = False   # a training graph's copies back need no autograd (set by aot_module)
    grad_mode_after: bool | None = None   # the graph switched grad mode (torch._C._set_grad_enabled): set it after

    def __getstate__(self) -> dict:   # (without the copy-back plan after_graph.finish caches, made again)
        return {k: v for k, v in self.__dict__.items() if k != "_copy_back"}
