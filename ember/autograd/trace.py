"""ATen-level tracing: a torch-level fx graph -> a functional ATen fx graph, plus what the runtime must do after it.

How: the graph runs on fake tensors (FakeTensorMode: shapes, dtypes, strides, devices, no data) under our own
TorchDispatchMode, `_Recorder` (recorder.py), which sees every ATen op below autograd and writes it into a new fx
graph. For the joint forward+backward trace (`trace_joint`) PyTorch's own autograd runs the backward on the same
fake tensors under the same recorder, so backward ATen ops are recorded too. This file drives a trace: fakes for
the inputs, the program run under the recorder, the outputs and input mutations classified into a TraceMeta.

## The graph `trace_forward` returns (what a code generator consumes)

- placeholders: `example_inputs`, then the graph module's own parameters and buffers (`meta.lifted` names them,
  in order; none for graphs from ember's frontend, which passes them as inputs already). All are tensors.
- nodes: `call_function` on `torch.ops.aten.*` OpOverloads (plus `operator.getitem` to take one result of a
  multi-result op, and `get_attr` for tensor constants the program made, stored on the GraphModule).
  Every node has `node.meta["val"]`: its fake tensor (or tuple of them), i.e. shape, dtype, stride, device.
- `node.meta["origin"]`: the name of the torch-level node whose execution recorded it ("backward" for ops of the
  backward), and `node.meta["where"]` (user file:line) when the torch-level node had one (ember's frontend sets it).
- functional: no node mutates anything. In-place ops (`add_`, `bernoulli_`, `copy_`, ...) became their
  out-of-place forms (`add`, `bernoulli.p`, `copy`, `_native_batch_norm_legit_functional`, ...); a write into a
  view became a scatter into its base (`slice_scatter`, `select_scatter`, `as_strided_scatter`) and later reads of
  other views of that base re-derive them from the new base. View ops (`view`, `permute`, `expand`, `slice`, ...)
  remain as they are: pure functions of their input, which a backend may implement as views or as copies.
- output: one flat tuple = the values of the program's outputs that the graph computes (`OutputSpec.kind ==
  "graph"`), then the new values of mutated inputs (`meta.mutations`).

## After the graph (done by after_graph.py's `run_graph`, which any compiler's output can be wrapped with)

- input mutations: for each `InputMutation(input_index, output_index)`: `inputs[input_index].copy_(outs[output_index])`
  (e.g. BatchNorm's running_mean / running_var / num_batches_tracked, or a user's `x.add_(1)`), so the real
  tensors end exactly as eager leaves them.
- outputs that are inputs or views of inputs (`OutputSpec.kind == "alias"`) are not computed by the graph:
  the runtime replays their view ops on the (already updated) input, so they alias it as in eager.
- grad mode: a graph that switches it (`torch._C._set_grad_enabled` nodes, from a `with torch.no_grad()` cut by a
  graph break) leaves it switched for the code after it, as eager would: `meta.grad_mode_after`.
- `meta.out_spec` (a pytree spec) rebuilds the program's output structure from the flat list.

Random ops (`Tag.nondeterministic_seeded`: bernoulli, rand, ...) are recorded as ops that draw from the global
generator when the graph runs, in program order, so a graph run eagerly draws the same numbers as the eager program.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ember.autograd.fake_dispatch import _tensors
from ember.autograd.recorder import _OriginInterpreter, _Recorder
from ember.autograd.symbolic import SYM_TYPES, SymArg, dispatch_context, is_symbolic_value, is_sym_node, \
    placeholder_values, shape_env_of
from ember.autograd.trace_meta import InputMutation, OutputSpec, TraceError, TraceMeta


def lift_parameters(gm: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The module's parameters then buffers (qualified names, tensors): they become graph inputs."""
    named = list(gm.named_parameters(remove_duplicate=True)) + list(gm.named_buffers(remove_duplicate=True))
    return [n for n, _ in named], [t for _, t in named]


class _swap_tensors:
    """Temporarily replace the module's parameters and buffers by other tensors (the fakes)."""

    def __init__(self, mod: torch.nn.Module, names: list[str], values: list[torch.Tensor]):
        new_for = {}
        for name, v in zip(names, values):
            owner, _, attr = name.rpartition(".")
            new_for[id(getattr(mod.get_submodule(owner), attr))] = v
        # every slot holding a lifted tensor (tied weights live in several)
        self.slots = [(d, k, old, new_for[id(old)]) for m in mod.modules() for d in (m._parameters, m._buffers)
                      for k, old in d.items() if old is not None and id(old) in new_for]

    def __enter__(self):
        for d, k, old, new in self.slots:
            d[k] = new

    def __exit__(self, *exc):
        for d, k, old, new in self.slots:
            d[k] = old


