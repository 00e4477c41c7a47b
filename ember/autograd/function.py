"""The runtime: a captured graph as one torch.autograd.Function whose forward and backward are compiled graphs.

aot_module(gm, example_inputs, fw_compiler, bw_compiler) returns a callable with gm's calling convention:
- inference (grad mode off, or nothing requires grad): trace_forward -> fw_compiler(graph) -> run, no backward built;
- training: trace_joint -> partition -> fw_compiler(forward graph), bw_compiler(backward graph, compiled on the
  first backward with the real saved tensors as example inputs) inside one autograd.Function.
After either: input mutations are copied back, outputs aliasing inputs are rebuilt as views (after_graph.finish).

Autocast is applied once, by the trace: the ATen graphs hold its casts, so everything after the trace (the
partition, the compilers, every run of either graph) happens with autocast off. Left on, it would cast again
what the graph computes in float32 on purpose (a block inside the graph that turns autocast off, a log_softmax
split into parts), so values would have other dtypes than the compiled code was planned for.

An artifact is built per input signature (shape, stride, dtype, device, requires_grad, grad mode): the frontend
guards on these too, but a graph from symbolic_trace may be called with anything, and a wrong artifact would be
silently wrong. A graph the tracer cannot make functional runs as it is (eager), logged under EMBER_LOGS=fallbacks.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.fx

from ember.autograd.partition import Partition, partition
from ember.autograd.after_graph import _lifted_getter, finish
from ember.autograd.trace import lift_parameters, trace_forward, trace_joint
from ember.autograd.symbolic import SymbolicSignature, placeholder_values, shape_env_of
from ember.autograd.trace_meta import TraceMeta
from ember.tools import collector, failsafe
from ember.tools.picker import picker
from ember.autograd.causal import use_is_causal
from ember.tools.logs import get_logger

Compiler = Callable[[torch.fx.GraphModule, list], Callable]
log = get_logger("autograd")
fallback_log = get_logger("fallbacks")
dynamic_log = get_logger("dynamic")


def _eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return gm.forward


@dataclasses.dataclass
class _Artifact:
    meta: TraceMeta
    forward: Callable
    name: str
    part: Partition | None = None               # training only
    bw_compiler: Compiler | None = None
    backward: Callable | None = None
    no_grad: bool = False   # an inference graph of inputs that require grad: run where autograd records nothing

    @property
    def training(self) -> bool:
        return self.part is not None

    def __post_init__(self):
        # inputs -> the tuple of those that require grad (CompiledGraphFunction's differentiable arguments)
        self.differentiable = picker([i for i, rg in enumerate(self.meta.requires_grad) if rg])

    def ember_saved(self) -> tuple:
        """The saved form (ember.runtime.artifacts). A backward not compiled yet (no backward ran before the
        save) is saved as its ATen graph, run as it is: its compile needs the trace's fake values."""
        bw_compiler = self.bw_compiler if self.backward is not None or self.part is None else _eager
        return (_Artifact, (self.meta, self.forward, self.name, self.part, bw_compiler, self.backward, self.no_grad))