def _fakes(fake_mode: FakeTensorMode, tensors: list) -> list:
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TraceError(f"graph input of type {type(t).__name__}: only tensors are supported")
        out.append(fake_mode.from_tensor(t.detach(), static_shapes=True))
    return out


def _fresh_fake(fake_mode: FakeTensorMode, like: torch.Tensor) -> torch.Tensor:
    """A new fake tensor (of this trace's own) with like's sizes, strides and offset: symbolic ones for a
    placeholder's meta["val"], whose object the frontend keeps, or a real tensor's (lifted parameters)."""
    with fake_mode:
        if like.storage_offset() == 0:
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
        need = like.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride()))
        return torch.empty(need, dtype=like.dtype, device=like.device).as_strided(
            like.shape, like.stride(), like.storage_offset())


def _symbolic_fakes(values: list, inputs: list) -> tuple[FakeTensorMode, list]:
    """The inputs of a symbolic graph as the trace sees them: the placeholders' SymInts, fresh fakes shaped as
    their fake tensors (a real tensor where a placeholder has no meta["val"]: its static fake), all in the
    FakeTensorMode of the placeholders' fakes, whose ShapeEnv holds the symbols."""
    shape_env = shape_env_of(values)
    modes = [v.fake_mode for v in values if isinstance(v, FakeTensor) and v.fake_mode.shape_env is shape_env]
    fake_mode = modes[0] if modes else FakeTensorMode(shape_env=shape_env)
    if any(is_symbolic_value(v) and shape_env_of([v]) is not shape_env for v in values):
        raise TraceError("the graph's placeholders hold sizes of several ShapeEnvs")
    out = []
    for i, x in enumerate(inputs):
        v = values[i] if i < len(values) else None
        if isinstance(v, SYM_TYPES):
            out.append(v)
        elif isinstance(x, torch.Tensor):
            out.append(_fresh_fake(fake_mode, v if isinstance(v, torch.Tensor) else x))
        elif type(x) is int:             # an int the graph does not say is symbolic: a constant of this trace
            out.append(x)
        else:
            raise TraceError(f"graph input of type {type(x).__name__}: only tensors and ints are supported")
    return fake_mode, out


def _check_inputs_do_not_overlap(inputs: list[torch.Tensor], mutated: set[int]) -> None:
    """Two inputs sharing memory, one of them written: each is traced as its own storage, so refuse."""
    storages = {}
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key in storages and (i in mutated or storages[key] in mutated):
            raise TraceError(f"graph inputs {storages[key]} and {i} share memory and one is written in place")
        storages.setdefault(key, i)


def _run(gm: torch.nn.Module, example_inputs: list, grad: bool, lift: bool = True, symbolic: bool = True):
    """Trace gm on fakes. Returns (recorder, fake mode, fake primals, program inputs, fake outputs (flat), out_spec,
    lifted names, all inputs). A symbolic graph (ember.autograd.symbolic) is traced on its placeholders' fakes
    and SymInts unless `symbolic` is False; otherwise on static fakes of the inputs (ints: constants)."""
    names, lifted = lift_parameters(gm) if lift else ([], [])
    inputs = list(example_inputs) + lifted
    values = placeholder_values(gm)
    if values is not None and symbolic:
        fake_mode, fakes = _symbolic_fakes(values, inputs)
    else:          # (a symbolic graph's int inputs traced statically, and sizes the capture specialized, whose
        fake_mode = FakeTensorMode()   # placeholders hold a SymInt of a fixed value: the entry guards it; constants)
        nodes = gm.graph.nodes if isinstance(gm, torch.fx.GraphModule) else ()
        fixed = {i for i, n in enumerate(n for n in nodes if n.op == "placeholder")
                 if isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.maybe_as_int() is not None}
        fakes = [x if type(x) is int and (values is not None or i in fixed) else _fakes(fake_mode, [x])[0]
                 for i, x in enumerate(inputs)]
    rec = _Recorder(fake_mode)
    primals, program_inputs = [], []
    with fake_mode:
        for i, (f, real) in enumerate(zip(fakes, inputs)):
            name = f"primal_{i}" if grad else f"arg_{i}"
            if not isinstance(f, torch.Tensor):
                if isinstance(f, SYM_TYPES):
                    rec.sym_placeholder(f, name, i)
                else:                           # an int input of a static trace: a constant of the graph
                    rec.int_placeholder(f, name, i)
                primals.append(f)
                program_inputs.append(f)
                continue
            p = f.requires_grad_(grad and real.requires_grad)
            rec.placeholder(p, name, i)
            primals.append(p)
            if p.requires_grad:                    # a non-leaf stand-in, so the program may write into it
                with torch.enable_grad():
                    x = p.clone()
                rec.alias_placeholder(x, p)
                program_inputs.append(x)
            else:
                program_inputs.append(p)
    n_user = len(example_inputs)
    # cudnn off while tracing: batch norm then goes to native_batch_norm, whose functional form we know
    # (convolutions are recorded as aten.convolution either way and still use cudnn when the graph runs).
    mode = grad or torch.is_grad_enabled()      # inference traces run in the caller's mode (nothing requires grad)
    with torch.set_grad_enabled(mode), torch.backends.cudnn.flags(enabled=False), dispatch_context(fake_mode), \
            fake_mode, rec, \
            _swap_tensors(gm, names, program_inputs[n_user:]):
        if isinstance(gm, torch.fx.GraphModule):
            out = _OriginInterpreter(gm, rec.graph).run(*program_inputs[:n_user])
        else:
            out = gm(*program_inputs[:n_user])
        after = torch.is_grad_enabled()          # a graph may switch grad mode for the code after it
        rec.grad_mode_after = after if after != mode else None
    flat, spec = pytree.tree_flatten(out)
    return rec, fake_mode, primals, program_inputs, flat, spec, names, inputs


def _outputs(rec: _Recorder, flat: list, program_inputs: list) -> tuple[list[OutputSpec], list, list]:
    """Classify program outputs; returns (specs, graph output nodes, graph output fakes)."""
    specs, nodes, fakes = [], [], []
    for o in flat:
        if isinstance(o, SYM_TYPES) and is_symbolic_value(o):   # an int computed from sizes: from the inputs
            node = rec.syms.to_node(o)
            specs.append(OutputSpec("sym", value=SymArg(node, rec.input_index)) if isinstance(node, torch.fx.Node)
                         else OutputSpec("const", value=node))
            continue
        if not isinstance(o, torch.Tensor):
            specs.append(OutputSpec("const", value=o))
            continue
        r = rec.recs.get(id(o))
        if r is not None and r.base.input_index is not None and not any(
                isinstance(a, torch.fx.Node) and not is_sym_node(a) for s in r.chain for a in _leaves((s[1], s[2]))):
            # (a view's symbolic sizes are computed from the call's inputs when it is replayed)
            def sym_arg(n):
                return SymArg(n, rec.input_index)
            views = tuple((op, _map_nodes(args, sym_arg), _map_nodes(kwargs, sym_arg), item)
                          for op, args, kwargs, item, _ in r.chain)
            specs.append(OutputSpec("alias", r.base.input_index, views))
            continue
        specs.append(OutputSpec("graph", len(nodes)))
        nodes.append(rec.node_of(o))
        fakes.append(o)
    return specs, nodes, fakes


def _leaves(x) -> list:
    if type(x) in (list, tuple):
        return [z for y in x for z in _leaves(y)]
    if type(x) is dict:
        return [z for y in x.values() for z in _leaves(y)]
    return [x]


def _map_nodes(x, fn):
    if isinstance(x, torch.fx.Node):
        return fn(x)
    if type(x) in (list, tuple):
        return type(x)(_map_nodes(y, fn) for y in x)
    if type(x) is dict:
        return {k: _map_nodes(y, fn) for k, y in x.items()}
    return x


def _mutations(rec: _Recorder, first_output: int) -> tuple[list[InputMutation], list, list]:
    muts, nodes, fakes = [], [], []
    for b in rec.bases:
        if b.input_index is not None and b.version > 0:
            muts.append(InputMutation(b.input_index, first_output + len(nodes), b.grad_enabled, b.grad_written))
            nodes.append(b.node)
            fakes.append(b.fake)
    return muts, nodes, fakes