class CompiledGraphFunction(torch.autograd.Function):
    """forward: the compiled forward graph; backward: the compiled backward graph on the saved values.

    apply(art, primals, *differentiable): `primals` is the list of all the graph's inputs (one argument, not a
    tensor to autograd); `differentiable` the ones that require grad, the only ones autograd gets a gradient
    edge for. Autograd's per-input work in apply and the engine's per-gradient checks then cover only those
    (a CNN's training graph takes hundreds of parameters and as many batch-norm buffers)."""

    @staticmethod
    def forward(ctx, art: _Artifact, primals: list, *differentiable):
        outs = art.forward(*primals)
        n, n_sym = art.part.num_forward_outputs, len(art.part.saved_symbols)
        fw_outs, saved = outs[:n], outs[n:len(outs) - n_sym]
        ctx.art = art
        ctx.save_for_backward(*[primals[i] for i in art.part.saved_primals], *saved)
        ctx.symbols = outs[len(outs) - n_sym:]     # ints: the sizes the backward is computed at
        diff = set(art.meta.tangent_of)
        ctx.mark_non_differentiable(*[o for k, o in enumerate(fw_outs) if k not in diff and
                                      isinstance(o, torch.Tensor)])
        # no zero gradients made for the non-differentiable outputs (a training graph's hundreds of batch norm
        # statistics): backward makes zeros only for differentiable outputs that got no gradient
        ctx.set_materialize_grads(False)
        ctx.tangent_meta = [(fw_outs[k].shape, fw_outs[k].dtype, fw_outs[k].device) for k in art.meta.tangent_of]
        return tuple(fw_outs)

    @staticmethod
    def backward(ctx, *grads):
        art: _Artifact = ctx.art
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"ember: double backward (backward with create_graph=True, or a gradient of a gradient) through "
                f"the compiled graph {art.name!r} is not supported: its backward graph reads saved activations that "
                f"carry no autograd history. Compile that code with ember.compile(..., backend='eager') or run it "
                f"uncompiled.")
        saved = (*ctx.saved_tensors, *ctx.symbols)
        tangents = [torch.zeros(shape, dtype=dtype, device=device) if grads[k] is None else
                    grads[k].contiguous() if grads[k].layout == torch.strided else grads[k]
                    for k, (shape, dtype, device) in zip(art.meta.tangent_of, ctx.tangent_meta)]
        if torch._C._is_any_autocast_enabled():   # (a backward() inside an autocast block; module docstring)
            with torch._C._DisableAutocast():
                return CompiledGraphFunction.backward(ctx, *grads)
        if art.backward is None:
            # the backward's compile, on the first backward: with the cyclic collector paused, as the frontend
            # pauses it for the forward's (ember.tools.collector says why); a crash in its compile or first
            # launch runs the backward graph eagerly (ember.tools.failsafe)
            with collector.paused():
                art.backward = failsafe.compile_backward(art.bw_compiler, art.part.backward, [*saved, *tangents],
                                                         art.name, lambda f: setattr(art, "backward", f))
        return (None, None, *art.backward(*saved, *tangents))


def _copied_back(meta) -> list[tuple[int, int]]:
    """(input, output): the graph outputs `finish` copies into their inputs at once, and that the program does
    not also return (a CUDA graph hands them out uncloned, or copies them into static inputs itself)."""
    returned = {s.index for s in meta.outputs if s.kind == "graph"}
    return [(m.input_index, m.output_index) for m in meta.mutations if m.output_index not in returned]


def _forward_of_joint(joint: torch.fx.GraphModule, meta) -> torch.fx.GraphModule:
    """A joint graph with no tangents as an inference graph: its outputs without the (all None) gradients."""
    out = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    n_fw = meta.num_graph_outputs + len(meta.mutations)
    assert all(g is None for g in out.args[0][n_fw:])
    out.args = (tuple(out.args[0][:n_fw]),)
    joint.recompile()
    return joint


def _signature(inputs: list) -> tuple:
    grad = torch.is_grad_enabled()
    return (grad,) + tuple((t.shape, t.stride(), t.dtype, t.device, grad and t.requires_grad)
                           if isinstance(t, torch.Tensor) else (int, t) if type(t) is int else (type(t), id(t))
                           for t in inputs)