def _graph_module(rec: _Recorder, name: str) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for k, v in rec.constants.items():
        root.register_buffer(k, v)
    rec.graph.eliminate_dead_code()
    rec.graph.lint()
    return torch.fx.GraphModule(root, rec.graph, class_name=name)


def trace_forward(gm: torch.nn.Module, example_inputs: list, symbolic: bool = True) \
        -> tuple[torch.fx.GraphModule, TraceMeta]:
    """The functional ATen graph of `gm` for inference (no autograd), and what to do after it (module docstring).
    A symbolic gm (docs/dynamic.md) gives a symbolic graph unless `symbolic` is False (then: at the example's
    sizes, its int inputs constants)."""
    rec, fake_mode, primals, program_inputs, flat, spec, names, inputs = _run(gm, example_inputs, False,
                                                                              symbolic=symbolic)
    specs, out_nodes, _ = _outputs(rec, flat, program_inputs)
    muts, mut_nodes, _ = _mutations(rec, len(out_nodes))
    _check_inputs_do_not_overlap(inputs, {m.input_index for m in muts})
    rec.graph.output(tuple(out_nodes + mut_nodes))
    meta = TraceMeta(len(inputs), names, specs, spec, muts, num_graph_outputs=len(out_nodes),
                     grad_mode_after=rec.grad_mode_after)
    return _graph_module(rec, "AtenForward"), meta


def trace_joint(gm: torch.nn.Module, example_inputs: list, symbolic: bool = True) \
        -> tuple[torch.fx.GraphModule, TraceMeta]:
    """Forward and backward in one functional ATen graph.

    placeholders: primals (example_inputs, then lifted parameters/buffers), then tangents: one per forward output
    that requires grad (`meta.tangent_of[k]` = its index among the forward outputs).
    output: (program outputs the graph computes..., new values of mutated inputs..., grad of each primal that
    requires grad (None where the output does not depend on it)...). The forward outputs are the first
    `meta.num_graph_outputs + len(meta.mutations)` of them.
    """
    rec, fake_mode, primals, program_inputs, flat, spec, names, inputs = _run(gm, example_inputs, True,
                                                                              symbolic=symbolic)
    specs, out_nodes, out_fakes = _outputs(rec, flat, program_inputs)
    muts, mut_nodes, _ = _mutations(rec, len(out_nodes))
    _check_inputs_do_not_overlap(inputs, {m.input_index for m in muts})
    fw_fakes = out_fakes + [program_inputs[m.input_index] for m in muts]
    fw_nodes = out_nodes + mut_nodes
    # an input written only under no_grad (an optimizer's parameters) keeps the caller's autograd history: its
    # new value needs no tangent
    differentiable = [True] * len(out_fakes) + [m.grad_written for m in muts]
    diff = [k for k, f in enumerate(fw_fakes) if f.requires_grad and differentiable[k]]
    wrt = [p for p in primals if isinstance(p, torch.Tensor) and p.requires_grad]
    # tangent placeholders go right after the primals
    last = [n for n in rec.graph.nodes if n.op == "placeholder"][-1]
    tangents = []
    with fake_mode:
        for k in diff:
            # contiguous: the runtime passes grads made contiguous (CompiledGraphFunction.backward)
            tangent = torch.empty(fw_fakes[k].shape, dtype=fw_fakes[k].dtype, device=fw_fakes[k].device)
            with rec.graph.inserting_after(last):
                node = last = rec.graph.placeholder(f"tangent_{len(tangents)}")
            rec._new(tangent, node)
            tangents.append(tangent)
    grads = [None] * len(wrt)
    if diff and wrt:
        rec.graph.origin = {"origin": "backward"}
        # autocast off, as where eager's backward() is called: after the autocast block (its docs advise it)
        with dispatch_context(fake_mode), fake_mode, rec, torch._C._DisableAutocast():
            grads = torch.autograd.grad([fw_fakes[k] for k in diff], wrt, tangents, allow_unused=True)
    grad_nodes = [None if g is None else rec.node_of(g) for g in grads]
    rec.graph.output(tuple(fw_nodes + grad_nodes))
    meta = TraceMeta(len(primals), names, specs, spec, muts, num_graph_outputs=len(out_nodes),
                     grad_mode_after=rec.grad_mode_after,
                     requires_grad=[isinstance(p, torch.Tensor) and p.requires_grad for p in primals],
                     tangent_of=diff)
    return _graph_module(rec, "AtenJoint"), meta