def _symbolic_signature(inputs: list) -> tuple:
    """The key of a symbolic artifact: sizes are the symbols', so only grad mode and requires_grad vary."""
    grad = torch.is_grad_enabled()
    return ("symbolic", grad) + tuple(grad and isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def aot_module(gm: torch.fx.GraphModule, example_inputs: list, fw_compiler: Compiler,
               bw_compiler: Compiler | None = None) -> Callable:
    """gm as a callable whose forward (and backward, when inputs require grad) are ATen graphs compiled by the
    given compilers, each `(aten_gm, example_inputs) -> callable`. bw_compiler defaults to fw_compiler."""
    bw_compiler = bw_compiler or fw_compiler
    where = getattr(gm, "meta", {}).get("ember_where") if isinstance(getattr(gm, "meta", None), dict) else None
    name = f"{type(gm).__name__} captured from {where}" if where else type(gm).__name__
    if isinstance(gm, torch.fx.GraphModule):
        use_is_causal(gm)
    lifted_names = lift_parameters(gm)[0]
    lifted = _lifted_getter(gm, lifted_names)
    artifacts: dict[tuple, _Artifact | None] = {}
    # a symbolic graph (docs/dynamic.md) is traced once per grad mode and requires_grad pattern, on its symbolic
    # fakes, for every call its ShapeEnv admits; a call it does not admit gets a static artifact of its own
    values = placeholder_values(gm)
    symbolic = SymbolicSignature(values, shape_env_of(values)) if values is not None else None

    def key_of(inputs: list) -> tuple:
        # (a graph the frontend guards is called at every size its guards admit: only a symbolic artifact, or
        # none (eager), serves it)
        if symbolic is not None and (guarded or symbolic.admits(inputs)):
            return _symbolic_signature(inputs)
        return _signature(inputs)

    def build(inputs: list, key: tuple) -> _Artifact | None:
        training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        no_grad = False
        user_inputs = inputs[:len(inputs) - len(lifted())]
        sym = key[0] == "symbolic"
        try:
            if not training:
                aten_gm, meta = trace_forward(gm, user_inputs, symbolic=sym)
            else:
                joint, meta = trace_joint(gm, user_inputs, symbolic=sym)
                if meta.tangent_of:
                    with torch._C._DisableAutocast():
                        part = partition(joint, meta)
                else:
                    # no output needs a gradient (an optimizer step runs under no_grad): nothing to differentiate,
                    # and the inference path may write the mutated inputs in place
                    training, aten_gm, no_grad = False, _forward_of_joint(joint, meta), True
                    # (no input that requires grad is written under grad mode: its new value would need one)
                    meta.copy_back_without_grad = True
        except Exception as e:  # TraceError, or fake tensors refusing data-dependent ops (.item(), nonzero)
            fallback_log.warning("ember.autograd: graph %r runs eagerly: %s: %s", name, type(e).__name__, e,
                                 exc_info=e if fallback_log.isEnabledFor(logging.DEBUG) else None)  # (EMBER_LOGS)
            return None
        if sym and symbolic.specialized():
            dynamic_log.info("ember.autograd: graph %r: tracing fixed sizes %s (an op the ShapeEnv guarded on "
                             "their values); other sizes get a graph of their own", name, symbolic.specialized())
        # an inner compiler's errors are not fallbacks here: they reach the caller (ember.tools.failsafe)
        if not training:
            log.debug("%s: inference graph, %d nodes", name, len(aten_gm.graph.nodes))
            # which outputs are only copied back into inputs: a code generator may write those in place (the
            # copy in `finish` is skipped when the graph returns the input itself). Inference only: a training
            # forward's inputs may be saved for the backward, which needs their old values.
            aten_gm.meta["ember_input_mutations"] = [(m.input_index, m.output_index) for m in meta.mutations]
            aten_gm.meta["ember_copied_back"] = _copied_back(meta)
            aten_gm.meta["ember_guarded"] = guarded    # the wrapper need not check the inputs again
            aten_gm.meta["ember_inference"] = True  # code generators may choose layouts (no backward reads them)
            with torch._C._DisableAutocast():
                return _Artifact(meta, fw_compiler(aten_gm, inputs), name, no_grad=no_grad)
        log.debug("%s: joint graph %d nodes -> forward %d, backward %d; saves %d tensors (%d bytes), "
                  "recomputes %d nodes", name, len(joint.graph.nodes), len(part.forward.graph.nodes),
                  len(part.backward.graph.nodes), len(part.saved), part.saved_bytes, len(part.recomputed))
        part.forward.meta["ember_guarded"] = guarded
        # the forward's outputs past these are saved for the backward: under CUDA graphs they stay in graph memory
        # (aliases) instead of being cloned and copied back in for the backward
        part.forward.meta["num_user_outputs"] = part.num_forward_outputs
        # (not ember_input_mutations: the code generator must not write in place what the backward may read)
        part.forward.meta["ember_copied_back"] = _copied_back(meta)
        # copies back that autograd need not see (batch norms' running statistics: neither side requires grad)
        # take finish's cached plan, as an optimizer step's do
        differentiable = set(meta.tangent_of)
        meta.copy_back_without_grad = all(not inputs[m.input_index].requires_grad and
                                          m.output_index not in differentiable for m in meta.mutations)
        with torch._C._DisableAutocast():
            return _Artifact(meta, fw_compiler(part.forward, inputs), name, part, bw_compiler)

    # The frontend guards every input's metadata and the grad mode before it calls a graph, so a graph it
    # captured (gm.meta["ember_guarded"]) is only ever called with the example's signature: no need to
    # recompute it per call (a module's hundreds of parameters made that a visible part of each call).
    guarded = isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_guarded", False)

    # Build now for the example inputs (the frontend calls a backend right before the first run), so an inner
    # compiler's error surfaces while compiling; other signatures are built on their first call.
    example = [*example_inputs, *lifted()]
    example_key = key_of(example)
    artifacts[example_key] = build(example, example_key)
    return _runner(gm, lifted_names, guarded, key_of, build, artifacts, artifacts[example_key])


def _call(art: _Artifact, inputs: list):
    """The outputs of art's forward graph on inputs (through CompiledGraphFunction when training)."""
    if art.training:
        return CompiledGraphFunction.apply(art, inputs, *art.differentiable(inputs))
    if art.no_grad:   # (torch.no_grad() as a context manager costs several times this, every step)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return art.forward(*inputs)
        finally:
            torch._C._set_grad_enabled(prev)
    return art.forward(*inputs)


def _runner(gm: torch.fx.GraphModule, lifted_names: list[str], guarded: bool, key_of: Callable | None,
            build: Callable | None, artifacts: dict, example_art: _Artifact | None) -> Callable:
    """The call of a graph: its artifact for the inputs' signature (a guarded graph's: the example's), then
    the inputs' mutations and the outputs' structure (after_graph.finish)."""
    lifted = _lifted_getter(gm, lifted_names)

    def run(*args):
        inputs = [*args, *lifted()]
        if guarded:
            art = example_art   # (not artifacts[example_key]: hashing that tuple of tuples costs per input and call)
        else:
            key = key_of(inputs)
            if key not in artifacts:
                artifacts[key] = build(inputs, key)
            art = artifacts[key]
        if art is None:
            return gm(*args)
        if torch._C._is_any_autocast_enabled():   # (module docstring: the graphs hold autocast's casts)
            with torch._C._DisableAutocast():
                return finish(art.meta, inputs, _call(art, inputs))
        return finish(art.meta, inputs, _call(art, inputs))

    run.artifacts = artifacts   # for tests and benchmarks: what was built per input signature

    def written_inputs(args: list) -> list:
        """The inputs a call may write (the graph's input mutations): a first launch's fail-safe copies them."""
        inputs = [*args, *lifted()]
        return [inputs[m.input_index] for art in artifacts.values() if art is not None for m in art.meta.mutations]
    if any(art is not None for art in artifacts.values()):   # (none: the graph runs as it is, eagerly)
        run.written_inputs = written_inputs
    if guarded:   # (a graph the frontend guards is saved with its one artifact: ember.save_cache)
        run.ember_saved = lambda: (_runner, (gm, lifted_names, True, None, None, {}, example_art))
    return run


def aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """The "aot_eager" backend: this whole pipeline, with both graphs run as they are (ATen ops, eagerly)."""
    return aot_module(gm, example_inputs, _eager, _eager)
